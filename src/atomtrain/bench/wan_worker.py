"""One worker of the slow-network benchmark's baselines, run inside a host's namespace:

    python -m atomtrain.bench.wan_worker SYSTEM RANK WORLD MASTER DATA BUDGET_S OUT MODEL_JSON

SYSTEM is `single` (one process, no network), `ddp` (gradients all-reduced in float16 every
step over gloo) or `pipeline` (WORLD stages, GPipe: activations forward and their gradients
back, every micro-batch, over gloo). MODEL_JSON holds the model shape, `rows`, `seq_len`,
`micro_batches` and optionally `lr`, `seed`, `data_seed`, `eval_batches`, `eval_every` and
`target_loss` (stop once the validation loss reaches it). Each writes JSON lines to OUT: steps
with their compute seconds, and validation losses, timed from the start of training (`t`) and
in unix seconds (`time`), so a caller can time them from process launch.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from atomtrain.data.loader import LoaderConfig, WindowSampler, to_xy, validation_batches
from atomtrain.data.shards import TokenShards
from atomtrain.models import GPT, GPTConfig
from atomtrain.optim import AdamW, AdamWConfig, clip_scale, grad_norm

Batches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Run:
    """What every system of a worker shares: its budget, schedule and stopping rule."""

    budget_s: float
    lr: float = 2e-3
    eval_every: int = 10
    """Optimizer steps between validations."""
    target_loss: float | None = None
    """Stop at the first validation at or below it (None: run the whole budget)."""


class Log:
    def __init__(self, path: Path) -> None:
        self.f = open(path, "w")  # noqa: SIM115 (kept open for the whole run)
        self.t0 = time.perf_counter()

    def write(self, **rec: float) -> None:
        rec["t"] = time.perf_counter() - self.t0
        rec["time"] = time.time()
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()


def lr_at(step: int, run: Run) -> float:
    return run.lr * min(1.0, (step + 1) / 10)


def optimizer_step(opt: AdamW, params: Mapping[str, torch.Tensor], step: int, run: Run) -> None:
    grads = {n: p.grad for n, p in params.items() if p.grad is not None}
    opt.step(sorted(grads), lr_at(step, run), clip_scale(grad_norm(grads), 1.0))
    for p in params.values():
        p.grad = None


def log_time(log: Log) -> float:
    return time.perf_counter() - log.t0


def reached(run: Run, val: float) -> bool:
    return run.target_loss is not None and val <= run.target_loss


def single(model: GPT, sampler: WindowSampler, val: Batches, run: Run, log: Log) -> None:
    params = dict(model.named_parameters())
    opt = AdamW(params, AdamWConfig())
    step = 0
    while log_time(log) < run.budget_s:
        x, y = to_xy(sampler.windows("train", step))
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        optimizer_step(opt, params, step, run)
        log.write(step=step, loss=loss.item(), busy_s=time.perf_counter() - t0)
        step += 1
        if step % run.eval_every == 0:
            t0 = time.perf_counter()
            v = evaluate(model, val)
            log.write(step=step, val_loss=v, busy_s=time.perf_counter() - t0)
            if reached(run, v):
                return


@torch.no_grad()
def evaluate(model: nn.Module, val: Batches) -> float:
    model.eval()
    out = sum(float(model(x, y)[1]) for x, y in val) / len(val)
    model.train()
    return out


def ddp(
    model: GPT, sampler: WindowSampler, val: Batches, run: Run, log: Log, rank: int, world: int
) -> None:
    params = dict(model.named_parameters())
    names = sorted(params)
    opt = AdamW(params, AdamWConfig())
    step, stop = 0, False
    while True:
        x, y = to_xy(sampler.windows("train", step))
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        busy = time.perf_counter() - t0
        grads = [params[n].grad for n in names]
        stop = stop or (rank == 0 and log_time(log) >= run.budget_s)
        flat = torch.cat(
            [g.reshape(-1) for g in grads if g is not None] + [torch.tensor([1.0 if stop else 0.0])]
        ).to(torch.float16)  # what DDP with a float16 compression hook sends
        dist.all_reduce(flat)  # every step, over the slow link; the last element says stop
        t1 = time.perf_counter()
        pos = 0
        for g in grads:
            if g is not None:
                g.copy_(flat[pos : pos + g.numel()].view_as(g).float() / world)
                pos += g.numel()
        optimizer_step(opt, params, step, run)
        busy += time.perf_counter() - t1
        log.write(step=step, loss=loss.item(), busy_s=busy)
        step += 1
        if flat[-1] > 0:
            return
        if rank == 0 and step % run.eval_every == 0:
            t0 = time.perf_counter()
            v = evaluate(model, val)
            log.write(step=step, val_loss=v, busy_s=time.perf_counter() - t0)
            stop = reached(run, v)


class Stage(nn.Module):
    """Stage `rank` of `world`: a run of consecutive blocks; the first stage also embeds, the
    last also holds the final norm and the (tied) output head."""

    def __init__(self, model: GPT, rank: int, world: int) -> None:
        super().__init__()
        n = len(model.blocks)
        lo, hi = n * rank // world, n * (rank + 1) // world
        self.first, self.last = rank == 0, rank == world - 1
        if self.first:
            self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        if self.last:
            self.ln_f = model.ln_f
            # the tied embedding lives on both ends; its gradients are summed every step
            self.head = nn.Parameter(model.wte.weight.detach().clone())

    def forward(self, h: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            h = self.wte(h) + self.wpe(torch.arange(h.size(1)))
        for b in self.blocks:
            h = b(h)
        if not self.last:
            return h
        logits = self.ln_f(h) @ self.head.T
        assert y is not None
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def tied(stage: Stage) -> torch.Tensor | None:
    if stage.first:
        return stage.wte.weight.grad
    return stage.head.grad if stage.last else None


class Pipe:
    """Point-to-point traffic of one stage with its neighbours."""

    def __init__(self, rank: int, world: int, width: int) -> None:
        self.rank, self.world, self.width = rank, world, width
        # every rank must create the group, though only the two ends use it
        self.ends = dist.new_group([0, world - 1])
        self.busy_s = 0.0
        """Compute seconds of this stage (waiting for neighbours excluded)."""

    def recv_forward(self, like: torch.Tensor) -> torch.Tensor:
        h = torch.empty(like.size(0), like.size(1), self.width)
        dist.recv(h, self.rank - 1)
        return h

    def forward(self, stage: Stage, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
        """(input activation or None, output or loss) of one micro-batch's forward pass."""
        h_in = None if stage.first else self.recv_forward(x).requires_grad_()
        t0 = time.perf_counter()
        out = stage(x if stage.first else h_in, y if stage.last else None)
        self.busy_s += time.perf_counter() - t0
        if not stage.last:
            dist.send(out.detach(), self.rank + 1)
        return h_in, out


