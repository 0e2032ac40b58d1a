"""Tiny transformers models built from configs (nothing downloaded), shared by the HF tests."""

from __future__ import annotations

from typing import Any

VOCAB = 300


def tiny_config(kind: str, layers: int = 6) -> Any:
    import transformers

    common: dict[str, Any] = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 1}
    if kind == "gpt2":
        return transformers.GPT2Config(
            n_embd=32,
            n_layer=layers,
            n_head=2,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    return cls(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **common,
    )
