"""The shape of a GPT and its named presets: plain numbers, no torch (`atomtrain plan` sizes a
175B model from these alone)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from atomtrain.errors import AtomError


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model."""

    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream."""
    block_size: int = 256
    """Longest context, in tokens."""
    vocab_size: int = 256
    """Number of token ids (the byte tokenizer needs 256)."""
    dropout: float = 0.0
    """Dropout probability in attention and MLP outputs."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry biases."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise AtomError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise AtomError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise AtomError(f"model.dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def from_name(cls, name: str, **overrides: object) -> GPTConfig:
        """The named preset, with any field replaced by `overrides`."""
        if name not in PRESETS:
            known = ", ".join(PRESETS)
            raise AtomError(f"unknown model preset {name!r}; known presets: {known}")
        return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]

    def num_parameters(self) -> int:
        """Distinct parameters of the GPT this shapes (the tied embedding counted once),
        without building it."""
        C, b = self.n_embd, int(self.bias)
        norm = C * (1 + b)
        block = 2 * norm + 12 * C * C + b * 9 * C
        return self.vocab_size * C + self.block_size * C + self.n_layer * block + norm


def _gpt3(n_layer: int, n_embd: int, n_head: int) -> GPTConfig:
    # Table 2.1 of the GPT-3 paper; vocabulary padded to a multiple of 64 as in nanoGPT.
    return GPTConfig(
        n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=2048, vocab_size=50304
    )


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=256),
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=256),
    "gpt3-125m": _gpt3(12, 768, 12),
    "gpt3-350m": _gpt3(24, 1024, 16),
    "gpt3-760m": _gpt3(24, 1536, 16),
    "gpt3-1.3b": _gpt3(24, 2048, 32),
    "gpt3-2.7b": _gpt3(32, 2560, 32),
    "gpt3-6.7b": _gpt3(32, 4096, 32),
    "gpt3-13b": _gpt3(40, 5120, 40),  # the paper prints 5140, which 40 heads cannot divide
    "gpt3-175b": _gpt3(96, 12288, 96),
}
"""Named model shapes: `tiny` for tests, `small` for the CPU default, and the GPT-3 family."""