def pipeline(
    model: GPT, sampler: WindowSampler, val: Batches, run: Run, log: Log, pipe: Pipe, micro: int
) -> None:
    stage = Stage(model, pipe.rank, pipe.world)
    params = dict(stage.named_parameters())
    opt = AdamW(params, AdamWConfig())
    step, stop = 0, False
    while True:
        flag = torch.tensor(
            [1.0 if stop or (pipe.rank == 0 and log_time(log) >= run.budget_s) else 0.0]
        )
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag[0] > 0:
            return
        x, y = to_xy(sampler.windows("train", step))
        pipe.busy_s = 0.0
        saved = [
            pipe.forward(stage, xm, ym)
            for xm, ym in zip(x.chunk(micro), y.chunk(micro), strict=True)
        ]
        for h_in, out in saved:  # GPipe: every forward, then every backward
            g = None
            if not stage.last:
                g = torch.empty_like(out)
                dist.recv(g, pipe.rank + 1)
            t0 = time.perf_counter()
            if g is None:
                (out / micro).backward()
            else:
                out.backward(g)
            pipe.busy_s += time.perf_counter() - t0
            if not stage.first:
                dist.send(h_in.grad, pipe.rank - 1)
        grad = tied(stage)
        if stage.first or stage.last:
            assert grad is not None
            dist.all_reduce(grad, group=pipe.ends)  # the embedding shared by both ends
        t0 = time.perf_counter()
        optimizer_step(opt, params, step, run)
        busy = pipe.busy_s + time.perf_counter() - t0  # waiting for neighbours excluded
        loss_value = sum(out.item() for _, out in saved) / micro if stage.last else float("nan")
        log.write(step=step, loss=loss_value, busy_s=busy)
        step += 1
        if step % run.eval_every == 0:
            v = pipeline_eval(stage, val, pipe)
            if stage.last:
                log.write(step=step, val_loss=v)
                stop = reached(run, v)


@torch.no_grad()
def pipeline_eval(stage: Stage, val: Batches, pipe: Pipe) -> float:
    total = 0.0
    for x, y in val:
        _, out = pipe.forward(stage, x, y)
        if stage.last:
            total += float(out)
    return total / len(val)


def main() -> None:
    system, rank, world, master, data, budget, out, model_json = sys.argv[1:9]
    rank_i, world_i = int(rank), int(world)
    spec = json.loads(model_json)
    run = Run(
        budget_s=float(budget),
        lr=spec.get("lr", 2e-3),
        eval_every=spec.get("eval_every", 10),
        target_loss=spec.get("target_loss"),
    )
    torch.set_num_threads(1)
    torch.manual_seed(spec.get("seed", 0))
    model = GPT(GPTConfig(**spec["model"]))
    shards = TokenShards.open(data, verify=False)
    rows = spec["rows"] if system != "pipeline" else spec["rows"] * world_i
    peer = rank_i if system == "ddp" else 0
    num = world_i if system == "ddp" else 1
    data_seed = spec.get("data_seed", 0)
    sampler = WindowSampler(
        shards,
        LoaderConfig(
            rows=rows, seq_len=spec["seq_len"], seed=data_seed, peer_index=peer, num_peers=num
        ),
    )
    val = validation_batches(
        WindowSampler(
            shards, LoaderConfig(rows=spec["rows"], seq_len=spec["seq_len"], seed=data_seed)
        ),
        spec.get("eval_batches", 4),
    )
    if system != "single":
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{master}",
            rank=rank_i,
            world_size=world_i,
            timeout=timedelta(seconds=300),
        )
    log = Log(Path(out))
    if system == "single":
        single(model, sampler, val, run, log)
    elif system == "ddp":
        ddp(model, sampler, val, run, log, rank_i, world_i)
    else:
        pipe = Pipe(rank_i, world_i, model.config.n_embd)
        pipeline(model, sampler, val, run, log, pipe, spec["micro_batches"])
    if system != "single":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
