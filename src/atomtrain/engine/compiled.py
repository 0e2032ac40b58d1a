"""Compiled blocks: each distinct block compiled once with `torch.compile`, the compiled function
reused for every block of that kind with the block's own (swapped-in) tensors passed as inputs.

    compiler = BlockCompiler(CompileConfig())
    out = compiler.call(block, tensors, (x,), {}, name="block 3")   # instead of functional_call

A block's kind is its structure (module types and their plain attributes), the names, shapes and
dtypes of its tensors, the structure and shapes of its inputs, and the modes the call runs in
(grad, autocast). The first block of a kind is the template: the compiled function runs
`functional_call(template, tensors, ...)`, so the weights are graph inputs, never constants, and
nothing the compiled code holds pins a sub-model on the device. Compiling therefore does not
multiply with depth: a 96-block model of one block type compiles one training graph, plus one for
each other mode it runs in (a recomputing sub-model's forward under `no_grad`, evaluation with
dropout off), each once.

Each kind gets its own code object, so Dynamo keeps a cache per kind (a cache shared across kinds
would count against one recompile limit). The backward is compiled with the forward (not lazily at
the first backward), so a failure to compile shows at the first call, where the block falls back to
eager with one warning naming it. Compiled artefacts go to Inductor's on-disk caches (FX graph and
AOTAutograd caches, under `TORCHINDUCTOR_CACHE_DIR`), so a restarted peer loads instead of
compiling again.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.func import functional_call

from atomtrain.errors import AtomError

log = logging.getLogger(__name__)

BlockCall = Callable[[nn.Module, dict[str, torch.Tensor], tuple, dict, str], Any]
"""How a block is run: (block, its tensors by local name, positional args, keyword args, a name
for messages) -> the block's output."""

_ATOMS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)


def eager_call(
    block: nn.Module, tensors: dict[str, torch.Tensor], args: tuple, kwargs: dict, name: str
) -> Any:
    """A block run as written, with `tensors` in place of its own."""
    del name
    return functional_call(block, tensors, args, kwargs)


@dataclass(frozen=True)
class CompileConfig:
    """How blocks are compiled."""

    backend: str = "inductor"
    """A `torch.compile` backend: `inductor` (generated C++ on a CPU, Triton on a GPU), or
    `aot_eager` (the same tracing and autograd graphs without code generation: for tests)."""
    cache_dir: str = ""
    """Where Inductor keeps compiled artefacts (empty: `TORCHINDUCTOR_CACHE_DIR`, or Inductor's
    own default under the temporary directory)."""


@dataclass
class _Kind:
    """One distinct block: its compiled function, or eager after a failure."""

    label: str
    fn: Callable[..., Any] | None
    compiled: bool = False
    """True once a first call has compiled (or loaded) it."""


