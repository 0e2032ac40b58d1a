"""A swarm under churn: peers SIGKILLed mid-round, a new peer joining, the killed one restarted
from its checkpoint. Used by `atomtrain bench churn` and by the tests, with real peer processes.
"""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

from atomtrain.peer.launcher import PeerProcess, Swarm
from atomtrain.train.checkpoint import latest_checkpoint
from atomtrain.train.metrics import read_metrics


@dataclass(frozen=True)
class ChurnConfig:
    """The scenario; defaults finish in about a minute on 2 CPU cores."""

    peers: int = 3
    """Peers at the start; the last one is killed."""
    steps: int = 240
    """Local steps of each original peer."""
    sync_every: int = 10
    kill_after_round: int = 1
    """Kill once the victim has applied this many rounds and written a checkpoint (while its
    next round runs)."""
    restart_killed: bool = True
    """Restart the killed peer from its last checkpoint."""
    kill: bool = True
    """Kill the victim (off: the same swarm without churn, the benchmark's reference)."""
    averaging_timeout_s: float = 20.0
    matchmaking_s: float = 1.5
    """Peers on one machine find each other fast; the default (3 s) suits real networks."""
    overrides: tuple[str, ...] = (
        "--model.preset=small",
        "--data.seq_len=64",
        "--data.rows=8",
        "--train.micro_batch_rows=8",
        "--train.checkpoint_interval=20",
        "--train.eval_interval=60",
        "--train.warmup_steps=10",
        "--train.lr=2e-3",
    )


@dataclass
class ChurnOutcome:
    result: dict
    swarm: Swarm
    killed_helpers_alive: list[int] = field(default_factory=list)
    logs: dict[int, str] = field(default_factory=dict)


def _rounds(peer: PeerProcess) -> int:
    recs = read_metrics(peer.run_dir / "metrics.jsonl")
    return max((r.get("round", 0) for r in recs), default=0)


def _last_step(peer: PeerProcess) -> int:
    recs = read_metrics(peer.run_dir / "metrics.jsonl")
    return max((r.get("step", 0) for r in recs), default=0)


