"""What averaging rounds give per step, without the network: `bench scaling`'s model, data,
optimizer and weight average, W workers in one process, a round every H steps that lands L steps
after it starts (the overlap Atom's rounds run with). Prints the validation loss of worker 0's
weight average every `--eval-every` steps, then one JSON line with the first step it reached the
target.

    .venv/bin/python scripts/simulate_rounds.py --workers 2 --every 32 --lands-after 20
    .venv/bin/python scripts/simulate_rounds.py --workers 1 --rows 16 --ema 0.9604   # ideal_2

Each worker draws its own windows (as peers do, by its index); bench scaling's swarm is timed
until every peer has validated at the target, this script validates worker 0 only. Rounds are
uncompressed (the bench's peers send 8 bits an element, with error feedback).

A round takes each worker's contribution q = theta - x (theta: the synchronized parameters),
averages them to s (plain averaging: bench scaling's outer step) and moves theta by s. With
--lands-after 0 every worker then continues from theta, as synchronous DiLoCo does. Otherwise
each keeps training while the round is in flight and, at the landing, adds `--landing-share`
of its correction q - s (peer/rounds.py's arithmetic at 1; what it leaves out stays in its next
contribution): at 1 the worker lands at theta - s plus what it trained in flight, at 0.5
halfway between that and theta - q plus the same. `--own-share` steps each worker back to
theta - q / W while the round runs (the runtime keeps half, runtime.OWN_SHARE: the same for 2
workers); without it the worker keeps its whole progress.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from atomtrain.config import DataSection
from atomtrain.data.loader import LoaderConfig, WindowSampler, to_xy
from atomtrain.data.shards import TokenShards
from atomtrain.errors import AtomError
from atomtrain.models.config import GPTConfig
from atomtrain.models.gpt import GPT
from atomtrain.train.averaged import WARMUP
from atomtrain.train.session import prepared_data


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--every", type=int, default=0, help="steps between rounds (0: none)")
    p.add_argument("--lands-after", type=int, default=0, help="steps a round is in flight")
    p.add_argument("--own-share", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--landing-share", type=float, default=1.0)
    p.add_argument("--rows", type=int, default=8, help="rows per step of each worker")
    p.add_argument("--lr", type=float, default=1.4e-3)
    p.add_argument("--ema", type=float, default=0.98, help="per step (ideal_N: 0.98 ** N)")
    p.add_argument("--ema-every", type=int, default=4)
    p.add_argument("--steps", type=int, default=1100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=2.2)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--preset", default="small")
    p.add_argument("--data", default="", help="a prepared corpus (default: bench scaling's)")
    p.add_argument("--name", default="")
    a = p.parse_args()
    if a.workers < 1 or a.every < 0 or a.lands_after < 0 or a.eval_every < 1:
        p.error(
            "--workers and --eval-every must be positive, --every and --lands-after not negative"
        )
    if a.every and a.lands_after >= a.every:
        p.error("--lands-after must be below --every (one round in flight at a time)")
    return a


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def put(model: torch.nn.Module, vector: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        p.data.copy_(vector[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """Atom's AdamW defaults (optim/adamw.py): decay on matrices and embeddings only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def main() -> None:
    a = parse()
    torch.set_num_threads(1)
    shards = TokenShards.open(a.data) if a.data else prepared_data(DataSection())
    cfg = GPTConfig.from_name(a.preset)
    torch.manual_seed(a.seed)
    init = GPT(cfg).state_dict()
    models = [GPT(cfg) for _ in range(a.workers)]
    for m in models:
        m.load_state_dict(init)
    opts = [adamw(m, a.lr) for m in models]
    draws = [
        WindowSampler(shards, LoaderConfig(a.rows, 64, a.seed, peer_index=i, num_peers=0))
        for i in range(a.workers)
    ]
    held_out = WindowSampler(shards, LoaderConfig(rows=8, seq_len=64, seed=a.seed))
    val = [to_xy(held_out.windows("val", i)) for i in range(16)]
    theta = flat(models[0]).clone()
    average, updates = theta.clone(), 0
    probe = GPT(cfg).eval()
    rounds = 0
    in_flight = None  # (landing step, contributions, own steps taken at the start, s)
    reached, t0 = None, time.time()
    for step in range(1, a.steps + 1):
        lr = a.lr * min(1.0, step / 10)  # --train.warmup_steps=10, then constant
        for m, opt, draw in zip(models, opts, draws, strict=True):
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = to_xy(draw.windows("train", step))
            _, loss = m(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
        if a.every and step % a.every == 0 and in_flight is None:
            rounds += 1
            qs = [theta - flat(m) for m in models]
            s = sum(qs) / a.workers
            if a.lands_after == 0:
                theta = theta - s
                for m in models:
                    put(m, theta.clone())
            else:
                own = [q / a.workers if a.own_share else q for q in qs]
                for m, q, e in zip(models, qs, own, strict=True):
                    put(m, flat(m) + q - e)
                in_flight = (step + a.lands_after, qs, own, s)
        if in_flight is not None and step >= in_flight[0]:
            _, qs, own, s = in_flight
            theta = theta - s
            for m, q, e in zip(models, qs, own, strict=True):
                put(m, flat(m) + e - q + a.landing_share * (q - s))
            in_flight = None
        if step % a.ema_every == 0:  # train/averaged.py's schedule
            updates += a.ema_every
            decay = min(a.ema, (1 + updates) / (WARMUP + updates)) ** a.ema_every
            average.mul_(decay).add_(flat(models[0]), alpha=1 - decay)
        if step % a.eval_every == 0:
            put(probe, average)
            with torch.no_grad():
                loss = sum(float(probe(x, y)[1]) for x, y in val) / len(val)
            print(f"{a.name} step {step} val {loss:.4f} ({time.time() - t0:.0f} s)", flush=True)
            if reached is None and loss <= a.target:
                reached = step
    print(json.dumps({"name": a.name, "reached": reached, "rounds": rounds, **vars(a)}), flush=True)


if __name__ == "__main__":
    try:
        main()
    except AtomError as e:  # a corpus that is missing or not prepared, say
        raise SystemExit(f"error: {e}") from None
