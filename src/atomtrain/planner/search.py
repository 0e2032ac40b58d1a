"""The dynamic program behind `plan_dp`, for one number of micro-batches per load.

States are (end of the last sub-model, its start, its policy class); each holds a Pareto set of
labels (time so far, saved activation bytes, largest window), a label pointing back to the one it
extends. Branch and bound keeps the search small: a label is dropped when its time plus what the
blocks after it must still cost exceeds the best plan known. That remaining cost is a true lower
bound: their compute and their loads, and, from the bytes the label leaves free, the overhead of
the blocks that cannot all be kept (offloaded or recomputed, whichever is cheaper; a fractional
knapsack over the blocks by overhead avoided per byte kept bounds what keeping can save). A
model whose memory forces most blocks out (175B on 80 GB) is then proved optimal in little more
than the time to walk the best plan's neighbourhood.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from atomtrain.engine.plan import ExecutionPlan, Policy, SubModel
from atomtrain.planner.cost import (
    POLICIES,
    SubModelCost,
    bwd_slot,
    outer_bytes,
    outer_transfer_s,
    pair_window,
    submodel_cost,
)
from atomtrain.planner.profile import ModelProfile

FRONT_CAP = 128
"""Labels a state keeps exactly; beyond it labels are merged on a byte grid (`_thin`), and the
plan is no longer proved optimal. With the bounds above no GPT-3 shape from 1.3B to 175B on
16 to 141 GB reaches it (each plans in under a second), nor do the small models the
brute-force tests check."""

_SLACK = 1 + 1e-12
"""Ties with the best known plan survive pruning (rounding in the bound's sums)."""


@dataclass(slots=True)
class _Label:
    """A plan of the blocks before its state's end, its last sub-model's forward slot not yet
    counted in `time` (per pass)."""

    time: float
    saved: int
    window: int
    sub: SubModel
    parent: _Label | None

    def plan(self) -> tuple[SubModel, ...]:
        subs = []
        lab: _Label | None = self
        while lab is not None:
            subs.append(lab.sub)
            lab = lab.parent
        return tuple(reversed(subs))


def _thin(front: list[_Label], room: int) -> None:
    """Keep the fastest label per cell of a grid over (saved, window), the grid coarsened
    until at most half the cap remain: plans whose memory differs by less than a cell are
    treated as alike (the kept one may use up to a cell more, still checked against room)."""
    cell = max(1, room // 4096)
    # The label using the least memory stays whatever the grid: it may be the only one that
    # fits what follows.
    safest = min(front, key=lambda lab: (lab.saved + lab.window, lab.time))
    while len(front) > FRONT_CAP // 2:
        best: dict[tuple[int, int], _Label] = {}
        for lab in front:
            key = (lab.saved // cell, lab.window // cell)
            if key not in best or lab.time < best[key].time:
                best[key] = lab
        front[:] = list(best.values())
        cell *= 2
    if safest not in front:
        front.append(safest)


def _pareto_insert(front: list[_Label], new: _Label, room: int) -> None:
    """Add `new` unless a label at least as good in time, saved bytes and window exists;
    drop the labels it dominates; thin a front grown past the cap."""
    t, s, w = new.time, new.saved, new.window
    for old in front:
        if old.time <= t and old.saved <= s and old.window <= w:
            return
    front[:] = [o for o in front if not (t <= o.time and s <= o.saved and w <= o.window)]
    front.append(new)
    if len(front) > FRONT_CAP:
        _thin(front, room)


@dataclass(frozen=True)
class KeepRelief:
    """A lower bound on the overhead blocks [i, N) add for not being kept, given `room` bytes
    to keep activations in. Block j not kept costs extra[j]; kept, it takes weight[j] bytes.
    The fractional knapsack (blocks by overhead per byte, the last one split) bounds what
    keeping can avoid."""

    total: list[float]
    cum_w: list[list[int]]
    cum_e: list[list[float]]
    rate: list[list[float]]

    @classmethod
    def over(cls, extra: list[float], weight: list[int]) -> KeepRelief:
        n = len(extra)
        out = cls([], [], [], [])
        for i in range(n + 1):
            # A block kept for free (no saved bytes) adds no overhead: left out of both sides.
            order = sorted(
                (j for j in range(i, n) if weight[j] > 0), key=lambda j: -extra[j] / weight[j]
            )
            cw, ce = [0], [0.0]
            for j in order:
                cw.append(cw[-1] + weight[j])
                ce.append(ce[-1] + extra[j])
            out.total.append(ce[-1])
            out.cum_w.append(cw)
            out.cum_e.append(ce)
            out.rate.append([extra[j] / weight[j] for j in order])
        return out

    def __call__(self, i: int, room: int) -> float:
        cw = self.cum_w[i]
        k = bisect_right(cw, room) - 1  # the first k blocks fit whole
        relief = self.cum_e[i][k]
        if k < len(cw) - 1:
            relief += (room - cw[k]) * self.rate[i][k]
        return max(0.0, self.total[i] - relief)


@dataclass(frozen=True)
class _Rest:
    """Per-pass sums over blocks [i, N), for the bound on what they must still cost."""

    fwd: list[float]
    bwd: list[float]
    load: list[float]
    grad: list[float]
    tail_load: float
    """The final sub-model's predecessor's load may be the last one in a backward slot: the
    final max_len blocks' loads are left out of the backward sum."""
    relief: KeepRelief
    """Overhead, forward and backward, of the blocks not kept."""
    relief_bwd: KeepRelief
    """The part of it the backward slots carry."""


def _rest_sums(prof: ModelProfile, m: int, max_len: int) -> _Rest:
    blocks = prof.blocks
    N = len(blocks)
    h2d, d2h = prof.h2d_bytes_per_s, prof.d2h_bytes_per_s

    def suffix(values: list[float]) -> list[float]:
        out = [0.0] * (N + 1)
        for i in range(N - 1, -1, -1):
            out[i] = out[i + 1] + values[i]
        return out

    load = suffix([b.param_bytes / h2d for b in blocks])
    # Not kept: offloaded (its saved bytes out in the forward, back in the backward) or
    # recomputed (its forward again in the backward), whichever costs less.
    moved = [m * b.saved_bytes for b in blocks]
    extra = [min(s / d2h + s / h2d, m * b.fwd_s) for s, b in zip(moved, blocks, strict=True)]
    extra_bwd = [min(s / h2d, m * b.fwd_s) for s, b in zip(moved, blocks, strict=True)]
    return _Rest(
        fwd=suffix([m * b.fwd_s for b in blocks]),
        bwd=suffix([m * b.bwd_s for b in blocks]),
        load=load,
        grad=suffix([b.grad_bytes / d2h for b in blocks]),
        tail_load=load[max(0, N - max_len)],
        relief=KeepRelief.over(extra, moved),
        relief_bwd=KeepRelief.over(extra_bwd, moved),
    )


def _class(policy: Policy) -> Policy:
    """KEEP and RECOMPUTE sub-models cost their successors alike (same forward, load and
    parameters): one state for both."""
    return Policy.OFFLOAD if policy is Policy.OFFLOAD else Policy.KEEP


class _Search:
    """The dynamic program for one m over the blocks of `prof`, under `room` device bytes
    beside the outer part; `bound` is the best known step's per-pass time."""

    def __init__(
        self,
        prof: ModelProfile,
        room: int,
        m: int,
        max_len: int,
        cost: dict[tuple[int, int, Policy], SubModelCost],
        rest: _Rest,
        bound: float,
    ) -> None:
        self.prof, self.room, self.max_len, self.cost, self.rest = prof, room, max_len, cost, rest
        self.N = len(prof.blocks)
        self.outer_s = m * (prof.outer_fwd_s + prof.outer_bwd_s)
        self.bound = bound
        # A label that stays feasible whatever follows (every later block kept, the largest
        # window) dominates every slower label of its state: this keeps fronts small when
        # memory is plentiful, and tight budgets keep them small by themselves.
        self.keep_suffix = [
            m * sum(b.saved_bytes for b in prof.blocks[i:]) for i in range(self.N + 1)
        ]
        biggest = max((c.params for c in cost.values()), default=0)
        self.w_max = max(
            (biggest + c.params + c.grads + c.workspace for c in cost.values()), default=0
        )
        self.safe_time: dict[tuple[int, int, Policy], float] = {}
        # fronts[(end, start, class)]: labels whose last sub-model is [start, end).
        self.fronts: dict[tuple[int, int, Policy], list[_Label]] = {}

    def run(self, passes: int) -> _Label | None:
        for (a, b, pol), c in self.cost.items():
            window = c.params + c.grads + c.workspace
            if a == 0 and c.saved + window <= self.room:
                t = c.load_s / passes + bwd_slot(c, None)
                self._insert((b, 0, _class(pol)), t, c.saved, window, SubModel(0, b, pol), None, c)
        for end in range(1, self.N):
            for start in range(max(0, end - self.max_len), end):
                for pol in (Policy.KEEP, Policy.OFFLOAD):
                    front = self.fronts.get((end, start, pol))
                    if front:
                        self._extend(front, self.cost[start, end, pol], end)
        return self._best()

    def _extend(self, front: list[_Label], prev: SubModelCost, end: int) -> None:
        """Every label of one state followed by every next sub-model."""
        for stop in range(end + 1, min(self.N, end + self.max_len) + 1):
            if (end, stop, Policy.KEEP) not in self.cost:
                break  # longer sub-models only get bigger
            for npol in POLICIES:
                nxt = self.cost[end, stop, npol]
                dt = max(prev.fwd_s, nxt.load_s) + bwd_slot(nxt, prev)
                pw = pair_window(prev, nxt)
                key = (stop, end, _class(npol))
                sub = SubModel(end, stop, npol)
                for lab in front:
                    window = max(lab.window, pw)
                    saved = lab.saved + nxt.saved
                    if saved + window <= self.room:
                        self._insert(key, lab.time + dt, saved, window, sub, lab, nxt)

    def _insert(
        self,
        key: tuple[int, int, Policy],
        t: float,
        saved: int,
        window: int,
        sub: SubModel,
        parent: _Label | None,
        last: SubModelCost,
    ) -> None:
        end = key[0]
        if t + self._rest_bound(end, last, saved, window) + self.outer_s > self.bound * _SLACK:
            return
        best_safe = self.safe_time.get(key)
        if best_safe is not None and t >= best_safe:
            return
        front = self.fronts.setdefault(key, [])
        if saved + self.keep_suffix[end] + max(window, self.w_max) <= self.room:
            self.safe_time[key] = t
            front[:] = [o for o in front if o.time < t]
        _pareto_insert(front, _Label(t, saved, window, sub, parent), self.room)
        if end == self.N:  # a whole plan: the best known bounds the rest of the search
            self.bound = min(self.bound, t + last.fwd_s + self.outer_s)

    def _rest_bound(self, end: int, last: SubModelCost, saved: int, window: int) -> float:
        """What the last sub-model's forward slot and every later slot must cost at least:
        forward slots their compute and loads, backward slots their compute, copies and the
        loads before them, both at least the overhead of the blocks the free bytes cannot
        keep."""
        if end == self.N:
            return last.fwd_s
        r = self.rest
        free = self.room - saved - window
        fwd = last.fwd_s + r.fwd[end]
        bwd = max(
            r.bwd[end] + r.relief_bwd(end, free),
            r.grad[end],
            last.load_s + r.load[end] - r.tail_load,
        )
        return max(max(fwd, r.load[end]) + bwd, fwd + r.bwd[end] + r.relief(end, free))

    def _best(self) -> _Label | None:
        best: tuple[float, _Label] | None = None
        for (end, start, _), front in self.fronts.items():
            if end != self.N:
                continue
            for lab in front:
                t = lab.time + self.cost[start, end, lab.sub.policy].fwd_s
                if best is None or t < best[0] - 1e-15:
                    best = (t, lab)
        return best[1] if best else None


def _submodel_costs(
    prof: ModelProfile, room: int, m: int, max_len: int
) -> dict[tuple[int, int, Policy], SubModelCost]:
    """Every sub-model of at most max_len blocks whose parameters fit, under every policy."""
    N = len(prof.blocks)
    cost = {}
    for a in range(N):
        for b in range(a + 1, min(N, a + max_len) + 1):
            c0 = submodel_cost(prof, a, b, Policy.RECOMPUTE, m)
            if c0.params > room:
                break  # longer sub-models only get bigger
            for pol in POLICIES:
                cost[a, b, pol] = submodel_cost(prof, a, b, pol, m)
    return cost


def plan_for_m(
    prof: ModelProfile,
    budget: int,
    micro_batches: int,
    m: int,
    max_len: int,
    known_s: float | None = None,
) -> tuple[float, ExecutionPlan] | None:
    """The fastest plan with m micro-batches per load under `budget` and its predicted step
    time, or None if none fits or none beats `known_s` (a step time already reached)."""
    passes = micro_batches // m
    room = budget - outer_bytes(prof, m)
    if room <= 0:
        return None
    transfer = outer_transfer_s(prof, passes)
    bound = float("inf") if known_s is None else (known_s - transfer) / passes
    search = _Search(
        prof,
        room,
        m,
        max_len,
        _submodel_costs(prof, room, m, max_len),
        _rest_sums(prof, m, max_len),
        bound,
    )
    lab = search.run(passes)
    if lab is None:
        return None
    per_pass = lab.time + search.cost[lab.sub.start, lab.sub.end, lab.sub.policy].fwd_s
    return passes * (per_pass + search.outer_s) + transfer, ExecutionPlan(lab.plan(), m)
