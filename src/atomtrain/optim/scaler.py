"""Dynamic loss scaling for float16 training: the loss is multiplied by `scale` before the
backward so that small gradients do not flush to zero in float16; the optimizer divides it out.
A step whose gradients overflow is skipped and the scale halved; after `growth_interval` good
steps in a row it doubles (the schedule of torch.amp.GradScaler)."""

from __future__ import annotations

from dataclasses import dataclass

from atomtrain.errors import AtomError

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class LossScaler:
    scale: float = 1.0
    """Factor the loss is multiplied by before the backward."""
    dynamic: bool = False
    """Halve on overflow and grow after `growth_interval` good steps (float16)."""
    growth_interval: int = 2000
    """Good steps in a row before the scale doubles."""
    good_steps: int = 0

    def update(self, finite: bool) -> None:
        if not self.dynamic:
            return
        if not finite:
            self.scale = max(self.scale / 2, 1.0)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= 2
            self.good_steps = 0

    @classmethod
    def for_precision(cls, precision: str) -> LossScaler:
        if precision not in PRECISIONS:
            raise AtomError(
                f"engine.precision must be one of {', '.join(PRECISIONS)}, got {precision!r}"
            )
        return cls(2.0**16, dynamic=True) if precision == "fp16" else cls()
