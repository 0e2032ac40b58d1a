"""A block's forward and backward inside the swap engine (`SwappedBlock` calls them through the
engine): what the sub-model's policy keeps for the backward (activations on the device, copies on
the host, or only the block's input, recomputed from), the parameters of a saved graph resolved
against the copy loaded again for the backward, the sub-model's loads and evictions at its first
and last block, and its gradients streamed to the host."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from atomtrain.engine.blocks import HostCopies, snapshot, split_output, storage_bytes, view_of
from atomtrain.engine.memory import count_saved_bytes
from atomtrain.engine.plan import Policy
from atomtrain.engine.replay import replayed_rng, rng_state

if TYPE_CHECKING:
    from atomtrain.engine.engine import SwapEngine


def forward_block(engine: SwapEngine, ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    i = ctx.i
    policy = engine.plan.submodels[engine.sub_of[i]].policy
    ctx.x_requires_grad = x.requires_grad
    ctx.x_bytes = x.numel() * x.element_size()
    if policy is Policy.RECOMPUTE:
        # What the block may mutate (a cache in its keyword arguments) as it is now: the
        # recompute replays on a copy of this, not on the live object.
        ctx.args = snapshot((ctx.rest, ctx.kwargs))
        ctx.rng = rng_state(engine.model.training, engine.device)
        ctx.x, ctx.saved_bytes = x.detach(), x.numel() * x.element_size()
        engine.memory.reserve(ctx.saved_bytes, f"input of block {i}")
        diff, layout = split_output(engine._call(i, x, ctx.rest, ctx.kwargs))
        engine._outputs[i] = layout
        return tuple(diff)
    params = engine._param_storages(i)
    offload = HostCopies() if policy is Policy.OFFLOAD else None
    counted = [0]
    seen: set[int] = set()
    alive: list[torch.UntypedStorage] = []

    def pack(t: torch.Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr()
        view = (tuple(t.shape), t.stride(), t.storage_offset())
        if ptr in params:  # a parameter: resolved against the reloaded copy at backward
            return ("param", (_local_of(engine, i, t), view))
        if offload is not None:  # one host copy per storage, however many views
            if ptr not in offload.host:
                offload.host[ptr] = engine._copy_to_host(storage_bytes(t))
                # Held until the block's forward ends, so that no later tensor of this
                # forward reuses the address and is taken for a view of this one.
                alive.append(t.untyped_storage())
            return ("host", (ptr, t.dtype, view))
        if ptr not in seen:
            seen.add(ptr)
            counted[0] += t.untyped_storage().nbytes()
        return ("device", t)

    unpack = partial(_unpack, engine, i, offload)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        xd = x.detach().requires_grad_(x.requires_grad)
        diff, layout = split_output(engine._call(i, xd, ctx.rest, ctx.kwargs, fetched=True))
    alive.clear()
    engine._outputs[i] = layout
    engine.memory.reserve(counted[0], f"kept activations of block {i}")
    ctx.kept, ctx.saved_bytes, ctx.offload = (xd, diff), counted[0], offload
    return tuple(t.detach() for t in diff)


def _local_of(engine: SwapEngine, i: int, t: torch.Tensor) -> str:
    ptr = t.untyped_storage().data_ptr()
    return next(
        n for n, d in engine._device_tensors(i).items() if d.untyped_storage().data_ptr() == ptr
    )


def _unpack(engine: SwapEngine, i: int, offload: HostCopies | None, packed: Any) -> torch.Tensor:
    kind, value = packed
    if kind == "device":
        return value
    if kind == "param":  # the same view, of the copy resident now
        local, (shape, stride, offset) = value
        return engine._device_tensor(i, local).as_strided(shape, stride, offset)
    assert offload is not None
    ptr, dtype, view = value
    restored = offload.restored.get(ptr)
    if restored is None:  # the storage comes back once, shared by its views
        restored = offload.host[ptr].result().to(engine.device, copy=True)
        nbytes = restored.numel()
        engine.memory.reserve(nbytes, f"restored activations of block {i}")
        offload.restored_bytes += nbytes
        offload.restored[ptr] = restored
    return view_of(restored, dtype, view)


def backward_block(
    engine: SwapEngine, ctx: Any, grads: tuple[torch.Tensor | None, ...]
) -> torch.Tensor | None:
    i = ctx.i
    k = engine.sub_of[i]
    sub = engine.plan.submodels[k]
    if i == sub.end - 1:
        engine._boundary(f"backward {k}")
        engine._acquire(k)
        engine.trace.record("bwd_start", k)
        if k > 0:
            engine._prefetch(k - 1)
    engine.memory.reserve(engine.block_grad_bytes[i], f"gradients of block {i}")
    engine._held_grad_bytes[k] += engine.block_grad_bytes[i]
    # The activation gradients flowing through the block: what comes in, what goes out.
    act = sum(g.numel() * g.element_size() for g in grads if g is not None)
    act += ctx.x_bytes
    engine.memory.reserve(act, f"activation gradients of block {i}")
    if sub.policy is Policy.RECOMPUTE:
        xd = _restore_input(ctx)
        rest, kwargs = snapshot(ctx.args)  # a fresh copy: the snapshot stays as it was
        ctx.args = None
        with (
            torch.enable_grad(),
            replayed_rng(ctx.rng, engine.device),
            engine._autocast(),
            count_saved_bytes(engine._param_storages(i)) as work,
        ):
            outs, _ = split_output(engine._call(i, xd, rest, kwargs))
        engine.memory.reserve(work[0], f"recomputed activations of block {i}")
        try:
            _backward(outs, grads)
        finally:
            engine._release(work[0])
    else:
        xd, outs = ctx.kept
        ctx.kept = None
        try:
            _backward(outs, grads)
        finally:
            if ctx.offload is not None:
                engine._release(ctx.offload.restored_bytes)
                ctx.offload = None
    engine._release(ctx.saved_bytes)
    engine._release(act)
    gx = xd.grad
    engine._offload_block_grads(i, k)
    if i == sub.start:
        # Bound device gradients to one sub-model's worth before the next one starts;
        # released here, in program order, so the accounted peak does not depend on when
        # the copy thread got to them.
        for f in engine._grad_futures[k]:
            f.result()
        engine._release(engine._held_grad_bytes.pop(k))
        engine.trace.record("bwd_end", k)
        if not (k == 0 and engine._keep_first):
            engine._evict(k)
        if engine._final_pass and engine.on_grads_ready is not None:
            engine.on_grads_ready(k, list(engine._grad_futures[k]))
    return gx


def _restore_input(ctx: Any) -> torch.Tensor:
    x = ctx.x
    ctx.x = None
    return x.detach().requires_grad_(ctx.x_requires_grad)


def _backward(outs: list[torch.Tensor], grads: tuple[torch.Tensor | None, ...]) -> None:
    """Backward from every output that got a gradient and has a graph."""
    pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
