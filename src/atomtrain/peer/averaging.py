"""Background averaging with hivemind's DecentralizedAverager, and detection of partial rounds.

Each round averages two flat vectors, token-weighted: the pseudo-gradient (compressed, float16 by
default) and the parameters at the last sync (uncompressed, which keeps peers' synchronized
parameters together even after rounds some of them missed).

hivemind splits the concatenated tensors into contiguous spans, one per group member; a member
that dies mid-round leaves its span unaveraged on the survivors, with only a log line. So the
vectors are cut into many chunks with a one-element *probe* after each. Every member writes its own
random probe value and tells the group that value (all-gather); after the round every probe must
equal the weighted mean of those values. A probe that does not lies in a span nobody averaged, and
the whole round is discarded rather than applied half-averaged. hivemind retries a round whose
all-reduce failed from tensors the failed attempt half-updated in place, so every attempt here
restarts from the round's input.

The averager runs behind the swarm's gates (auth.py) and, when defended, reduces robustly
(robust.py).
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import queue
import random
from dataclasses import dataclass

# hivemind reads RPC signatures and recognizes streams by typing's AsyncIterator only
from typing import Any, AsyncIterator  # noqa: UP035

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import Float16Compression, NoCompression, PerTensorCompression
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import as_aiter, azip
from hivemind.utils.timed_storage import get_dht_time

from atomtrain.peer.auth import MemberGate
from atomtrain.peer.robust import DELTA, PROBE, THETA, Defence, RobustRunner, capped_weights

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
        gate: MemberGate | None = None,
        defence: Defence | None = None,
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
        self.defence = defence
        half = len(tensors) // 2
        self.kinds = [PROBE if i % 2 else DELTA if i < half else THETA for i in range(len(tensors))]
        self._events: Any = mp.get_context("fork").Queue()
        self.names: dict[str, str] = {}  # peer ID -> name, from the rounds' metadata
        self.averager = GuardedAverager(
            state_provider,
            gate or MemberGate(None, prefix),
            defence,
            self.kinds,
            self._events,
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
        rms = float(delta.double().pow(2).mean().sqrt()) if delta.numel() else 0.0
        self._theta_in = theta_sync.detach().float().clone()
        self._theta_digest = _digest(self._theta_in)
        gather = {
            **info,
            "probe": self._probe,
            "weight": weight,
            "rms": rms,
            "theta_digest": self._theta_digest,
        }
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
        a reducer sent back bad averages, or a probe shows part of the vectors was never
        averaged."""
        control, self._control = self._control, None
        try:
            gathered = control.result(timeout=0)
        except Exception as e:
            raise RoundFailed(f"round failed: {type(e).__name__}: {e}") from None
        if not gathered:
            raise RoundFailed("no group formed")
        peers = [g for g in gathered.values() if isinstance(g, dict)]
        for peer_id, g in gathered.items():
            if isinstance(g, dict):
                self.names[peer_id.to_base58()] = str(g.get("name", ""))[:64]
        try:
            weights = [float(g["weight"]) for g in peers]
            probes = [float(g["probe"]) for g in peers]
        except (KeyError, TypeError, ValueError):
            raise RoundFailed("a group member sent malformed round metadata") from None
        if len(peers) != len(gathered):
            raise RoundFailed("a group member sent malformed round metadata")
        if self.defence is not None:
            weights = capped_weights(weights, self.defence.weight_cap)
        total = sum(weights)
        if not (total > 0 and all(map(_finite, probes))):
            raise RoundFailed("a group member sent malformed round metadata")
        expected = sum(w * p for w, p in zip(weights, probes, strict=True)) / total
        with self.averager.get_tensors() as tensors:
            delta, theta_sync, seen = self._read(tensors)
        bad = [i for i, p in enumerate(seen) if not abs(p - expected) <= 1e-5 * abs(expected)]
        if bad:
            raise RoundFailed(
                f"partial round: {len(bad)} of {len(seen)} probes unaveraged "
                f"(a group member left mid-round or sent bad averages); discarded"
            )
        finite = bool(torch.isfinite(delta).all()) and bool(torch.isfinite(theta_sync).all())
        if self.defence is not None and not finite:
            raise RoundFailed("the averages hold non-finite values; discarded")
        if self.defence is not None and self._in_sync(peers):
            # most of the group holds our synchronized parameters bit for bit, so their average
            # is ours: no reducer (an honest one would agree) gets to move them
            theta_sync = self._theta_in
        return RoundResult(delta, theta_sync, len(peers), peers)

    def _in_sync(self, peers: list[dict[str, Any]]) -> bool:
        same = sum(1 for g in peers if g.get("theta_digest") == self._theta_digest)
        return same * 2 > len(peers)

    def rejections(self) -> list[tuple[str, str]]:
        """(peer, why) for each member the averager rejected since the last call, by name when a
        round told us its name."""
        out: list[tuple[str, str]] = []
        while True:
            try:
                peer_id, why = self._events.get_nowait()
            except queue.Empty:
                return out
            out.append((self.names.get(peer_id) or peer_id, why))

    def download_state(self, timeout_s: float) -> tuple[dict, list[torch.Tensor]] | None:
        out = self.averager.load_state_from_peers(timeout=timeout_s)
        if out is None:
            return None
        metadata, tensors = out
        return metadata, list(tensors)

    def shutdown(self) -> None:
        self.cancel()
        self.averager.shutdown()


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().numpy().tobytes(), digest_size=16).hexdigest()


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


