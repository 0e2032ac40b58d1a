"""AdamW over named host tensors, steppable a subset at a time.

The swap engine steps each sub-model's parameters once the step is validated, while the plain
trainer steps all at once; both go through this one implementation (torch's fused AdamW kernel,
the update of torch.optim.AdamW(fused=True)), so the two paths agree bit for bit. State is keyed
by parameter name, so a checkpoint written by one path resumes in the other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from atomtrain.errors import AtomError


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyperparameters (the learning rate comes from the schedule at each step)."""

    beta1: float = 0.9
    """Decay of the first moment."""
    beta2: float = 0.95
    """Decay of the second moment."""
    eps: float = 1e-8
    """Added to the denominator."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices and embeddings only (not biases or norms)."""


class AdamW:
    def __init__(self, params: Mapping[str, torch.Tensor], cfg: AdamWConfig) -> None:
        self.params = params
        self.cfg = cfg
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    def _state_for(self, name: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
        st = self.state.get(name)
        if st is None:
            st = {
                # float32 on the parameter's device: what the fused kernel reads.
                "step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            self.state[name] = st
        return st

    @torch.no_grad()
    def step(self, names: Iterable[str], lr: float, grad_scale: float = 1.0) -> None:
        """Update the named parameters from their `.grad` multiplied by `grad_scale` (the
        gradients themselves are left as they are).

        One call of torch's fused AdamW kernel (the one `torch.optim.AdamW(fused=True)` runs)
        per group of tensors alike in decay, device and dtype, so a subset steps as fast per
        element as the whole model does."""
        groups: dict[tuple, list[str]] = {}
        for name in names:
            p = self.params[name]
            if p.grad is None:
                continue
            decay = p.dim() >= 2 and self.cfg.weight_decay > 0
            groups.setdefault((decay, p.device, p.dtype), []).append(name)
        for (decay, device, _), group in groups.items():
            self._fused(group, lr, grad_scale, self.cfg.weight_decay if decay else 0.0, device)

    def _fused(
        self, names: list[str], lr: float, grad_scale: float, wd: float, device: torch.device
    ) -> None:
        params = [self.params[n] for n in names]
        states = [self._state_for(n, p) for n, p in zip(names, params, strict=True)]
        steps = [st["step"] for st in states]
        torch._foreach_add_(steps, 1)
        scale = None
        if grad_scale != 1.0:  # the kernel divides each gradient by this
            scale = torch.tensor(1.0 / grad_scale, dtype=torch.float32, device=device)
        grads = [p.grad for p in params if p.grad is not None]  # all of them: checked in step
        torch._fused_adamw_(
            params,
            grads,
            [st["exp_avg"] for st in states],
            [st["exp_avg_sq"] for st in states],
            [],
            steps,
            lr=lr,
            beta1=self.cfg.beta1,
            beta2=self.cfg.beta2,
            weight_decay=wd,
            eps=self.cfg.eps,
            amsgrad=False,
            maximize=False,
            grad_scale=scale,
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat `{name/field: tensor}`, ready for safetensors."""
        return {f"{n}/{k}": v for n, st in self.state.items() for k, v in st.items()}

    def load_state_dict(self, flat: dict[str, torch.Tensor]) -> None:
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in flat.items():
            name, _, field = key.rpartition("/")
            if name not in self.params or field not in ("step", "exp_avg", "exp_avg_sq"):
                raise AtomError(f"optimizer state names an unknown tensor {key!r}")
            if field != "step" and value.shape != self.params[name].shape:
                raise AtomError(
                    f"optimizer state {key!r} has shape {tuple(value.shape)}, "
                    f"parameter has {tuple(self.params[name].shape)}"
                )
            like = self.params[name]
            state.setdefault(name, {})[field] = (
                value.to(device=like.device, dtype=torch.float32)
                if field == "step"
                else value.to(like.dtype).clone()
            )
        self.state = state


def grad_norm(grads: dict[str, torch.Tensor]) -> float:
    """Global L2 norm of gradients, reduced in name order so every path rounds alike."""
    if not grads:
        return 0.0
    norms = [torch.linalg.vector_norm(grads[n].float(), 2) for n in sorted(grads)]
    return float(torch.linalg.vector_norm(torch.stack(norms), 2))


def clip_scale(total_norm: float, max_norm: float) -> float:
    """The factor torch's clip_grad_norm_ would apply (1.0 when clipping is off or not needed)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
