"""A joiner's download of the swarm's state, from peers it chose itself.

hivemind's averager downloads from whoever claims the highest priority in an unsigned DHT record
(`{prefix}.all_averagers`) that any member may write for itself, or for another. Atom's averagers
declare nothing there; the runtime picks its sources from the signed status records instead, each
peer's claim bounded by the round the swarm agrees on (state.py), and this asks them in order.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming

log = logging.getLogger(__name__)

ZERO_MOMENTUM = "zero"
"""A state's metadata says `"momentum": ZERO_MOMENTUM` when its server left out an outer
momentum of zeros; the receiver puts the zeros back before any check (state.py)."""


async def download_from(
    averager: Any, sources: list[str], timeout_s: float | None, most_bytes: int | None = None
) -> Any:
    """(metadata, tensors) from the first of `sources` (base58 peer IDs) that serves a state,
    or None. A source that streams more than `most_bytes` is cut off (a state is checked only
    once received: an endless one must not fill this process's memory first)."""
    for source in sources:
        try:
            peer = PeerID.from_base58(source)
        except Exception:
            continue
        if peer == averager.peer_id:
            continue
        try:
            stub = averager.get_stub(averager._p2p, peer, namespace=averager.prefix)
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            metadata: Any = None
            tensors: list[Any] = []
            parts: list[Any] = []
            received = 0
            async for message in aiter_with_timeout(stream, timeout=timeout_s):
                received += message.ByteSize()
                if most_bytes is not None and received > most_bytes:
                    raise ValueError(f"more than {most_bytes} bytes")
                if message.metadata:
                    metadata = averager.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:  # the start of the next tensor
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
            if parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            if metadata:
                return metadata, with_momentum(metadata, tensors)
            log.debug("peer %s did not send its state", source)
        except Exception as e:
            log.debug("no state from %s: %s", source, e)
    return None


def with_momentum(metadata: Any, tensors: list[Any]) -> list[Any]:
    """The state's tensors with a left-out momentum of zeros put back (anything else as sent,
    for state.py to check)."""
    if (
        isinstance(metadata, dict)
        and metadata.get("momentum") == ZERO_MOMENTUM
        and len(tensors) == 1
        and isinstance(tensors[0], torch.Tensor)
        and tensors[0].dtype == torch.float32
        and tensors[0].dim() == 1
    ):
        return [tensors[0], torch.zeros_like(tensors[0])]
    return tensors
