"""The swap engine: a model's blocks streamed through the device one sub-model at a time.

Master parameters stay where the model keeps them (host memory; pinned on CUDA). For each pass the
engine runs the model's own forward with each block replaced by a proxy that (1) makes sure the
block's sub-model is on the device, prefetching the next one while this one computes, and (2) runs
the block through `SwappedBlock`, an autograd function that saves what the plan's policy says and,
in the backward, brings the sub-model back (the last one never left), recomputes if needed, and
streams the block's gradients back to the host parameters' `.grad`.

Everything on the device is reserved in `DeviceMemory` first, so `memory.peak` is the accounted
peak and a plan that would exceed `budget_bytes` fails loudly instead of silently.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from atomtrain.engine.blocks import (
    BlockProxy,
    FetchParam,
    OutputLayout,
    SwappedBlock,
    check_inputs,
    join_output,
)
from atomtrain.engine.calls import CalledModel, ModelCall, default_call, extract_loss
from atomtrain.engine.compiled import BlockCall, BlockCompiler, CompileConfig, eager_call
from atomtrain.engine.layout import BlockLayout, find_blocks
from atomtrain.engine.memory import DeviceMemory, count_saved_bytes, tensor_bytes
from atomtrain.engine.passes import backward_block, forward_block
from atomtrain.engine.plan import ExecutionPlan
from atomtrain.engine.replay import autocast
from atomtrain.engine.transfer import Copier, Loaded, PinnedPool, Trace, copy_grads_to_host
from atomtrain.errors import AtomError
from atomtrain.optim.scaler import PRECISIONS

__all__ = ["EngineConfig", "ModelCall", "SwapEngine", "default_call", "extract_loss"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine uses the device."""

    budget_bytes: int
    """Device bytes the engine may hold at once: parameters, gradients, activations."""
    param_dtype: str = "float32"
    """Dtype of device copies (`bfloat16`/`float16` halve transfer bytes; masters stay fp32)."""
    blocks: str = ""
    """Dotted path of the block container (empty: found automatically)."""
    reserve_bytes: int = 0
    """Device bytes held back from `budget_bytes` for what the engine cannot count: the CUDA
    context's workspaces, allocator rounding and per-stream pools (the factory sets 5%, at
    least 256 MiB, on a GPU; 0 on the CPU)."""
    precision: str = "fp32"
    """Compute precision: `fp32`, or `bf16`/`fp16` autocast (matrix products in 16 bits;
    norms, softmax and the loss in fp32 as autocast chooses; fp32 masters, fp32 gradient
    accumulation on the host; dynamic loss scaling for fp16, done by the runner)."""
    compile: CompileConfig | None = None
    """Compile each distinct block once (`torch.compile`) and run every block of its kind
    through it, its device tensors passed as inputs (None: every block eager)."""


