"""Models: a plain GPT with named size presets."""

from atomtrain.models.gpt import GPT, PRESETS, GPTConfig, generate

__all__ = ["GPT", "PRESETS", "GPTConfig", "generate"]
