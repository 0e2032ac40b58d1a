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

    def wait(self, device: torch.device) -> None:
        if self.ready is not None:
            stream = torch.cuda.current_stream(device)
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


class PinnedPool:
    """A bounded set of reused host staging buffers (pinned on CUDA, so copies into them run
    asynchronously): device-to-host gradient copies land in one, then are accumulated into the
    fp32 `.grad` on the host, and the buffer goes back. At most `count` buffers of
    `buffer_bytes` exist; a copy waits for a free one instead of allocating."""

    def __init__(self, buffer_bytes: int, count: int, pinned: bool) -> None:
        self.buffer_bytes = buffer_bytes
        self.count = count
        self.pinned = pinned
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._cond = threading.Condition()

    @property
    def capacity_bytes(self) -> int:
        return self.buffer_bytes * self.count

    def acquire(self) -> torch.Tensor:
        with self._cond:
            while not self._free and self._made >= self.count:
                self._cond.wait()
            if self._free:
                return self._free.pop()
            self._made += 1
        return torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self.pinned)

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


def copy_grads_to_host(
    pairs: list[tuple[torch.Tensor, torch.Tensor]] | list,
    pool: PinnedPool,
    replace: bool,
    stream: torch.cuda.Stream | None,
    ready: torch.cuda.Event | None,
) -> None:
    """Device gradients `g` into the host masters' fp32 `.grad` (replacing or accumulating),
    through pooled staging buffers: no host memory is allocated after the first step."""
    i = 0
    while i < len(pairs):
        buf = pool.acquire()
        try:
            batch: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
            used = 0
            while i < len(pairs):
                g = pairs[i][1]
                n = g.numel() * g.element_size()
                if batch and used + n > pool.buffer_bytes:
                    break
                if n > pool.buffer_bytes:  # larger than any buffer: a one-off host tensor
                    batch.append((pairs[i][0], g, None))
                else:
                    view = buf[used : used + n].view(g.dtype).view(g.shape)
                    batch.append((pairs[i][0], g, view))
                    used += n
                i += 1
            if stream is not None and ready is not None:
                stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    staged = [
                        (h, v.copy_(g, non_blocking=True) if v is not None else g.to("cpu"))
                        for h, g, v in batch
                    ]
                stream.synchronize()
            else:
                staged = [(h, v.copy_(g) if v is not None else g.to("cpu")) for h, g, v in batch]
            for h, s in staged:
                if replace or h.grad is None:
                    if h.grad is None or h.grad.shape != h.shape:
                        h.grad = torch.empty_like(h, dtype=torch.float32)
                    h.grad.copy_(s)
                else:
                    h.grad.add_(s)
        finally:
            pool.release(buf)
