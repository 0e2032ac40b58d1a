"""Optimizers over named host tensors, shared by the plain trainer and the swap engine."""

from atomtrain.optim.adamw import AdamW, AdamWConfig, clip_scale, grad_norm
from atomtrain.optim.scaler import LossScaler

__all__ = ["AdamW", "AdamWConfig", "LossScaler", "clip_scale", "grad_norm"]
