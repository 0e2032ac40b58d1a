"""Host-to-device copies on a background worker, and the engine's event trace.

On CUDA a copy runs on its own stream from pinned host memory and the compute stream waits on an
event; on the CPU a worker thread copies into separate buffers, so tests exercise the same
schedule, accounting and trace.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch


@dataclass
class Trace:
    """Ordered engine events: (sequence number, event, sub-model index)."""

    events: list[tuple[int, str, int]] = field(default_factory=list)
    enabled: bool = True
    _counter: itertools.count = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, event: str, k: int) -> None:
        if self.enabled:
            with self._lock:
                self.events.append((next(self._counter), event, k))

    def clear(self) -> None:
        with self._lock:
            self.events.clear()

    def first(self, event: str, k: int) -> int:
        return next(seq for seq, e, i in self.events if e == event and i == k)


@dataclass
class Loaded:
    """A sub-model's device tensors: one {local name: tensor} per block."""

    blocks: list[dict[str, torch.Tensor]]
    nbytes: int
    ready: torch.cuda.Event | None = None
    gate_wait_s: float = 0.0
    """Seconds the copy waited for its gate (the optimizer step writing its source)."""

    def wait(self) -> None:
        if self.ready is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self.ready)
            # Allocated on the copy stream, used on this one: keep the allocator from reusing
            # the memory before this stream is done with it.
            for block in self.blocks:
                for t in block.values():
                    t.record_stream(stream)
            self.ready = None


class Copier:
    """Runs copies on one worker in submission order; `load` returns once the copy has begun."""

    def __init__(
        self, device: torch.device, dtype: torch.dtype, trace: Trace, name: str = "atom-copy"
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.trace = trace
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        # The engine hands over sources already at the device dtype (staged parameters,
        # buffers as they are). copy=True: on the CPU the "device" copy must be a buffer of
        # its own, as on a GPU.
        return t.detach().to(self.device, non_blocking=True, copy=True)

    def load(
        self,
        k: int,
        host: list[dict[str, torch.Tensor]],
        nbytes: int,
        before: Callable[[], None] | None = None,
    ) -> Future[Loaded]:
        started = threading.Event()

        def work() -> Loaded:
            t0 = time.perf_counter()
            try:
                if before is not None:
                    before()  # e.g. wait for this sub-model's optimizer step
                self.trace.record("load_start", k)
            finally:
                gate_s = time.perf_counter() - t0
                started.set()
            ready = None
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    blocks = [{n: self._to_device(t) for n, t in b.items()} for b in host]
                    ready = torch.cuda.Event()
                    ready.record(self.stream)
            else:
                blocks = [{n: self._to_device(t) for n, t in b.items()} for b in host]
            self.trace.record("load_end", k)
            return Loaded(blocks, nbytes, ready, gate_s)

        fut = self.pool.submit(work)
        started.wait()
        return fut

    def submit(self, fn: Callable[[], object]) -> Future:
        return self.pool.submit(fn)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
