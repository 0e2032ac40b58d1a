"""The swap engine as a StepRunner: passes through the engine, the optimizer on the host.

The optimizer steps each sub-model on a host thread as soon as that is exact: without clipping,
right when the sub-model's gradients are final (overlapping the backward of earlier sub-models);
with clipping, once the global norm is known, in forward order, overlapping the next step's
forward, whose load of a sub-model waits for that sub-model's step.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from atomtrain.engine.engine import SwapEngine
from atomtrain.optim import AdamW, clip_scale, grad_norm
from atomtrain.train.runner import split_rows


class SwapRunner:
    def __init__(
        self, engine: SwapEngine, optimizer: AdamW, micro_batch_rows: int, grad_clip: float
    ) -> None:
        self.engine = engine
        self.optimizer = optimizer
        self.micro = micro_batch_rows
        self.grad_clip = grad_clip
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="atom-optim")
        self._lr = 0.0
        self._overlap = False
        self.names = [list(names.values()) for names in engine.block_param_names]
        self.submodel_names = [
            [n for i in s.blocks for n in self.names[i]] for s in engine.plan.submodels
        ]
        engine.on_grads_ready = self._grads_ready

    def _schedule(self, k: int, names: list[str], scale: float, wait: list[Future]) -> None:
        lr = self._lr

        def step() -> None:
            for f in wait:
                f.result()
            self.optimizer.step(names, lr, scale)
            self.engine.refresh_staging(names)
            self.engine.trace.record("opt_step", k)

        self.engine.gates[k] = self.pool.submit(step)

    def _grads_ready(self, k: int, futures: list[Future]) -> None:
        if self._overlap:
            self._schedule(k, self.submodel_names[k], 1.0, futures)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> dict[str, float]:
        self.engine.model.train()
        self._lr = lr
        self._overlap = self.grad_clip <= 0
        rows = self.micro * self.engine.plan.micro_batches_per_load
        parts = split_rows(x, y, rows)
        total = 0.0
        for j, (xp, yp) in enumerate(parts):
            w = len(xp) / len(x)
            loss = self.engine.run_pass(xp, yp, w, first=j == 0, final=j == len(parts) - 1)
            total += loss * w
        self.engine.finish_step()
        params = self.engine.host_params
        norm = grad_norm({n: p.grad for n, p in params.items() if p.grad is not None})
        if math.isfinite(norm):
            scale = clip_scale(norm, self.grad_clip)
            if not self._overlap:
                for k, names in enumerate(self.submodel_names):
                    self._schedule(k, names, scale, [])
            self._schedule(-1, self.engine.outer_param_names, scale, [])
        return {"loss": total, "grad_norm": norm}

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.engine.model.eval()
        return self.engine.forward_loss(x, y)

    def sync(self) -> None:
        for fut in list(self.engine.gates.values()):
            fut.result()

    def host_parameters(self) -> dict[str, torch.Tensor]:
        self.sync()
        return dict(self.engine.model.named_parameters())

    def close(self) -> None:
        self.sync()
        self.pool.shutdown(wait=True)
        self.engine.close()
