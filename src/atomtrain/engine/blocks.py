"""The pieces the engine runs each block through: autograd functions, output and argument
handling, and the offload of saved activations.

A block may return any nest of tensors and other values (`(hidden, aux_loss)`, a cache, None):
every floating-point tensor in it is an output of `SwappedBlock`, so each gets its gradient (an
auxiliary loss returned by a block trains its parameters). Keyword arguments may hold objects a
block mutates (a transformers cache appends keys); a recomputing sub-model snapshots them before
the forward and replays the backward on a fresh copy of that snapshot, never on the live object.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from atomtrain.errors import AtomError

if TYPE_CHECKING:
    from atomtrain.engine.engine import SwapEngine


class SwappedBlock(torch.autograd.Function):
    """One block: forward as the plan's policy says; backward through the engine. Returns the
    floating-point tensors of the block's output, flattened."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        engine: SwapEngine,
        i: int,
        rest: tuple,
        kwargs: dict,
        anchor: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        # `anchor` needs a gradient, so the block stays in the graph when x does not (frozen
        # embeddings or first layers): its own parameters still do
        ctx.engine, ctx.i, ctx.rest, ctx.kwargs = engine, i, rest, kwargs
        ctx.set_materialize_grads(False)  # outputs nobody used get None, not zeros
        return engine._forward_block(ctx, x)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        return ctx.engine._backward_block(ctx, grads), None, None, None, None, None


class FetchParam(torch.autograd.Function):
    """A block parameter as a graph node that refers to the sub-model's *current* device copy.

    Kept and offloaded graphs survive the sub-model's eviction: the tensors they save are tokens
    resolved at backward time against the reloaded copy, and the gradient is handed to the engine
    instead of accumulating into a leaf that would pin the old copy on the device.
    """

    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, engine: SwapEngine, i: int, local: str
    ) -> torch.Tensor:
        ctx.engine, ctx.i, ctx.local = engine, i, local
        return engine._device_tensor(i, local).detach()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        ctx.engine._stash_grad(ctx.i, ctx.local, g)
        return None, None, None, None


class BlockProxy(nn.Module):
    """Stands in for block i during the engine's forward."""

    def __init__(self, engine: SwapEngine, i: int) -> None:
        super().__init__()
        self.i = i
        self._owner = [engine]  # a plain list: not a submodule, names stay unchanged

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._owner[0]._run_block(self.i, args, kwargs)


# ----- outputs ---------------------------------------------------------------------------------


@dataclass
class OutputLayout:
    """A block output's structure: where its differentiable tensors go back."""

    spec: pytree.TreeSpec
    leaves: list[Any]
    """The output's leaves, differentiable tensors replaced by None."""
    slots: list[int]
    """Leaf positions of the differentiable tensors, in the order the autograd function
    returns them."""


def split_output(out: Any) -> tuple[list[torch.Tensor], OutputLayout]:
    leaves, spec = pytree.tree_flatten(out)
    slots = [j for j, v in enumerate(leaves) if is_differentiable(v)]
    diff = [leaves[j] for j in slots]
    rest = [None if j in set(slots) else v for j, v in enumerate(leaves)]
    return diff, OutputLayout(spec, rest, slots)


def join_output(layout: OutputLayout, diff: tuple[torch.Tensor, ...]) -> Any:
    leaves = list(layout.leaves)
    for j, t in zip(layout.slots, diff, strict=True):
        leaves[j] = t
    return pytree.tree_unflatten(leaves, layout.spec)


def is_differentiable(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def check_inputs(i: int, rest: tuple, kwargs: dict) -> None:
    """Refuse extra inputs that need a gradient: the engine passes only the first input's."""
    for v in pytree.tree_leaves((rest, kwargs)):
        if isinstance(v, torch.Tensor) and v.requires_grad:
            raise AtomError(
                f"block {i} takes a second input that needs a gradient (shape "
                f"{tuple(v.shape)}); the engine passes only the first input's gradient"
            )


# ----- arguments as they were at forward time ---------------------------------------------------

_ATOMS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)


def snapshot(obj: Any, memo: dict[int, Any] | None = None) -> Any:
    """A copy of `obj`'s containers and plain objects sharing its tensors: what a block may
    mutate (lists, dicts, attributes of a cache object) is copied, tensors are not."""
    if memo is None:
        memo = {}
    if isinstance(obj, (*_ATOMS, torch.Tensor, nn.Module)) or callable(obj):
        return obj
    key = id(obj)
    if key in memo:
        return memo[key]
    if isinstance(obj, list):
        new_list: list = []
        memo[key] = new_list
        new_list.extend(snapshot(v, memo) for v in obj)
        return new_list
    if isinstance(obj, dict):
        new_dict = copy.copy(obj)  # keeps the dict's own type (OrderedDict, ...)
        memo[key] = new_dict
        for k, v in obj.items():
            new_dict[k] = snapshot(v, memo)
        return new_dict
    if isinstance(obj, tuple):
        items = [snapshot(v, memo) for v in obj]
        new_tuple = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        memo[key] = new_tuple
        return new_tuple
    if hasattr(obj, "__dict__"):
        new = copy.copy(obj)
        memo[key] = new
        for k, v in vars(obj).items():
            vars(new)[k] = snapshot(v, memo)
        return new
    return obj


# ----- offloaded activations --------------------------------------------------------------------


@dataclass
class HostCopies:
    """A block's saved activations in host memory, one copy per distinct device storage
    (views of one storage, e.g. q, k and v split from one projection, share it), and what
    the backward has brought back so far."""

    host: dict[int, Any] = field(default_factory=dict)
    """Storage key -> host bytes (or a future of them, while the copy runs)."""
    restored: dict[int, torch.Tensor] = field(default_factory=dict)
    restored_bytes: int = 0


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under `t`, as a flat uint8 tensor on t's device."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def view_of(storage: torch.Tensor, dtype: torch.dtype, view: tuple) -> torch.Tensor:
    shape, stride, offset = view
    return torch.empty(0, dtype=dtype, device=storage.device).set_(
        storage.untyped_storage(), offset, shape, stride
    )
