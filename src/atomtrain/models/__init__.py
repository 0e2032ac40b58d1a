"""Models: a plain GPT with named size presets.

The shapes (`GPTConfig`, `PRESETS`) need no torch; `GPT` and `generate` are imported on first use,
so code that only sizes models (`atomtrain plan`) starts without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from atomtrain.models.config import PRESETS, GPTConfig

if TYPE_CHECKING:
    from atomtrain.models.gpt import GPT, generate

__all__ = ["GPT", "PRESETS", "GPTConfig", "generate"]


def __getattr__(name: str) -> Any:
    if name in ("GPT", "generate"):
        from atomtrain.models import gpt

        return getattr(gpt, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
