"""Device memory accounting: every byte the engine puts on the device is reserved here first.

Parameters, gradients and saved boundary inputs are counted from the tensors themselves.
Activations autograd keeps inside a block are counted from the tensors autograd actually saves
(`saved_tensors_hooks`), deduplicated by storage and excluding parameters already counted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from atomtrain.errors import AtomError


class BudgetExceeded(AtomError):
    pass


class DeviceMemory:
    """A running total of reserved device bytes against `budget_bytes`, with its peak."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, what: str) -> None:
        with self._lock:
            if self.used + nbytes > self.budget_bytes:
                raise BudgetExceeded(
                    f"device budget exceeded by {self.used + nbytes - self.budget_bytes} bytes "
                    f"reserving {nbytes} for {what} ({self.used} of {self.budget_bytes} in use)"
                )
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
            assert self.used >= 0, "released more device bytes than reserved"

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.used


def tensor_bytes(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@contextmanager
def count_saved_bytes(exclude: set[int]) -> Iterator[list[int]]:
    """Bytes of the distinct storages autograd saves inside the block; `exclude` holds the
    data pointers of storages already accounted (parameters, the block's input)."""
    seen = set(exclude)
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total
