"""Loading a trained model (and its tokenizer) from a run directory or a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from atomtrain.data.tokenizer import Tokenizer, tokenizer_from_spec
from atomtrain.errors import AtomError
from atomtrain.models import GPT, GPTConfig
from atomtrain.train.averaged import saved_average
from atomtrain.train.checkpoint import check_matches, load_checkpoint
from atomtrain.train.session import resolve_resume


def _empty_model(described: object, ckpt_path: Path) -> nn.Module:
    """The model a checkpoint's `state.json` describes, its weights still to be filled in."""
    if isinstance(described, dict) and described.get("kind") == "hf":
        from atomtrain.models.hf import config_from_dict, hf_from_config

        config = described.get("config")
        if not isinstance(config, dict):
            raise AtomError(f"checkpoint {ckpt_path} does not describe its transformers config")
        return hf_from_config(config_from_dict(config), where=str(ckpt_path))
    try:
        mc = GPTConfig(**described)  # type: ignore[arg-type]
    except TypeError as e:
        raise AtomError(f"checkpoint {ckpt_path} does not describe its model shape") from e
    with torch.device("meta"):
        model = GPT(mc)
    model = model.to_empty(device="cpu")
    model.lm_head.weight = model.wte.weight  # to_empty allocates tied tensors apart
    return model


def load_trained(path: Path) -> tuple[nn.Module, Tokenizer, Path]:
    """(model in eval mode on the CPU, tokenizer, checkpoint path) for a run or checkpoint."""
    if not path.exists():
        raise AtomError(f"{path} does not exist")
    run_dir, ckpt_path = resolve_resume(path)
    ckpt = load_checkpoint(ckpt_path)
    if "model" not in ckpt.state:
        raise AtomError(f"checkpoint {ckpt_path} does not describe its model shape")
    try:
        spec = json.loads((run_dir / "tokenizer.json").read_text())
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise AtomError(f"{run_dir}/tokenizer.json is missing or unreadable") from e
    model = _empty_model(ckpt.state["model"], ckpt_path)
    params = dict(model.named_parameters())
    check_matches(ckpt, params)
    # a run with a weight average (train.ema) validated the average: that is its model
    average = saved_average(ckpt.extra, params, ckpt_path) or {}
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(average.get(name, ckpt.params[name]))
    model.eval()
    return model, tokenizer_from_spec(spec), ckpt_path
