"""Measured profiles: a model's real blocks timed on the device (each called as one forward of
the outer part really calls it, keyword arguments included), the bytes autograd saves counted,
the copy bandwidth measured; cached as JSON keyed by model, batch and device."""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from atomtrain.engine.compiled import BlockCall, BlockCompiler, CompileConfig, eager_call
from atomtrain.engine.layout import BlockLayout, find_blocks
from atomtrain.engine.memory import count_saved_bytes
from atomtrain.planner.profile import BlockCost, ModelProfile

log = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth(device: torch.device, nbytes: int = 64 << 20) -> tuple[float, float]:
    """(host-to-device, device-to-host) bytes per second for one large copy."""
    host = torch.empty(nbytes // 4, dtype=torch.float32)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, copy=True)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), device, 3)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), device, 3)
    return nbytes / h2d, nbytes / d2h


@dataclass
class BlockInputs:
    """A block's call as the model's forward really makes it: the hidden state, then the other
    positional and keyword arguments (masks, position ids, rotary embeddings, flags)."""

    x: torch.Tensor
    rest: tuple
    kwargs: dict[str, Any]
    block_call: BlockCall = eager_call
    """How the engine will run the block: eagerly or compiled."""

    def call(self, block: nn.Module, tensors: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
        out = self.block_call(block, tensors, (x, *self.rest), self.kwargs, "profiled block")
        return out[0] if isinstance(out, tuple) else out


def _detached(value: Any, dtype: torch.dtype) -> Any:
    """`value` with its tensors detached, floating ones at the device dtype (as the engine runs)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        return t.to(dtype) if t.is_floating_point() else t
    if isinstance(value, tuple | list):
        return type(value)(_detached(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v, dtype) for k, v in value.items()}
    return value


def _measure_block(
    block: nn.Module, inputs: BlockInputs, dtype: torch.dtype, device: torch.device, reps: int
) -> BlockCost:
    x = inputs.x
    tensors = {
        n: t.detach().to(device, dtype=dtype if t.is_floating_point() else t.dtype, copy=True)
        for n, t in [*block.named_parameters(), *block.named_buffers()]
    }
    names = {n for n, p in block.named_parameters() if p.requires_grad}
    for n in names:
        tensors[n].requires_grad_(True)
    storages = {t.untyped_storage().data_ptr() for t in tensors.values()}

    with torch.no_grad():
        fwd_s = _timed(lambda: inputs.call(block, tensors, x), device, reps)

    def fwd_bwd() -> None:
        y = inputs.call(block, tensors, x.detach().requires_grad_())
        y.backward(torch.ones_like(y))
        for n in names:
            tensors[n].grad = None

    total = _timed(fwd_bwd, device, reps)
    # Tensors passed in (a mask) count too: the engine keeps or offloads them like any other.
    with count_saved_bytes(storages) as saved:
        graph = inputs.call(block, tensors, x.detach().requires_grad_())
    del graph
    itemsize = torch.empty((), dtype=dtype).element_size()
    pbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return BlockCost(
        fwd_s=fwd_s,
        bwd_s=max(total - fwd_s, 1e-9),
        param_bytes=pbytes,
        grad_bytes=sum(tensors[n].numel() * itemsize for n in names),
        input_bytes=x.numel() * x.element_size(),
        saved_bytes=saved[0],
    )


def _outer_tensors(
    model: nn.Module, layout: BlockLayout, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    params = {n for n, p in model.named_parameters() if p.requires_grad}
    outer = {
        n: t.detach().to(device, dtype=dtype if t.is_floating_point() else t.dtype, copy=True)
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if not layout.is_block_param(n)
    }
    for n, t in outer.items():
        if n in params:
            t.requires_grad_(True)
    return outer


def measure_profile(
    model: nn.Module,
    rows: int,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    blocks_path: str = "",
    reps: int = 3,
    block_call: BlockCall = eager_call,
) -> ModelProfile:
    """Time each distinct block on the device, run by `block_call` as the engine will run it
    (compiled blocks compile in the warm-up call), and count the bytes it saves.

    One forward of the outer part (blocks as identities) captures each block's real call, its
    keyword arguments included, so blocks that need more than the hidden state (a Llama layer's
    rotary `position_embeddings`, a causal mask) are measured as the model runs them.
    """
    layout = find_blocks(model, blocks_path or None)
    vocab = getattr(getattr(model, "config", None), "vocab_size", 256)
    idx = torch.randint(0, vocab, (rows, seq_len), device=device)
    tgt = torch.randint(0, vocab, (rows, seq_len), device=device)  # saved apart from idx
    outer = _outer_tensors(model, layout, device, dtype)
    captured: dict[int, BlockInputs] = {}

    class Capture(nn.Module):  # the outer part alone: blocks as identities
        def __init__(self, i: int) -> None:
            super().__init__()
            self.i = i

        def forward(self, x: torch.Tensor, *rest: Any, **kwargs: Any) -> torch.Tensor:
            if self.i not in captured:
                captured[self.i] = BlockInputs(
                    _detached(x, dtype), _detached(rest, dtype), _detached(kwargs, dtype)
                )
            return x

    params = {n for n, p in model.named_parameters() if p.requires_grad}
    storages = {t.untyped_storage().data_ptr() for t in outer.values()}
    with layout.replaced(Capture):

        def outer_fwd() -> torch.Tensor:
            out = functional_call(model, outer, (idx, tgt))
            return out[1] if isinstance(out, tuple) else out.loss

        with torch.no_grad():
            outer_fwd_s = _timed(outer_fwd, device, reps)
        outer_total = _timed(lambda: outer_fwd().backward(), device, reps)
        with count_saved_bytes(storages) as osaved:
            loss = outer_fwd()
        del loss
    cache: dict[str, BlockCost] = {}
    costs = []
    for i in range(len(layout)):
        block = layout.block(i)
        sig = type(block).__name__ + str([tuple(p.shape) for p in block.parameters()])
        if sig not in cache:
            inputs = replace(captured[i], block_call=block_call)
            cache[sig] = _measure_block(block, inputs, dtype, device, reps)
        costs.append(cache[sig])
    h2d, d2h = measure_bandwidth(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return ModelProfile(
        blocks=tuple(costs),
        outer_param_bytes=sum(t.numel() * t.element_size() for t in outer.values()),
        outer_grad_bytes=sum(t.numel() * itemsize for n, t in outer.items() if n in params),
        outer_saved_bytes=osaved[0],
        outer_fwd_s=outer_fwd_s,
        outer_bwd_s=max(outer_total - outer_fwd_s, 1e-9),
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        micro_batch_rows=rows,
        seq_len=seq_len,
        device=device_name(device),
        measured=True,
        notes={"blocks": "eager" if block_call is eager_call else "compiled"},
    )


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{torch.get_num_threads()}threads"


def profile_key(
    model: nn.Module,
    rows: int,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    compiled: str = "",
) -> str:
    shape = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    raw = json.dumps(
        [
            type(model).__name__,
            sorted({type(m).__name__ for m in model.modules()}),  # Llama vs Mistral, same shapes
            shape,
            rows,
            seq_len,
            device_name(device),
            str(dtype),
            torch.__version__,
            *([f"compiled:{compiled}"] if compiled else []),  # eager keys stay as they were
        ]
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def cached_profile(
    model: nn.Module,
    rows: int,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    cache_dir: Path,
    blocks_path: str = "",
    compile: CompileConfig | None = None,
) -> ModelProfile:
    """The measured profile from the cache, measuring (and caching) it on a miss; with
    `compile`, of compiled blocks (cached apart from the eager one)."""
    key = profile_key(model, rows, seq_len, device, dtype, compile.backend if compile else "")
    path = cache_dir / f"{key}.json"
    if path.is_file():
        try:
            return ModelProfile.from_json(path.read_text())
        except (json.JSONDecodeError, TypeError, KeyError):
            log.warning("ignoring unreadable profile cache %s", path)
    call = BlockCompiler(compile).call if compile else eager_call
    prof = measure_profile(model, rows, seq_len, device, dtype, blocks_path, block_call=call)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(prof.to_json())
    tmp.replace(path)
    return prof
