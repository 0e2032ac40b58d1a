"""Tokenized shards on disk: `prepare` writes them and a manifest, `TokenShards` checks them.

Layout of a prepared directory:

    manifest.json        tokenizer spec, dtype, token counts and sha256 of every shard
    train_000.bin ...    token ids as a flat numpy array (uint16 when the vocabulary allows)
    val_000.bin ...      the held-out validation split
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from atomtrain.data.corpus import read_texts, resolve_sources
from atomtrain.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    tokenizer_from_spec,
)
from atomtrain.errors import AtomError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class PrepareConfig:
    """How `atomtrain data prepare` turns text into shards."""

    tokenizer: str = "byte"
    """`byte` (default), `bpe` (trained on the corpus with the tokenizers package), or a
    transformers model directory (or its `tokenizer.json`) whose tokenizer to use."""
    bpe_vocab_size: int = 4096
    """Vocabulary of a trained BPE tokenizer."""
    val_fraction: float = 0.02
    """Share of the documents held out for validation (at least one window's worth of tokens)."""
    shard_tokens: int = 1 << 24
    """Most tokens per shard file."""
    seed: int = 0
    """Seed of the document shuffle that decides the split."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _make_tokenizer(cfg: PrepareConfig, files: list[Path]) -> Tokenizer:
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "bpe":
        return BPETokenizer.train(files, cfg.bpe_vocab_size)
    if Path(cfg.tokenizer).is_file() or (Path(cfg.tokenizer) / "tokenizer.json").is_file():
        return HFTokenizer.from_dir(Path(cfg.tokenizer))
    raise AtomError(
        f"data.tokenizer must be 'byte', 'bpe' or a directory with a tokenizer.json, "
        f"got {cfg.tokenizer!r}"
    )


def _encode(tok: Tokenizer, text: str) -> np.ndarray:
    if isinstance(tok, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    return np.asarray(tok.encode(text), dtype=np.int64)


def _write_shards(arrays: list[np.ndarray], out: Path, split: str, cfg: PrepareConfig, dtype: str):
    stream = np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype=dtype)
    entries = []
    for i, start in enumerate(range(0, max(len(stream), 1), cfg.shard_tokens)):
        part = stream[start : start + cfg.shard_tokens]
        name = f"{split}_{i:03d}.bin"
        tmp = out / (name + ".tmp")
        part.tofile(tmp)
        os.replace(tmp, out / name)
        entries.append({"file": name, "tokens": len(part), "sha256": sha256_file(out / name)})
    return entries


def check_prepare_target(out: Path, overwrite: bool) -> None:
    """AtomError unless OUT can receive prepared data without changing anything else there."""
    for parent in (out, *out.parents):
        if parent.exists() and not parent.is_dir():
            raise AtomError(f"cannot prepare data into {out}: {parent} is a file, not a directory")
    if (out / MANIFEST).exists():
        if not overwrite:
            raise AtomError(f"{out} already holds prepared data; pass --overwrite to replace it")
    elif out.is_dir() and any(out.iterdir()) and not overwrite:
        raise AtomError(f"{out} is a directory with other files in it; name a new or empty one")


def prepare(src: str, out: Path, cfg: PrepareConfig, overwrite: bool = False) -> dict:
    """Tokenize SRC into shards under OUT and return the manifest written there."""
    if not 0.0 < cfg.val_fraction < 0.5:
        raise AtomError(f"data.val_fraction must be in (0, 0.5), got {cfg.val_fraction}")
    if cfg.tokenizer == "bpe" and not 256 <= cfg.bpe_vocab_size <= 1 << 20:
        raise AtomError(
            f"the BPE vocabulary size must be in 256-{1 << 20}, got {cfg.bpe_vocab_size}"
        )
    check_prepare_target(out, overwrite)
    files = resolve_sources(src)
    out.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(cfg, files)
    docs = [_encode(tok, text + "\n\n") for _, text in read_texts(files)]
    order = list(range(len(docs)))
    random.Random(cfg.seed).shuffle(order)
    total = sum(len(d) for d in docs)
    n_val_tokens, val_idx = 0, set()
    for i in order:  # hold out whole documents until the validation share is met
        if n_val_tokens >= cfg.val_fraction * total:
            break
        val_idx.add(i)
        n_val_tokens += len(docs[i])
    if len(val_idx) == len(docs):  # a single document: split its tail off instead
        whole = np.concatenate(docs)
        cut = int(len(whole) * (1 - cfg.val_fraction))
        train_docs, val_docs = [whole[:cut]], [whole[cut:]]
    else:
        train_docs = [docs[i] for i in order if i not in val_idx]
        val_docs = [docs[i] for i in order if i in val_idx]
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": src,
        "num_documents": len(docs),
        "val_documents": [str(files[i]) for i in sorted(val_idx)]
        if len(val_idx) < len(docs)
        else [],
        "tokenizer": tok.spec(),
        "dtype": dtype,
        "splits": {
            "train": _write_shards(train_docs, out, "train", cfg, dtype),
            "val": _write_shards(val_docs, out, "val", cfg, dtype),
        },
    }
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST)
    return manifest


def _check_entries(splits: object) -> None:
    """The manifest's shard lists: names inside the directory, counts, checksums."""
    if not isinstance(splits, dict):
        raise TypeError("splits must be an object")
    for entries in splits.values():
        if not isinstance(entries, list):
            raise TypeError("a split must be a list of shards")
        for e in entries:
            if not (
                isinstance(e, dict)
                and isinstance(e.get("file"), str)
                and Path(e["file"]).name == e["file"]
                and isinstance(e.get("tokens"), int)
                and e["tokens"] >= 0
                and isinstance(e.get("sha256"), str)
            ):
                raise ValueError("a shard entry is malformed")


class TokenShards:
    """A prepared directory, opened read-only as memmaps after checking it against its manifest."""

    def __init__(self, root: Path, manifest: dict, splits: dict[str, list[np.ndarray]]) -> None:
        self.root = root
        self.manifest = manifest
        self.splits = splits

    @classmethod
    def open(cls, root: Path | str, verify: bool = True) -> TokenShards:
        root = Path(root)
        path = root / MANIFEST
        if not path.is_file():
            raise AtomError(f"{path} is missing; run `atomtrain data prepare SRC {root}` first")
        try:
            manifest = json.loads(path.read_text())
            dtype = np.dtype(manifest["dtype"])
            split_entries = manifest["splits"]
            tokenizer_from_spec(manifest["tokenizer"])
            _check_entries(split_entries)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise AtomError(f"{path} is not a valid shard manifest ({type(e).__name__})") from e
        if manifest.get("format_version") != FORMAT_VERSION:
            raise AtomError(
                f"{path} has format version {manifest.get('format_version')}, "
                f"expected {FORMAT_VERSION}"
            )
        splits: dict[str, list[np.ndarray]] = {}
        for split in ("train", "val"):
            splits[split] = [
                cls._open_shard(root, e, dtype, verify)
                for e in split_entries.get(split, [])
                if e.get("tokens", 0) > 0
            ]
        return cls(root, manifest, splits)

    @staticmethod
    def _open_shard(root: Path, entry: dict, dtype: np.dtype, verify: bool) -> np.ndarray:
        f = root / str(entry.get("file", ""))
        if not f.is_file():
            raise AtomError(f"data shard {f} is missing")
        expected = int(entry["tokens"]) * dtype.itemsize
        if f.stat().st_size != expected:
            raise AtomError(
                f"data shard {f} is corrupt: {f.stat().st_size} bytes, manifest says {expected}"
            )
        if verify and sha256_file(f) != entry.get("sha256"):
            raise AtomError(f"data shard {f} is corrupt: checksum does not match the manifest")
        return np.memmap(f, dtype=dtype, mode="r")

    @property
    def tokenizer(self) -> Tokenizer:
        return tokenizer_from_spec(self.manifest["tokenizer"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    def num_tokens(self, split: str) -> int:
        return sum(len(s) for s in self.splits[split])
