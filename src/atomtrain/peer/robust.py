"""Robust aggregation inside hivemind's all-reduce: one peer cannot move the model arbitrarily.

In a butterfly all-reduce every member reduces one span of the vectors: it receives every member's
part of that span and sends back their average. Here the reducer first checks each part against
its *own* part (it trusts only itself) and against the size an honest contribution has this round
(`Typical`: the group's lower-median update per token, times the member's capped tokens):

- a part with non-finite values is dropped;
- a pseudo-gradient part farther from ours than `clip` typical sizes is pulled back onto that
  bound (centered clipping); beyond `reject` sizes it is dropped;
- weights (tokens) are capped at `weight_cap` times the group's lower median weight;
- updates of members whose synchronized parameters differ from the group's reference (sketches
  in the round's metadata, sync.py) are left out: they were made from other parameters (a stale
  model). Such a member is not banned: it downloads the swarm's state and takes part again.

A member whose part is dropped is *rejected*: named to the peer (and so in its log and status) and
banned: the gates refuse it from then on, and its data in any later group is dropped. Probe
elements (see averaging.py) are averaged as they are, with the same capped weights, so every
member can still tell a fully averaged round from a partial one.

A reducer can lie too: every member checks the averaged parts it receives (finite, and within the
`reject` bounds of its own values). A reducer that fails the check is rejected and banned like a
sender, and the round it spoiled is discarded.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.p2p import PeerID

from atomtrain.peer.sync import lower_median
from atomtrain.peer.traffic import CountedRunner

DELTA, PROBE = "delta", "probe"
MIN_WEIGHT = 1e-6


@dataclass(frozen=True)
class Defence:
    """Bounds of the robust aggregation."""

    clip: float = 2.0
    """Pseudo-gradient parts farther than this many typical updates from ours are clipped."""
    reject: float = 20.0
    """...and beyond this many, dropped, and their sender banned."""
    min_scale: float = 0.0
    """Smallest typical update (RMS), so a peer whose own update is near zero (its last round
    right after a sync) does not take honest peers' updates for outliers."""
    weight_cap: float = 4.0
    """Largest weight, as a multiple of the group's lower median weight."""


def capped_weights(weights: Sequence[float], cap: float) -> list[float]:
    """The weights the round uses: invalid ones become tiny, large ones are capped. Every member
    computes the same list from the same gathered metadata."""
    clean = [w if math.isfinite(w) and w > 0 else MIN_WEIGHT for w in weights]
    median = lower_median(clean)
    return [max(MIN_WEIGHT, min(w, cap * median)) for w in clean]


@dataclass(frozen=True)
class Typical:
    """How large (RMS per element) an honest contribution is expected to be this round.

    An update grows with the tokens behind it, so each member's typical update is the group's
    typical update *per token* (the lower median of what members report: one cannot inflate it)
    times the member's capped tokens."""

    delta: dict[int, float]
    """Per sender index."""

    @classmethod
    def of(
        cls, weights: Sequence[float], reported_rms: Sequence[float], min_scale: float
    ) -> Typical:
        per_token = lower_median([r / w for r, w in zip(reported_rms, weights, strict=True)])
        median_w = lower_median(list(weights)) or 1.0
        per_token = max(per_token, min_scale / median_w)
        return cls({i: per_token * w for i, w in enumerate(weights)})

    def delta_bound(self, i: int, own: int) -> float:
        """Distance between two honest updates: at most about the sum of their sizes."""
        return self.delta[i] + self.delta[own]


def bound(scale: float, numel: int, factor: float) -> float:
    return factor * scale * math.sqrt(max(numel, 1)) + 1e-12


