"""What the engine executes: cut points, an activation policy per sub-model, rows per load.

The planner (planner/) chooses a plan; the engine only follows it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum

from atomtrain.errors import AtomError


class Policy(str, Enum):
    """What a sub-model keeps on the device between its forward and its backward."""

    KEEP = "keep"
    """Every activation autograd saves stays on the device: no recomputation."""
    OFFLOAD = "offload"
    """Every activation autograd saves goes to host memory and comes back for the backward."""
    RECOMPUTE = "recompute"
    """Only each block's input stays on the device; the block is recomputed in the backward."""


@dataclass(frozen=True)
class SubModel:
    start: int
    """First block (inclusive)."""
    end: int
    """Last block (exclusive)."""
    policy: Policy = Policy.RECOMPUTE

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True)
class ExecutionPlan:
    submodels: tuple[SubModel, ...]
    micro_batches_per_load: int = 1
    """Micro-batches that pass through each loaded sub-model together (one pass)."""

    def validate(self, num_blocks: int) -> None:
        pos = 0
        for s in self.submodels:
            if s.start != pos or s.end <= s.start:
                raise AtomError(f"plan's sub-models must tile blocks 0..{num_blocks} in order")
            pos = s.end
        if pos != num_blocks:
            raise AtomError(f"plan covers {pos} blocks, the model has {num_blocks}")
        if self.micro_batches_per_load < 1:
            raise AtomError("plan's micro_batches_per_load must be at least 1")

    @classmethod
    def even(
        cls,
        num_blocks: int,
        num_submodels: int,
        policy: Policy = Policy.RECOMPUTE,
        micro_batches_per_load: int = 1,
    ) -> ExecutionPlan:
        """Blocks split as evenly as possible into `num_submodels` runs."""
        n = max(1, min(num_submodels, num_blocks))
        cuts = [num_blocks * k // n for k in range(n + 1)]
        subs = tuple(SubModel(a, b, policy) for a, b in itertools.pairwise(cuts))
        return cls(subs, micro_batches_per_load)

    def describe(self) -> str:
        parts = [f"[{s.start}:{s.end}) {s.policy.value}" for s in self.submodels]
        return f"{len(parts)} sub-models: " + ", ".join(parts)
