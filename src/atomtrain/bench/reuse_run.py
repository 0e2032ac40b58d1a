"""One timed training run of the reuse benchmark, and the loss curve made from its snapshots."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from atomtrain.data.reuse import EchoingLoader, ReuseConfig
from atomtrain.data.stream import StreamConfig, StreamingSource
from atomtrain.models import GPT, GPTConfig
from atomtrain.optim import AdamW, AdamWConfig
from atomtrain.train.runner import PlainRunner
from atomtrain.train.session import REUSE_SLACK

if TYPE_CHECKING:
    from atomtrain.bench.reuse import ReuseBenchConfig


@dataclass
class Snapshot:
    time_s: float
    """Since the run's launch."""
    fresh: int
    echoed: int
    params: dict[str, torch.Tensor]


@dataclass
class RunTrace:
    snapshots: list[Snapshot] = field(default_factory=list)
    steps: int = 0
    fresh: int = 0
    step_s: float = 0.0
    """Median time of one step's compute (at full speed: with its batch, which is ready)."""
    upstream_s: float = 0.0
    """Wall time per fresh batch."""
    echo_loss_gap: float | None = None
    """Mean training loss of an echoed batch less that of the fresh batch before it (negative:
    the model has begun to fit the rows it sees again)."""


@dataclass(frozen=True)
class Point:
    time_s: float
    fresh: float
    echoed: float
    loss: float


def _model(cfg: ReuseBenchConfig) -> GPT:
    return GPT(
        GPTConfig(
            n_layer=cfg.n_layer,
            n_embd=cfg.n_embd,
            n_head=cfg.n_head,
            block_size=cfg.seq_len,
            vocab_size=256,
        )
    )


def _loader(
    cfg: ReuseBenchConfig, files: list[Path], seed: int, rate: float, reuse: bool
) -> EchoingLoader:
    stream = StreamConfig(
        rows=cfg.rows, chunk_len=cfg.seq_len + 1 + REUSE_SLACK, seed=seed, rate_tokens_per_s=rate
    )
    echo = ReuseConfig(enabled=reuse, max_echo=cfg.max_echo, seq_len=cfg.seq_len, seed=seed)
    return EchoingLoader(StreamingSource(files, stream), echo)


def train_run(
    cfg: ReuseBenchConfig,
    files: list[Path],
    seed: int,
    rate: float,
    reuse: bool,
    budget_s: float,
    step_s: float | None = None,
    steps: int = 0,
) -> RunTrace:
    """Train from launch until `budget_s` (at full speed, `rate` 0: `steps` steps),
    snapshotting every `snapshot_fresh` batches' worth of time (at full speed: steps)."""
    launch = time.perf_counter()
    torch.manual_seed(seed)
    model = _model(cfg)
    runner = PlainRunner(
        model,
        AdamW(dict(model.named_parameters()), AdamWConfig()),
        cfg.rows,
        1.0,
        torch.device("cpu"),
    )
    loader = _loader(cfg, files, seed, rate, reuse)
    every_s = cfg.snapshot_fresh * cfg.input_slowdown * step_s if step_s else None
    trace, durations, gaps = RunTrace(), [], []
    fresh_loss = float("nan")
    next_snap = every_s
    try:
        while True:
            now = time.perf_counter() - launch
            if every_s is None and trace.steps % cfg.snapshot_fresh == 0 and trace.steps:
                _snapshot(trace, model, loader, now)
            elif next_snap is not None and now >= next_snap:
                _snapshot(trace, model, loader, now)
                next_snap += every_s  # type: ignore[operator]
            if now >= budget_s or (every_s is None and trace.steps >= steps):
                break
            t0 = time.perf_counter()
            fresh_before = loader.fresh
            x, y = loader.next_batch()
            t1 = time.perf_counter()
            lr = cfg.lr * min(1.0, (trace.steps + 1) / cfg.warmup_steps)
            loss = runner.train_step(x, y, lr)["loss"]
            durations.append(time.perf_counter() - (t0 if every_s is None else t1))
            trace.steps += 1
            loader.record_loss(loss)
            if loader.fresh > fresh_before:
                fresh_loss = loss
            else:
                gaps.append(loss - fresh_loss)
        trace.fresh = loader.fresh
        wall = time.perf_counter() - launch
    finally:
        loader.close()
    trace.step_s = statistics.median(durations) if durations else 0.0
    trace.upstream_s = wall / max(trace.fresh, 1)
    trace.echo_loss_gap = statistics.fmean(gaps) if gaps else None
    return trace


def _snapshot(trace: RunTrace, model: GPT, loader: EchoingLoader, now: float) -> None:
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    trace.snapshots.append(Snapshot(now, loader.fresh, loader.echoed, params))


@torch.no_grad()
def eval_curve(trace: RunTrace, val: list, cfg: ReuseBenchConfig) -> list[Point]:
    """Validation loss at each snapshot, as the trailing mean of `smooth` snapshots."""
    model = _model(cfg)
    model.eval()
    raw = []
    for snap in trace.snapshots:
        model.load_state_dict(snap.params, strict=False)
        raw.append(statistics.fmean(float(model(x, y)[1]) for x, y in val))
    curve = []
    for i, snap in enumerate(trace.snapshots):
        window = raw[max(0, i - cfg.smooth + 1) : i + 1]
        curve.append(Point(snap.time_s, snap.fresh, snap.echoed, statistics.fmean(window)))
    return curve


def time_to(curve: list[Point], target: float) -> Point | None:
    """Where the curve first reaches `target`, linearly between the two snapshots around it."""
    for i, p in enumerate(curve):
        if p.loss > target:
            continue
        if i == 0:
            return p
        q = curve[i - 1]
        f = (q.loss - target) / (q.loss - p.loss)
        return Point(
            q.time_s + f * (p.time_s - q.time_s),
            q.fresh + f * (p.fresh - q.fresh),
            q.echoed + f * (p.echoed - q.echoed),
            target,
        )
    return None
