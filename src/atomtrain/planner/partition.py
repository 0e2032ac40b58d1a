"""Choosing cut points, activation policies and micro-batches per load.

`predict` is the cost model and the single source of truth: the step time of a plan (loads of the
next sub-model hidden behind the current one's compute, gradients streamed back in the other
direction) and its device peak (outer part + all activations saved between forward and backward +
the largest two-sub-model window). `plan_dp` finds the plan with the least predicted step time under
the budget, exactly, by dynamic programming over (end of the last sub-model, its start, its policy)
with Pareto sets of (time, saved activations, window); `plan_brute_force` enumerates every plan and
is what the tests check the dynamic program against.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from atomtrain.engine.plan import ExecutionPlan, Policy, SubModel
from atomtrain.errors import AtomError
from atomtrain.planner.profile import ModelProfile

POLICIES = (Policy.KEEP, Policy.OFFLOAD, Policy.RECOMPUTE)


MAX_BLOCKS_PER_SUBMODEL = 8
"""The search space: longer sub-models only enlarge the window while their loads hide no better
(in the cost model two sub-models of identical blocks overlap equally well at any length)."""


class NoPlanFits(AtomError):
    pass


@dataclass(frozen=True)
class SubModelCost:
    """One sub-model under a policy, for one pass of m micro-batches."""

    params: int
    grads: int
    load_s: float
    grad_s: float
    fwd_s: float
    bwd_s: float
    saved: int
    """Device bytes held from its forward to its backward."""
    workspace: int
    """Device bytes that come and go during its backward."""
    restore_s: float = 0.0
    """Host-to-device time of its offloaded activations in the backward: the link is shared
    with the load of the sub-model before it, which runs at the same time."""


def submodel_cost(prof: ModelProfile, start: int, end: int, policy: Policy, m: int) -> SubModelCost:
    blocks = prof.blocks[start:end]
    params = sum(b.param_bytes for b in blocks)
    grads = sum(b.grad_bytes for b in blocks)
    fwd = m * sum(b.fwd_s for b in blocks)
    bwd = m * sum(b.bwd_s for b in blocks)
    max_saved = m * max(b.saved_bytes for b in blocks)
    # Gradients of a block's output and input exist during its backward under any policy.
    act_grads = 2 * m * max(b.input_bytes for b in blocks)
    restore = 0.0
    if policy is Policy.KEEP:
        saved, work = m * sum(b.saved_bytes for b in blocks), act_grads
    elif policy is Policy.OFFLOAD:  # copies made by the compute thread: on the critical path
        moved = m * sum(b.saved_bytes for b in blocks)
        restore = moved / prof.h2d_bytes_per_s
        fwd += moved / prof.d2h_bytes_per_s
        bwd += restore
        saved, work = 0, max_saved + act_grads
    else:
        bwd += fwd
        saved, work = m * sum(b.input_bytes for b in blocks), max_saved + act_grads
    return SubModelCost(
        params,
        grads,
        params / prof.h2d_bytes_per_s,
        grads / prof.d2h_bytes_per_s,
        fwd,
        bwd,
        saved,
        work,
        restore,
    )


def _bwd_slot(c: SubModelCost, prev: SubModelCost | None) -> float:
    """A sub-model's backward, the load of the one before it (sharing the host-to-device link
    with its restored activations) and its gradients' copy back, all at once."""
    return max(c.bwd_s, (prev.load_s if prev else 0.0) + c.restore_s, c.grad_s)


def _outer_transfer_s(prof: ModelProfile, passes: int) -> float:
    """The outer part's load at the start of a step and its gradients' copy after each pass:
    on the training thread, hidden behind nothing."""
    return prof.outer_param_bytes / prof.h2d_bytes_per_s + passes * (
        prof.outer_grad_bytes / prof.d2h_bytes_per_s
    )


@dataclass(frozen=True)
class Prediction:
    step_s: float
    lower_bound_s: float
    """max(the step's compute, one load of every parameter): no plan of any cut points,
    policies or micro-batches per load beats it."""
    peak_bytes: int
    passes: int
    costs: tuple[SubModelCost, ...]


def _outer_bytes(prof: ModelProfile, m: int) -> int:
    return prof.outer_param_bytes + prof.outer_grad_bytes + m * prof.outer_saved_bytes


def _pair_window(a: SubModelCost, c: SubModelCost) -> int:
    """Peak of a's forward while c loads, and of c's backward while a loads."""
    return max(a.params + c.params, c.params + c.grads + c.workspace + a.params)


