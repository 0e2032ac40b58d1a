"""Data: tokenizers, tokenized shards on disk, and the deterministic resumable loader."""

from atomtrain.data.loader import LoaderConfig, TrainLoader, WindowSampler, validation_batches
from atomtrain.data.shards import PrepareConfig, TokenShards, prepare
from atomtrain.data.tokenizer import BPETokenizer, ByteTokenizer, tokenizer_from_spec

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "LoaderConfig",
    "PrepareConfig",
    "TokenShards",
    "TrainLoader",
    "WindowSampler",
    "prepare",
    "tokenizer_from_spec",
    "validation_batches",
]
