"""`atomtrain bench reuse`: an input pipeline k times slower than a training step, with and
without data echoing, each trained to the same target validation loss.

The target is the validation loss the run without reuse reaches in `steps` steps; the run with
reuse trains until it reaches that loss (or runs out of the time the other took). Times count
training only, not the validation checks both make every `eval_every` steps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from atomtrain.data.corpus import resolve_sources
from atomtrain.data.loader import LoaderConfig, WindowSampler, validation_batches
from atomtrain.data.reuse import EchoingLoader, ReuseConfig
from atomtrain.data.stream import StreamConfig, StreamingSource
from atomtrain.models import GPT, GPTConfig
from atomtrain.optim import AdamW, AdamWConfig
from atomtrain.train.runner import PlainRunner
from atomtrain.train.session import REUSE_SLACK, prepared_data


@dataclass(frozen=True)
class ReuseBenchConfig:
    """Defaults finish in about a minute on 2 CPU cores."""

    input_slowdown: float = 4.0
    """Upstream time per batch over the step time."""
    steps: int = 300
    """Steps of the run without reuse; its final loss is the target."""
    max_echo: int = 4
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 2
    seq_len: int = 64
    rows: int = 16
    lr: float = 3e-3
    eval_every: int = 5
    eval_batches: int = 8
    seed: int = 0


def _runner(cfg: ReuseBenchConfig) -> PlainRunner:
    torch.manual_seed(cfg.seed)
    model = GPT(
        GPTConfig(
            n_layer=cfg.n_layer,
            n_embd=cfg.n_embd,
            n_head=cfg.n_head,
            block_size=cfg.seq_len,
            vocab_size=256,
        )
    )
    return PlainRunner(
        model,
        AdamW(dict(model.named_parameters()), AdamWConfig()),
        cfg.rows,
        1.0,
        torch.device("cpu"),
    )


def _loader(cfg: ReuseBenchConfig, files, rate: float, reuse: bool) -> EchoingLoader:
    src = StreamingSource(
        files,
        StreamConfig(
            rows=cfg.rows,
            chunk_len=cfg.seq_len + 1 + REUSE_SLACK,
            seed=cfg.seed,
            rate_tokens_per_s=rate,
        ),
    )
    return EchoingLoader(
        src, ReuseConfig(enabled=reuse, max_echo=cfg.max_echo, seq_len=cfg.seq_len, seed=cfg.seed)
    )


def _train(
    cfg: ReuseBenchConfig,
    loader: EchoingLoader,
    val,
    target: float | None,
    max_steps: int,
    budget_s: float,
) -> dict:
    runner = _runner(cfg)
    train_s, loss, step = 0.0, float("nan"), 0
    reached = None
    while step < max_steps and train_s < budget_s:
        t0 = time.perf_counter()
        x, y = loader.next_batch()
        lr = cfg.lr * min(1.0, (step + 1) / 10)
        runner.train_step(x, y, lr)
        train_s += time.perf_counter() - t0
        step += 1
        if step % cfg.eval_every == 0 or step == max_steps:
            loss = sum(runner.eval_loss(vx, vy) for vx, vy in val) / len(val)
            if target is not None and loss <= target:
                reached = train_s
                break
    loader.close()
    return {
        "steps": step,
        "train_s": train_s,
        "loss": loss,
        "reached_s": reached,
        "echo": (loader.fresh + loader.echoed) / max(loader.fresh, 1),
    }


def run_reuse_bench(cfg: ReuseBenchConfig) -> dict:
    from atomtrain.config import DataSection

    shards = prepared_data(DataSection())
    val = validation_batches(
        WindowSampler(shards, LoaderConfig(rows=cfg.rows, seq_len=cfg.seq_len)), cfg.eval_batches
    )
    held_out = set(shards.manifest.get("val_documents", []))
    files = [f for f in resolve_sources("stdlib") if str(f) not in held_out]
    # The step time with input always ready sets the upstream rate.
    probe = _train(cfg, _loader(cfg, files, 0.0, False), val, None, 25, math.inf)
    step_s = probe["train_s"] / probe["steps"]
    batch_tokens = cfg.rows * (cfg.seq_len + 1 + REUSE_SLACK)
    rate = batch_tokens / (cfg.input_slowdown * step_s)
    base = _train(cfg, _loader(cfg, files, rate, False), val, None, cfg.steps, math.inf)
    target = base["loss"]
    reuse = _train(
        cfg, _loader(cfg, files, rate, True), val, target, 100 * cfg.steps, base["train_s"]
    )
    return {
        "input_slowdown": cfg.input_slowdown,
        "no_reuse_time_to_target_s": base["train_s"],
        "reuse_time_to_target_s": reuse["reached_s"],
        "speedup": base["train_s"] / reuse["reached_s"] if reuse["reached_s"] else None,
        "speedup_is_lower_bound": reuse["reached_s"] is None,
        "final_loss_no_reuse": base["loss"],
        "final_loss_reuse": reuse["loss"],
        "mean_echo_factor": reuse["echo"],
        "target_loss": target,
        "steps_no_reuse": base["steps"],
        "steps_reuse": reuse["steps"],
        "step_s": step_s,
        "input_tokens_per_s": rate,
    }
