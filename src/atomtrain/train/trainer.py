"""The training loop. It knows nothing about GPT, devices or swapping: it drives a StepRunner."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from atomtrain.data.loader import TrainLoader
from atomtrain.data.reuse import EchoingLoader
from atomtrain.train.averaged import WeightAverage
from atomtrain.train.checkpoint import checkpoint_name, prune_checkpoints, save_checkpoint
from atomtrain.train.config import TrainConfig, lr_at
from atomtrain.train.metrics import MetricsLog
from atomtrain.train.runner import StepRunner

log = logging.getLogger(__name__)

StepHook = Callable[[dict[str, Any]], None]


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps completed."""
    tokens: int = 0
    """Training tokens consumed."""
    schedule_offset: int = 0
    """Added to `step` for the learning-rate schedule: a peer that joined a swarm follows the
    swarm's progress, not its own step count."""


@dataclass
class Trainer:
    runner: StepRunner
    loader: TrainLoader | EchoingLoader
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    cfg: TrainConfig
    run_dir: Path
    checkpoint_extra: dict[str, Any] = field(default_factory=dict)
    """Added to every checkpoint's state.json (the run config, the model shape)."""
    on_step: StepHook | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    """Set it (e.g. from a signal handler) to end after the current step with a checkpoint."""
    state: TrainState = field(default_factory=TrainState)
    after_step: Callable[[TrainState, dict[str, Any]], None] | None = None
    """Called after each optimizer step with its metrics record, before validation and
    checkpoints (the peer runtime runs its rounds here and adds to the record)."""
    extra_state: Callable[[], tuple[dict[str, Any], dict[str, torch.Tensor]]] | None = None
    step_context: Callable[[], AbstractContextManager[Any]] = nullcontext
    """Entered around each optimizer step (the device scheduler's, when serving beside)."""
    """More state for checkpoints: JSON fields and tensors (the peer runtime's)."""

    tensorboard: bool = False
    """Also write TensorBoard event files to run_dir/tensorboard."""
    average: WeightAverage | None = None
    """The weights' moving average (`train.ema`): updated after every `train.ema_every`-th
    step (a swarm round included; with the swap engine, on its optimizer thread as each
    sub-model is stepped, and a round's change from the next step on), validated in place of
    the weights, saved with them."""

    def __post_init__(self) -> None:
        board = self.run_dir / "tensorboard" if self.tensorboard else None
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", board)

    def evaluate(self) -> float:
        """The mean validation loss of the weights, or of their moving average with one."""
        with self.averaged_weights():
            return self._validate()

    def averaged_weights(self) -> AbstractContextManager[None]:
        """Inside it the model holds the weights' moving average, if the run keeps one (what it
        validates and samples from); the weights themselves after it."""
        if self.average is None:
            return nullcontext()
        params = self.runner.host_parameters()  # waits for any optimizer step still running
        return self.average.swapped_in(params, self.runner.parameters_written)

    def adopt_average(self) -> bool:
        """The weights become their average (before a swarm's last round, which then averages
        the peers' averages); False: the run keeps none."""
        if self.average is None:
            return False
        self.average.adopt(self.runner.host_parameters())
        self.runner.parameters_written()
        return True

    def shift_average(self, shift: Callable[[Mapping[str, torch.Tensor]], None]) -> None:
        """The weights were moved by `shift` (a swarm's re-synchronization, which keeps the local
        progress): the average moves by the same, its history kept."""
        if self.average is not None:
            self.runner.host_parameters()  # waits for any optimizer step still running
            shift(self.average.shadow)

    def restart_average(self) -> None:
        """The weights were replaced (the peer runtime's downloads, a swarm's last round): the
        average starts again from them."""
        if self.average is not None:
            self.average.restart(self.runner.host_parameters())

    def _validate(self) -> float:
        losses = [self.runner.eval_loss(x, y) for x, y in self.val_batches]
        return sum(losses) / max(len(losses), 1)

    def fit(self) -> TrainState:
        """Train from `state.step` to `cfg.steps`, or until `stop` is set."""
        start_time = time.perf_counter()
        start_tokens = self.state.tokens
        if self.state.step == 0:  # the initial weights' loss: compute on the run's clock too
            val = self.evaluate()
            elapsed = time.perf_counter() - start_time
            self.metrics.write(
                {"step": 0, "val_loss": val, "eval_s": elapsed, "elapsed_s": elapsed}
            )
        # the swap engine updates the average as its optimizer steps each sub-model (a runner's
        # `stepped`); any other runner, after the whole step
        followed = self.average is not None and hasattr(self.runner, "stepped")
        params = self.runner.host_parameters() if followed else {}
        while self.state.step < self.cfg.steps and not self.stop.is_set():
            if followed and self.average is not None and self.average.due(self.state.step + 1):
                self.runner.stepped = self.average.follow(params)  # type: ignore[attr-defined]
            record = self._one_step()
            elapsed = time.perf_counter() - start_time
            record["tokens_per_s"] = (self.state.tokens - start_tokens) / max(elapsed, 1e-9)
            record["elapsed_s"] = elapsed
            if self.after_step:
                self.after_step(self.state, record)
            if self.average is not None and not followed and self.average.due(self.state.step):
                self.average.update(self.runner.host_parameters())
            last = self.state.step == self.cfg.steps
            if self.state.step % self.cfg.eval_interval == 0 or last:
                t_eval = time.perf_counter()
                record["val_loss"] = self.evaluate()
                record["eval_s"] = time.perf_counter() - t_eval
            self.metrics.write(record)
            if self.on_step:
                self.on_step(record)
            if self.state.step % self.cfg.checkpoint_interval == 0 and not last:
                self.save()
        self.save()
        self.metrics.close()
        return self.state

    def _one_step(self) -> dict[str, Any]:
        x, y = self.loader.next_batch()
        lr = lr_at(self.state.step + self.state.schedule_offset, self.cfg)
        t0 = time.perf_counter()
        with self.step_context():
            out = self.runner.train_step(x, y, lr)
        out["step_s"] = time.perf_counter() - t0  # compute time: busy fraction = sum / wall
        record_loss = getattr(self.loader, "record_loss", None)
        if record_loss is not None:  # data echoing weighs what its echoes are still worth
            record_loss(out["loss"])
        if not math.isfinite(out["grad_norm"]):
            log.warning("step %d: non-finite gradient norm, update skipped", self.state.step)
        self.state.step += 1
        self.state.tokens += x.numel()
        record = {
            "step": self.state.step,
            "lr": lr,
            "tokens": self.state.tokens,
            "tokens_step": x.numel(),
            **out,
        }
        stats = getattr(self.loader, "stats", None)
        if stats is not None:  # data echoing reports its echo factor
            record.update(stats())
        return record

    def save(self) -> Path:
        """A checkpoint of the current step (an existing one for this step is kept as it is)."""
        path = self.run_dir / "checkpoints" / checkpoint_name(self.state.step)
        if path.exists():
            return path
        params = self.runner.host_parameters()  # waits for the optimizer (and average) first
        state = {
            "step": self.state.step,
            "tokens": self.state.tokens,
            "schedule_offset": self.state.schedule_offset,
            "loader": self.loader.state_dict(),
            **self.checkpoint_extra,
        }
        tensors: dict[str, torch.Tensor] = {}
        if self.extra_state is not None:
            fields, tensors = self.extra_state()
            state.update(fields)
        if self.average is not None:
            tensors = {**tensors, **self.average.state()}
            state["ema_updates"] = self.average.updates
        save_checkpoint(
            path,
            params,
            self.runner.optimizer.state_dict(),
            state,
            extra=tensors,
        )
        prune_checkpoints(self.run_dir, self.cfg.keep_checkpoints)
        return path
