"""Tokenizers: byte-level by default (nothing to download or train), BPE trained locally.

A tokenizer describes itself with `spec()`, a small dict stored in a shard manifest, from which
`tokenizer_from_spec` rebuilds it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from atomtrain.errors import AtomError


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def spec(self) -> dict[str, object]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def spec(self) -> dict[str, object]:
        return {"kind": "byte", "vocab_size": 256}


class BPETokenizer:
    """Byte-level BPE from the `tokenizers` package, trained on the corpus itself."""

    def __init__(self, tok: object) -> None:
        self._tok = tok
        self.vocab_size: int = tok.get_vocab_size()  # type: ignore[attr-defined]

    @classmethod
    def train(cls, files: list[Path], vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train([str(f) for f in files], trainer)
        return cls(tok)

    @classmethod
    def from_json(cls, text: str) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_str(text))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)  # type: ignore[attr-defined]

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))  # type: ignore[attr-defined]

    def spec(self) -> dict[str, object]:
        return {
            "kind": "bpe",
            "vocab_size": self.vocab_size,
            "json": self._tok.to_str(),  # type: ignore[attr-defined]
        }


class HFTokenizer(BPETokenizer):
    """A transformers model's own tokenizer (its `tokenizer.json`), read by `tokenizers`.

    Special tokens are not added when encoding a corpus (documents are joined as they are) and
    are left out when decoding.
    """

    @classmethod
    def from_dir(cls, path: Path) -> HFTokenizer:
        from tokenizers import Tokenizer as HFTok

        f = path / "tokenizer.json" if path.is_dir() else path
        try:
            return cls(HFTok.from_file(str(f)))
        except Exception as e:  # the tokenizers package raises its own exception types
            raise AtomError(f"{f} is not a readable tokenizer.json: {e}") from None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)  # type: ignore[attr-defined]

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))  # type: ignore[attr-defined]

    def spec(self) -> dict[str, object]:
        return {**super().spec(), "kind": "hf"}


def tokenizer_from_spec(spec: dict[str, object]) -> Tokenizer:
    """Rebuild the tokenizer a manifest describes."""
    kind = spec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind in ("bpe", "hf") and isinstance(spec.get("json"), str):
        cls = HFTokenizer if kind == "hf" else BPETokenizer
        try:
            return cls.from_json(str(spec["json"]))
        except Exception as e:  # the tokenizers package raises its own exception types
            raise AtomError(f"manifest holds an unreadable BPE tokenizer: {e}") from e
    raise AtomError(f"manifest names an unknown tokenizer: {json.dumps(kind)}")
