"""Loading a trained model (and its tokenizer) from a run directory or a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from atomtrain.data.tokenizer import Tokenizer, tokenizer_from_spec
from atomtrain.errors import AtomError
from atomtrain.models import GPT, GPTConfig
from atomtrain.train.checkpoint import check_matches, load_checkpoint
from atomtrain.train.session import resolve_resume


def load_trained(path: Path) -> tuple[GPT, Tokenizer, Path]:
    """(model in eval mode on the CPU, tokenizer, checkpoint path) for a run or checkpoint."""
    if not path.exists():
        raise AtomError(f"{path} does not exist")
    run_dir, ckpt_path = resolve_resume(path)
    ckpt = load_checkpoint(ckpt_path)
    try:
        mc = GPTConfig(**ckpt.state["model"])
    except (KeyError, TypeError) as e:
        raise AtomError(f"checkpoint {ckpt_path} does not describe its model shape") from e
    try:
        spec = json.loads((run_dir / "tokenizer.json").read_text())
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise AtomError(f"{run_dir}/tokenizer.json is missing or unreadable") from e
    with torch.device("meta"):
        model = GPT(mc)
    model = model.to_empty(device="cpu")
    model.lm_head.weight = model.wte.weight  # to_empty allocates tied tensors apart
    params = dict(model.named_parameters())
    check_matches(ckpt, params)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(ckpt.params[name])
    model.eval()
    return model, tokenizer_from_spec(spec), ckpt_path
