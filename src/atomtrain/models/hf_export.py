"""Writing a trained model in the transformers format: `atomtrain export RUN --format hf OUT`.

    OUT/config.json, model.safetensors      what AutoModelForCausalLM.from_pretrained(OUT) loads
    OUT/tokenizer.json, tokenizer_config.json   what AutoTokenizer.from_pretrained(OUT) loads

A transformers model is written as it is. Our GPT is written as GPT-2 (`GPT2LMHeadModel`), which
computes the same function: pre-LayerNorm blocks, learned positions, tied embeddings; its `Conv1D`
layers hold the transpose of our Linear weights, the exact GELU replaces GPT-2's tanh approximation,
and a GPT without biases gets zero biases. The byte tokenizer becomes a byte-level BPE without
merges whose ids are the byte values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atomtrain.data.tokenizer import Tokenizer
from atomtrain.errors import AtomError
from atomtrain.models.gpt import GPT
from atomtrain.models.hf import HFCausalLM, quiet_transformers, require_transformers

TOKENIZER_SIDE_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
"""Copied from the fine-tuned model's own directory when it is still there."""


def gpt2_config(model: GPT) -> Any:
    transformers = require_transformers()
    c = model.config
    return transformers.GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        activation_function="gelu",  # torch's exact GELU, as our MLP uses
        resid_pdrop=c.dropout,
        embd_pdrop=c.dropout,
        attn_pdrop=c.dropout,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )


def gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our GPT's parameters under GPT-2's names and layouts."""
    sd = {n: p.detach() for n, p in model.named_parameters()}
    C = model.config.n_embd

    def bias(name: str, size: int) -> torch.Tensor:
        return sd.get(name, torch.zeros(size))

    out = {"transformer.wte.weight": sd["wte.weight"], "transformer.wpe.weight": sd["wpe.weight"]}
    for i in range(model.config.n_layer):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[f"{dst}{ln}.weight"] = sd[f"{src}{ln}.weight"]
            out[f"{dst}{ln}.bias"] = bias(f"{src}{ln}.bias", C)
        for ours, theirs, width in (
            ("attn.qkv", "attn.c_attn", 3 * C),
            ("attn.proj", "attn.c_proj", C),
            ("mlp.fc", "mlp.c_fc", 4 * C),
            ("mlp.proj", "mlp.c_proj", C),
        ):
            out[f"{dst}{theirs}.weight"] = sd[f"{src}{ours}.weight"].t()  # Conv1D: (in, out)
            out[f"{dst}{theirs}.bias"] = bias(f"{src}{ours}.bias", width)
    out["transformer.ln_f.weight"] = sd["ln_f.weight"]
    out["transformer.ln_f.bias"] = bias("ln_f.bias", C)
    return {k: v.contiguous().clone() for k, v in out.items()}


def gpt_as_gpt2(model: GPT) -> nn.Module:
    """A `GPT2LMHeadModel` computing what `model` computes."""
    transformers = require_transformers()
    with quiet_transformers():
        lm = transformers.GPT2LMHeadModel(gpt2_config(model))
    missing, unexpected = lm.load_state_dict(gpt2_state_dict(model), strict=False)
    # lm_head is tied to wte; GPT-2's attention bias buffers are not parameters.
    if unexpected or [k for k in missing if not k.startswith("lm_head")]:
        raise AtomError(f"GPT-2 mapping left out {missing or unexpected}")  # a bug, not bad input
    lm.tie_weights()
    return lm


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the alphabet of byte-level BPE)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def byte_tokenizer_json() -> str:
    """Our byte tokenizer as a `tokenizers` file: byte-level BPE, no merges, id = byte value."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = HFTok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return str(tok.to_str())


def tokenizer_json(tok: Tokenizer) -> str:
    spec = tok.spec()
    if spec.get("kind") == "byte":
        return byte_tokenizer_json()
    text = spec.get("json")
    if not isinstance(text, str):
        raise AtomError(f"cannot export a {spec.get('kind')!r} tokenizer")
    return text


def export_hf(
    model: nn.Module,
    tok: Tokenizer,
    out: Path,
    source_dir: Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `model` and `tok` to `out` in the transformers format; returns `out`."""
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise AtomError(f"{out} already exists and is not empty; pass --overwrite to replace it")
    lm: Any
    if isinstance(model, HFCausalLM):
        lm = model.lm
    elif isinstance(model, GPT):
        lm = gpt_as_gpt2(model)
    else:
        raise AtomError(f"cannot export a {type(model).__name__} in the transformers format")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    config = lm.config
    config.use_cache = True  # for whoever generates with it; training turned it off
    try:
        with quiet_transformers():
            lm.save_pretrained(out, safe_serialization=True)
    finally:
        config.use_cache = False if isinstance(model, HFCausalLM) else config.use_cache
    (out / "tokenizer.json").write_text(tokenizer_json(tok))
    copied = False
    for name in TOKENIZER_SIDE_FILES:
        if source_dir is not None and (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, out / name)
            copied |= name == "tokenizer_config.json"
    if not copied:
        tc = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": int(model.config.block_size),
        }
        (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    return out
