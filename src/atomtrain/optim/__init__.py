"""Optimizers over named host tensors, shared by the plain trainer and the swap engine."""

from atomtrain.optim.adamw import AdamW, AdamWConfig, clip_scale, grad_norm

__all__ = ["AdamW", "AdamWConfig", "clip_scale", "grad_norm"]
