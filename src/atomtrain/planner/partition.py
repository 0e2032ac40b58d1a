"""Choosing cut points, activation policies and micro-batches per load.

`predict` (`cost.py`) is the cost model and the single source of truth. `plan_dp` finds the plan
with the least predicted step time under the budget by dynamic programming over (end of the last
sub-model, its start, its policy) with Pareto sets of (time, saved activations, window), bounded
by the best simple plan (`search.py`); `plan_brute_force` enumerates every plan and is what the
tests check the dynamic program against.
"""

from __future__ import annotations

import itertools

from atomtrain.engine.plan import ExecutionPlan, Policy, SubModel
from atomtrain.errors import AtomError
from atomtrain.planner.cost import (
    POLICIES,
    Prediction,
    SubModelCost,
    lower_bound,
    outer_bytes,
    predict,
    submodel_cost,
)
from atomtrain.planner.profile import ModelProfile
from atomtrain.planner.search import plan_for_m

__all__ = [
    "MAX_BLOCKS_PER_SUBMODEL",
    "NoPlanFits",
    "Prediction",
    "SubModelCost",
    "fmt_bytes",
    "lower_bound",
    "parse_bytes",
    "plan_brute_force",
    "plan_dp",
    "predict",
    "submodel_cost",
]


MAX_BLOCKS_PER_SUBMODEL = 8
"""The search space: longer sub-models only enlarge the window while their loads hide no better
(in the cost model two sub-models of identical blocks overlap equally well at any length)."""


class NoPlanFits(AtomError):
    pass


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


def _best_uniform(
    prof: ModelProfile, budget: int, micro_batches: int, m: int, max_len: int
) -> tuple[float, ExecutionPlan] | None:
    """The best simple plan that fits, if any, and its predicted step time: equal sub-models,
    the first j kept and the rest under one other policy (j as large as fits)."""
    N = len(prof.blocks)
    best: tuple[float, ExecutionPlan] | None = None
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
            if best is None or t < best[0]:
                best = (t, plan(lo))
    return best


def plan_dp(
    prof: ModelProfile, budget: int, micro_batches: int, max_len: int = MAX_BLOCKS_PER_SUBMODEL
) -> ExecutionPlan:
    """The plan with the least predicted step time whose predicted peak fits `budget`, among
    plans whose sub-models have at most `max_len` blocks."""
    # The best simple plan over every m: the answer unless the search finds a faster one (so a
    # search whose fronts were merged never does worse), and its bound from the start.
    simple = [
        _best_uniform(prof, budget, micro_batches, m, max_len) for m in _divisors(micro_batches)
    ]
    best = min((s for s in simple if s is not None), key=lambda s: s[0], default=None)
    for m in reversed(_divisors(micro_batches)):
        found = plan_for_m(prof, budget, micro_batches, m, max_len, best[0] if best else None)
        if found and (best is None or found[0] < best[0] - 1e-15):
            best = found
    if best is None:
        raise no_fit_reason(prof, budget)
    return best[1]


def no_fit_reason(prof: ModelProfile, budget: int) -> NoPlanFits:
    """Why nothing fits: the block whose smallest possible window is furthest over budget."""
    outer = outer_bytes(prof, 1)
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
