"""Background averaging of the pseudo-gradient with hivemind's DecentralizedAverager, and
detection of partial rounds.

A round carries one vector: each member's pseudo-gradient (parameters at the last sync minus
parameters now), compressed on the wire (float16 by default, 8-bit or 4-bit as options), averaged
weighted by tokens. The synchronized parameters never travel in a round: members compare
sketches of them (sync.py) and a member found out of sync downloads the swarm's state instead.

The vector is held flat (the model's pieces, layout.py, are views of it). hivemind splits the
tensors of a round into contiguous spans, one per group member, and sends each tensor part as one
message; a member that dies mid-round leaves its span unaveraged on the survivors, with only a log
line. So each round lays the vector out for its group (`round_layout`): one span per member, each
a one-element *probe* followed by one chunk of the vector, cut where hivemind will cut. Every
member writes its own random probe value and tells the group that value (all-gather); after the
round every probe must equal the weighted mean of those values. A probe that does not lies in a
span nobody averaged, and the whole round is discarded rather than applied half-averaged. A round
of N members moves 2N tensors however many parameters the model has (a piece each, as before,
made hivemind handle about 150 messages a round for the small model, most of its averaging CPU).

Memory: the averaged tensors hold the update in float16 (half the float32 model), and a second
float16 copy keeps this member's own contribution: the runtime needs it to apply the round
(error feedback), and hivemind retries a failed all-reduce from tensors it half-updated in place,
so every attempt restarts from that copy. Both live in shared memory, read by hivemind's process.

The averager itself (GuardedAverager, guarded.py) runs behind the swarm's gates and, when
defended, reduces robustly, audits every span and leaves out members it caught.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import random
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind import DHT
from hivemind.averaging.control import AveragingStage
from hivemind.compression import (
    Float16Compression,
    NoCompression,
    PerTensorCompression,
)
from hivemind.utils import MPFuture

from atomtrain.errors import AtomError
from atomtrain.peer.assembly import RETRIES, ExpectedMembers
from atomtrain.peer.auth import MemberGate
from atomtrain.peer.bounds import (
    DELTA,
    PROBE,
    Defence,
    equal_weights,
)
from atomtrain.peer.codecs import Blockwise8Bit, Uniform4BitQuantization, register
from atomtrain.peer.exact import START_FLOOR_S
from atomtrain.peer.guarded import FORGED, MALFORMED, UNVERIFIED, GuardedAverager, finite
from atomtrain.peer.layout import Piece
from atomtrain.peer.probation import read_only
from atomtrain.peer.sync import membership
from atomtrain.peer.traffic import Traffic

log = logging.getLogger(__name__)
register()  # the 4-bit codec, before any averager process starts

CODECS: dict[str, tuple[Any, torch.dtype, float]] = {
    # name: (hivemind codec, dtype of the held tensors, wire bytes per element)
    "float16": (Float16Compression(), torch.float16, 2.0),
    "int8": (Blockwise8Bit(), torch.float16, 1.0),
    "int4": (Uniform4BitQuantization(), torch.float16, 0.5),
    "none": (NoCompression(), torch.float32, 4.0),
}


def codec(name: str) -> tuple[Any, torch.dtype, float]:
    if name not in CODECS:
        raise AtomError(f"peer.compression must be one of {', '.join(CODECS)}, got {name!r}")
    return CODECS[name]


@dataclass
class RoundResult:
    group_size: int
    peers: list[dict[str, Any]]
    """What each member told the group (name, tokens, round, sketch...), in group order."""
    own_index: int
    in_sync: list[bool]
    """Per member: holds the group's reference synchronized parameters (sync.py)."""
    peer_ids: list[str]
    """The members' peer IDs (base58), in group order."""
    read_only: list[bool] = field(default_factory=list)
    """Per member: read, its update left out of the average (probation.py)."""

    @property
    def self_in_sync(self) -> bool:
        return self.in_sync[self.own_index] if self.in_sync else True


class RoundFailed(Exception):
    pass


