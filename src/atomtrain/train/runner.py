"""How one optimizer step runs: the plain runner keeps the whole model on one device.

A runner turns a batch into an updated model. The trainer drives any runner the same way, so the
swap engine (engine/) plugs in as another runner with the same interface.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from atomtrain.optim import AdamW, clip_scale, grad_norm


class StepRunner(Protocol):
    optimizer: AdamW

    def train_step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> dict[str, float]:
        """One optimizer step on inputs/targets (rows, T); returns loss and grad_norm."""
        ...

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float: ...

    def host_parameters(self) -> dict[str, torch.Tensor]:
        """The master parameters, by name, as checkpoints store them."""
        ...

    def parameters_written(self) -> None:
        """The masters were written outside an optimizer step (a swarm round, a download, the
        weight average swapped in): whatever the runner derives from them is derived again."""
        ...

    def close(self) -> None: ...


def split_rows(x: torch.Tensor, y: torch.Tensor, micro: int):
    """(x, y) micro-batches of `micro` rows each."""
    return list(zip(x.split(micro), y.split(micro), strict=True))


class PlainRunner:
    """The whole model on `device`; gradients accumulated over micro-batches, then one step."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: AdamW,
        micro_batch_rows: int,
        grad_clip: float,
        device: torch.device,
        forward_context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.micro = micro_batch_rows
        self.grad_clip = grad_clip
        self.device = device
        self.forward_context = forward_context
        """Entered around each forward (compiled blocks stand in for the model's own there)."""

    def train_step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> dict[str, float]:
        self.model.train()
        params = dict(self.model.named_parameters())
        for p in params.values():
            p.grad = None
        parts = split_rows(x, y, self.micro)
        total = 0.0
        for xm, ym in parts:
            with self.forward_context():
                _, loss = self.model(xm.to(self.device), ym.to(self.device))
            (loss * (len(xm) / len(x))).backward()
            total += loss.item() * len(xm) / len(x)
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        norm = grad_norm(grads)
        if torch.isfinite(torch.tensor(norm)):
            self.optimizer.step(sorted(grads), lr, clip_scale(norm, self.grad_clip))
        return {"loss": total, "grad_norm": norm}

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.model.eval()
        with self.forward_context():
            _, loss = self.model(x.to(self.device), y.to(self.device))
        return float(loss)

    def host_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def parameters_written(self) -> None:
        pass  # the model computes from its parameters themselves

    def close(self) -> None:
        pass
