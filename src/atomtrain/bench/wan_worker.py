"""One worker of the slow-network benchmark's baselines, run inside a host's namespace:

    python -m atomtrain.bench.wan_worker SYSTEM RANK WORLD MASTER DATA BUDGET_S OUT MODEL_JSON

SYSTEM is `single` (one process, no network), `ddp` (gradients all-reduced every step over gloo)
or `pipeline` (two stages, GPipe: activations forward and their gradients back, every
micro-batch, over gloo). Each writes JSON lines to OUT: steps with their compute seconds, and
validation losses, all timed from the start of training.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from atomtrain.data.loader import LoaderConfig, WindowSampler, to_xy, validation_batches
from atomtrain.data.shards import TokenShards
from atomtrain.models import GPT, GPTConfig
from atomtrain.optim import AdamW, AdamWConfig, clip_scale, grad_norm

LR = 2e-3
EVAL_EVERY = 10


class Log:
    def __init__(self, path: Path) -> None:
        self.f = open(path, "w")  # noqa: SIM115 (kept open for the whole run)
        self.t0 = time.perf_counter()

    def write(self, **rec: float) -> None:
        rec["t"] = time.perf_counter() - self.t0
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()


def lr_at(step: int) -> float:
    return LR * min(1.0, (step + 1) / 10)


def optimizer_step(opt: AdamW, params: Mapping[str, torch.Tensor], step: int) -> None:
    grads = {n: p.grad for n, p in params.items() if p.grad is not None}
    opt.step(sorted(grads), lr_at(step), clip_scale(grad_norm(grads), 1.0))
    for p in params.values():
        p.grad = None


def single(model: GPT, sampler: WindowSampler, val, budget: float, log: Log) -> None:
    params = dict(model.named_parameters())
    opt = AdamW(params, AdamWConfig())
    step = 0
    while log_time(log) < budget:
        x, y = to_xy(sampler.windows("train", step))
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        optimizer_step(opt, params, step)
        log.write(step=step, loss=float(loss), busy_s=time.perf_counter() - t0)
        step += 1
        if step % EVAL_EVERY == 0:
            t0 = time.perf_counter()
            v = evaluate(model, val)
            log.write(step=step, val_loss=v, busy_s=time.perf_counter() - t0)


def log_time(log: Log) -> float:
    return time.perf_counter() - log.t0


@torch.no_grad()
def evaluate(model: nn.Module, val) -> float:
    model.eval()
    out = sum(float(model(x, y)[1]) for x, y in val) / len(val)
    model.train()
    return out


def ddp(
    model: GPT, sampler: WindowSampler, val, budget: float, log: Log, rank: int, world: int
) -> None:
    params = dict(model.named_parameters())
    names = sorted(params)
    opt = AdamW(params, AdamWConfig())
    step = 0
    while True:
        x, y = to_xy(sampler.windows("train", step))
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        busy = time.perf_counter() - t0
        grads = [params[n].grad for n in names]
        flat = torch.cat(
            [g.reshape(-1) for g in grads if g is not None]
            + [torch.tensor([1.0 if rank == 0 and log_time(log) >= budget else 0.0])]
        )
        dist.all_reduce(flat)  # every step, over the slow link; the last element says stop
        t1 = time.perf_counter()
        pos = 0
        for g in grads:
            if g is not None:
                g.copy_(flat[pos : pos + g.numel()].view_as(g) / world)
                pos += g.numel()
        optimizer_step(opt, params, step)
        busy += time.perf_counter() - t1
        log.write(step=step, loss=float(loss), busy_s=busy)
        step += 1
        if rank == 0 and step % EVAL_EVERY == 0:
            t0 = time.perf_counter()
            v = evaluate(model, val)
            log.write(step=step, val_loss=v, busy_s=time.perf_counter() - t0)
        if flat[-1] > 0:
            return


class Stage(nn.Module):
    """Half of the GPT: embeddings and the first blocks, or the last blocks and the head."""

    def __init__(self, model: GPT, first: bool) -> None:
        super().__init__()
        half = len(model.blocks) // 2
        self.first = first
        if first:
            self.wte, self.wpe = model.wte, model.wpe
            self.blocks = nn.ModuleList(model.blocks[:half])
        else:
            self.blocks = nn.ModuleList(model.blocks[half:])
            self.ln_f = model.ln_f
            # the tied embedding lives on both stages; its gradients are summed every step
            self.head = nn.Parameter(model.wte.weight.detach().clone())

    def forward(self, h: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            h = self.wte(h) + self.wpe(torch.arange(h.size(1)))
        for b in self.blocks:
            h = b(h)
        if self.first:
            return h
        logits = self.ln_f(h) @ self.head.T
        assert y is not None
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def tied(stage: Stage) -> torch.Tensor:
    return stage.wte.weight if stage.first else stage.head


def pipeline(
    model: GPT, sampler: WindowSampler, val, budget: float, log: Log, rank: int, micro: int
) -> None:
    stage = Stage(model, first=rank == 0)
    params = dict(stage.named_parameters())
    opt = AdamW(params, AdamWConfig())
    C = model.config.n_embd
    step = 0
    while True:
        flag = torch.tensor([1.0 if rank == 0 and log_time(log) >= budget else 0.0])
        dist.broadcast(flag, 0)
        if flag[0] > 0:
            return
        x, y = to_xy(sampler.windows("train", step))
        xs, ys = x.chunk(micro), y.chunk(micro)
        busy, losses, saved = 0.0, [], []
        for xm, ym in zip(xs, ys, strict=True):  # GPipe: every forward, then every backward
            if rank == 0:
                t0 = time.perf_counter()
                h = stage(xm)
                busy += time.perf_counter() - t0
                saved.append(h)
                dist.send(h.detach(), 1)
            else:
                h = torch.empty(xm.size(0), xm.size(1), C)
                dist.recv(h, 0)
                h.requires_grad_()
                t0 = time.perf_counter()
                loss = stage(h, ym) / micro
                busy += time.perf_counter() - t0
                saved.append(h)
                losses.append(loss)
        for m in range(micro):
            if rank == 1:
                t0 = time.perf_counter()
                losses[m].backward()
                busy += time.perf_counter() - t0
                dist.send(saved[m].grad, 0)
            else:
                g = torch.empty_like(saved[m])
                dist.recv(g, 1)
                t0 = time.perf_counter()
                saved[m].backward(g)
                busy += time.perf_counter() - t0
        tied_grad = tied(stage).grad
        assert tied_grad is not None
        dist.all_reduce(tied_grad)  # the embedding shared by both ends
        t0 = time.perf_counter()
        optimizer_step(opt, params, step)
        busy += time.perf_counter() - t0
        loss_value = sum(loss.item() for loss in losses) if rank == 1 else float("nan")
        log.write(step=step, loss=loss_value, busy_s=busy)
        step += 1
        if step % EVAL_EVERY == 0:
            v = pipeline_eval(stage, val, rank, C)
            if rank == 1:
                log.write(step=step, val_loss=v)


@torch.no_grad()
def pipeline_eval(stage: Stage, val, rank: int, C: int) -> float:
    total = 0.0
    for x, y in val:
        if rank == 0:
            dist.send(stage(x), 1)
        else:
            h = torch.empty(x.size(0), x.size(1), C)
            dist.recv(h, 0)
            total += float(stage(h, y))
    return total / len(val)


def main() -> None:
    system, rank, world, master, data, budget, out, model_json = sys.argv[1:9]
    rank_i, world_i, budget_s = int(rank), int(world), float(budget)
    spec = json.loads(model_json)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**spec["model"]))
    shards = TokenShards.open(data, verify=False)
    rows = spec["rows"] if system != "pipeline" else spec["rows"] * world_i
    peer = rank_i if system == "ddp" else 0
    num = world_i if system == "ddp" else 1
    sampler = WindowSampler(
        shards, LoaderConfig(rows=rows, seq_len=spec["seq_len"], peer_index=peer, num_peers=num)
    )
    val = validation_batches(
        WindowSampler(shards, LoaderConfig(rows=spec["rows"], seq_len=spec["seq_len"])), 4
    )
    if system != "single":
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{master}",
            rank=rank_i,
            world_size=world_i,
            timeout=timedelta(seconds=120),
        )
    log = Log(Path(out))
    if system == "single":
        single(model, sampler, val, budget_s, log)
    elif system == "ddp":
        ddp(model, sampler, val, budget_s, log, rank_i, world_i)
    else:
        pipeline(model, sampler, val, budget_s, log, rank_i, spec["micro_batches"])
    if system != "single":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
