"""`atomtrain data prepare SRC OUT`: tokenize text into shards with a manifest."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="prepare training data")
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    p = dsub.add_parser("prepare", help="tokenize SRC (file, directory, glob or `stdlib`) into OUT")
    p.add_argument("src", help="a text file, a directory, a glob, or `stdlib`")
    p.add_argument("out", type=Path, help="directory for the shards and manifest.json")
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="byte, bpe (trained here), or a transformers model directory with a tokenizer.json",
    )
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    p.add_argument("--val-fraction", type=float, default=0.02)
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=run_prepare)


def run_prepare(args: argparse.Namespace, _extra: list[str]) -> int:
    from atomtrain.data.shards import PrepareConfig, check_prepare_target, prepare
    from atomtrain.errors import AtomError

    if not 256 <= args.vocab_size <= 1 << 20:  # the byte alphabet is 256 tokens
        raise AtomError(f"--vocab-size must be in 256-{1 << 20}, got {args.vocab_size}")
    check_prepare_target(args.out, args.overwrite)
    cfg = PrepareConfig(
        tokenizer=args.tokenizer, bpe_vocab_size=args.vocab_size, val_fraction=args.val_fraction
    )
    m = prepare(args.src, args.out, cfg, overwrite=args.overwrite)
    train = sum(e["tokens"] for e in m["splits"]["train"])
    val = sum(e["tokens"] for e in m["splits"]["val"])
    print(
        f"{args.out}: {m['num_documents']} documents, {train:,} training and {val:,} validation "
        f"tokens ({m['tokenizer']['kind']} tokenizer, vocabulary {m['tokenizer']['vocab_size']})"
    )
    return 0