def predict(prof: ModelProfile, plan: ExecutionPlan, micro_batches: int) -> Prediction:
    m = plan.micro_batches_per_load
    if micro_batches % m:
        raise AtomError(f"{micro_batches} micro-batches do not split into loads of {m}")
    passes = micro_batches // m
    costs = [submodel_cost(prof, s.start, s.end, s.policy, m) for s in plan.submodels]
    S = len(costs)
    per_pass = m * (prof.outer_fwd_s + prof.outer_bwd_s)
    window = costs[0].params + costs[0].grads + costs[0].workspace
    for s, c in enumerate(costs):
        nxt = costs[s + 1] if s + 1 < S else None
        prev = costs[s - 1] if s > 0 else None
        per_pass += max(c.fwd_s, nxt.load_s if nxt else 0.0)
        per_pass += _bwd_slot(c, prev)
        if nxt:
            window = max(window, _pair_window(c, nxt))
    step = costs[0].load_s + passes * per_pass + _outer_transfer_s(prof, passes)
    peak = _outer_bytes(prof, m) + sum(c.saved for c in costs) + window
    return Prediction(step, lower_bound(prof, micro_batches), peak, passes, tuple(costs))


def lower_bound(prof: ModelProfile, micro_batches: int) -> float:
    """No plan's step is shorter: every micro-batch's compute, and every parameter loaded once."""
    compute = micro_batches * (
        sum(b.fwd_s + b.bwd_s for b in prof.blocks) + prof.outer_fwd_s + prof.outer_bwd_s
    )
    loads = (prof.outer_param_bytes + sum(b.param_bytes for b in prof.blocks)) / (
        prof.h2d_bytes_per_s
    )
    return max(compute, loads)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_brute_force(
    prof: ModelProfile, budget: int, micro_batches: int, max_len: int = MAX_BLOCKS_PER_SUBMODEL
) -> ExecutionPlan:
    """Every composition of the blocks, every policy per sub-model, every m: small N only."""
    N = len(prof.blocks)
    best: tuple[float, ExecutionPlan] | None = None
    for m in _divisors(micro_batches):
        for mask in itertools.product((False, True), repeat=N - 1):
            cuts = [0] + [i + 1 for i, cut in enumerate(mask) if cut] + [N]
            spans = list(itertools.pairwise(cuts))
            if any(b - a > max_len for a, b in spans):
                continue
            for pols in itertools.product(POLICIES, repeat=len(spans)):
                plan = ExecutionPlan(
                    tuple(SubModel(a, b, p) for (a, b), p in zip(spans, pols, strict=True)), m
                )
                pred = predict(prof, plan, micro_batches)
                if pred.peak_bytes <= budget and (best is None or pred.step_s < best[0] - 1e-15):
                    best = (pred.step_s, plan)
    if best is None:
        raise no_fit_reason(prof, budget)
    return best[1]


@dataclass
class _Label:
    time: float
    saved: int
    window: int
    plan: tuple[SubModel, ...]


FRONT_CAP = 32
"""Labels a state keeps exactly; beyond it labels are merged on a byte grid (`_thin`). Small
models never reach it (the dynamic program stays exact, as the brute-force tests check); a
175B model on 80 GB would otherwise keep thousands per state and plan for minutes."""


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


def _pareto_insert(front: list[_Label], new: _Label, room: int = 0) -> None:
    """Add `new` unless a label at least as good in time, saved bytes and window exists;
    drop the labels it dominates; thin a front grown past the cap."""
    for old in front:
        if old.time <= new.time and old.saved <= new.saved and old.window <= new.window:
            return
    if front:
        front[:] = [
            o
            for o in front
            if not (new.time <= o.time and new.saved <= o.saved and new.window <= o.window)
        ]
    front.append(new)
    if room and len(front) > FRONT_CAP:
        _thin(front, room)


