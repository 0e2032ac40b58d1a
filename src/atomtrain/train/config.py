"""The trainer's own settings."""

from __future__ import annotations

from dataclasses import dataclass

from atomtrain.errors import AtomError


@dataclass(frozen=True)
class TrainConfig:
    """Optimization and bookkeeping of one training run."""

    steps: int = 600
    """Optimizer steps to run in total."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 30
    """Linear warmup from 0 to `lr`."""
    micro_batch_rows: int = 16
    """Sequences per forward/backward pass; `data.rows` must be a multiple (accumulation)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping)."""
    eval_interval: int = 100
    """Steps between validation losses (the last step is always evaluated)."""
    eval_batches: int = 4
    """Validation batches averaged for each validation loss."""
    eval_rows: int = 0
    """Sequences per validation batch (0: `data.rows`). Runs that train on different batch
    sizes validate on the same windows when they set the same `eval_rows`."""
    checkpoint_interval: int = 200
    """Steps between checkpoints (the last step always writes one)."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept on disk."""
    seed: int = 0
    """Seed of the initial weights and of dropout."""
    ema: float = 0.0
    """Decay of a moving average of the weights kept beside them (0: none; 0.98 averages about
    the last 50 steps). With it, validation losses are the average's, checkpoints carry it and
    `export` and `sample` use it: train/averaged.py. It costs one float32 copy of the model
    (counted by the swap engine's host check, and by `atomtrain plan --weight-average`) and a
    pass over it per step; with the swap engine that pass runs on the host optimizer's thread
    as each sub-model is stepped, so the next forward still overlaps it."""
    ema_every: int = 1
    """Update the weight average after every this many steps, by ema**ema_every: that many
    times fewer passes over the model, for an average that lags up to ema_every - 1 steps."""

    def __post_init__(self) -> None:
        positive = (
            "steps",
            "micro_batch_rows",
            "eval_interval",
            "eval_batches",
            "checkpoint_interval",
            "keep_checkpoints",
            "ema_every",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise AtomError(f"train.{name} must be positive, got {getattr(self, name)}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise AtomError(
                f"train.lr must be positive and train.min_lr in [0, lr], "
                f"got lr={self.lr}, min_lr={self.min_lr}"
            )
        if not 0.0 <= self.ema < 1.0:
            raise AtomError(f"train.ema must be in [0, 1), got {self.ema}")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.eval_rows < 0:
            raise AtomError(
                "train.warmup_steps, train.grad_clip and train.eval_rows must not be negative"
            )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay from `lr` to `min_lr` at `steps`."""
    import math

    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
