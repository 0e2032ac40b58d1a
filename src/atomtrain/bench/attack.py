"""`atomtrain bench attack`: a keyed swarm with one peer sending poisoned updates.

For each attack (peer/attack.py) the same swarm (honest peers plus one attacker) trains twice,
with the defences (robust aggregation, validation, bans) and without. The reference is the honest
peers training alone with each other (`clean_final_loss`). Peers without the key, or with
another key, try to join the clean swarm while it trains (`unauthorized_join_refused`).
Every peer is a real `atomtrain train --swarm` process on 127.0.0.1.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from atomtrain.peer.attack import ATTACKS
from atomtrain.peer.auth import KEY_ENV, write_new_key
from atomtrain.peer.launcher import Swarm
from atomtrain.train.metrics import read_metrics


@dataclass(frozen=True)
class AttackConfig:
    honest: int = 2
    steps: int = 100
    sync_every: int = 10
    attacks: tuple[str, ...] = ATTACKS
    overrides: tuple[str, ...] = (
        "--model.preset=small",
        "--data.seq_len=64",
        "--data.rows=8",
        "--train.micro_batch_rows=8",
        "--train.checkpoint_interval=1000",
        "--train.eval_interval=1000",
        "--train.warmup_steps=10",
        "--train.lr=2e-3",
        "--peer.matchmaking_s=1.5",
        "--peer.averaging_timeout_s=15",
        "--peer.final_wait_s=60",
        # plain model averaging as the outer step: over a few short rounds DiLoCo's Nesterov
        # momentum makes the final loss swing by several percent from run to run, which would
        # drown the effect measured here
        "--peer.outer_lr=1.0",
        "--peer.outer_momentum=0.0",
    )


def _final_loss(run_dir: Path) -> float:
    recs = read_metrics(run_dir / "metrics.jsonl")
    return next((float(r["val_loss"]) for r in reversed(recs) if "val_loss" in r), math.nan)


def _wait(swarm: Swarm, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while swarm.running() and time.time() < deadline:
        time.sleep(0.5)
    if swarm.running():
        swarm.stop()


def _common(cfg: AttackConfig, key: Path, defend: bool) -> list[str]:
    return [
        *cfg.overrides,
        f"--train.steps={cfg.steps}",
        f"--peer.sync_every={cfg.sync_every}",
        f"--peer.swarm_key={key}",
        f"--peer.defend={'true' if defend else 'false'}",
    ]


def _intruders_refused(cfg: AttackConfig, out: Path, addr: str, other_key: Path) -> bool:
    """A peer without a key and one with another key try to join; both must be turned away."""
    refused = []
    for label, extra in (("nokey", []), ("wrongkey", [f"--peer.swarm_key={other_key}"])):
        common = [o for o in _common(cfg, other_key, True) if not o.startswith("--peer.swarm_key")]
        intruder = Swarm("clean", out, f"intruder-{label}", [*common, *extra])
        peer = intruder.launch(cfg.honest, cfg.honest + 1, addr)
        try:
            code = peer.proc.wait(timeout=120)
        except Exception:
            intruder.stop()
            code = None
        log = peer.log_path.read_text()
        refused.append(code == 2 and "no peer accepted" in log)
    return all(refused)


def run_case(
    cfg: AttackConfig, out: Path, key: Path, attack: str, defend: bool
) -> tuple[list[float], int]:
    """(honest peers' final losses, contributions they rejected) for one swarm."""
    name = f"{attack or 'clean'}-{'defended' if defend else 'undefended'}"
    n = cfg.honest + (1 if attack else 0)
    swarm = Swarm(name, out, name, _common(cfg, key, defend), wait_for=n, expected=n)
    try:
        addr = swarm.wait_addr(swarm.launch(0, n, None))
        for i in range(1, n):
            extra = [f"--peer.attack={attack}"] if attack and i == n - 1 else None
            swarm.launch(i, n, addr, extra)
        _wait(swarm, 600)
    finally:
        if swarm.running():
            swarm.stop()
    honest = swarm.peers[: cfg.honest]
    rejected = 0
    for p in honest:
        recs = read_metrics(p.run_dir / "metrics.jsonl")
        rejected += max((len(r.get("rejected_peers", ())) for r in recs), default=0)
    return [_final_loss(p.run_dir) for p in honest], rejected


def _mean(xs: list[float]) -> float | None:
    finite = [x for x in xs if math.isfinite(x)]
    return sum(finite) / len(finite) if finite and len(finite) == len(xs) else None


def run_attack_bench(cfg: AttackConfig, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    os.environ.pop(KEY_ENV, None)  # the intruders must not find the swarm's key there
    key, other = out / "swarm.key", out / "other.key"
    write_new_key(key, force=True)
    write_new_key(other, force=True)

    # the clean swarm, with intruders knocking while it trains
    name = "clean"
    swarm = Swarm(
        name, out, name, _common(cfg, key, True), wait_for=cfg.honest, expected=cfg.honest + 1
    )
    try:
        addr = swarm.wait_addr(swarm.launch(0, cfg.honest + 1, None))
        for i in range(1, cfg.honest):
            swarm.launch(i, cfg.honest + 1, addr)
        refused = _intruders_refused(cfg, out, addr, other)
        _wait(swarm, 600)
    finally:
        if swarm.running():
            swarm.stop()
    clean = _mean([_final_loss(p.run_dir) for p in swarm.peers])

    attacks = []
    for attack in cfg.attacks:
        defended, rejected = run_case(cfg, out, key, attack, True)
        undefended, _ = run_case(cfg, out, key, attack, False)
        d, u = _mean(defended), _mean(undefended)
        attacks.append(
            {
                "attack": attack,
                "final_loss_defended": d,
                "final_loss_undefended": u,
                "undefended_diverged": u is None,
                "defended_within_5pct": d is not None
                and clean is not None
                and abs(d - clean) <= 0.05 * clean,
                "rejected_contributions": rejected,
            }
        )
    return {
        "honest_peers": cfg.honest,
        "attackers": 1,
        "steps": cfg.steps,
        "sync_every": cfg.sync_every,
        "clean_final_loss": clean,
        "attacks": attacks,
        "unauthorized_join_refused": refused,
    }