def _plan_for_m(
    prof: ModelProfile,
    budget: int,
    micro_batches: int,
    m: int,
    max_len: int = MAX_BLOCKS_PER_SUBMODEL,
    known: float | None = None,
) -> tuple[float, ExecutionPlan] | None:
    N = len(prof.blocks)
    passes = micro_batches // m
    room = budget - _outer_bytes(prof, m)
    if room <= 0:
        return None
    cost = {}
    for a in range(N):
        for b in range(a + 1, min(N, a + max_len) + 1):
            c0 = submodel_cost(prof, a, b, Policy.RECOMPUTE, m)
            if c0.params > room:
                break  # longer sub-models only get bigger
            for pol in POLICIES:
                cost[a, b, pol] = submodel_cost(prof, a, b, pol, m)
    # A label that stays feasible whatever follows (every later block kept, the largest
    # window) dominates every slower label of its state: this keeps fronts small when memory
    # is plentiful, and tight budgets keep them small by themselves.
    keep_suffix = [m * sum(b.saved_bytes for b in prof.blocks[i:]) for i in range(N + 1)]
    biggest = max((c.params for c in cost.values()), default=0)
    w_max = max((biggest + c.params + c.grads + c.workspace for c in cost.values()), default=0)

    def insert(key: tuple[int, int, Policy], lab: _Label) -> None:
        # KEEP and RECOMPUTE sub-models cost their successors alike: one state for both.
        key = (key[0], key[1], Policy.OFFLOAD if key[2] is Policy.OFFLOAD else Policy.KEEP)
        last = lab.plan[-1]
        c = cost[last.start, last.end, last.policy]
        if lab.time + rest_bound(key[0], c) + outer_s > bound * (1 + 1e-12):
            return
        front = fronts.setdefault(key, [])
        best_safe = safe_time.get(key)
        if best_safe is not None and lab.time >= best_safe:
            return
        if lab.saved + keep_suffix[key[0]] + max(lab.window, w_max) <= room:
            safe_time[key] = lab.time
            front[:] = [o for o in front if o.time < lab.time]
        _pareto_insert(front, lab, room)

    safe_time: dict[tuple[int, int, Policy], float] = {}
    # Incumbent for branch and bound: the best uniform plan. A label whose time plus what
    # the remaining blocks must cost at least (their plain compute) exceeds it cannot win.
    incumbent = _best_uniform(prof, budget, micro_batches, m, max_len)
    if known is not None:  # the best step time already found for another m
        incumbent = known if incumbent is None else min(incumbent, known)
    outer_s = m * (prof.outer_fwd_s + prof.outer_bwd_s)
    # What blocks end.. must still cost, whatever the plan: their forward slots sum to at least
    # their compute and at least their loads, and so do their backward slots (a sub-model's
    # backward slot waits for the load of the one before it, the last of which may be the
    # final sub-model's predecessor: the final max_len blocks' loads are left out).
    fwd_rest = [m * sum(b.fwd_s for b in prof.blocks[i:]) for i in range(N + 1)]
    bwd_rest = [m * sum(b.bwd_s for b in prof.blocks[i:]) for i in range(N + 1)]
    load_rest = [
        sum(b.param_bytes for b in prof.blocks[i:]) / prof.h2d_bytes_per_s for i in range(N + 1)
    ]
    grad_rest = [
        sum(b.grad_bytes for b in prof.blocks[i:]) / prof.d2h_bytes_per_s for i in range(N + 1)
    ]
    tail_load = load_rest[max(0, N - max_len)]

    def rest_bound(end: int, last: SubModelCost) -> float:
        fwd = max(last.fwd_s + fwd_rest[end], load_rest[end])
        bwd = max(bwd_rest[end], grad_rest[end], last.load_s + load_rest[end] - tail_load)
        return fwd + bwd if end < N else last.fwd_s

    bound = (
        (incumbent - _outer_transfer_s(prof, passes)) / passes
        if incumbent is not None
        else float("inf")
    )
    # fronts[(end, start, policy)]: labels for plans of blocks [0, end) whose last sub-model is
    # [start, end) under policy, with time counted except that sub-model's forward slot.
    fronts: dict[tuple[int, int, Policy], list[_Label]] = {}
    for (a, b, pol), c in cost.items():
        if a == 0:
            window = c.params + c.grads + c.workspace
            if c.saved + window <= room:
                t = c.load_s / passes + _bwd_slot(c, None)
                insert((b, 0, pol), _Label(t, c.saved, window, (SubModel(0, b, pol),)))
    for end in range(1, N + 1):
        for start in range(end):
            for pol in (Policy.KEEP, Policy.OFFLOAD):
                for lab in fronts.get((end, start, pol), []):
                    prev = cost[start, end, lab.plan[-1].policy]
                    for stop in range(end + 1, min(N, end + max_len) + 1):
                        for npol in POLICIES:
                            nxt = cost.get((end, stop, npol))
                            if nxt is None:
                                break
                            window = max(lab.window, _pair_window(prev, nxt))
                            saved = lab.saved + nxt.saved
                            if saved + window > room:
                                continue
                            t = lab.time + max(prev.fwd_s, nxt.load_s) + _bwd_slot(nxt, prev)
                            insert(
                                (stop, end, npol),
                                _Label(t, saved, window, (*lab.plan, SubModel(end, stop, npol))),
                            )
    best: tuple[float, ExecutionPlan] | None = None
    for (end, start, _), front in fronts.items():
        if end != N:
            continue
        for lab in front:
            total = passes * (lab.time + cost[start, end, lab.plan[-1].policy].fwd_s + outer_s)
            total += _outer_transfer_s(prof, passes)
            if best is None or total < best[0] - 1e-15:
                best = (total, ExecutionPlan(lab.plan, m))
    return best


