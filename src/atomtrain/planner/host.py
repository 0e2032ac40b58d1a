"""The host side of a plan: memory it needs and the time its optimizer takes.

The engine keeps every parameter, gradient and AdamW moment in host memory in fp32 (16 bytes per
parameter), a 16-bit staging copy when the device runs 16-bit parameters, the activations
offloaded between a sub-model's forward and its backward, and a bounded pool of pinned transfer
buffers. `check_host_memory` answers in one line whether that fits. The optimizer steps overlap
the next step's forward, but the outer part's step must finish before it starts, and all of them
before the step after: `optimizer_cost_s` is what the step cannot hide.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from atomtrain.engine.plan import ExecutionPlan, Policy
from atomtrain.errors import AtomError
from atomtrain.planner.partition import fmt_bytes
from atomtrain.planner.profile import ModelProfile

MASTER_BYTES_PER_PARAM = 16
"""fp32 master, fp32 gradient, two fp32 AdamW moments."""


@dataclass(frozen=True)
class HostSpec:
    """The host as the planner sees it."""

    memory_bytes: int
    """Host memory the run may use."""
    optimizer_params_per_s: float = 0.0
    """Host AdamW throughput (0: not counted)."""
    device_itemsize: int = 4
    """Bytes per parameter on the device (2 for 16-bit device copies), to count parameters
    from the profile's byte figures."""
    pinned_pool_bytes: int = 0
    """Pinned transfer buffers the engine keeps."""
    weight_average: bool = False
    """A float32 moving average of the weights beside the masters (train.ema)."""


def machine_memory_bytes() -> int:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def num_params(prof: ModelProfile, itemsize: int) -> int:
    return (prof.outer_grad_bytes + sum(b.grad_bytes for b in prof.blocks)) // itemsize


@dataclass(frozen=True)
class HostNeed:
    masters_bytes: int
    staging_bytes: int
    offloaded_bytes: int
    pinned_bytes: int
    average_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (
            self.masters_bytes
            + self.staging_bytes
            + self.offloaded_bytes
            + self.pinned_bytes
            + self.average_bytes
        )


def host_need(prof: ModelProfile, plan: ExecutionPlan, host: HostSpec) -> HostNeed:
    n = num_params(prof, host.device_itemsize)
    m = plan.micro_batches_per_load
    offloaded = sum(
        m * sum(prof.blocks[i].saved_bytes for i in s.blocks)
        for s in plan.submodels
        if s.policy is Policy.OFFLOAD
    )
    staging = n * host.device_itemsize if host.device_itemsize < 4 else 0
    average = n * 4 if host.weight_average else 0
    return HostNeed(n * MASTER_BYTES_PER_PARAM, staging, offloaded, host.pinned_pool_bytes, average)


def host_memory_line(prof: ModelProfile, plan: ExecutionPlan, host: HostSpec) -> str:
    """One line: what the plan needs in host memory, of what, and whether it fits."""
    need = host_need(prof, plan, host)
    parts = f"fp32 masters, gradients and AdamW state {fmt_bytes(need.masters_bytes)}"
    if need.staging_bytes:
        parts += f", 16-bit staging {fmt_bytes(need.staging_bytes)}"
    if need.offloaded_bytes:
        parts += f", offloaded activations {fmt_bytes(need.offloaded_bytes)}"
    if need.pinned_bytes:
        parts += f", pinned buffers {fmt_bytes(need.pinned_bytes)}"
    if need.average_bytes:
        parts += f", weight average {fmt_bytes(need.average_bytes)}"
    verdict = (
        "fits"
        if need.total_bytes <= host.memory_bytes
        else f"{fmt_bytes(need.total_bytes - host.memory_bytes)} short"
    )
    return (
        f"host memory: needs {fmt_bytes(need.total_bytes)} ({parts}) of "
        f"{fmt_bytes(host.memory_bytes)}: {verdict}"
    )


def check_host_memory(prof: ModelProfile, plan: ExecutionPlan, host: HostSpec) -> None:
    """Raise AtomError with the one-line answer when the plan does not fit in host memory."""
    if host_need(prof, plan, host).total_bytes > host.memory_bytes:
        raise AtomError(host_memory_line(prof, plan, host))


def optimizer_cost_s(prof: ModelProfile, step_s: float, host: HostSpec) -> float:
    """Seconds the host optimizer adds to a step of `step_s`: the outer part's step (the next
    forward waits for it) and whatever of the whole step the step itself cannot cover."""
    if host.optimizer_params_per_s <= 0:
        return 0.0
    total = num_params(prof, host.device_itemsize) / host.optimizer_params_per_s
    outer = (prof.outer_grad_bytes // host.device_itemsize) / host.optimizer_params_per_s
    return outer + max(0.0, total - outer - step_s)