class BlockCompiler:
    def __init__(self, cfg: CompileConfig) -> None:
        self.cfg = cfg
        if cfg.cache_dir:
            # Inductor reads the variable each time it opens its caches; an explicit setting
            # by the user wins.
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cfg.cache_dir)))
        self._kinds: dict[tuple, _Kind] = {}
        self._structures: dict[tuple[nn.Module, bool], tuple] = {}
        self.compiles: Counter[str] = Counter()
        """Graphs the backend compiled, per kind label (1 each when nothing recompiles)."""
        self.compile_s = 0.0
        """Seconds spent in first calls (tracing, compiling or loading from the cache, and
        that one run), all kinds together."""
        self.failed: list[str] = []
        """Labels of kinds that fell back to eager."""

    @property
    def distinct_blocks(self) -> int:
        """Kinds compiled (and not fallen back to eager)."""
        return sum(1 for k in self._kinds.values() if k.compiled and k.fn is not None)

    def call(
        self,
        block: nn.Module,
        tensors: dict[str, torch.Tensor],
        args: tuple,
        kwargs: dict,
        name: str,
    ) -> Any:
        structure = self._structures.get((block, block.training))
        if structure is None:  # walked once per block and mode, not on every call
            structure = self._structures[(block, block.training)] = module_structure(block)
        key = block_kind(block, tensors, args, kwargs, structure)
        kind = self._kinds.get(key)
        if kind is None:
            mode = "train" if block.training else "eval"
            grad = "grad" if torch.is_grad_enabled() else "no_grad"
            label = f"{type(block).__name__}#{len(self._kinds)} ({mode}, {grad})"
            kind = self._kinds[key] = _Kind(label, self._compile(block, label))
        if kind.fn is None:
            return eager_call(block, tensors, args, kwargs, name)
        t0 = time.perf_counter()
        try:
            out = kind.fn(tensors, args, kwargs)
        except (AtomError, torch.OutOfMemoryError):
            raise  # the engine's own errors and memory are not about compiling
        except Exception as e:
            # A first call compiles; later ones only when a guard fails (Dynamo's own errors).
            if kind.compiled and not isinstance(e, torch._dynamo.exc.TorchDynamoException):
                raise
            return self._fall_back(kind, e, block, tensors, args, kwargs, name)
        if not kind.compiled:
            kind.compiled = True
            dt = time.perf_counter() - t0
            self.compile_s += dt
            log.info("compiled %s for %s in %.1fs", kind.label, name, dt)
        return out

    def _fall_back(
        self,
        kind: _Kind,
        error: Exception,
        block: nn.Module,
        tensors: dict[str, torch.Tensor],
        args: tuple,
        kwargs: dict,
        name: str,
    ) -> Any:
        """Eager from now on for this kind, after one warning naming the block."""
        kind.fn = None
        self.failed.append(kind.label)
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        log.warning("%s (%s) runs eagerly: compiling failed: %s", name, kind.label, reason)
        return eager_call(block, tensors, args, kwargs, name)

    def _compile(self, template: nn.Module, label: str) -> Callable[..., Any]:
        def run(tensors: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
            return functional_call(template, tensors, args, kwargs)

        # A code object of its own: Dynamo caches compiled frames per code object.
        run.__code__ = run.__code__.replace(co_name=f"block_kind_{len(self._kinds)}")
        backend = torch._dynamo.lookup_backend(self.cfg.backend)

        def counted(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
            self.compiles[label] += 1
            with (
                # The backward compiled now, not at the first backward: a failure shows at
                # the first call, where the block can still fall back to eager.
                torch._functorch.config.patch(force_non_lazy_backward_lowering=True),
                # Random numbers (dropout) drawn as eager draws them: a recomputing sub-model's
                # no_grad forward and its recompute are two graphs that must draw one mask.
                torch._inductor.config.patch(fallback_random=True),
            ):
                return backend(gm, example_inputs)

        return torch.compile(run, backend=counted, fullgraph=True, dynamic=False)


# ----- what makes two blocks the same kind -----------------------------------------------------


def block_kind(
    block: nn.Module,
    tensors: dict[str, torch.Tensor],
    args: tuple,
    kwargs: dict,
    structure: tuple | None = None,
) -> tuple:
    """A key equal for two calls exactly when one compiled function serves both
    (`structure`: the block's `module_structure`, when the caller keeps it)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return (
        structure if structure is not None else module_structure(block),
        tuple((n, _tensor_key(t)) for n, t in tensors.items()),
        str(spec),
        tuple(_value_key(v) for v in leaves),
        torch.is_grad_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cpu"),
        torch.get_autocast_dtype("cuda"),
    )


def module_structure(block: nn.Module) -> tuple:
    """Module types and plain attributes, the whole tree."""
    return tuple(
        (name, type(m), tuple(sorted((k, _value_key(v)) for k, v in _plain_attrs(m))))
        for name, m in block.named_modules()
    )


def _plain_attrs(m: nn.Module) -> list[tuple[str, Any]]:
    """A module's own attributes other than its parameters, buffers, submodules and hooks."""
    return [(k, v) for k, v in vars(m).items() if not k.startswith("_")]


def _tensor_key(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _value_key(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("tensor", *_tensor_key(v))
    if isinstance(v, _ATOMS):
        return (type(v), v)
    if isinstance(v, tuple | list) and all(isinstance(e, _ATOMS) for e in v):
        return (type(v), tuple(v))
    # Anything else (a config object, a cache) by identity: blocks share a kind only when they
    # share the object itself.
    return ("object", id(v))


# ----- a whole model's blocks, for runners without the engine ----------------------------------


class _CompiledBlock(nn.Module):
    """Stands in for a block: runs it through the compiler with its own tensors."""

    def __init__(self, block: nn.Module, compiler: BlockCompiler, name: str) -> None:
        super().__init__()
        self._target = [block]  # a plain list: not a submodule, names stay unchanged
        self._compiler = compiler
        self._name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        block = self._target[0]
        # Views, not the Parameters themselves: Dynamo guards on a Parameter's identity, so
        # each block's own would compile again. Gradients still reach the Parameters.
        tensors = {n: p.view_as(p) for n, p in block.named_parameters()}
        tensors.update(block.named_buffers())
        return self._compiler.call(block, tensors, args, kwargs, self._name)


@contextmanager
def compiled_blocks(model: nn.Module, compiler: BlockCompiler, blocks: str = "") -> Iterator[None]:
    """Within the block, `model`'s forward runs its blocks through `compiler` (the model is
    restored on exit): how the plain runner compiles."""
    from atomtrain.engine.layout import find_blocks

    layout = find_blocks(model, blocks or None)
    with layout.replaced(lambda i: _CompiledBlock(layout.block(i), compiler, f"block {i}")):
        yield
