"""One device, two jobs: training submits work in sub-model units, inference in requests.

Preemptive: a pending request stops training at its next sub-model boundary (the engine calls
`train_boundary` before each sub-model's forward and backward); the request runs; training
resumes where it stopped. When the request needs device memory the budget cannot spare,
training's resident sub-models are evicted at that boundary (their masters live on the host, so
they are reloaded, bit for bit, when training resumes).

Without preemption a job keeps the device for its whole unit of work, as kernels already queued
on a GPU do: a training step, or a request, runs to completion before the other starts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from atomtrain.engine.memory import DeviceMemory


class DeviceScheduler:
    def __init__(self, preemptive: bool = True, memory: DeviceMemory | None = None) -> None:
        self.preemptive = preemptive
        self.memory = memory
        self._cond = threading.Condition()
        self._pending = 0
        self._inferring = False
        self._training = False  # between two boundaries (preemptive) or inside a step
        self._need = 0  # device bytes the pending requests ask for
        self.trace: list[tuple[float, str, str]] = []
        self.preemptions = 0

    def _record(self, event: str, where: str = "") -> None:
        self.trace.append((time.perf_counter(), event, where))

    # --- the training job ---------------------------------------------------------------------

    def train_boundary(self, where: str, evict: Callable[[], None] | None = None) -> None:
        """Called by training between sub-models; blocks while inference has the device. When
        a request needs the memory, `evict` drops training's resident sub-models first."""
        with self._cond:
            if not self.preemptive:
                return
            if self._pending or self._inferring:
                self.preemptions += 1
                self._record("preempted", where)
                m = self.memory
                if evict is not None and m is not None and m.used + self._need > m.budget_bytes:
                    evict()  # the request needs the room: sub-models reload when training resumes
                    self._record("evicted", where)
                self._training = False
                self._cond.notify_all()
                while self._pending or self._inferring:
                    self._cond.wait()
                self._record("resumed", where)
            self._training = True

    @contextmanager
    def train_step(self) -> Iterator[None]:
        """A training step: without preemption it holds the device throughout."""
        with self._cond:
            while self._inferring or (not self.preemptive and self._pending):
                self._cond.wait()
            self._training = True
            self._record("step_start")
        try:
            yield
        finally:
            with self._cond:
                self._training = False
                self._record("step_end")
                self._cond.notify_all()

    # --- the inference job ----------------------------------------------------------------------

    @contextmanager
    def inference(self, nbytes: int = 0) -> Iterator[None]:
        """A request: waits for training to reach a boundary (or, without preemption, to end its
        step), reserves `nbytes` of device memory, and has the device to itself."""
        with self._cond:
            self._pending += 1
            self._need += nbytes
            self._record("request")
            while self._training or self._inferring:
                self._cond.wait()
            self._pending -= 1
            self._need -= nbytes
            self._inferring = True
            self._record("infer_start")
        reserved = False
        try:
            if self.memory is not None and nbytes:
                self.memory.reserve(nbytes, "inference")
                reserved = True
            yield
        finally:
            if reserved and self.memory is not None:
                self.memory.release(nbytes)
            with self._cond:
                self._inferring = False
                self._record("infer_end")
                self._cond.notify_all()
