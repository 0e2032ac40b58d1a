"""`atomtrain bench attack`: a keyed swarm with one peer sending poisoned updates.

For each attack (peer/attack.py) the same swarm (honest peers plus one attacker) trains twice,
with the defences (robust aggregation, validation, bans) and without. The reference is the honest
peers training alone with each other (`clean_final_loss`). Peers without the key, or with
another key, try to join the clean swarm while it trains (`unauthorized_join_refused`).
Every peer is a real `atomtrain train --swarm` process on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from atomtrain.bench.attack_report import SwarmRun, attack_report, final_loss
from atomtrain.bench.cgroup import CpuQuotas
from atomtrain.peer.attack import ATTACKS
from atomtrain.peer.auth import KEY_ENV, load_swarm_key, write_new_key
from atomtrain.peer.certs import issue, write_new_identity
from atomtrain.peer.exclusion import OPPOSED_COSINE, STRONGLY_OPPOSED_COSINE
from atomtrain.peer.launcher import Swarm
from atomtrain.train.metrics import read_metrics

SYBILS = 2
"""Identities a sybil attacker adds to its own (3 in all, from one member)."""


@dataclass(frozen=True)
class AttackConfig:
    honest: int = 3
    steps: int = 600
    sync_every: int = 5
    """Fixed, so every swarm starts a round every 5 steps; with the audit a round of 4 peers on 2
    cores takes about 2.5 s, some 25 steps, so 600 steps give the honest peers 20-25 rounds (150
    gave 3-7: the issue asks for at least 20, for the outer momentum to matter)."""
    seeds: int = 3
    attacks: tuple[str, ...] = ATTACKS
    undefended: bool = True
    """Also each attack against swarms without the defences (half the bench's time)."""
    trace: bool = False
    """The peers log debug messages (each try's start, with wall-clock times to compare across
    peers' logs: guarded._log_start)."""
    cpu_per_peer: float = 0.0
    """Cores each peer process may use (a cgroup CPU quota, bench/cgroup.py), the same in every
    swarm; 0: no quota. Without one, the peers share the machine's cores, and an attack's swarm
    has one process more than the clean one (the attacker, which trains on after it is banned),
    so its honest peers train more slowly and land more rounds per step: on 2 cores the DHT
    overwrite's honest peers took 95-107 s for 600 steps against 56-66 s, applied 29-33 rounds
    against 20-24, and ended 2-6% above the clean swarm (run Q8; whether for that is not
    settled, README)."""
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
        # the outer optimizer is DiLoCo's default (Nesterov momentum): an attack that steers
        # the momentum is measured as users would meet it
    )


def _swarm(
    quotas: CpuQuotas | None, name: str, out: Path, base: str, overrides: list[str], **kw
) -> Swarm:
    """A swarm whose peers each run under their own CPU quota, with as many threads as it
    allows whole cores (at least one), where there are quotas."""
    if quotas is None:
        return Swarm(name, out, base, overrides, **kw)
    threads = max(1, math.ceil(quotas.cores))
    return Swarm(name, out, base, overrides, wrap=quotas.wrap, threads=threads, **kw)


def _release(quotas: CpuQuotas | None, swarm: Swarm) -> None:
    """The stopped swarm's CPU groups removed (anything left in them killed)."""
    if quotas is None:
        return
    for peer in swarm.peers:
        quotas.release(f"{swarm.base}-peer{peer.index}")


