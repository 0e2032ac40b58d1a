"""What the planner knows about a model on a device: per-block costs and link bandwidth.

A profile is either measured (`measure.py`: the real blocks timed on the device, the bytes
autograd saves counted, cached as JSON keyed by model, batch and device) or analytic
(`analytic_profile`: FLOPs and bytes from the model's shape and a device's stated speed), so
`atomtrain plan` plans a GPT-3 175B from its shape alone, without torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class BlockCost:
    """One block, for one micro-batch."""

    fwd_s: float
    """Forward time."""
    bwd_s: float
    """Backward time (given the saved activations)."""
    param_bytes: int
    """Parameters and buffers at the device dtype."""
    grad_bytes: int
    """Gradients at the device dtype."""
    input_bytes: int
    """The block's input activation (what recomputation saves)."""
    saved_bytes: int
    """Activations autograd saves inside the block, parameters excluded."""


@dataclass(frozen=True)
class ModelProfile:
    blocks: tuple[BlockCost, ...]
    outer_param_bytes: int
    """Embeddings, final norm, head: resident for the whole step."""
    outer_grad_bytes: int
    outer_saved_bytes: int
    """Activations the outer part saves, per micro-batch (the logits dominate)."""
    outer_fwd_s: float
    outer_bwd_s: float
    h2d_bytes_per_s: float
    """Host-to-device bandwidth."""
    d2h_bytes_per_s: float
    """Device-to-host bandwidth."""
    micro_batch_rows: int
    seq_len: int
    device: str
    measured: bool
    notes: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        d = json.loads(text)
        d["blocks"] = tuple(BlockCost(**b) for b in d["blocks"])
        return cls(**d)

    @property
    def model_param_bytes(self) -> int:
        return self.outer_param_bytes + sum(b.param_bytes for b in self.blocks)


# ----- analytic ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSpec:
    """A device as the analytic profile sees it."""

    memory_bytes: int
    tflops: float = 80.0
    """Dense bf16 matmul throughput actually reached (about half of a 4090's or 3090's peak)."""
    h2d_gbps: float = 25.0
    """Host-to-device GB/s (PCIe 4.0 x16 in practice)."""
    d2h_gbps: float = 25.0
    name: str = "gpu"


def analytic_profile(
    model_cfg: object, rows: int, seq_len: int, dev: DeviceSpec, dtype_bytes: int = 2
) -> ModelProfile:
    """A GPT's costs from its shape: 2 FLOPs per parameter per token forward, twice that
    backward, plus causal attention; activations as in Korthikanti et al. with fused attention
    (34 bytes per token and channel in 16-bit, no T×T term)."""
    C, L, V = model_cfg.n_embd, model_cfg.n_layer, model_cfg.vocab_size  # type: ignore[attr-defined]
    tokens = rows * seq_len
    block_params = 12 * C * C + 13 * C
    fwd_flops = 2 * block_params * tokens + 2 * rows * seq_len * seq_len * C
    speed = dev.tflops * 1e12
    block = BlockCost(
        fwd_s=fwd_flops / speed,
        bwd_s=2 * fwd_flops / speed,
        param_bytes=block_params * dtype_bytes,
        grad_bytes=block_params * dtype_bytes,
        input_bytes=tokens * C * dtype_bytes,
        saved_bytes=17 * tokens * C * dtype_bytes,
    )
    outer_params = V * C + model_cfg.block_size * C + 2 * C  # type: ignore[attr-defined]
    head_flops = 2 * V * C * tokens
    return ModelProfile(
        blocks=(block,) * L,
        outer_param_bytes=outer_params * dtype_bytes,
        outer_grad_bytes=outer_params * dtype_bytes,
        outer_saved_bytes=tokens * V * 4 * 2 + tokens * C * dtype_bytes,
        outer_fwd_s=head_flops / speed,
        outer_bwd_s=2 * head_flops / speed,
        h2d_bytes_per_s=dev.h2d_gbps * 1e9,
        d2h_bytes_per_s=dev.d2h_gbps * 1e9,
        micro_batch_rows=rows,
        seq_len=seq_len,
        device=dev.name,
        measured=False,
        notes={"source": f"analytic: {dev.tflops} TFLOP/s, {dev.h2d_gbps} GB/s host-to-device"},
    )
