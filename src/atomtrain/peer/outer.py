"""The outer optimizer of DiLoCo: Nesterov momentum on the averaged pseudo-gradient."""

from __future__ import annotations

import torch


class OuterNesterov:
    """theta_sync <- theta_sync - lr * (delta + mu * m), with m <- mu * m + delta."""

    def __init__(self, numel: int, lr: float, momentum: float) -> None:
        self.lr = lr
        self.momentum = momentum
        self.buf = torch.zeros(numel, dtype=torch.float32)

    @torch.no_grad()
    def step(self, theta_sync: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The new synchronized parameters (flat, float32) from the averaged pseudo-gradient."""
        self.buf.mul_(self.momentum).add_(delta)
        update = delta + self.momentum * self.buf
        return theta_sync - self.lr * update