def _best_uniform(
    prof: ModelProfile, budget: int, micro_batches: int, m: int, max_len: int
) -> float | None:
    """Predicted step time of the best simple plan that fits, if any: equal sub-models, the
    first j kept and the rest under one other policy (j as large as fits)."""
    N = len(prof.blocks)
    best = None
    for length in range(1, min(N, max_len) + 1):
        cuts = [*range(0, N, length), N]
        spans = list(itertools.pairwise(cuts))
        for other in POLICIES:

            def plan(j: int, spans: list = spans, other: Policy = other) -> ExecutionPlan:
                return ExecutionPlan(
                    tuple(
                        SubModel(a, b, Policy.KEEP if n < j else other)
                        for n, (a, b) in enumerate(spans)
                    ),
                    m,
                )

            lo, hi = 0, len(spans)  # largest j whose plan fits: peak grows with j
            if predict(prof, plan(0), micro_batches).peak_bytes > budget:
                continue
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if predict(prof, plan(mid), micro_batches).peak_bytes <= budget:
                    lo = mid
                else:
                    hi = mid - 1
            t = predict(prof, plan(lo), micro_batches).step_s
            best = t if best is None else min(best, t)
    return best


def plan_dp(
    prof: ModelProfile, budget: int, micro_batches: int, max_len: int = MAX_BLOCKS_PER_SUBMODEL
) -> ExecutionPlan:
    """The plan with the least predicted step time whose predicted peak fits `budget`, among
    plans whose sub-models have at most `max_len` blocks."""
    best: tuple[float, ExecutionPlan] | None = None
    # The best simple plan over every m bounds the search for each m from the start.
    uniform = [
        _best_uniform(prof, budget, micro_batches, m, max_len) for m in _divisors(micro_batches)
    ]
    known = min((t for t in uniform if t is not None), default=None)
    for m in reversed(_divisors(micro_batches)):
        bound = best[0] if best else known
        found = _plan_for_m(prof, budget, micro_batches, m, max_len, bound)
        if found and (best is None or found[0] < best[0] - 1e-15):
            best = found
    if best is None:
        raise no_fit_reason(prof, budget)
    return best[1]


def no_fit_reason(prof: ModelProfile, budget: int) -> NoPlanFits:
    """Why nothing fits: the block whose smallest possible window is furthest over budget."""
    outer = _outer_bytes(prof, 1)
    worst, need = 0, 0
    for i in range(len(prof.blocks)):
        c = submodel_cost(prof, i, i + 1, Policy.OFFLOAD, 1)
        n = outer + c.params + c.grads + c.workspace
        if n > need:
            worst, need = i, n
    if need > budget:
        return NoPlanFits(
            f"no plan fits {fmt_bytes(budget)}: block {worst} alone needs {fmt_bytes(need)} "
            f"(its parameters, gradients and workspace with the resident outer part of "
            f"{fmt_bytes(outer)}), {fmt_bytes(need - budget)} more than the budget"
        )
    return NoPlanFits(
        f"no plan fits {fmt_bytes(budget)}: even one block at a time with every "
        "activation offloaded exceeds it; lower the micro-batch or sequence length"
    )


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_bytes(text: str) -> int:
    """`24GB`, `24GiB`, `512MB`, `1.5e9`: decimal units for GB/MB, binary for GiB/MiB."""
    t = text.strip().upper().replace(" ", "")
    units = {
        "TIB": 1 << 40,
        "GIB": 1 << 30,
        "MIB": 1 << 20,
        "KIB": 1 << 10,
        "TB": 10**12,
        "GB": 10**9,
        "MB": 10**6,
        "KB": 10**3,
        "B": 1,
    }
    num, mult = t, 1
    for suffix, unit in units.items():
        if t.endswith(suffix):
            num, mult = t[: -len(suffix)], unit
            break
    try:
        value = float(num) * mult
    except ValueError:
        raise AtomError(f"cannot read {text!r} as a size (e.g. 24GB, 512MiB)") from None
    if value <= 0:
        raise AtomError(f"size {text!r} must be positive")
    return int(value)
