"""Device memory accounting: every byte the engine puts on the device is reserved here first.

Parameters, gradients and saved boundary inputs are counted from the tensors themselves.
On a GPU, bytes return to the budget on the device's timeline, not the program's: a release
carries an event recorded after the last kernel that may use the memory, and the bytes count
until that event has passed; a reservation that would exceed the budget makes the host wait for
the oldest such events (so the CPU cannot queue loads of later sub-models past the budget).
Activations autograd keeps inside a block are counted from the tensors autograd actually saves
(`saved_tensors_hooks`), deduplicated by storage and excluding parameters already counted.
"""

from __future__ import annotations

import threading
from collections import deque
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
        self.host_waits = 0
        """Reservations that waited for the device to finish with released memory."""
        self._lock = threading.Lock()
        self._pending: deque[tuple[torch.cuda.Event, int]] = deque()

    def _reap(self, need: int) -> None:
        """Return to the budget what the device is done with; wait for the oldest releases
        while `need` more bytes would not fit."""
        while self._pending:
            event, n = self._pending[0]
            if not event.query():
                if self.used + need <= self.budget_bytes:
                    return
                self.host_waits += 1
                event.synchronize()
            self._pending.popleft()
            self.used -= n

    def reserve(self, nbytes: int, what: str) -> None:
        with self._lock:
            self._reap(nbytes)
            if self.used + nbytes > self.budget_bytes:
                raise BudgetExceeded(
                    f"device budget exceeded by {self.used + nbytes - self.budget_bytes} bytes "
                    f"reserving {nbytes} for {what} ({self.used} of {self.budget_bytes} in use)"
                )
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def release(self, nbytes: int, after: torch.cuda.Event | None = None) -> None:
        """Give `nbytes` back, at once or (on a GPU) once the device has passed `after`."""
        with self._lock:
            if after is not None:
                self._pending.append((after, nbytes))
                return
            self.used -= nbytes
            assert self.used >= 0, "released more device bytes than reserved"

    def drain(self) -> None:
        """Wait for every pending release."""
        with self._lock:
            while self._pending:
                event, n = self._pending.popleft()
                event.synchronize()
                self.used -= n

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