class SwapEngine:
    def __init__(
        self,
        model: nn.Module,
        plan: ExecutionPlan,
        cfg: EngineConfig,
        device: torch.device,
        call: ModelCall = default_call,
    ) -> None:
        self.model = model
        self.plan = plan
        self.cfg = cfg
        self.device = device
        self._called = CalledModel(model, call)
        if cfg.precision not in PRECISIONS:
            raise AtomError(
                f"engine.precision must be one of {', '.join(PRECISIONS)}, got {cfg.precision!r}"
            )
        self.layout: BlockLayout = find_blocks(model, cfg.blocks or None)
        plan.validate(len(self.layout))
        self.dtype = getattr(torch, cfg.param_dtype)
        if not 0 <= cfg.reserve_bytes < cfg.budget_bytes:
            raise AtomError(
                f"engine reserve of {cfg.reserve_bytes} bytes leaves nothing of the "
                f"{cfg.budget_bytes}-byte budget"
            )
        self.memory = DeviceMemory(cfg.budget_bytes - cfg.reserve_bytes)
        self.trace = Trace()
        self.copier = Copier(device, self.dtype, self.trace)
        self.offloader = ThreadPoolExecutor(1, thread_name_prefix="atom-offload")
        self.d2h_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._index_model()
        # Gradient staging: two buffers, each the largest block's gradients, so one fills
        # while the other is accumulated into the host `.grad`.
        self.grad_pool = PinnedPool(
            max(1, max(self.block_grad_bytes, default=1)), 2, device.type == "cuda"
        )
        self.resident: dict[int, Loaded] = {}
        self.pending: dict[int, Future[Loaded]] = {}
        self.gates: dict[int, Future] = {}
        """Per sub-model (and -1 for the outer part): work a load must wait for (an optimizer
        step writing the host parameters it would copy)."""
        self.on_grads_ready: Callable[[int, list[Future]], None] | None = None
        self.boundary_hook: Callable[[str, Callable[[], None]], None] | None = None
        """Called before each sub-model's forward and backward, with a function that evicts
        the resident sub-models: where a scheduler may pause training (and make room)."""
        self._outputs: dict[int, OutputLayout] = {}
        self._held_grad_bytes: dict[int, int] = defaultdict(int)
        self._grad_futures: dict[int, list[Future]] = defaultdict(list)
        self._outer_dev: dict[str, torch.Tensor] | None = None
        self._outer_bytes = 0
        self._first_pass = True
        self._final_pass = True
        self._keep_first = False
        self._stashed: dict[tuple[int, str], torch.Tensor] = {}
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        self.gate_wait_s = 0.0
        """Seconds the training thread waited for optimizer steps gating a load."""
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        self.compiler = BlockCompiler(cfg.compile) if cfg.compile is not None else None
        self.block_call: BlockCall = self.compiler.call if self.compiler else eager_call

    # ----- setup -----------------------------------------------------------------------------

    def _index_model(self) -> None:
        lay = self.layout
        self.blocks = [lay.block(i) for i in range(len(lay))]
        self.sub_of = [k for k, s in enumerate(self.plan.submodels) for _ in s.blocks]
        if self.device.type == "cuda":
            for p in self.model.parameters():
                if not p.data.is_pinned():
                    p.data = p.data.pin_memory()
        self.host_params = dict(self.model.named_parameters())
        self._param_ids = {id(p) for p in self.host_params.values()}
        self.host_blocks: list[dict[str, torch.Tensor]] = []
        self.block_param_names: list[dict[str, str]] = []  # local name -> model-wide name
        for i, block in enumerate(self.blocks):
            tensors: dict[str, torch.Tensor] = dict(block.named_parameters())
            tensors.update({n: b for n, b in block.named_buffers()})
            self.host_blocks.append(tensors)
            # Frozen parameters (requires_grad False when the engine is built) get no device
            # gradient, no gradient bytes and no optimizer step, as in plain training.
            self.block_param_names.append(
                {n: lay.prefix(i) + n for n, p in block.named_parameters() if p.requires_grad}
            )
        self.host_outer: dict[str, torch.Tensor] = {
            n: p for n, p in self.model.named_parameters() if not self.layout.is_block_param(n)
        }
        self.host_outer.update(
            {n: b for n, b in self.model.named_buffers() if not self.layout.is_block_param(n)}
        )
        self.outer_param_names = [
            n
            for n in self.host_outer
            if n in self.host_params and self.host_params[n].requires_grad
        ]
        self._staging: dict[int, torch.Tensor] = {}
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.block_bytes = [
            sum(self._device_bytes(t) for t in b.values()) for b in self.host_blocks
        ]
        self.block_grad_bytes = [
            sum(self.host_blocks[i][n].numel() * itemsize for n in names)
            for i, names in enumerate(self.block_param_names)
        ]
        self.submodel_bytes = [
            sum(self.block_bytes[i] for i in s.blocks) for s in self.plan.submodels
        ]

    def _device_bytes(self, t: torch.Tensor) -> int:
        """Bytes of t's device copy: parameters at the device dtype, buffers as they are."""
        if t.is_floating_point() and id(t) in self._param_ids:
            return t.numel() * torch.empty((), dtype=self.dtype).element_size()
        return t.numel() * t.element_size()

    def _host_source(self, t: torch.Tensor) -> torch.Tensor:
        """What a load copies from: the master itself, or its low-precision staging copy
        (parameters only: buffers such as rotary `inv_freq` keep their dtype)."""
        if self.dtype == torch.float32 or not t.is_floating_point() or id(t) not in self._param_ids:
            return t
        staged = self._staging.get(id(t))
        if staged is None:
            staged = t.detach().to(self.dtype)
            if self.device.type == "cuda":
                staged = staged.pin_memory()
            self._staging[id(t)] = staged
        return staged

    def refresh_staging(self, names: list[str]) -> None:
        """Re-derive low-precision staging copies after an optimizer step wrote the masters."""
        if self.dtype == torch.float32:
            return
        with torch.no_grad():
            for n in names:
                p = self.host_params[n]
                if id(p) in self._staging:
                    self._staging[id(p)].copy_(p)

    # ----- loading and eviction ---------------------------------------------------------------

    def _issue_load(self, k: int) -> Future[Loaded]:
        nbytes = self.submodel_bytes[k]
        self.memory.reserve(nbytes, f"parameters of sub-model {k}")
        sub = self.plan.submodels[k]
        gate = self.gates.get(k)
        host = [
            {n: self._host_source(t) for n, t in self.host_blocks[i].items()} for i in sub.blocks
        ]
        return self.copier.load(k, host, nbytes, before=gate.result if gate else None)

    def _prefetch(self, k: int) -> None:
        if k not in self.resident and k not in self.pending:
            self.pending[k] = self._issue_load(k)

    def _acquire(self, k: int) -> Loaded:
        if k not in self.resident:
            fut = self.pending.pop(k, None) or self._issue_load(k)
            t0 = time.perf_counter()
            loaded = fut.result()
            # Of the wait, what the load itself spent waiting for the optimizer.
            self.gate_wait_s += min(time.perf_counter() - t0, loaded.gate_wait_s)
            loaded.wait(self.device)
            sub = self.plan.submodels[k]
            for j, i in enumerate(sub.blocks):
                for local in self.block_param_names[i]:
                    loaded.blocks[j][local].requires_grad_(True)
            self.resident[k] = loaded
        return self.resident[k]

    def _boundary(self, where: str) -> None:
        if self.boundary_hook is not None:
            self.boundary_hook(where, self._evict_for_other_job)

    def _evict_for_other_job(self) -> None:
        self.evict_all()
        self.trace.record("evicted", -1)

    def evict_all(self) -> None:
        """Drop every sub-model from the device (loads in flight finish first)."""
        for k, fut in list(self.pending.items()):
            fut.result()
            self._release(self.submodel_bytes[k])
        self.pending.clear()
        for k in list(self.resident):
            self._evict(k)

    def _evict(self, k: int) -> None:
        loaded = self.resident.pop(k, None)
        if loaded is not None:
            self._release(loaded.nbytes)

    # ----- the outer part (embeddings, final norm, head): resident for a whole step ------------

    def _load_outer(self) -> dict[str, torch.Tensor]:
        if self._outer_dev is None:
            gate = self.gates.get(-1)
            if gate is not None:
                t0 = time.perf_counter()
                gate.result()
                self.gate_wait_s += time.perf_counter() - t0
            grads = tensor_bytes([self.host_outer[n] for n in self.outer_param_names])
            if self.dtype != torch.float32:
                grads //= 2
            params = sum(self._device_bytes(t) for t in self.host_outer.values())
            self._outer_bytes = params + grads
            self.memory.reserve(self._outer_bytes, "outer parameters and gradients")
            dev = {
                n: self.copier._to_device(self._host_source(t)) for n, t in self.host_outer.items()
            }
            for n in self.outer_param_names:
                dev[n].requires_grad_(True)
            self._outer_dev = dev
        return self._outer_dev

    def _release_outer(self) -> None:
        if self._outer_dev is not None:
            self._outer_dev = None
            self._release(self._outer_bytes)

    def _offload_outer_grads(self) -> None:
        assert self._outer_dev is not None
        for n in self.outer_param_names:
            g = self._outer_dev[n].grad
            self._outer_dev[n].grad = None
            if g is not None:
                self._accumulate(self.host_params[n], g)

    def _accumulate(self, host: torch.Tensor, g: torch.Tensor) -> None:
        if host.grad is None:
            host.grad = torch.empty_like(host)
            host.grad.copy_(g)
        elif self._first_pass:
            host.grad.copy_(g)  # in place: the host gradient is allocated once
        else:
            host.grad.add_(g)

    # ----- a pass: the model's forward with proxies, then its backward -------------------------

    def run_pass(
        self, x: torch.Tensor, y: torch.Tensor, weight: float, first: bool, final: bool
    ) -> float:
        """Forward and backward of one pass; gradients land in the host parameters' `.grad`
        (replacing them when `first`, accumulating otherwise). Returns the pass's loss."""
        self._first_pass, self._final_pass = first, final
        self._keep_first = not final  # sub-model 0 ends this backward and starts the next pass
        self._grad_futures.clear()
        outer = self._load_outer()
        exclude = {t.untyped_storage().data_ptr() for t in outer.values()}
        with (
            self.layout.replaced(lambda i: BlockProxy(self, i)),
            count_saved_bytes(exclude) as saved,
            self._autocast(),
        ):
            # Copies of their own, as on a GPU: a micro-batch is a view of the batch, and its
            # whole storage would be counted as saved.
            xd, yd = x.to(self.device, copy=True), y.to(self.device, copy=True)
            loss = extract_loss(self._model_call(outer, xd, yd))
        self.memory.reserve(saved[0], "outer activations")
        try:
            (loss * weight).backward()
        finally:
            self._release(saved[0])
        self._offload_outer_grads()
        return float(loss.detach())

    def _model_call(self, outer: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        params = {f"model.{n}": t for n, t in outer.items()}
        return functional_call(self._called, params, (x, y))

    @torch.no_grad()
    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The loss alone, streaming the sub-models through once."""
        outer = self._load_outer()
        try:
            with self.layout.replaced(lambda i: BlockProxy(self, i)), self._autocast():
                out = self._model_call(outer, x.to(self.device), y.to(self.device))
            return float(extract_loss(out))
        finally:
            for k in list(self.resident):
                self._evict(k)
            self._release_outer()

    def finish_step(self) -> None:
        """Wait for every gradient to reach the host and release the outer part."""
        for futs in self._grad_futures.values():
            for f in futs:
                f.result()
        self._release_outer()
        for k in list(self.resident):
            self._evict(k)
        self.memory.drain()

    # ----- per block ---------------------------------------------------------------------------

    def _run_block(self, i: int, args: tuple, kwargs: dict) -> Any:
        x, rest = args[0], args[1:]
        k = self.sub_of[i]
        sub = self.plan.submodels[k]
        if i == sub.start:
            self._boundary(f"forward {k}")
            self._acquire(k)
            self.trace.record("compute_start", k)
            if k + 1 < len(self.plan.submodels):
                self._prefetch(k + 1)
        if torch.is_grad_enabled():
            check_inputs(i, rest, kwargs)
            diff = SwappedBlock.apply(x, self, i, rest, kwargs, self._anchor)
            out = join_output(self._outputs.pop(i), diff)
        else:
            out = self._call(i, x, rest, kwargs)
        if i == sub.end - 1:
            self.trace.record("compute_end", k)
            keep = torch.is_grad_enabled() and k == len(self.plan.submodels) - 1
            if not keep:  # the last sub-model stays for the start of the backward
                self._evict(k)
        return out

    def _device_tensors(self, i: int) -> dict[str, torch.Tensor]:
        k = self.sub_of[i]
        return self.resident[k].blocks[i - self.plan.submodels[k].start]

    def _device_tensor(self, i: int, local: str) -> torch.Tensor:
        return self._device_tensors(i)[local]

    def _stash_grad(self, i: int, local: str, g: torch.Tensor) -> None:
        key = (i, local)
        self._stashed[key] = g if key not in self._stashed else self._stashed[key] + g

    def _call(
        self, i: int, x: torch.Tensor, rest: tuple, kwargs: dict, fetched: bool = False
    ) -> Any:
        """Block i's whole output, computed with its device tensors."""
        params = self._device_tensors(i)
        if fetched:  # trainable parameters as FetchParam nodes, the rest as they are
            names = self.block_param_names[i]
            params = {
                n: FetchParam.apply(self._anchor, self, i, n) if n in names else t
                for n, t in params.items()
            }
        return self.block_call(self.blocks[i], params, (x, *rest), kwargs, f"block {i}")

    def _param_storages(self, i: int) -> set[int]:
        k = self.sub_of[i]
        params = self.resident[k].blocks[i - self.plan.submodels[k].start]
        return {t.untyped_storage().data_ptr() for t in params.values()}

    def _forward_block(self, ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`SwappedBlock`'s forward (passes.py)."""
        return forward_block(self, ctx, x)

    def _backward_block(
        self, ctx: Any, grads: tuple[torch.Tensor | None, ...]
    ) -> torch.Tensor | None:
        """`SwappedBlock`'s backward (passes.py)."""
        return backward_block(self, ctx, grads)

    def _offload_block_grads(self, i: int, k: int) -> None:
        params = self.resident[k].blocks[i - self.plan.submodels[k].start]
        pairs = []
        for local, name in self.block_param_names[i].items():
            g = self._stashed.pop((i, local), None)
            if g is None:
                g = params[local].grad
                params[local].grad = None
            if g is not None:
                pairs.append((self.host_params[name], g))
        ready = None
        if self.d2h_stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        args = (pairs, self.grad_pool, self._first_pass, self.d2h_stream, ready)
        self._grad_futures[k].append(self.offloader.submit(copy_grads_to_host, *args))

    def _release(self, nbytes: int) -> None:
        """Bytes back to the budget once the kernels queued so far are done with them."""
        after = None
        if self.device.type == "cuda" and nbytes:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        self.memory.release(nbytes, after)

    def _copy_to_host(self, src: torch.Tensor) -> Future[torch.Tensor]:
        """An offloaded activation's copy to host memory, on the copy thread (and on CUDA its
        own stream, into pinned memory), so the forward goes on meanwhile. The closure holds
        `src` until the copy is done."""
        ready = None
        if self.d2h_stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))

        def work() -> torch.Tensor:
            if ready is None or self.d2h_stream is None:
                return src.to("cpu", copy=True)
            self.d2h_stream.wait_event(ready)
            host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            with torch.cuda.stream(self.d2h_stream):
                host.copy_(src, non_blocking=True)
            self.d2h_stream.synchronize()
            return host

        return self.offloader.submit(work)

    def _autocast(self) -> Any:
        """The forward's autocast, also around a recompute (which runs in the backward)."""
        return autocast(self.device, self.autocast_dtype)

    def close(self) -> None:
        self.finish_step()
        for k, fut in self.pending.items():
            fut.result()
            self._release(self.submodel_bytes[k])
        self.pending.clear()
        self.copier.close()
        self.offloader.shutdown(wait=True)
