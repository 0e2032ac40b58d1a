"""Background averaging with hivemind's DecentralizedAverager, and detection of partial rounds.

Each round averages two flat vectors, token-weighted: the pseudo-gradient (compressed, float16 by
default) and the parameters at the last sync (uncompressed, which keeps peers' synchronized
parameters together even after rounds some of them missed).

hivemind splits the concatenated tensors into contiguous spans, one per group member; a member
that dies mid-round leaves its span unaveraged on the survivors, with only a log line. So the
vectors are cut into many chunks with a one-element *probe* after each. Every member writes its own
random probe value and tells the group that value (all-gather); after the round every probe must
equal the weighted mean of those values. A probe that does not lies in a span nobody averaged, and
the whole round is discarded rather than applied half-averaged.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import Float16Compression, NoCompression, PerTensorCompression

log = logging.getLogger(__name__)

CHUNKS_PER_VECTOR = 32


@dataclass
class RoundResult:
    delta: torch.Tensor
    """Averaged pseudo-gradient (flat float32)."""
    theta_sync: torch.Tensor
    """Averaged parameters at the last sync (flat float32)."""
    group_size: int
    peers: list[dict[str, Any]]
    """What each member told the group (name, tokens, round)."""


class RoundFailed(Exception):
    pass


def _chunk_sizes(numel: int, chunks: int) -> list[int]:
    chunks = max(1, min(chunks, numel))
    return [numel * (i + 1) // chunks - numel * i // chunks for i in range(chunks)]


class ProbedAverager:
    """Owns the averager and its tensor layout; one round at a time."""

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        numel: int,
        compression: str,
        matchmaking_s: float,
        timeout_s: float,
        target_group_size: int,
        state_provider: Any,
    ) -> None:
        self.numel = numel
        self.timeout_s = timeout_s
        sizes = _chunk_sizes(numel, CHUNKS_PER_VECTOR)
        self.sizes = sizes
        tensors: list[torch.Tensor] = []
        codecs: list[Any] = []
        fast = Float16Compression() if compression == "float16" else NoCompression()
        for vector in range(2):  # 0: pseudo-gradient, 1: parameters at last sync
            for n in sizes:
                tensors.append(torch.zeros(n))
                codecs.append(fast if vector == 0 else NoCompression())
                tensors.append(torch.zeros(1))  # probe
                codecs.append(NoCompression())
        self._state_provider = state_provider
        averager_cls = _averager_class(state_provider)
        self.averager = averager_cls(
            tensors,
            dht,
            prefix=prefix,
            start=True,
            target_group_size=target_group_size,
            min_group_size=2,
            min_matchmaking_time=matchmaking_s,
            request_timeout=1.0,
            allreduce_timeout=timeout_s,
            next_chunk_timeout=max(timeout_s / 3, 2.0),
            compression=PerTensorCompression(codecs),
            state_compression=NoCompression(),
            allow_state_sharing=True,
            declare_state_period=5.0,
            shutdown_timeout=3.0,
        )
        self._probe = 0.0
        self._control: Any = None

    # --- writing and reading the flat vectors -----------------------------------------------

    def _write(
        self, tensors: tuple, delta: torch.Tensor, theta_sync: torch.Tensor, probe: float
    ) -> None:
        pos, t = 0, 0
        for vector in (delta, theta_sync):
            pos = 0
            for n in self.sizes:
                tensors[t].copy_(vector[pos : pos + n])
                tensors[t + 1].fill_(probe)
                pos, t = pos + n, t + 2

    def _read(self, tensors: tuple) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        vectors = [torch.empty(self.numel), torch.empty(self.numel)]
        probes, t = [], 0
        for vector in vectors:
            pos = 0
            for n in self.sizes:
                vector[pos : pos + n].copy_(tensors[t])
                probes.append(float(tensors[t + 1]))
                pos, t = pos + n, t + 2
        return vectors[0], vectors[1], probes

    # --- a round ------------------------------------------------------------------------------

    def start(
        self, delta: torch.Tensor, theta_sync: torch.Tensor, weight: float, info: dict[str, Any]
    ) -> None:
        assert self._control is None, "a round is already running"
        self._probe = random.uniform(1.0, 2.0)
        with self.averager.get_tensors() as tensors:
            self._write(tensors, delta, theta_sync, self._probe)
        gather = {**info, "probe": self._probe, "weight": weight}
        self._control = self.averager.step(
            wait=False, weight=max(weight, 1e-6), timeout=self.timeout_s, gather=gather
        )

    @property
    def running(self) -> bool:
        return self._control is not None

    def done(self) -> bool:
        return self._control is not None and self._control.done()

    def cancel(self) -> None:
        if self._control is not None:
            self._control.cancel()
            self._control = None

    def result(self) -> RoundResult:
        """The finished round's averages; RoundFailed when there was no group, the round broke,
        or a probe shows part of the vectors was never averaged."""
        control, self._control = self._control, None
        try:
            gathered = control.result(timeout=0)
        except Exception as e:
            raise RoundFailed(f"round failed: {type(e).__name__}: {e}") from None
        if not gathered:
            raise RoundFailed("no group formed")
        peers = [g for g in gathered.values() if isinstance(g, dict)]
        total = sum(float(g.get("weight", 0)) for g in peers)
        if len(peers) != len(gathered) or total <= 0:
            raise RoundFailed("a group member sent malformed round metadata")
        expected = sum(float(g["weight"]) * float(g["probe"]) for g in peers) / total
        with self.averager.get_tensors() as tensors:
            delta, theta_sync, probes = self._read(tensors)
        bad = [i for i, p in enumerate(probes) if abs(p - expected) > 1e-5 * abs(expected)]
        if bad:
            raise RoundFailed(
                f"partial round: {len(bad)} of {len(probes)} probes unaveraged "
                f"(a group member left mid-round); discarded"
            )
        return RoundResult(delta, theta_sync, len(peers), peers)

    def download_state(self, timeout_s: float) -> tuple[dict, list[torch.Tensor]] | None:
        out = self.averager.load_state_from_peers(timeout=timeout_s)
        if out is None:
            return None
        metadata, tensors = out
        return metadata, list(tensors)

    def shutdown(self) -> None:
        self.cancel()
        self.averager.shutdown()


def _averager_class(provider: Any) -> type[DecentralizedAverager]:
    class StateSharingAverager(DecentralizedAverager):
        """Serves the peer's state (metadata, tensors) to joiners."""

        def get_current_state(self):
            metadata, tensors = provider()
            return metadata, tensors, None

    return StateSharingAverager
