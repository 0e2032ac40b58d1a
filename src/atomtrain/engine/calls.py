"""How the engine calls a model and finds its loss: any signature (`call`), any output that holds
one (a tensor, `(logits, loss)`, an object with `.loss`, a dict)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from atomtrain.errors import AtomError

ModelCall = Callable[[nn.Module, torch.Tensor, torch.Tensor], Any]


def default_call(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
    return model(x, y)


class CalledModel(nn.Module):
    """The model as `call` invokes it, so `functional_call` can swap in the outer part's device
    copies (names gain a `model.` prefix) whatever the model's own signature."""

    def __init__(self, model: nn.Module, call: ModelCall) -> None:
        super().__init__()
        self.model = model
        self.call = call

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        return self.call(self.model, x, y)


def extract_loss(out: Any) -> torch.Tensor:
    """The loss from a model's output: `(logits, loss)`, an object with `.loss`, or a dict."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and "loss" in out:
        return out["loss"]
    if hasattr(out, "loss"):
        return out.loss
    if isinstance(out, tuple | list) and len(out) >= 2 and isinstance(out[1], torch.Tensor):
        return out[1]
    raise AtomError(f"cannot find a loss in the model's output ({type(out).__name__})")