class RobustReducer(TensorPartReducer):
    """Keeps every sender's part until all arrived, then combines them robustly."""

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        part_kinds: Sequence[str],
        weights: Sequence[float],
        own_sender: int,
        typical: Typical,
        defence: Defence,
        banned: Sequence[bool],
        on_reject: Callable[[int, str], None],
        in_sync: Sequence[bool] | None = None,
    ) -> None:
        self.part_kinds = list(part_kinds)
        self.weights = list(weights)
        self.own_sender = own_sender
        self.typical = typical
        self.defence = defence
        self.dropped = list(banned)
        # who holds the group's majority synchronized parameters (None: no majority)
        self.in_sync = list(in_sync) if in_sync is not None else None
        self.on_reject = on_reject
        self.parts: dict[int, torch.Tensor] = {}
        super().__init__(part_shapes, len(weights))

    def reset_accumulators(self) -> None:
        self.parts = {}
        super().reset_accumulators()

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        if not (0 <= sender_index < self.num_senders and 0 <= part_index < self.num_parts):
            raise AllreduceException("invalid sender or part index")
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException("part arrived after the reducer finished")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        if part_index != self.current_part_index:
            raise AllreduceException("part arrived out of order")
        future = self.current_part_future
        if tensor_part.shape != self.part_shapes[part_index] or not tensor_part.is_floating_point():
            self._reject(sender_index, f"a part of {tensor_part.dtype} {tuple(tensor_part.shape)}")
            self.num_parts_received[sender_index] -= 1  # not received: the part is not waited for
            raise AllreduceException("a part of the wrong shape or dtype")
        if part_index < self.sender_failed_after[sender_index]:
            self.parts[sender_index] = tensor_part.detach().float().clone()
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await future

    def check_current_part_finished(self) -> None:
        if self.current_part_accumulated_from == self.num_current_senders:
            self.current_part_future.set_result(self._combine())
            self.reset_accumulators()

    def _combine(self) -> torch.Tensor:
        shape = self.part_shapes[self.current_part_index]
        kind = self.part_kinds[self.current_part_index]
        if kind == PROBE:
            return self._mean(self.parts.items(), shape)
        own_i = self.own_sender
        own = self.parts.get(own_i)
        kept: list[tuple[int, torch.Tensor]] = []
        for i, x in self.parts.items():
            if kind == DELTA and self.in_sync is not None and not self.in_sync[i]:
                continue  # an update made from other synchronized parameters than the group's
            if i == self.own_sender or own is None:
                kept.append((i, x))
                continue
            if self.dropped[i]:
                continue
            if not bool(torch.isfinite(x).all()):
                self._reject(i, "non-finite values")
                continue
            r = x - own
            norm = float(r.norm())
            clip, reject = self.defence.clip, self.defence.reject
            scale = self.typical.delta_bound(i, own_i)
            if norm > bound(scale, x.numel(), reject):
                self._reject(i, f"{kind} {norm / bound(scale, x.numel(), 1):.3g}x typical")
                continue
            tau = bound(scale, x.numel(), clip)
            kept.append((i, own + r * (tau / norm) if norm > tau else x))
        return self._mean(kept, shape)

    def _mean(self, items, shape: torch.Size) -> torch.Tensor:
        out = torch.zeros(shape)
        total = 0.0
        for i, x in items:
            out.add_(x, alpha=self.weights[i])
            total += self.weights[i]
        return out.div_(total) if total > 0 else out

    def _reject(self, sender: int, why: str) -> None:
        self.dropped[sender] = True
        self.on_reject(sender, why)


class RobustRunner(CountedRunner):
    """hivemind's all-reduce with the robust reducer and a check of what other reducers return."""

    def __init__(
        self,
        *,
        kinds: Sequence[str],
        weights: dict[PeerID, float],
        reported_rms: dict[PeerID, float],
        banned: set[PeerID],
        in_sync: dict[PeerID, bool] | None,
        defence: Defence,
        on_reject: Callable[[PeerID, str], None],
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.defence = defence
        self._on_reject = on_reject
        own_index = self.ordered_peer_ids.index(self.peer_id)
        own_parts = self.tensor_part_container._input_parts_by_peer[own_index]
        part_kinds = [kinds[info.key] for _, info in own_parts]
        senders = self.sender_peer_ids
        self.typical = Typical.of(
            [weights.get(p, MIN_WEIGHT) for p in senders],
            [reported_rms.get(p, math.nan) for p in senders],
            defence.min_scale,
        )
        self._own_sender = senders.index(self.peer_id)
        self.tensor_part_reducer = RobustReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            part_kinds,
            [weights.get(p, MIN_WEIGHT) for p in senders],
            self._own_sender,
            self.typical,
            defence,
            [p in banned for p in senders],
            lambda i, why: on_reject(senders[i], why),
            [in_sync[p] for p in senders] if in_sync is not None else None,
        )
        self._kinds_by_peer = [
            [kinds[info.key] for _, info in parts]
            for parts in self.tensor_part_container._input_parts_by_peer
        ]
        register = self.tensor_part_container.register_processed_part

        def checked(peer_index: int, part_index: int, delta: torch.Tensor) -> None:
            if peer_index != own_index:
                self._check_reduced(peer_index, part_index, delta)
            register(peer_index, part_index, delta)

        self.tensor_part_container.register_processed_part = checked

    def _check_reduced(self, peer_index: int, part_index: int, delta: torch.Tensor) -> None:
        """`delta` is the reducer's average minus our own part."""
        kind = self._kinds_by_peer[peer_index][part_index]
        norm = float(delta.norm())
        # an average of updates is no farther from ours than the largest one
        scale = max(self.typical.delta.values()) + self.typical.delta[self._own_sender]
        typical = bound(scale, delta.numel(), 1.0)
        if not bool(torch.isfinite(delta).all()):
            why = "non-finite averages"
        elif kind != PROBE and norm > typical * self.defence.reject:
            why = f"{kind} averages {norm / typical:.3g}x typical"
        else:
            return
        culprit = self.ordered_peer_ids[peer_index]
        self._on_reject(culprit, f"reducer returned {why}")
        error = AllreduceException(f"{culprit} returned {why}")
        self.finalize(exception=error)  # the round is lost: end it now, not at its timeout
        raise error
