"""How far honest updates and "a little is enough" (ALIE) lean one way from a reducer's own:
what exclusion.LEAN is set against, without the network. `bench attack`'s model, data and
learning rate; `--members` honest workers start each round from the same parameters and train
on their own windows (the last `--short` of them fewer steps: a slower peer), a fourth sends
ALIE made from its own update (attack.poison), and every worker's span is read by the project's
own reducer (robust.RobustReducer: its cosines and leans, one span per member as a round of
that many reduces them). The honest updates' mean is applied and the next round begins.
Prints one JSON line per round and a summary line.

    .venv/bin/python scripts/measure_lean.py --rounds 6

Only the first span's reader is each honest member in turn; the attacker's own span is not
read (it judges no one that matters). AdamW's state starts afresh each round, as a peer's
inner optimizer does not: the leans of honest pairs measured in `bench attack` are in its JSON
(`agreement_defended`, `honest_lean`).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging

import torch
import torch.nn.functional as F

from atomtrain.config import DataSection
from atomtrain.data.loader import LoaderConfig, WindowSampler, to_xy
from atomtrain.models.config import GPTConfig
from atomtrain.models.gpt import GPT
from atomtrain.peer.attack import poison
from atomtrain.peer.bounds import Defence
from atomtrain.peer.robust import RobustReducer
from atomtrain.train.session import prepared_data


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--members", type=int, default=3, help="honest workers")
    p.add_argument("--short", type=int, default=1, help="of them, training --short-steps")
    p.add_argument("--steps", type=int, default=25, help="steps per round (a round every 5 "
                   "steps lands about 25 steps on in bench attack)")  # fmt: skip
    p.add_argument("--short-steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.members < 2 or not 0 <= a.short < a.members or min(a.steps, a.short_steps) < 1:
        p.error("--members >= 2, 0 <= --short < --members, and positive step counts")
    return a


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train(model: GPT, draw: WindowSampler, steps: int, first: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loss = torch.zeros(())
    for k in range(steps):
        x, y = to_xy(draw.windows("train", first + k))
        logits = model(x)
        logits = logits[0] if isinstance(logits, tuple) else logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss)


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
    draws = [
        WindowSampler(shards, LoaderConfig(8, 64, a.seed, peer_index=i, num_peers=n))
        for i in range(n)
    ]
    honest_leans, attacker_leans, honest_cos, attacker_cos = [], [], [], []
    for r in range(a.rounds):
        theta = flat(model)
        deltas = []
        for i in range(n):
            worker = copy.deepcopy(model)
            short = a.members - a.short <= i < a.members
            train(worker, draws[i], a.short_steps if short else a.steps, r * a.steps)
            deltas.append(flat(worker) - theta)
        deltas[-1] = poison("alie", deltas[-1])
        span = slice(0, theta.numel() // n)  # the first member's span, read by each in turn
        row = {"round": r, "readers": []}
        for reader in range(a.members):
            parts = [d[span] for d in deltas]
            parts[0], parts[reader] = parts[reader], parts[0]  # the reader reduces this span
            cos, lean = read(parts, 0)
            kept = {i: (round(cos[i], 3), round(lean[i], 3)) for i in lean}
            row["readers"].append(kept)
            for i, (c, x) in kept.items():
                attacker = i == n - 1
                (attacker_leans if attacker else honest_leans).append(x)
                (attacker_cos if attacker else honest_cos).append(c)
        print(json.dumps(row))
        mean = torch.stack(deltas[: a.members]).mean(dim=0)
        torch.nn.utils.vector_to_parameters(theta + mean, model.parameters())
    print(
        json.dumps(
            {
                "honest_lean_abs_max": max(abs(x) for x in honest_leans),
                "attacker_lean": [min(attacker_leans), max(attacker_leans)],
                "honest_cosine": [min(honest_cos), max(honest_cos)],
                "attacker_cosine": [min(attacker_cos), max(attacker_cos)],
                "readings": [len(honest_leans), len(attacker_leans)],
            }
        )
    )


if __name__ == "__main__":
    main()
