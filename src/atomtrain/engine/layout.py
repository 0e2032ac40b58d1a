"""Where a model's repeated blocks are, found from outside without editing the model.

The engine needs one container (an nn.ModuleList or nn.ModuleDict) whose entries the model's own
forward calls in order, each taking the hidden state as its first argument. Our GPT keeps them in
`blocks`; models from popular libraries keep decoder layers in `model.layers`, `transformer.h` or
`gpt_neox.layers`. `find_blocks` picks the container holding the most parameters among those
whose entries are all of one type, or takes a dotted path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from atomtrain.errors import AtomError


@dataclass
class BlockLayout:
    model: nn.Module
    path: str
    """Dotted path of the container, e.g. `blocks` or `model.layers`."""
    container: nn.ModuleList | nn.ModuleDict
    keys: list[str]

    def __len__(self) -> int:
        return len(self.keys)

    def block(self, i: int) -> nn.Module:
        return self.container[self._key(i)]  # type: ignore[index]

    def _key(self, i: int) -> int | str:
        return int(self.keys[i]) if isinstance(self.container, nn.ModuleList) else self.keys[i]

    def prefix(self, i: int) -> str:
        """Name prefix of block i's parameters in the model's `named_parameters()`."""
        return f"{self.path}.{self.keys[i]}." if self.path else f"{self.keys[i]}."

    def is_block_param(self, name: str) -> bool:
        return name.startswith(f"{self.path}.") if self.path else True

    @contextmanager
    def replaced(self, make: Callable[[int], nn.Module]) -> Iterator[None]:
        """Temporarily stand `make(i)` in for block i (as torch.func.functional_call does for
        parameters); the model is restored on exit, also on error."""
        originals = [self.block(i) for i in range(len(self))]
        try:
            for i in range(len(self)):
                self.container[self._key(i)] = make(i)  # type: ignore[index]
            yield
        finally:
            for i, module in enumerate(originals):
                self.container[self._key(i)] = module  # type: ignore[index]


def _candidates(model: nn.Module) -> Iterator[tuple[str, nn.ModuleList | nn.ModuleDict]]:
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList | nn.ModuleDict) and len(module) >= 2:
            kinds = {type(m) for m in module.children()}
            if len(kinds) == 1 and sum(p.numel() for p in module.parameters()) > 0:
                yield name, module


def find_blocks(model: nn.Module, path: str | None = None) -> BlockLayout:
    """The block container at `path`, or the largest uniform one when no path is given."""
    if path:
        try:
            container = model.get_submodule(path)
        except AttributeError:
            raise AtomError(f"model has no submodule {path!r} to take blocks from") from None
        if not isinstance(container, nn.ModuleList | nn.ModuleDict):
            raise AtomError(f"{path!r} is a {type(container).__name__}, not a ModuleList/Dict")
    else:
        found = list(_candidates(model))
        if not found:
            raise AtomError(
                f"found no ModuleList of repeated blocks in {type(model).__name__}; "
                "name the container explicitly (engine.blocks=...)"
            )
        path, container = max(found, key=lambda nc: sum(p.numel() for p in nc[1].parameters()))
    keys = [
        str(k)
        for k in (
            range(len(container)) if isinstance(container, nn.ModuleList) else container.keys()
        )
    ]
    return BlockLayout(model, path, container, keys)
