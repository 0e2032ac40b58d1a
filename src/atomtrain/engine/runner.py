"""The swap engine as a StepRunner: passes through the engine, the optimizer on the host.

A step is exact only once the whole backward is done: a non-finite gradient anywhere skips the
step everywhere (as the plain runner does), and clipping scales every gradient by the global
norm. So the runner validates first (global norm finite, clip factor), then steps the outer part
and the sub-models on a host thread in the order the next forward needs them: the next step's
forward overlaps their optimizer steps, its load of sub-model k waiting only for k's step.

`stats` says how much of the optimizer's time the compute thread actually waited for.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from atomtrain.engine.engine import SwapEngine
from atomtrain.optim import AdamW, clip_scale, grad_norm
from atomtrain.optim.scaler import LossScaler
from atomtrain.train.runner import split_rows


@dataclass
class OptimizerStats:
    """Host optimizer time, and the part of it the training thread waited for."""

    optimizer_s: float = 0.0
    """Seconds the optimizer thread spent stepping."""
    waited_s: float = 0.0
    """Seconds the training thread waited for an optimizer step (loads gated on a step, the
    outer part's step, `sync`)."""
    average_s: float = 0.0
    """Seconds the optimizer thread spent updating the weight average (train.ema; not in
    optimizer_s)."""

    @property
    def overlap_fraction(self) -> float:
        """Share of the optimizer's time hidden behind training (1: all of it)."""
        if self.optimizer_s <= 0:
            return 0.0
        return max(0.0, 1.0 - self.waited_s / self.optimizer_s)


class SwapRunner:
    def __init__(
        self,
        engine: SwapEngine,
        optimizer: AdamW,
        micro_batch_rows: int,
        grad_clip: float,
        scaler: LossScaler | None = None,
    ) -> None:
        self.engine = engine
        self.optimizer = optimizer
        self.micro = micro_batch_rows
        self.grad_clip = grad_clip
        self.scaler = scaler or LossScaler.for_precision(engine.cfg.precision)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="atom-optim")
        self.stats = OptimizerStats()
        self.names = [list(names.values()) for names in engine.block_param_names]
        self.submodel_names = [
            [n for i in s.blocks for n in self.names[i]] for s in engine.plan.submodels
        ]
        self.stepped: Callable[[list[str]], None] | None = None
        """Told, on the optimizer thread, the names of the parameters each optimizer step of the
        next train_step wrote, after each (the trainer's weight average, train.ema: updated
        there, it does not make the next forward wait for the last step; each update runs as
        its own task after its step's, so a load gated on that step does not wait for it)."""
        self._updates: list[Future] = []  # those tasks, which `sync` waits for too

    def _schedule(
        self,
        k: int,
        names: list[str],
        lr: float,
        scale: float,
        stepped: Callable[[list[str]], None] | None,
    ) -> None:
        def step() -> None:
            t0 = time.perf_counter()
            self.optimizer.step(names, lr, scale)
            self.engine.refresh_staging(names)
            self.stats.optimizer_s += time.perf_counter() - t0
            self.engine.trace.record("opt_step", k)

        self.engine.gates[k] = self.pool.submit(step)
        if stepped is not None:
            self._follow(stepped, names)

    def _follow(self, stepped: Callable[[list[str]], None], names: list[str]) -> None:
        """The average's update of `names`, queued after every optimizer task so far."""
        self._updates = [f for f in self._updates if not f.done()]
        self._updates.append(self.pool.submit(self._update_average, stepped, names))

    def _update_average(self, stepped: Callable[[list[str]], None], names: list[str]) -> None:
        t0 = time.perf_counter()
        stepped(names)
        self.stats.average_s += time.perf_counter() - t0

    def train_step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> dict[str, float]:
        stepped, self.stepped = self.stepped, None  # this step's only, even if it fails
        self.engine.model.train()
        rows = self.micro * self.engine.plan.micro_batches_per_load
        parts = split_rows(x, y, rows)
        loss_scale = self.scaler.scale
        total = 0.0
        for j, (xp, yp) in enumerate(parts):
            w = len(xp) / len(x)
            loss = self.engine.run_pass(
                xp, yp, w * loss_scale, first=j == 0, final=j == len(parts) - 1
            )
            total += loss * w
        self.engine.finish_step()
        params = self.engine.host_params
        scaled = grad_norm({n: p.grad for n, p in params.items() if p.grad is not None})
        norm = scaled / loss_scale
        finite = math.isfinite(norm)
        self.scaler.update(finite)
        if finite:
            scale = clip_scale(norm, self.grad_clip) / loss_scale
            # The outer part first: the next forward starts with it.
            self._schedule(-1, self.engine.outer_param_names, lr, scale, stepped)
            for k, names in enumerate(self.submodel_names):
                self._schedule(k, names, lr, scale, stepped)
        elif stepped is not None:  # a skipped step: the average follows the unchanged weights
            self._follow(stepped, list(self.engine.host_params))
        self.stats.waited_s = self.engine.gate_wait_s
        return {"loss": total, "grad_norm": norm}

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.engine.model.eval()
        return self.engine.forward_loss(x, y)

    def sync(self) -> None:
        t0 = time.perf_counter()
        for fut in [*self.engine.gates.values(), *self._updates]:
            fut.result()
        self._updates.clear()
        self.engine.gate_wait_s += time.perf_counter() - t0
        self.stats.waited_s = self.engine.gate_wait_s

    def host_parameters(self) -> dict[str, torch.Tensor]:
        self.sync()
        return dict(self.engine.model.named_parameters())

    def parameters_written(self) -> None:
        """Low-precision staging copies (engine.param_dtype) are what loads copy from: an
        evaluation or a step after the masters were written elsewhere must not read old ones."""
        self.sync()
        self.engine.refresh_staging(list(self.engine.host_params))

    def close(self) -> None:
        self.sync()
        self.pool.shutdown(wait=True)
        self.engine.close()
