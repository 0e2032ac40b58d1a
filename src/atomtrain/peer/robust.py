"""Robust aggregation inside hivemind's all-reduce: no single member controls the result.

In a butterfly all-reduce every member reduces one span of the vectors: it receives every member's
part of that span and sends back their average. Here the reducer combines the parts robustly,
from what it measures in the parts themselves, never from what members claim about them:

- a part with non-finite values is dropped;
- the *center* is the coordinate-wise median of the parts; the *typical size* is the lower
  median of the parts' norms (one member can move neither beyond the honest members' values);
- a pseudo-gradient part farther from the center than `clip` typical sizes is pulled back onto
  that bound (centered clipping); beyond `reject` sizes it is dropped;
- with fewer than three parts no majority exists, so no part is trusted more than another,
  the reducer's own included: each is scaled down to the smaller norm (`clip` times it) and
  they are averaged. Whoever reduces, the average is then no larger than the smaller part: in a
  pair with a member that flips or inflates its update, the honest member's round is worth
  nothing, never worse (centered on its own part, a reducer once returned the other's inflated
  and reversed update, 20 honest sizes, accepted by the loose check that centering needed);
- every member weighs the same: token counts are claims nobody can check, so a member that
  reports more tokens gains no weight. With N members, one member moves the average by at most
  about clip / N typical updates from where the others put it, whatever it sends or claims;
- updates of members whose synchronized parameters differ from the group's reference (sketches
  in the round's metadata, sync.py) are left out: they were made from other parameters (a stale
  model). Such a member is not banned: it downloads the swarm's state and takes part again. So
  are those of a member read only (probation.py: declared on probation by most of the group),
  whose parts are still read (`reads`), not averaged.

A member whose part is dropped for non-finite values or a malformed part is *rejected*: named to
the peer (and so in its log and status) and banned: the gates refuse it from then on, and its
data in any later group is dropped. One whose part is only far too large (beyond `reject`) is
left out of the next rounds for a while instead, as a member that stalls: an honest member that
caught up, or trained alone for a while, sends such a part too (measured: at a run's last round,
one that had just caught up sent 32 clipping bounds). Beyond `ban` (10^4 bounds) it is banned. Probe
elements (see averaging.py) are averaged as they are, with the same weights, so every member can
still tell a fully averaged round from a partial one.

Each reducer also measures, over the update parts of its span, how each other member's part
agrees with its own (their cosine, `RobustRunner`'s `on_agreement`): a member whose update points
against this one's round after round, or far against it once, is left out for a while
(exclusion.py, OPPOSED_COSINE, STRONGLY_OPPOSED_COSINE), though clipping already bounds what it
moves each round; so is one whose update, less its component along this one's, leans one way (what
is left summed over its absolute sum, and that less the same of this one's update against its,
halved, where both lean the same way, `leans`, exclusion.LEAN: "a little is enough" moves every
coordinate the same way, where what is left of an honest update is noise), and one whose update
follows this one's little, far less than another member's does (`peer.follow_ratio`: a member
training on poisoned data). A member that brings
its weight average to its last round reads no one (guarded.reads_members: no `on_agreement`).

A reducer can lie too: every member checks the averaged parts it receives (bounds.py). With three or
more members in sync (reducer_bounds), within `reduced` times a typical update and its own part of
its own values; with fewer, no larger than `PAIR_SLACK` times its own part (a member in sync: its
part is one of the two). A reducer that returns non-finite values is rejected and banned like a
sender; one beyond its bound is doubted: the round is discarded and the reducer left out of the next
rounds for a while, as a member that stalls (longer each time), not banned, since an honest reducer
can land there too (one whose own update is tens of times a member's). One that lies within the
bound is caught by the span's auditor instead (audit.py: a second member replays every reduction,
`Defence.audit`); without the audit it could move its span's average by a few typical updates each
round, unseen."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Collection, Sequence

import torch
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.p2p import PeerID

from atomtrain.peer.bounds import (
    DELTA,
    MIN_WEIGHT,
    NON_FINITE,
    PROBE,
    Defence,
    Typical,
    bound,
    reducer_bounds,
    returned_lie,
    returned_pair_lie,
)
from atomtrain.peer.exact import ExactAverageRunner
from atomtrain.peer.exclusion import LEAN_MEMBERS
from atomtrain.peer.sync import lower_median


def lie_direction(shape: torch.Size, part_index: int) -> torch.Tensor:
    """A unit vector, the same for a part in every round: where a lying reducer pushes."""
    u = torch.randn(shape, generator=torch.Generator().manual_seed(1000 + part_index))
    return u / u.norm()


def median_center(parts: list[torch.Tensor]) -> torch.Tensor:
    """Coordinate-wise median (the mean of the two middle values for an even count)."""
    n = len(parts)
    ordered = torch.stack(parts).sort(dim=0).values  # (n, numel)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


class RobustReducer(TensorPartReducer):
    """Keeps every sender's part until all arrived, then combines them robustly."""

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        part_kinds: Sequence[str],
        weights: Sequence[float],
        own_sender: int,
        defence: Defence,
        banned: Sequence[bool],
        on_reject: Callable[[int, str], None],
        in_sync: Sequence[bool] | None = None,
        lie: float = 0.0,
        measure: bool = True,
        reads: Sequence[bool] | None = None,
    ) -> None:
        self.part_kinds = list(part_kinds)
        self.measure = measure  # agreement (off where no one reads it: an audit's replay)
        self.lie = lie  # bench attack only: lying_reducer (attack.py)
        self.weights = list(weights)
        self.own_sender = own_sender
        self.defence = defence
        self.dropped = list(banned)
        # who holds the group's majority synchronized parameters (None: no majority)
        self.in_sync = list(in_sync) if in_sync is not None else None
        # senders read only (probation.py): out of the average (in_sync False), still read
        self.reads = list(reads) if reads is not None else [False] * len(weights)
        self.on_reject = on_reject
        self.parts: dict[int, torch.Tensor] = {}
        # told, part by part, which senders' parts each average combined (audit.py)
        self.on_combined: Callable[[int, list[int]], None] | None = None
        # a sender whose part is only far too large: left out for a while, not banned
        self.on_doubt: Callable[[int, str], None] = on_reject
        # per sender, over this round's update parts: (its part . ours, |its part|^2, |ours|^2,
        # of its part less its component along ours the sum and the absolute sum, and of ours
        # less its component along its part the same; the last four only where leans are read)
        self.agreement: dict[int, list[float]] = {}
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
        if self.current_part_future.done():  # cancelled with a handler that awaited it
            return
        if self.current_part_accumulated_from == self.num_current_senders:
            self.current_part_future.set_result(self._combine())
            if self.on_combined is not None:
                self.on_combined(self.current_part_index, sorted(self.parts))
            self.reset_accumulators()

    def _combine(self) -> torch.Tensor:
        shape = self.part_shapes[self.current_part_index]
        kind = self.part_kinds[self.current_part_index]
        if kind == PROBE:
            return self._mean(sorted(self.parts.items()), shape)
        candidates: dict[int, torch.Tensor] = {}
        read: dict[int, torch.Tensor] = {}  # read against ours, not averaged (probation.py)
        for i, x in sorted(self.parts.items()):  # in sender order: an audit's replay sums alike
            if kind == DELTA and self.in_sync is not None and not self.in_sync[i]:
                if self.reads[i] and not self.dropped[i]:  # read only: judged, not averaged
                    if bool(torch.isfinite(x).all()):
                        read[i] = x
                    else:
                        self._reject(i, "non-finite values")
                continue  # an update made from other synchronized parameters than the group's
            if self.dropped[i]:
                continue
            if not bool(torch.isfinite(x).all()):
                self._reject(i, "non-finite values")
                continue
            candidates[i] = x
        if not candidates:
            return torch.zeros(shape)
        numel = max(int(torch.Size(shape).numel()), 1)
        # without a majority (fewer than three parts) no part is trusted more than another
        few = len(candidates) < 3 and math.isfinite(self.defence.clip)
        # parts far beyond any honest one are dropped first (our own too, when a majority can
        # outvote it); the rest are clipped around a center and scale they alone decide
        tau, center = self._radius(candidates, numel)
        # a rejection bans: only against a majority (three or more) or the reducer's own part;
        # two others alone are equally far from their mean, and neither can be told honest
        judged = len(candidates) >= 3 or self.own_sender in candidates
        for i, x in list(candidates.items()):
            norm = float((x - center).norm())
            if judged and norm > self.defence.reject * tau:
                ban = norm > self.defence.ban * tau
                # of two, the other is left out of the next rounds but still averaged now,
                # scaled down like any part: the average stays what any reducer returns
                drop = ban or not few
                self._reject(
                    i, f"sent a {kind} part {norm / tau:.3g}x the clipping bound", ban, drop
                )
                if drop:
                    del candidates[i]
        if not candidates:
            return torch.zeros(shape)
        if kind == DELTA and self.measure:  # after the drops: never against our dropped part
            self._measure_agreement({**candidates, **read})
        typical = lower_median([float(x.norm()) for x in candidates.values()])
        if len(candidates) < 3 and math.isfinite(self.defence.clip):
            scale = self.defence.clip * max(typical, bound(self.defence.min_scale, numel, 1.0))
            kept = [
                (i, x * min(1.0, scale / max(float(x.norm()), 1e-30)))
                for i, x in candidates.items()
            ]
            average = self._mean(kept, shape)
            if self.lie and kind == DELTA:  # bench attack only: as large as the pair check allows
                average = lie_direction(shape, self.current_part_index) * typical
            return average
        tau, center = self._radius(candidates, numel)
        kept = []
        for i, x in candidates.items():
            r = x - center
            norm = float(r.norm())
            kept.append((i, center + r * (tau / norm) if norm > tau else x))
        average = self._mean(kept, shape)
        if self.lie and kind == DELTA:  # bench attack only
            average += lie_direction(shape, self.current_part_index) * (self.lie * typical)
        return average

    def _measure_agreement(self, parts: dict[int, torch.Tensor]) -> None:
        """Add each other sender's part, against this reducer's own, to `agreement`."""
        if self.own_sender not in parts or len(parts) < 2:
            return
        senders = list(parts)
        own = senders.index(self.own_sender)
        stacked = torch.stack([parts[i].flatten() for i in senders]).double()
        dot_products = stacked @ stacked[own]
        dots = dot_products.tolist()
        theirs = stacked.pow(2).sum(dim=1)  # each part's |x|^2
        squares = theirs.tolist()
        own2 = squares[own]
        # each part less its component along ours: what a difference in size (a slower peer,
        # one just re-synchronized) leaves is the noise, which leans no way; and ours less its
        # component along each part, which leans the same way as theirs where both share a
        # direction that leans (what each one's noise keeps of it is taken out with it), and
        # the other way against a part moved all one way ("a little is enough")
        # (a part all along ours, flipped or equal, leaves only rounding: nothing to read)
        # (in a pair, no lean is read: what tells two honest updates apart can lean both ways
        # alike, and leaving the other out stops every round: exclusion.LEAN_MEMBERS)
        leaning = [(0.0, 0.0, 0.0, 0.0)] * len(senders)
        if own2 > 0 and len(senders) >= LEAN_MEMBERS:
            mine = stacked[own]
            apart = stacked - (dot_products / own2).unsqueeze(1) * mine
            scale = torch.where(theirs > 0, dot_products / theirs.clamp_min(1e-300), 0.0)
            back = mine - scale.unsqueeze(1) * stacked
            size, back_size = apart.abs().sum(dim=1), back.abs().sum(dim=1)
            read = (size > 1e-9 * stacked.abs().sum(dim=1)) & (theirs > 0)
            read &= back_size > 1e-9 * mine.abs().sum()
            leaning = list(
                zip(
                    torch.where(read, apart.sum(dim=1), 0.0).tolist(),
                    torch.where(read, size, 0.0).tolist(),
                    torch.where(read, back.sum(dim=1), 0.0).tolist(),
                    torch.where(read, back_size, 0.0).tolist(),
                    strict=True,
                )
            )
        for i, dot, square, lean in zip(senders, dots, squares, leaning, strict=True):
            if i != self.own_sender:
                sums = self.agreement.setdefault(i, [0.0] * 7)
                sums[0] += dot
                sums[1] += square
                sums[2] += own2
                for k, x in enumerate(lean):
                    sums[3 + k] += x

    def cosines(self) -> dict[int, float]:
        """Per sender, the cosine of its update parts of this span with this reducer's own."""
        sums = self.agreement.items()
        return {i: dot / math.sqrt(a * b) for i, (dot, a, b, *_) in sums if a > 0 and b > 0}

    def leans(self) -> dict[int, float]:
        """Per sender, how far its update parts of this span lean one way, read two ways; the
        lesser where both lean the same way, else 0; in [-1, 1]. One: its parts less their
        component along this reducer's own (part by part), summed over their absolute sum. The
        other: that, less the same of this reducer's own parts against the sender's, halved.
        What is left of an honest update is noise, up about as often as down, whatever its
        size against ours; but where two updates share a direction that leans one way, what our
        own noise keeps of it is taken out with ours, and what is left of theirs leans with it
        (two honest peers early in training read 0.26 at cosine 0.92, bench scaling --quick),
        while what is left of ours leans the same way, so the second reading cancels it. Where
        one of two trained more steps than the other in such a direction, both readings can
        lean, from each side (0.29 and -0.23 in a pair there: none is read in a pair,
        exclusion.LEAN_MEMBERS). "A little is enough" moves every coordinate the same way: what is
        left of it leans that way, what is left of ours the other, and both readings lean far
        (exclusion.LEAN has the figures)."""
        out = {}
        for i, (*_, lean, size, back, back_size) in self.agreement.items():
            if size > 0 and back_size > 0:
                one_way = lean / size
                against_ours = (one_way - back / back_size) / 2
                lesser = math.copysign(min(abs(one_way), abs(against_ours)), one_way)
                out[i] = lesser if one_way * against_ours > 0 else 0.0
        return out

    def _radius(self, parts: dict[int, torch.Tensor], numel: int) -> tuple[float, torch.Tensor]:
        """(clipping radius, center) measured from the parts."""
        center, own_centered = self._center(parts)
        scale = max(
            lower_median([float(x.norm()) for x in parts.values()]),  # the typical size
            bound(self.defence.min_scale, numel, 1.0),
        )
        # around the reducer's own part (judging a pair), an honest part may sit up to about
        # the sum of two updates' sizes away; around the median, about one
        return self.defence.clip * scale * (2.0 if own_centered else 1.0), center

    def _center(self, parts: dict[int, torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """The median of three or more parts; with fewer, the reducer's own part (True:
        centered on it), which only judges the other (its average is of parts scaled down,
        _combine), or without it, their mean (which judges no one)."""
        if len(parts) >= 3:
            return median_center(list(parts.values())), False
        own = parts.get(self.own_sender)
        if own is not None:
            return own, True
        return median_center(list(parts.values())), False

    def _mean(self, items, shape: torch.Size) -> torch.Tensor:
        out = torch.zeros(shape)
        total = 0.0
        for i, x in items:
            out.add_(x, alpha=self.weights[i])
            total += self.weights[i]
        return out.div_(total) if total > 0 else out

    def _reject(self, sender: int, why: str, ban: bool = True, drop: bool = True) -> None:
        """Drop the sender's parts from now on (unless drop=False: only left out of the next
        rounds); another member is also banned, or with ban=False (a part only far larger than
        the others: an honest member that caught up or trained alone for a while sends one too)
        left out of the next rounds for a while (our own update is only left out of this one:
        a majority found it far from theirs)."""
        if drop:
            self.dropped[sender] = True
        if sender != self.own_sender:
            (self.on_reject if ban else self.on_doubt)(sender, why)


class RobustRunner(ExactAverageRunner):
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
        read_only: Collection[PeerID] = (),
        on_reject: Callable[[PeerID, str], None],
        on_doubt: Callable[[PeerID, str], None] | None = None,
        on_agreement: Callable[[dict[PeerID, float], dict[PeerID, float]], None] | None = None,
        lie: float = 0.0,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.defence = defence
        self._on_reject = on_reject
        self._on_doubt = on_doubt or (lambda peer_id, why: None)
        self._on_agreement = on_agreement
        own_index = self.ordered_peer_ids.index(self.peer_id)
        own_parts = self.tensor_part_container._input_parts_by_peer[own_index]
        part_kinds = [kinds[info.key] for _, info in own_parts]
        senders = self.sender_peer_ids
        # what every reducer's averages are checked against: with three or more members in
        # sync, a typical update (reducer_bounds); with fewer, this member's own part, if it
        # is one of them (None: out of sync, it applies nothing of this round)
        counted = [p for p in senders if in_sync is None or in_sync.get(p, True)]
        claims = [reported_rms.get(p, math.nan) for p in counted]
        self._typical: Typical | None = (
            reducer_bounds(claims, defence)
            if len(counted) >= 3 or not math.isfinite(defence.clip)
            else None
        )
        self._counted = self.peer_id in counted
        self._own_sender = senders.index(self.peer_id)
        self._weights = [weights.get(p, MIN_WEIGHT) for p in senders]
        # out of every span's average: out of sync, or read only (probation.py; the bounds
        # above still count a read-only member in sync: it checks what it applies)
        self._in_sync = (
            [(in_sync or {}).get(p, True) and p not in read_only for p in senders]
            if in_sync is not None or read_only
            else None
        )
        self._kinds_by_peer = [
            [kinds[info.key] for _, info in parts]
            for parts in self.tensor_part_container._input_parts_by_peer
        ]
        # (shape, compression info) of every span's parts: the container drops them when done
        self.span_parts = [
            [(part.shape, info) for part, info in parts]
            for parts in self.tensor_part_container._input_parts_by_peer
        ]
        self.tensor_part_reducer = RobustReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            part_kinds,
            self._weights,
            self._own_sender,
            defence,
            [p in banned for p in senders],
            lambda i, why: on_reject(senders[i], why),
            self._in_sync,
            lie,
            measure=on_agreement is not None,  # no one reads it: not measured
            reads=[p in read_only for p in senders],
        )
        self.tensor_part_reducer.on_doubt = lambda i, why: self._on_doubt(senders[i], why)
        register = self.tensor_part_container.register_processed_part

        def checked(peer_index: int, part_index: int, average: torch.Tensor) -> None:
            # (averages that come after the round ended are only counted as delivered,
            # exact._name_if_no_averages: the parts they are checked against are gone)
            if peer_index != own_index and not self._future.done():
                self._check_reduced(peer_index, part_index, average)
            register(peer_index, part_index, average)

        self.tensor_part_container.register_processed_part = checked

    def finalize(self, **kwargs) -> None:
        """A round that ran to its end tells how each other member's update agreed with ours
        (on_agreement)."""
        if self._on_agreement is not None and not self._future.done() and not kwargs:
            senders = self.sender_peer_ids
            reducer = self.tensor_part_reducer
            cosines = {senders[i]: cosine for i, cosine in reducer.cosines().items()}
            leans = {senders[i]: lean for i, lean in reducer.leans().items()}
            self._on_agreement(cosines, leans)
        super().finalize(**kwargs)

    def replay_reducer(self, peer_index: int) -> RobustReducer:
        """A reducer for the span of the member at `peer_index`, as that member's own (its part
        the one centered on), judging no one and lying about nothing: what an honest reducer
        of that span computes from the same parts (audit.py)."""
        return RobustReducer(
            tuple(shape for shape, _ in self.span_parts[peer_index]),
            self._kinds_by_peer[peer_index],
            self._weights,
            self.sender_peer_ids.index(self.ordered_peer_ids[peer_index]),
            self.defence,
            [False] * len(self.sender_peer_ids),
            lambda i, why: None,
            self._in_sync,
            measure=False,
        )

    def _check_reduced(self, peer_index: int, part_index: int, average: torch.Tensor) -> None:
        """`average`: what the reducer of that span sent back for our part. Non-finite: the
        reducer is rejected and banned. Beyond its bound (reducer_bounds, PAIR_SLACK): it is
        doubted, left out of the next rounds for a while as a member that stalls, not banned,
        since an honest reducer can land there too (with its own update tens of times larger
        than a member's, its honest average of three sits past any fixed bound). Either way the
        round is discarded."""
        kind = self._kinds_by_peer[peer_index][part_index]
        own = self.tensor_part_container._input_parts_by_peer[peer_index][part_index][0]
        culprit = self.ordered_peer_ids[peer_index]
        if self._typical is not None:
            why = returned_lie(kind, own, average, self._typical, self.defence.reduced)
        elif self._counted:
            why = returned_pair_lie(kind, own, average, self.defence.min_scale)
        else:  # out of sync: none of the update is ours to compare (nor applied here)
            why = returned_pair_lie(PROBE, own, average)
        if why is None:
            return
        if why == NON_FINITE:
            self._on_reject(culprit, f"reducer returned {why}")
        else:
            self._on_doubt(culprit, f"returned {why} (its round discarded)")
        error = AllreduceException(f"{culprit} returned {why}")
        self.finalize(exception=error)  # the round is lost: end it now, not at its timeout
        raise error
