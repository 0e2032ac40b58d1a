"""An exponential moving average of the weights (`train.ema`): what the run validates, saves
beside its checkpoints and exports.

At a constant or slowly decaying learning rate the weights a run trains move around their
trend with the noise of each step's batch; their moving average follows the trend with much
of that noise averaged away (Polyak averaging), which a validation loss sees as a lower, steadier
curve. The average lives beside the master parameters, on their device, one copy of the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from atomtrain.errors import AtomError

PREFIX = "ema/"
"""Checkpoint tensors of the average are named `ema/<parameter>`."""

WARMUP = 10
"""Early steps weigh more (decay min(decay, (1 + t) / (WARMUP + t)) at update t), so the
average tracks the first steps instead of remembering the initial weights for hundreds of steps."""


class WeightAverage:
    """The moving average of `params` (name -> master tensor), updated after each step."""

    def __init__(self, params: dict[str, torch.Tensor], decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise AtomError(f"train.ema must be in (0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self.shadow = {n: p.detach().clone() for n, p in params.items() if p.is_floating_point()}
        self._spare: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        for s in self.shadow.values():  # one buffer per kind, the size of its largest tensor
            kind = (s.dtype, s.device)
            if kind not in self._spare or self._spare[kind].numel() < s.numel():
                self._spare[kind] = torch.empty(s.numel(), dtype=s.dtype, device=s.device)

    @torch.no_grad()
    def update(self, params: dict[str, torch.Tensor]) -> None:
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (WARMUP + self.updates))
        for name, s in self.shadow.items():
            s.lerp_(params[name].detach(), 1.0 - decay)

    @contextmanager
    def swapped_in(self, params: dict[str, torch.Tensor]) -> Iterator[None]:
        """The parameters hold the average inside the block (and their own values again after
        it): whatever reads the masters (a validation pass, the swap engine) reads the average.
        Exchanged in place, so every reference to a parameter stays valid."""
        self._exchange(params)
        try:
            yield
        finally:
            self._exchange(params)

    @torch.no_grad()
    def _exchange(self, params: dict[str, torch.Tensor]) -> None:
        for name, s in self.shadow.items():
            p = params[name]
            spare = self._spare[(s.dtype, s.device)][: s.numel()].view_as(s)
            spare.copy_(p)
            p.copy_(s)
            s.copy_(spare)

    def state(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensors: the average, by parameter name under `ema/`."""
        return {PREFIX + n: s for n, s in self.shadow.items()}

    def load(self, tensors: dict[str, torch.Tensor], updates: int) -> bool:
        """Take a checkpoint's average; False (nothing taken) when it has none, so the average
        starts from the resumed weights. One of another shape is an error."""
        found = {n[len(PREFIX) :]: t for n, t in tensors.items() if n.startswith(PREFIX)}
        if not found:
            return False
        if set(found) != set(self.shadow):
            raise AtomError("checkpoint's weight average (ema/) names other parameters")
        for name, s in self.shadow.items():
            if found[name].shape != s.shape:
                raise AtomError(f"checkpoint's weight average of {name} has another shape")
        with torch.no_grad():
            for name, s in self.shadow.items():
                s.copy_(found[name])
        self.updates = updates
        return True


def averaged_params(
    params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """A checkpoint's weight average as parameters (name -> tensor), or None without one."""
    found = {n[len(PREFIX) :]: t for n, t in tensors.items() if n.startswith(PREFIX)}
    if not found:
        return None
    return {n: found.get(n, p) for n, p in params.items()}