class ProbedAverager:
    """Owns the averager and its tensor layout; one round at a time."""

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        pieces: list[Piece],
        compression: str,
        matchmaking_s: float,
        timeout_s: float,
        target_group_size: int,
        state_provider: Any,
        gate: MemberGate | None = None,
        defence: Defence | None = None,
        attack: str = "",
        start_timeout_s: float = START_FLOOR_S,
        live_others: Callable[[], list[str]] = list,
        unfinished_others: Callable[[], list[str]] = list,
        assemble_early: str = RETRIES,
    ) -> None:
        """`attack`: `forge_gather` makes this averager a leader that forges (bench attack);
        `start_timeout_s`: exact.py's floor of each member's start timeout; `live_others`: the
        peer IDs of the live others, read at each round's start (a leader that has them all in
        a retry's group forms it at once: assembly.py; `assemble_early` ALWAYS: in every try);
        `unfinished_others`: those and the live others it left out or rejected.
        """
        self.pieces = pieces
        self.timeout_s = timeout_s
        wire, dtype, _ = codec(compression)
        numel = sum(p.numel for p in pieces)
        if numel < 2 * target_group_size:
            raise AtomError(f"a model of {numel} parameters is too small to average")
        # shared memory, read and written by hivemind's process: the averaged vector and a probe
        # slot per possible member; this member's contribution and its probe value
        self._held = torch.zeros(numel, dtype=dtype).share_memory_()
        self._probes = torch.zeros(target_group_size).share_memory_()
        self._own = torch.zeros(numel, dtype=dtype).share_memory_()
        self._probe_in = torch.zeros(target_group_size).share_memory_()
        tensors = [self._held, self._probes]
        inputs = [self._own, self._probe_in]
        self._inputs = inputs
        self.kinds = [DELTA, PROBE]  # by the round layout's compression keys
        self._events: Any = mp.get_context("fork").Queue()
        self._discard: Any = mp.get_context("fork").Value("b", 0)  # set by hivemind's process
        self._attempts: Any = mp.get_context("fork").Value("i", 0)  # groups this round ran with
        self._expected = ExpectedMembers(target_group_size)
        self._unfinished = ExpectedMembers(target_group_size)
        self._live_others, self._unfinished_others = live_others, unfinished_others
        self._stalls: list[tuple[str, str]] = []
        self._agreements: list[tuple[str, str, float]] = []
        self.rejected_ids: set[str] = set()  # peer IDs (base58) rejected, as events came
        self.left_out_ids: set[str] = set()  # stallers; the runtime forgets one as it returns
        self.names: dict[str, str] = {}  # peer ID -> name, from the rounds' metadata (events)
        self.traffic = Traffic()  # bytes moved, counted in the averager's process
        # hivemind ignores SIGINT in the calling process to start the averager and leaves it so:
        # Ctrl-C (how a peer is stopped, with a checkpoint) must still reach the trainer
        on_interrupt = signal.getsignal(signal.SIGINT)
        self.averager = GuardedAverager(
            state_provider,
            gate or MemberGate(None, prefix),
            defence,
            self.kinds,
            self._events,
            inputs,
            self.traffic,
            self._discard,
            self._attempts,
            tensors,
            dht,
            # a member's round is scheduled at most this far from its group's (retries keep it)
            window_s=timeout_s + 2 * matchmaking_s,
            start_timeout_s=start_timeout_s,
            attack=attack,
            expected=self._expected,
            unfinished=self._unfinished,
            assemble_early=assemble_early,
            prefix=prefix,
            start=True,
            target_group_size=target_group_size,
            min_group_size=2,
            min_matchmaking_time=matchmaking_s,
            request_timeout=1.0,
            allreduce_timeout=timeout_s,
            next_chunk_timeout=max(timeout_s / 3, 2.0),
            compression=PerTensorCompression([wire, NoCompression()]),
            state_compression=NoCompression(),
            allow_state_sharing=True,
            declare_state_period=5.0,
            shutdown_timeout=3.0,
        )
        if on_interrupt is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, on_interrupt)
        self.defence = defence
        self._probe = 0.0
        self._control: Any = None
        self._triggered = False

    def held_bytes(self) -> int:
        """Host bytes this averager holds for the round (averaged tensors and own copy)."""
        return sum(t.numel() * t.element_size() for t in (*self._inputs, self._held, self._probes))

    # --- a round ------------------------------------------------------------------------------

    def start(
        self,
        write: Callable[[Piece, torch.Tensor], None],
        weight: float,
        info: Callable[[], dict[str, Any]],
    ) -> None:
        """`write(piece, out)` fills `out` with this member's contribution for the piece; then
        `info()` says what the group is told about it (it may use what `write` measured); then
        the round looks for its group."""
        assert self._control is None, "a round is already running"
        self._write(write)
        self._control = self._step(weight, info(), scheduled_time=None)
        self._triggered = True

    def prepare(self, weight: float, info: dict[str, Any], scheduled_time: float) -> None:
        """Look for a group now for an all-reduce at `scheduled_time` (unix seconds), telling it
        `info` and `weight` ahead; the contribution is written later, by trigger(). A prepared
        round that finds no group by then fails (no retries: its slot has passed)."""
        assert self._control is None, "a round is already running"
        self._control = self._step(weight, info, scheduled_time=scheduled_time)
        self._triggered = False

    def trigger(self, write: Callable[[Piece, torch.Tensor], None]) -> None:
        """Write the prepared round's contribution and let its all-reduce run."""
        assert self._control is not None and not self._triggered
        self._write(write)
        self._triggered = True
        self._control.allow_allreduce()

    @property
    def awaiting_trigger(self) -> bool:
        """A round was prepared and its contribution is not written yet."""
        return self._control is not None and not self._triggered

    def _write(self, write: Callable[[Piece, torch.Tensor], None]) -> None:
        # into the round's input; hivemind copies it into the averaged tensors at each attempt
        for piece in self.pieces:
            write(piece, self._view(self._own, piece))

    def _step(self, weight: float, info: dict[str, Any], scheduled_time: float | None) -> Any:
        self._probe = random.uniform(1.0, 2.0)
        self._discard.value = 0
        self._attempts.value = 0
        self._probe_in.fill_(self._probe)
        self._expected.write(self._live_others())
        self._unfinished.write(self._unfinished_others())
        gather = {**info, "probe": self._probe, "weight": weight}
        if self.defence is not None:  # every reducer and auditor of the group uses its median
            gather["min_scale"] = self.defence.min_scale
        return self.averager.step(
            wait=False,
            weight=max(weight, 1e-6),
            timeout=self.timeout_s,
            gather=gather,
            scheduled_time=scheduled_time,
            allow_retries=scheduled_time is None,
            require_trigger=scheduled_time is not None,
        )

    @property
    def running(self) -> bool:
        return self._control is not None

    def done(self) -> bool:
        return self._control is not None and self._control.done()

    @property
    def attempts(self) -> int:
        """Groups the last round ran its all-reduce with: more than 1 where one was lost (a
        member stalled it) and hivemind retried within the round's time, which only a round
        started when due does (a prepared round fails; its slot has passed)."""
        return int(self._attempts.value)

    def group_found(self) -> bool:
        """The running round found its group (its all-reduce may wait for the trigger)."""
        stage = getattr(self._control, "stage", None)
        return stage in (
            AveragingStage.AWAITING_TRIGGER,
            AveragingStage.RUNNING_ALLREDUCE,
            AveragingStage.FINISHED,
        )

    def cancel(self) -> None:
        if self._control is not None:
            self._control.cancel()
            self._control = None

    def result(self) -> RoundResult:
        """The finished round; RoundFailed when there was no group, the round broke, a reducer
        sent back bad averages, or a probe shows part of the vector was never averaged."""
        control, self._control = self._control, None
        try:
            gathered = control.result(timeout=0)
        except Exception as e:
            raise RoundFailed(f"round failed: {type(e).__name__}: {e}") from None
        if not gathered:
            raise RoundFailed("no group formed")
        if self._discard.value == FORGED:
            raise RoundFailed(
                "the leader sent metadata its members did not sign: took part for the others, "
                "applied nothing, rejected the leader"
            )
        if self._discard.value == MALFORMED:
            raise RoundFailed("a group member signed malformed round metadata: rejected it")
        if self._discard.value == UNVERIFIED:
            raise RoundFailed(
                "no certificate found for a group member's metadata key: took part for the "
                "others, applied nothing"
            )
        if self._discard.value:
            raise RoundFailed(
                "the group held a peer this one banned or excludes: took part for the others, "
                "applied nothing"
            )
        peers = [g for g in gathered.values() if isinstance(g, dict)]
        if len(peers) != len(gathered):
            raise RoundFailed("a group member sent malformed round metadata")
        own_id = self.averager.peer_id
        ids = list(gathered)
        try:
            weights = [float(g["weight"]) for g in peers]
            probes = [float(g["probe"]) for g in peers]
        except (KeyError, TypeError, ValueError):
            raise RoundFailed("a group member sent malformed round metadata") from None
        if self.defence is not None:
            weights = equal_weights(weights)
        total = sum(weights)
        if not (total > 0 and all(map(finite, probes))):
            raise RoundFailed("a group member sent malformed round metadata")
        expected = sum(w * p for w, p in zip(weights, probes, strict=True)) / total
        with self.averager.get_tensors():
            seen = self._probes[: len(peers)].tolist()  # one per member's span (round_layout)
        bad = [p for p in seen if not abs(p - expected) <= 1e-5 * abs(expected)]
        if bad:
            raise RoundFailed(
                f"partial round: {len(bad)} of {len(seen)} probes unaveraged "
                f"(a group member left mid-round or sent bad averages); discarded"
            )
        flags = membership(peers)
        return RoundResult(
            len(peers),
            peers,
            ids.index(own_id),
            flags,
            [i.to_base58() for i in ids],
            read_only(peers, ids, flags) if self.defence is not None else [False] * len(peers),
        )

    @contextmanager
    def averaged(self) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """(group average, own contribution) per piece, while no round runs."""
        assert self._control is None
        with self.averager.get_tensors():
            yield [(self._view(self._held, p), self._view(self._own, p)) for p in self.pieces]

    def contributions(self) -> list[torch.Tensor]:
        """This member's contribution to the running (or last) round, per piece."""
        return [self._view(self._own, p) for p in self.pieces]

    @staticmethod
    def _view(flat: torch.Tensor, piece: Piece) -> torch.Tensor:
        return flat[piece.offset : piece.offset + piece.numel]

    def rejections(self) -> list[tuple[str, str]]:
        """(peer, why) for each member the averager rejected since the last call, by name when a
        round told us its name."""
        out: list[tuple[str, str]] = []
        while True:
            try:
                peer_id, why, kind = self._events.get_nowait()
            except queue.Empty:
                return out
            if kind == "name":  # from metadata its member signed (any, in open swarms)
                self.names[peer_id] = why
                continue
            if kind == "agreement":  # "cosine lean" (exclusion.LeftOut.reading)
                cosine, lean = (float(x) for x in why.split())
                name = self.names.get(peer_id) or peer_id
                self._agreements.append((name, peer_id, cosine, lean))
                continue
            (self.left_out_ids if kind == "stall" else self.rejected_ids).add(peer_id)
            named = (self.names.get(peer_id) or peer_id, why)
            (self._stalls if kind == "stall" else out).append(named)

    def stalls(self) -> list[tuple[str, str]]:
        """(peer, why) for each member excluded for a while since the last call, for stalling
        a round (read after rejections())."""
        out, self._stalls = self._stalls, []
        return out

    def agreements(self) -> list[tuple[str, str, float, float]]:
        """(name, peer ID, cosine, lean) for each reading, since the last call, of how a
        member's update agreed with this peer's own over the span this peer reduced, and how
        far it leans one way less its component along this peer's (NaN: not read; read after
        rejections()): what the update rules (exclusion.py: OPPOSED_COSINE, LEAN) judge, for a
        user to check them on their data."""
        out, self._agreements = self._agreements, []
        return out

    def download_state(self, timeout_s: float, sources: list[str], wait: bool = True) -> Any:
        """(metadata, tensors) from the first of `sources` (peer IDs, best first: state.py) that
        serves one, or None; with wait=False, a future of that."""
        future = MPFuture()
        self.averager._outer_pipe.send(
            ("_download_from", [], dict(sources=list(sources), timeout_s=timeout_s, future=future))
        )
        return future.result(timeout=timeout_s * max(len(sources), 1)) if wait else future

    def shutdown(self) -> None:
        self.cancel()
        self.averager.shutdown()
