"""Causal language models from `transformers`, trained as they are (`pip install atomtrain[hf]`).

    >>> model = load_hf("path/to/llama")             # config.json + safetensors (sharded too)
    >>> model = hf_from_config('{"model_type": "qwen2", "num_hidden_layers": 4}')
    >>> logits, loss = model(idx, targets)           # the interface every runner drives

`HFCausalLM` holds the library's model as `self.lm` and adds nothing but the `(idx, targets) ->
(logits, loss)` call; the decoder layers stay in their own ModuleList (`lm.model.layers`,
`lm.transformer.h`, ...), where the engine finds them. Parameter names are the library's with an
`lm.` prefix, so an export writes them back unchanged. Models are built with `use_cache=False`: a
layer recomputed in the backward must not append to a key/value cache.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atomtrain.errors import AtomError

log = logging.getLogger(__name__)

PREFIX = "lm."
"""What `HFCausalLM` adds in front of the library's parameter names."""

NO_CONTEXT_LIMIT = 1 << 20
"""Context length assumed for architectures whose config names none (rotary without a limit)."""


def require_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise AtomError(
            "transformers models need the `hf` extra: pip install 'atomtrain[hf]'"
        ) from None
    return transformers


@dataclass(frozen=True)
class HFShape:
    """What the rest of Atom reads from a model's `config` (as from a GPTConfig)."""

    block_size: int
    """Longest context, in tokens."""
    vocab_size: int
    """Number of token ids."""


def context_length(config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return NO_CONTEXT_LIMIT


class HFCausalLM(nn.Module):
    """A `transformers` causal LM with Atom's call: `(idx, targets) -> (logits, loss)`."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        lm.config.use_cache = False  # type: ignore[union-attr]
        self.lm = lm
        self.config = HFShape(context_length(lm.config), int(lm.config.vocab_size))  # type: ignore[union-attr, arg-type]

    @property
    def hf_config(self) -> Any:
        return self.lm.config

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) and, when targets are given, the mean cross-entropy loss.

        Targets are already shifted (as for our GPT), so the library's own label shift is not used.
        """
        logits = self.lm(input_ids=idx, use_cache=False).logits  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss


def config_to_dict(config: Any) -> dict[str, Any]:
    """The config as plain JSON values (stored in checkpoints, rebuilt by `config_from_dict`)."""
    return dict(json.loads(config.to_json_string(use_diff=False)))


def config_from_dict(values: dict[str, Any]) -> Any:
    transformers = require_transformers()
    kind = values.get("model_type")
    mapping = transformers.models.auto.configuration_auto.CONFIG_MAPPING
    if not isinstance(kind, str) or kind not in mapping:
        raise AtomError(f"unsupported architecture: transformers knows no model_type {kind!r}")
    return mapping[kind].from_dict(values)


def check_causal_lm(config: Any, where: str) -> None:
    """One line when transformers has no causal LM for this config (an encoder, a seq2seq)."""
    transformers = require_transformers()
    if type(config) not in transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise AtomError(
            f"unsupported architecture in {where}: {config.model_type} "
            "has no causal language model in transformers"
        )


def _causal_lm_from_config(config: Any, where: str) -> nn.Module:
    transformers = require_transformers()
    check_causal_lm(config, where)
    config.use_cache = False
    with quiet_transformers():
        return transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", dtype=torch.float32
        )


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def hf_config_from_text(text: str) -> Any:
    """A config from a JSON file's path, inline JSON (`{"model_type": ...}`) or a model_type."""
    transformers = require_transformers()
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            values = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise AtomError(f"model.hf_config is not valid JSON: {e}") from None
        return config_from_dict(values)
    if stripped.endswith(".json") or Path(stripped).is_file():
        try:
            values = json.loads(Path(stripped).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise AtomError(f"model.hf_config: cannot read {stripped}: {e}") from None
        return config_from_dict(values)
    try:
        return transformers.AutoConfig.for_model(stripped)
    except ValueError:
        raise AtomError(
            f"model.hf_config: {stripped!r} is neither a JSON config nor a model_type "
            "transformers knows (e.g. gpt2, llama, qwen2, mistral)"
        ) from None


def hf_from_config(config: Any, seed: int = 0, where: str = "model.hf_config") -> HFCausalLM:
    """A model with fresh weights from a config (an object or what `hf_config_from_text` reads)."""
    if isinstance(config, str):
        config = hf_config_from_text(config)
    torch.manual_seed(seed)
    return HFCausalLM(_causal_lm_from_config(config, where))


def load_hf(path: str | Path) -> HFCausalLM:
    """The model in directory `path`: config.json and its safetensors weights, checked strictly.

    Raises AtomError in one line when `path` is not a model directory, names an architecture that
    is not a causal LM, or holds weights that do not match its config (missing, unexpected or
    differently shaped tensors). A directory without weights is an error too: use
    `--model.hf_config` for fresh weights.
    """
    transformers = require_transformers()
    root = Path(path)
    if not (root / "config.json").is_file():
        raise AtomError(f"{root} is not a transformers model directory (no config.json)")
    try:
        config = transformers.AutoConfig.from_pretrained(root, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise AtomError(
            f"{root}/config.json: unsupported or unreadable config: {_first_line(e)}"
        ) from None
    check_causal_lm(config, str(root))
    if not list(root.glob("*.safetensors")):
        raise AtomError(
            f"{root} holds no safetensors weights (use --model.hf_config for fresh weights)"
        )
    try:
        with quiet_transformers():
            lm, info = transformers.AutoModelForCausalLM.from_pretrained(
                root,
                config=config,
                local_files_only=True,
                use_safetensors=True,
                dtype=torch.float32,
                attn_implementation="sdpa",
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported below, in one line
            )
    except (ValueError, OSError, RuntimeError) as e:
        raise AtomError(f"weights in {root} do not match its config: {_first_line(e)}") from None
    problems = {k: list(v) for k, v in info.items() if v and k in LOADING_PROBLEMS}
    if problems:
        detail = "; ".join(
            f"{LOADING_PROBLEMS[k]} {len(v)} (e.g. {_key_name(v[0])})" for k, v in problems.items()
        )
        raise AtomError(f"weights in {root} do not match its config: {detail}")
    lm.train()
    return HFCausalLM(lm)


LOADING_PROBLEMS = {
    "missing_keys": "missing",
    "unexpected_keys": "unexpected",
    "mismatched_keys": "wrong shape",
    "error_msgs": "errors",
}


def _key_name(entry: object) -> str:
    return str(entry[0]) if isinstance(entry, tuple) else str(entry)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars or load reports on the terminal: the CLI owns it, errors are ours."""
    tl = require_transformers().utils.logging
    level = tl.get_verbosity()
    tl.set_verbosity_error()
    tl.disable_progress_bar()
    try:
        yield
    finally:
        tl.set_verbosity(level)
        tl.enable_progress_bar()


def hf_tokenizer_file(path: str | Path) -> Path | None:
    """The directory's `tokenizer.json` (the `tokenizers` format), if it has one."""
    f = Path(path) / "tokenizer.json"
    return f if f.is_file() else None