def _wait(swarm: Swarm, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while swarm.running() and time.time() < deadline:
        time.sleep(0.5)
    if swarm.running():
        swarm.stop()


def _common(cfg: AttackConfig, key: Path, defend: bool, seed: int = 0) -> list[str]:
    return [
        *cfg.overrides,
        f"--train.seed={seed}",
        f"--data.seed={seed}",
        f"--train.steps={cfg.steps}",
        f"--peer.sync_every={cfg.sync_every}",
        f"--peer.swarm_key={key}",
        f"--peer.defend={'true' if defend else 'false'}",
    ]


def _intruders_refused(
    cfg: AttackConfig, out: Path, addr: str, other_key: Path, quotas: CpuQuotas | None
) -> bool:
    """A peer without a key and one with another key try to join; both must be turned away."""
    refused = []
    for label, extra in (("nokey", []), ("wrongkey", [f"--peer.swarm_key={other_key}"])):
        common = [o for o in _common(cfg, other_key, True) if not o.startswith("--peer.swarm_key")]
        intruder = _swarm(quotas, "clean", out, f"intruder-{label}", [*common, *extra])
        peer = intruder.launch(cfg.honest, cfg.honest + 1, addr)
        try:
            code = peer.proc.wait(timeout=120)
        except Exception:
            intruder.stop()
            code = None
        finally:
            _release(quotas, intruder)
        log = peer.log_path.read_text()
        refused.append(code == 2 and "no peer accepted" in log)
    return all(refused)


def admit_attacker(out: Path, key: Path) -> list[str]:
    """The attacker is a member the owner admitted (it holds a certificate, not the owner's
    key): what it may do is what any admitted member may."""
    identity = out / "attacker.id"
    member = write_new_identity(identity, force=True)
    cert = issue(load_swarm_key(str(key)).secret, "attacker", member.public_key, member.peer_id)  # type: ignore[union-attr]
    (out / "attacker.cert").write_text(cert.to_text() + "\n")
    return [f"--peer.swarm_cert={out / 'attacker.cert'}", f"--peer.identity={identity}"]


def run_case(
    cfg: AttackConfig,
    out: Path,
    key: Path,
    attack: str,
    defend: bool,
    seed: int,
    quotas: CpuQuotas | None = None,
) -> SwarmRun:
    """One swarm: the honest peers, and with `attack` one more peer that attacks."""
    name = f"s{seed}-{attack or 'clean'}-{'defended' if defend else 'undefended'}"
    n = cfg.honest + (1 if attack else 0)
    # a sybil attack: the member's own process sends sign-flipped updates, and SYBILS more
    # processes with its certificate under new peer IDs try to add their weight to it
    sybils = SYBILS if attack == "sybil" else 0
    common = _common(cfg, key, defend, seed)
    swarm = _swarm(
        quotas, name, out, name, common, wait_for=n, expected=n + sybils, verbose=cfg.trace
    )
    try:
        addr = swarm.wait_addr(swarm.launch(0, n + sybils, None))
        member = admit_attacker(out, key) if attack else []
        for i in range(1, n + sybils):
            kind = "sign_flip" if attack == "sybil" and i == n - 1 else attack
            extra = [*member, f"--peer.attack={kind}"] if attack and i >= n - 1 else None
            swarm.launch(i, n + sybils, addr, extra)
        _wait(swarm, 900)
    finally:
        if swarm.running():
            swarm.stop()
        _release(quotas, swarm)
    return _records(swarm, cfg.honest)


def _records(swarm: Swarm, honest: int) -> SwarmRun:
    names = [f"{swarm.base}-peer{p.index}" for p in swarm.peers]
    return SwarmRun(
        honest=names[:honest],
        attacker=names[honest] if len(names) > honest else None,
        sybils=names[honest + 1 :],
        records=[read_metrics(p.run_dir / "metrics.jsonl") for p in swarm.peers[:honest]],
    )


def _clean_runs(
    cfg: AttackConfig,
    out: Path,
    key: Path,
    other: Path,
    quotas: CpuQuotas | None,
    say: Callable[[str], None],
) -> tuple[list[SwarmRun], bool]:
    """The honest peers alone, every seed (seed 0 with intruders knocking while it trains), and
    whether the intruders were refused."""
    name = "s0-clean-defended"
    common = _common(cfg, key, True)
    swarm = _swarm(
        quotas,
        name,
        out,
        name,
        common,
        wait_for=cfg.honest,
        expected=cfg.honest + 1,
        verbose=cfg.trace,
    )
    try:
        addr = swarm.wait_addr(swarm.launch(0, cfg.honest + 1, None))
        for i in range(1, cfg.honest):
            swarm.launch(i, cfg.honest + 1, addr)
        refused = _intruders_refused(cfg, out, addr, other, quotas)
        _wait(swarm, 900)
    finally:
        if swarm.running():
            swarm.stop()
        _release(quotas, swarm)
    clean = [_records(swarm, cfg.honest)]
    say(f"seed 0 clean: final loss {final_loss(clean[0])}")
    for seed in range(1, cfg.seeds):
        clean.append(run_case(cfg, out, key, "", True, seed, quotas))
        say(f"seed {seed} clean: final loss {final_loss(clean[-1])}")
    return clean, refused


def run_attack_bench(cfg: AttackConfig, out: Path, progress: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    os.environ.pop(KEY_ENV, None)  # the intruders must not find the swarm's key there
    key, other = out / "swarm.key", out / "other.key"
    write_new_key(key, force=True)
    write_new_key(other, force=True)

    def say(text: str) -> None:
        if progress:
            print(f"[bench attack] {text}", file=sys.stderr, flush=True)

    quotas = CpuQuotas(cfg.cpu_per_peer) if cfg.cpu_per_peer > 0 else None
    with quotas or contextlib.nullcontext():
        clean, refused = _clean_runs(cfg, out, key, other, quotas, say)
        cases: dict[str, dict[str, list[SwarmRun]]] = {}
        for attack in cfg.attacks:
            for defend in (True, False) if cfg.undefended else (True,):
                label = "defended" if defend else "undefended"
                for seed in range(cfg.seeds):
                    run = run_case(cfg, out, key, attack, defend, seed, quotas)
                    cases.setdefault(attack, {}).setdefault(label, []).append(run)
                    say(f"seed {seed} {attack} {label}: final loss {final_loss(run)}")
    result = attack_report(clean, cases, OPPOSED_COSINE)
    result.update(
        honest_peers=cfg.honest,
        attackers=1,
        steps=cfg.steps,
        sync_every=cfg.sync_every,
        seeds=cfg.seeds,
        strongly_opposed_cosine=STRONGLY_OPPOSED_COSINE,  # one reading below it names a member
        cpu_per_peer=cfg.cpu_per_peer,  # 0: the peers shared the machine's cores
        trace=cfg.trace,  # the peers logged debug messages (their timing may differ a little)
        unauthorized_join_refused=refused,
    )
    return result