class GuardedAverager(DecentralizedAverager):
    """hivemind's averager behind the swarm's gates, with robust aggregation when defended.

    Runs in its own process. Serves the peer's state (metadata, tensors) to joiners that pass the
    gate; refuses group requests, tensor parts and state downloads from callers that do not; never
    asks a leader that does not; and reports each member it rejects through `events`.
    """

    def __init__(
        self,
        provider: Any,
        gate: MemberGate,
        defence: Defence | None,
        kinds: list[str],
        events: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self._provider, self._gate, self._defence = provider, gate, defence
        self._kinds, self._events = kinds, events
        super().__init__(*args, **kwargs)

    def get_current_state(self):
        metadata, tensors = self._provider()
        return metadata, tensors, None

    def _reject(self, peer_id: PeerID, why: str) -> None:
        if peer_id not in self._gate.banned:
            self._gate.ban(peer_id)
            self._events.put((peer_id.to_base58(), why))

    # --- gates ------------------------------------------------------------------------------

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not await self._gate.allows(self.dht, context.remote_id):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not await self._gate.allows(self.dht, context.remote_id):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._gate.allows(self.dht, context.remote_id):
            return  # the caller sees no state and moves on
        async for message in super().rpc_download_state(request, context):
            yield message

    async def _step(self, *, step, future_for_init):
        self._guard_leaders()
        # hivemind retries a step whose all-reduce failed, starting from tensors the failed
        # attempt already half-updated in place: keep this round's input to restart from it
        with self.get_tensors() as tensors:
            self._round_input = [t.detach().clone() for t in tensors]
        return await super()._step(step=step, future_for_init=future_for_init)

    def _guard_leaders(self) -> None:
        """hivemind picks leaders from the DHT with no hook to refuse one: wrap the request so a
        banned or unproven leader is skipped like one that said no."""
        matchmaking = getattr(self, "_matchmaking", None)
        if matchmaking is None or getattr(matchmaking, "_atom_guarded", False):
            return
        ask = matchmaking._request_join_group

        async def guarded(leader: PeerID):
            if not await self._gate.allows(self.dht, leader):
                return None
            return await ask(leader)

        matchmaking._request_join_group = guarded
        matchmaking._atom_guarded = True

    # --- robust all-reduce ------------------------------------------------------------------

    async def _aggregate_with_group(self, group_info, min_vector_size, **kwargs):
        if any(p in self._gate.banned for p in group_info.peer_ids):
            raise AllreduceException("the group holds a banned peer")
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        for tensor, original in zip(tensors, getattr(self, "_round_input", ()), strict=False):
            tensor.copy_(original)  # every attempt of a round starts from the round's input
        if self._defence is None:
            return await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        group_id = group_info.group_id if group_id is None else group_id
        weights, reported, digests = [], [], []
        for blob in group_info.gathered:
            try:
                user = self.serializer.loads(self.serializer.loads(blob)[2])
                weights.append(float(user["weight"]))
                reported.append(float(user.get("rms", float("nan"))))
                digests.append(str(user.get("theta_digest", "")))
            except Exception:  # malformed metadata: the probe check discards the round
                weights.append(float("nan"))
                reported.append(float("nan"))
                digests.append("")
        majority = max(set(digests), key=digests.count)
        in_sync = (
            {p: d == majority for p, d in zip(group_info.peer_ids, digests, strict=True)}
            if majority and digests.count(majority) * 2 > len(digests)
            else None
        )
        capped = capped_weights(weights, self._defence.weight_cap)
        runner = RobustRunner(
            kinds=self._kinds,
            weights=dict(zip(group_info.peer_ids, capped, strict=True)),
            reported_rms=dict(zip(group_info.peer_ids, reported, strict=True)),
            banned=set(self._gate.banned),
            in_sync=in_sync,
            defence=self._defence,
            on_reject=self._reject,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        async for tensor, update in azip(as_aiter(*tensors), runner):
            tensor.add_(update, alpha=self._averaging_alpha)
        self.last_updated = get_dht_time()
        self._state_updated.set()
