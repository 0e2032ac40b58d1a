"""`atomtrain sample RUN`: continue a prompt with a trained model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads when a sample is drawn, not with every command
    from torch import nn

    from atomtrain.data.tokenizer import Tokenizer


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="generate text from a run directory or checkpoint")
    p.add_argument("path", type=Path, help="run directory or checkpoint directory")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 decodes greedily")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def sample_text(
    model: nn.Module,
    tok: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int = 0,
) -> str:
    import torch

    from atomtrain.models import generate

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = tok.encode(prompt) or [0]
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = generate(model, idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=gen)
    model.train(was_training)
    return tok.decode(out[0].tolist())


def run(args: argparse.Namespace, _extra: list[str]) -> int:
    from atomtrain.errors import AtomError
    from atomtrain.train.loading import load_trained
    from atomtrain.values import check_number, check_seed

    if args.tokens <= 0:
        raise AtomError("--tokens must be positive")
    check_number(args.temperature, "--temperature", 0.0)
    if args.top_k is not None and args.top_k < 0:
        raise AtomError(f"--top-k must be 0 (no limit) or positive, got {args.top_k}")
    check_seed(args.seed, "--seed")
    model, tok, _ = load_trained(args.path)
    top_k = args.top_k or None
    print(sample_text(model, tok, args.prompt, args.tokens, args.temperature, top_k, args.seed))
    return 0
