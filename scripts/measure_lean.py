"""How far honest updates and "a little is enough" (ALIE) lean one way, once their component along a
reducer's own update is taken out, read two ways (robust.RobustReducer.leans): what exclusion.LEAN
is set against, without the network. `bench attack`'s model, data and learning rate, Atom's AdamW
defaults; `--members` honest workers start each round from the same parameters and train on their
own windows (the last `--short` of them only `--short-steps` a round: a slower peer, whose update is
smaller), a further worker sends ALIE made from its own update (attack.poison, as bench attack's
attacker does) or, with `--alie honest`, the honest updates' mean less `--z` of their standard
deviations (an attacker that sees every honest update); each honest worker reads every span with the
project's reducer (robust.RobustReducer: its cosines and leans), as one part, where a round cuts a
span into parts of 2^18 values or so and codes them. The honest updates' mean is applied, each
worker keeps its optimizer's state, and the next round begins. Prints one JSON line per round and a
summary line.

    .venv/bin/python scripts/measure_lean.py --rounds 6

The honest leans `bench attack` measures on the wire (codec, re-synchronizations, the
clock's rounds) are in its JSON (`agreement_defended`, `honest_lean`).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import math

import torch
import torch.nn.functional as F

from atomtrain.config import DataSection
from atomtrain.data.loader import LoaderConfig, WindowSampler, to_xy
from atomtrain.models.config import GPTConfig
from atomtrain.models.gpt import GPT
from atomtrain.peer.attack import ALIE_Z, poison
from atomtrain.peer.bounds import Defence
from atomtrain.peer.robust import RobustReducer
from atomtrain.train.session import prepared_data


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--members", type=int, default=3, help="honest workers")
    p.add_argument("--short", type=int, default=1, help="of them, training --short-steps")
    p.add_argument("--steps", type=int, default=25, help="steps per round (a round every 5 "
                   "steps lands about 25 steps on in bench attack)")  # fmt: skip
    p.add_argument("--short-steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--alie", choices=("own", "honest"), default="own",
        help="ALIE from the attacker's own update, or from every honest one's",
    )  # fmt: skip
    p.add_argument("--z", type=float, default=ALIE_Z, help="with --alie honest: spreads moved")
    a = p.parse_args()
    if a.members < 2 or not 0 <= a.short < a.members or min(a.steps, a.short_steps) < 1:
        p.error("--members >= 2, 0 <= --short < --members, and positive step counts")
    return a


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """Atom's AdamW defaults (optim/adamw.py): decay on matrices and embeddings only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=2e-3, betas=(0.9, 0.95), eps=1e-8)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train(model: GPT, opt: torch.optim.Optimizer, draw: WindowSampler, steps: int, first: int):
    for k in range(steps):
        x, y = to_xy(draw.windows("train", first + k))
        logits = model(x)
        logits = logits[0] if isinstance(logits, tuple) else logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def read(parts: list[torch.Tensor], reader: int) -> tuple[dict[int, float], dict[int, float]]:
    """(cosines, leans) of every other part against `reader`'s, as its reducer reads them."""

    async def reduce() -> RobustReducer:  # (the reducer's futures need an event loop)
        reducer = RobustReducer(
            [parts[0].shape], ["delta"], [1.0] * len(parts), reader, Defence(),
            [False] * len(parts), lambda i, why: None,
        )  # fmt: skip
        reducer.parts = dict(enumerate(parts))
        reducer._combine()
        return reducer

    reducer = asyncio.run(reduce())
    return reducer.cosines(), reducer.leans()


def main() -> None:
    a = parse()
    # (hivemind's reducer warns, as it is collected, that no stream sent it parts)
    logging.getLogger("hivemind.averaging.partition").setLevel(logging.ERROR)
    torch.manual_seed(a.seed)
    torch.set_num_threads(2)
    shards = prepared_data(DataSection())
    model = GPT(GPTConfig.from_name("small"))
    n = a.members + 1  # and the attacker
    workers = [copy.deepcopy(model) for _ in range(n)]
    opts = [adamw(w) for w in workers]
    draws = [
        WindowSampler(shards, LoaderConfig(8, 64, a.seed, peer_index=i, num_peers=n))
        for i in range(n)
    ]
    short = range(a.members - a.short, a.members)
    theta = flat(model)
    honest, attacker = [], []  # (cosine, lean)
    for r in range(a.rounds):
        deltas = []
        for i, (worker, opt) in enumerate(zip(workers, opts, strict=True)):
            torch.nn.utils.vector_to_parameters(theta.clone(), worker.parameters())
            train(worker, opt, draws[i], a.short_steps if i in short else a.steps, r * a.steps)
            deltas.append(flat(worker) - theta)
        if a.alie == "honest":
            honest_deltas = torch.stack(deltas[: a.members])
            deltas[-1] = honest_deltas.mean(dim=0) - a.z * honest_deltas.std(dim=0)
        else:
            deltas[-1] = poison("alie", deltas[-1])
        spans = torch.arange(theta.numel()).chunk(n)  # as a round of n members cuts them
        row: dict = {"round": r, "lean_abs_max": {}, "alie_lean": []}
        for reader in range(a.members):
            for span in spans:
                cos, lean = read([d[span] for d in deltas], reader)
                for i, x in lean.items():
                    (attacker if i == n - 1 else honest).append((cos.get(i, math.nan), x))
                    if i == n - 1:
                        row["alie_lean"].append(round(x, 3))
                    else:
                        kind = "short" if i in short else "full"
                        kept = row["lean_abs_max"].get(kind, 0.0)
                        row["lean_abs_max"][kind] = round(max(kept, abs(x)), 4)
        if row["alie_lean"]:  # (none where every reducer dropped its part)
            row["alie_lean"] = [min(row["alie_lean"]), max(row["alie_lean"])]
        print(json.dumps(row))
        theta = theta + torch.stack(deltas[: a.members]).mean(dim=0)

    def span(values: list[float]) -> list[float]:
        return [round(min(values), 3), round(max(values), 3)] if values else []

    summary = {
        "honest_lean_abs_max": round(max((abs(x) for _, x in honest), default=0.0), 4),
        "attacker_lean": span([x for _, x in attacker]),
        "honest_cosine": span([c for c, _ in honest]),
        "attacker_cosine": span([c for c, _ in attacker]),
        "readings": [len(honest), len(attacker)],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