def _wait(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


def _final_params(peer: PeerProcess) -> dict[str, torch.Tensor] | None:
    ckpt = latest_checkpoint(peer.run_dir)
    return load_file(ckpt / "model.safetensors") if ckpt else None


def run_churn(cfg: ChurnConfig, out_dir: Path, name: str = "churn") -> ChurnOutcome:
    n = cfg.peers
    common = [
        *cfg.overrides,
        f"--train.steps={cfg.steps}",
        f"--peer.sync_every={cfg.sync_every}",
        f"--peer.matchmaking_s={cfg.matchmaking_s}",
        f"--peer.averaging_timeout_s={cfg.averaging_timeout_s}",
    ]
    swarm = Swarm(name, out_dir, name, common, wait_for=n, expected=n + 1)
    first = swarm.launch(0, n, None)
    try:
        addr = swarm.wait_addr(first)
        for i in range(1, n):
            swarm.launch(i, n, addr)
        victim = swarm.peers[-1]
        _wait(  # a round applied, and a checkpoint to restart from
            lambda: (
                _rounds(victim) >= cfg.kill_after_round
                and (not cfg.restart_killed or latest_checkpoint(victim.run_dir) is not None)
            ),
            180,
            "the victim's first round and checkpoint",
        )
        if not cfg.kill:
            _wait(lambda: not swarm.running(), 600, "the swarm to finish")
            return ChurnOutcome(_summary(cfg, swarm, swarm.peers, None, []), swarm)
        time.sleep(cfg.sync_every * 0.05)  # into its next round
        helpers = [p.pid for p in psutil.Process(victim.proc.pid).children(recursive=True)]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        killed_at = time.time()
        survivors = swarm.peers[:-1]
        remaining = max(cfg.steps - min(_last_step(p) for p in survivors), cfg.sync_every * 2)
        swarm.wait_for = 0
        joiner = swarm.launch(n, n + 1, addr, [f"--train.steps={remaining}"])
        restarted = None
        if cfg.restart_killed and latest_checkpoint(victim.run_dir) is not None:
            done = _last_step(victim)
            restarted = swarm.launch(
                n - 1,
                n,
                addr,
                ["--resume", str(victim.run_dir), f"--train.steps={done + remaining}"],
            )
        time.sleep(5.0)
        alive = [
            pid
            for pid in helpers
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        ]
        lost = _unsent_steps(victim)
        _wait(lambda: not swarm.running(), 600, "the swarm to finish")
    finally:
        if swarm.running():
            swarm.stop()
    result = _summary(cfg, swarm, survivors, joiner, alive)
    redone = (lost[0] - _checkpoint_step(restarted)) if restarted else 0
    result.update(
        {
            "killed": 1,
            "joined": 1 + (1 if restarted else 0),
            "updates_lost_steps": lost[1],
            "restart_steps_redone": redone,
            "killed_helpers_alive_after_5s": len(alive),
            "seconds_from_kill_to_end": time.time() - killed_at,
        }
    )
    logs = {p.index: p.log_path.read_text() for p in swarm.peers}
    return ChurnOutcome(result, swarm, alive, logs)


def _unsent_steps(peer: PeerProcess) -> tuple[int, int]:
    """(last step, local steps since its last applied round): the victim's progress that no
    round carried to anyone when it died."""
    recs = [r for r in read_metrics(peer.run_dir / "metrics.jsonl") if "loss" in r]
    last = max((r["step"] for r in recs), default=0)
    applied = max((r["step"] for r in recs if "group_size" in r), default=0)
    return last, last - applied


def _checkpoint_step(peer: PeerProcess) -> int:
    """The step a resumed peer restarted from (its first new record's step, minus one)."""
    recs = [r for r in read_metrics(peer.run_dir / "metrics.jsonl") if "loss" in r]
    steps = [r["step"] for r in recs]
    # a resumed run truncates its metrics at the checkpoint, then appends from there
    return next((a for a, b in itertools.pairwise(steps) if b <= a), steps[0] - 1 if steps else 0)


def _summary(
    cfg: ChurnConfig,
    swarm: Swarm,
    survivors: list[PeerProcess],
    joiner: PeerProcess | None,
    alive: list[int],
) -> dict:
    finishers = [p for p in swarm.peers if p.proc.returncode == 0]
    metrics = {p.index: read_metrics(p.run_dir / "metrics.jsonl") for p in survivors}
    stalls = []
    for recs in metrics.values():
        times = [r["elapsed_s"] for r in recs if "elapsed_s" in r and "loss" in r]  # steps
        stalls.append(max((b - a for a, b in itertools.pairwise(times)), default=0.0))
    joiner_recs = read_metrics(joiner.run_dir / "metrics.jsonl") if joiner else []
    since_join = [
        r["first_contribution_since_join_s"]
        for r in joiner_recs
        if "first_contribution_since_join_s" in r
    ]
    contributed = [r["first_contribution_s"] for r in joiner_recs if "first_contribution_s" in r]
    params = [x for x in (_final_params(p) for p in finishers) if x is not None]
    spread = 0.0
    for other in params[1:]:
        spread = max(spread, max(float((params[0][k] - other[k]).abs().max()) for k in other))
    finals = [
        next((r["val_loss"] for r in reversed(recs) if "val_loss" in r), float("nan"))
        for recs in metrics.values()
    ]
    return {
        "peers": cfg.peers,
        "killed": 0,
        "joined": 0,
        "survivor_steps_lost": sum(cfg.steps - _last_step(p) for p in survivors),
        "max_survivor_stall_s": max(stalls),
        "join_to_first_contribution_s": contributed[0] if contributed else None,
        "dht_start_to_first_contribution_s": since_join[0] if since_join else None,
        "final_loss": sum(finals) / len(finals),
        "param_spread": spread,
        "averaging_timeout_s": cfg.averaging_timeout_s,
        "finished_peers": len(finishers),
    }


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1))
