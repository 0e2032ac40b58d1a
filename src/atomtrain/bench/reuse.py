"""`atomtrain bench reuse`: an input pipeline k times slower than a training step, with and
without data echoing, over several seeds; each run timed from its launch to a fixed target.

    atomtrain bench reuse --json            # 3 seeds, a few minutes on 2 CPU cores
    atomtrain bench reuse --quick --json    # the same measurement, small, for tests

Phase 1 trains one run per seed with input at full speed for `target_step` steps. The target is
the median over seeds of their validation loss at that step (smoothed as below, on
`eval_batches` batches of the held-out split), fixed before any slowed run starts. Phase 2, per
seed, times a few full-speed steps to set the input rate (`input_slowdown` times slower than a
step, as the machine's load stands now), then trains a run without reuse and a run with reuse
from the same slowed stream, back to back, each
for the same wall-clock budget from its launch (model built, stream started). Both take
parameter snapshots at the same wall-clock interval; the snapshots are evaluated after the run
so that evaluation costs no run any time. A run's loss curve is the trailing mean of its last
`smooth` snapshots (the target uses the same window, in fresh batches), and its time to target
is where that curve first reaches the target. The ratio is taken per seed, within the same
minute of the same machine, then the median over seeds is reported with its spread.

What an echoed step is worth: the fresh batches the run without reuse needed to reach the
target, less those the run with reuse needed, per echoed step the latter took (1: as good as a
fresh step, 0: worthless). The speedup is about 1 + (echo factor - 1) x that value.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from atomtrain.bench.reuse_run import RunTrace, eval_curve, time_to, train_run
from atomtrain.data.corpus import resolve_sources
from atomtrain.data.loader import LoaderConfig, WindowSampler, validation_batches
from atomtrain.train.session import REUSE_SLACK, prepared_data

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReuseBenchConfig:
    """The default takes a few minutes on 2 CPU cores; `quick()` a fraction of one."""

    source: str = "stdlib"
    """Text the runs stream (validation documents held out as `atomtrain data prepare` does)."""
    input_slowdown: float = 4.0
    """Upstream time per batch over the measured step time."""
    target_step: int = 150
    """Step of the full-speed runs whose (median) validation loss is the target."""
    budget_factor: float = 1.2
    """Each slowed run trains this many times the time `target_step` fresh batches take to
    arrive, so that the run without reuse reaches the target and both show a final loss."""
    seeds: int = 3
    """Seeds (model initialisation, stream order, echo choices); the figures are medians."""
    max_echo: int = 4
    """Most uses of one fresh batch (the reuse run's echo factor bound)."""
    snapshot_fresh: int = 10
    """Snapshot interval, in fresh batches at the slowed rate (steps at full speed)."""
    smooth: int = 3
    """Snapshots in the trailing mean that makes a loss curve."""
    eval_batches: int = 16
    """Held-out validation batches each snapshot is evaluated on."""
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 2
    seq_len: int = 64
    rows: int = 16
    lr: float = 3e-3
    warmup_steps: int = 10
    probe_steps: int = 20
    """Full-speed steps timed before each seed's pair of runs to set its input rate."""
    threads: int = 1
    """Torch threads: one, so the stream's worker keeps the other core of a small machine."""

    @staticmethod
    def quick() -> ReuseBenchConfig:
        return ReuseBenchConfig(
            target_step=20,
            budget_factor=1.25,
            snapshot_fresh=4,
            eval_batches=4,
            n_layer=1,
            n_embd=32,
            probe_steps=8,
        )

    @property
    def batch_tokens(self) -> int:
        return self.rows * (self.seq_len + 1 + REUSE_SLACK)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _files_and_val(cfg: ReuseBenchConfig) -> tuple[list[Path], list]:
    from atomtrain.config import DataSection

    shards = prepared_data(DataSection(source=cfg.source))
    val = validation_batches(
        WindowSampler(shards, LoaderConfig(rows=cfg.rows, seq_len=cfg.seq_len)), cfg.eval_batches
    )
    held_out = set(shards.manifest.get("val_documents", []))
    return [f for f in resolve_sources(cfg.source) if str(f) not in held_out], val


def _seed_result(
    cfg: ReuseBenchConfig, base: RunTrace, reuse: RunTrace, target: float, val: list
) -> dict:
    b_curve, r_curve = eval_curve(base, val, cfg), eval_curve(reuse, val, cfg)
    b_hit, r_hit = time_to(b_curve, target), time_to(r_curve, target)
    out: dict = {
        "no_reuse_time_to_target_s": b_hit.time_s if b_hit else None,
        "reuse_time_to_target_s": r_hit.time_s if r_hit else None,
        "speedup": b_hit.time_s / r_hit.time_s if b_hit and r_hit else None,
        "final_loss_no_reuse": b_curve[-1].loss,
        "final_loss_reuse": r_curve[-1].loss,
        "steps_no_reuse": base.steps,
        "steps_reuse": reuse.steps,
        "echo_factor": reuse.steps / max(reuse.fresh, 1),
        "effective_slowdown": base.upstream_s / base.step_s if base.step_s else None,
        "echo_train_loss_gap": reuse.echo_loss_gap,
        "echo_value": None,
    }
    if b_hit and r_hit and r_hit.echoed > 0:
        # fresh batches an echoed step saved, per echoed step
        out["echo_value"] = (b_hit.fresh - r_hit.fresh) / r_hit.echoed
        out["fresh_to_target_no_reuse"] = round(b_hit.fresh, 1)
        out["fresh_to_target_reuse"] = round(r_hit.fresh, 1)
    return out


def _summary(cfg: ReuseBenchConfig, per_seed: list[dict]) -> dict:
    def med(key: str) -> float | None:
        return _median([s[key] for s in per_seed if s[key] is not None])

    speedups = [s["speedup"] for s in per_seed if s["speedup"] is not None]
    b_final, r_final = med("final_loss_no_reuse"), med("final_loss_reuse")
    return {
        "speedup_median": _median(speedups),
        "speedup_min": min(speedups) if speedups else None,
        "speedup_max": max(speedups) if speedups else None,
        "speedup": _median(speedups),
        "seeds_reached": len(speedups),
        "no_reuse_time_to_target_s": med("no_reuse_time_to_target_s"),
        "reuse_time_to_target_s": med("reuse_time_to_target_s"),
        "final_loss_no_reuse": b_final,
        "final_loss_reuse": r_final,
        "final_loss_rel_diff": (r_final - b_final) / b_final if b_final and r_final else None,
        "mean_echo_factor": med("echo_factor"),
        "echo_value_median": med("echo_value"),
        "echo_train_loss_gap": med("echo_train_loss_gap"),
        "effective_slowdown_median": med("effective_slowdown"),
    }


def _seed_pair(cfg: ReuseBenchConfig, files: list[Path], seed: int, target: float, val) -> dict:
    """The run without reuse, then the one with, from an input rate set by the step time
    measured just before (a shared machine's load moves it; the slowdown should not move)."""
    probe = train_run(cfg, files, seed, 0.0, False, math.inf, steps=cfg.probe_steps)
    rate = cfg.batch_tokens / (cfg.input_slowdown * probe.step_s)
    budget_s = cfg.budget_factor * cfg.target_step * cfg.input_slowdown * probe.step_s
    runs = {}
    for reuse in (False, True):
        log.info("reuse bench: seed %d, reuse %s, %.0f s", seed, reuse, budget_s)
        runs[reuse] = train_run(cfg, files, seed, rate, reuse, budget_s, probe.step_s)
    return {
        "seed": seed,
        **_seed_result(cfg, runs[False], runs[True], target, val),
        "step_s": probe.step_s,
        "input_tokens_per_s": rate,
        "budget_s_per_run": budget_s,
    }


def run_reuse_bench(cfg: ReuseBenchConfig) -> dict:
    launch = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        files, val = _files_and_val(cfg)
        seeds = list(range(cfg.seeds))
        full = []
        for seed in seeds:
            log.info("reuse bench: seed %d at full input speed, %d steps", seed, cfg.target_step)
            full.append(train_run(cfg, files, seed, 0.0, False, math.inf, steps=cfg.target_step))
        targets = [time_to_step(eval_curve(t, val, cfg), cfg.target_step) for t in full]
        target = statistics.median(targets)  # fixed before any slowed run starts
        per_seed = [_seed_pair(cfg, files, seed, target, val) for seed in seeds]
    finally:
        torch.set_num_threads(threads)
    return {
        "input_slowdown": cfg.input_slowdown,
        **_summary(cfg, per_seed),
        "seeds": seeds,
        "per_seed": per_seed,
        "target_loss": target,
        "target_step": cfg.target_step,
        "target_losses_per_seed": targets,
        "eval_batches": cfg.eval_batches,
        "config": asdict(cfg),
        "bench_s": time.perf_counter() - launch,
    }


def time_to_step(curve: list, step: int) -> float:
    """The smoothed loss of a full-speed run at `step` (its snapshots fall on multiples)."""
    return next(p.loss for p in curve if p.fresh >= step)
