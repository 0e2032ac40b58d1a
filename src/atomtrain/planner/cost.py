"""The cost model: a plan's predicted step time and device peak.

`predict` is the single source of truth the planner minimises: the step time of a plan (loads of
the next sub-model hidden behind the current one's compute, gradients streamed back in the other
direction, the outer part's transfers) and its device peak (outer part + all activations saved
between forward and backward + the largest two-sub-model window). `lower_bound` is what no plan
beats.
"""

from __future__ import annotations

from dataclasses import dataclass

from atomtrain.engine.plan import ExecutionPlan, Policy
from atomtrain.errors import AtomError
from atomtrain.planner.profile import ModelProfile

POLICIES = (Policy.KEEP, Policy.OFFLOAD, Policy.RECOMPUTE)


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
    elif policy is Policy.OFFLOAD:
        # The copy out runs on the copy thread but shares the link (and, on a CPU, the cores)
        # with the forward; the copy back is waited for by the backward: both counted in full.
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


def bwd_slot(c: SubModelCost, prev: SubModelCost | None) -> float:
    """A sub-model's backward, the load of the one before it (sharing the host-to-device link
    with its restored activations) and its gradients' copy back, all at once."""
    return max(c.bwd_s, (prev.load_s if prev else 0.0) + c.restore_s, c.grad_s)


def outer_transfer_s(prof: ModelProfile, passes: int) -> float:
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


def outer_bytes(prof: ModelProfile, m: int) -> int:
    return prof.outer_param_bytes + prof.outer_grad_bytes + m * prof.outer_saved_bytes


def pair_window(a: SubModelCost, c: SubModelCost) -> int:
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
        per_pass += bwd_slot(c, prev)
        if nxt:
            window = max(window, pair_window(c, nxt))
    step = costs[0].load_s + passes * per_pass + outer_transfer_s(prof, passes)
    peak = outer_bytes(prof, m) + sum(c.saved for c in costs) + window
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
