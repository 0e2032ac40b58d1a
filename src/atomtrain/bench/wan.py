"""`atomtrain bench wan`: Atom against synchronous data parallelism and pipeline parallelism on
real rate-limited links between network namespaces, and one process alone as the reference.

Every system gets the same wall-clock budget on the same model and data. The target loss is the
validation loss the single process reaches at 60% of its budget. A baseline that does not reach
it is credited with a lower bound instead: its measured time per step times the steps the single
process needed, divided by the number of workers (as if its larger batch were perfectly
efficient), so the reported speedups are lower bounds.

Link speed relative to compute: these CPUs compute about `gpu_to_cpu_ratio` times slower than a
consumer GPU, so a link of B Mbit/s here is as slow, relative to compute, as B * ratio Mbit/s
between GPU machines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from atomtrain.bench.netlab import NetLab
from atomtrain.config import DataSection
from atomtrain.models import GPTConfig
from atomtrain.train.session import prepared_data


@dataclass(frozen=True)
class WanBenchConfig:
    peers: int = 2
    bandwidth_mbit: float = 1.0
    budget_s: float = 60.0
    gpu_to_cpu_ratio: float = 1000.0
    """Assumed: about 100 GFLOP/s on these 2 cores against about 100 TFLOP/s on a consumer GPU."""
    rows: int = 8
    seq_len: int = 64
    micro_batches: int = 4
    sync_every: int = 20


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _summary(logs: list[list[dict]], tokens_per_step: int, target: float | None) -> dict:
    steps = [r for log in logs for r in log if "busy_s" in r and "val_loss" not in r]
    vals = [(r["t"], r["val_loss"]) for log in logs for r in log if "val_loss" in r]
    wall = max((r["t"] for r in steps), default=0.0)
    busy = [
        sum(r["busy_s"] for r in log if "busy_s" in r)
        / max(max((r["t"] for r in log if "busy_s" in r), default=0.0), 1e-9)
        for log in logs
        if any("busy_s" in r for r in log)
    ]
    reached = sorted(t for t, v in vals if target is not None and v <= target)
    return {
        "tokens_per_s": len(steps) * tokens_per_step / max(wall, 1e-9),
        "time_to_target_s": reached[0] if reached else None,
        "final_loss": sorted(vals)[-1][1] if vals else None,
        "device_busy_fraction": sum(busy) / len(busy) if busy else None,
        "steps": len(steps) // max(len(logs), 1),
        "s_per_step": wall / max(len(steps) // max(len(logs), 1), 1),
    }


def _worker(lab: NetLab | None, host: int, args: list[str]) -> subprocess.Popen:
    argv = [sys.executable, "-m", "atomtrain.bench.wan_worker", *args]
    if lab is None:
        return subprocess.Popen(argv, start_new_session=True)
    # gloo picks its interface from the hostname (loopback here): name the host's veth
    env = dict(os.environ, GLOO_SOCKET_IFNAME=lab.veths[host][1], OMP_NUM_THREADS="1")
    return lab.popen(host, argv, env=env)


def _run_baseline(
    system: str, lab: NetLab | None, cfg: WanBenchConfig, data: Path, spec: str, work: Path
) -> list[list[dict]]:
    world = 1 if system == "single" else cfg.peers
    master = f"{lab.address(0)}:29500" if lab else "127.0.0.1:29500"
    procs = [
        _worker(
            lab,
            r,
            [
                system,
                str(r),
                str(world),
                master,
                str(data),
                str(cfg.budget_s),
                str(work / f"{system}{r}.jsonl"),
                spec,
            ],
        )
        for r in range(world)
    ]
    for p in procs:
        p.wait(timeout=cfg.budget_s * 20 + 600)
    return [_read(work / f"{system}{r}.jsonl") for r in range(world)]


def _run_atom(lab: NetLab, cfg: WanBenchConfig, data: Path, work: Path) -> list[list[dict]]:
    swarm = f"wan{int(time.time()) % 100000}"
    procs: list[subprocess.Popen] = []
    join = ""
    for i in range(cfg.peers):
        args = [
            sys.executable,
            "-m",
            "atomtrain.cli.main",
            "train",
            "--quiet",
            "--no-sample",
            f"--peer.swarm={swarm}",
            f"--peer.host={lab.address(i)}",
            f"--peer.index={i}",
            f"--peer.num_peers={cfg.peers}",
            f"--peer.wait_for={cfg.peers}",
            f"--peer.sync_every={cfg.sync_every}",
            "--peer.final_sync=false",
            "--peer.averaging_timeout_s=300",
            "--peer.state_timeout_s=300",
            f"--run.out_dir={work}",
            f"--run.name=atom{i}",
            f"--data.prepared={data}",
            f"--data.rows={cfg.rows}",
            f"--data.seq_len={cfg.seq_len}",
            f"--train.micro_batch_rows={cfg.rows}",
            "--train.steps=1000000",
            "--train.eval_interval=10",
            "--train.warmup_steps=10",
            "--train.lr=2e-3",
            "--train.checkpoint_interval=1000000",
            "--train.min_lr=2e-3",
            "--model.preset=small",
        ]
        if join:
            args.append(f"--peer.join={join}")
        out = open(work / f"atom{i}.log", "w")  # noqa: SIM115 (the peer writes it)
        procs.append(
            lab.popen(
                i,
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={
                    "OMP_NUM_THREADS": "1",
                    "PATH": "/usr/bin:/bin",
                    "HOME": str(Path.home()),
                    "HIVEMIND_LOGLEVEL": "CRITICAL",
                },
            )
        )
        if i == 0:
            deadline = time.time() + 120
            while not (work / "atom0" / "peer.json").exists() and time.time() < deadline:
                time.sleep(0.2)
            join = json.loads((work / "atom0" / "peer.json").read_text())["addrs"][0]
    metrics = [work / f"atom{i}" / "metrics.jsonl" for i in range(cfg.peers)]
    deadline = time.time() + 180
    while not all(m.exists() and m.read_text().count("\n") > 1 for m in metrics):
        if time.time() > deadline:
            break
        time.sleep(0.2)
    time.sleep(cfg.budget_s)
    for p in procs:
        p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
    return [trainer_log(_read(m), cfg.budget_s) for m in metrics]


def trainer_log(records: list[dict], budget_s: float) -> list[dict]:
    """A trainer's metrics as the baseline worker logs them: a step entry ({t, busy_s}) per
    step, a validation entry ({t, val_loss, busy_s}) per validation, within `budget_s`."""
    log = []
    for r in records:
        if "elapsed_s" in r and r["elapsed_s"] <= budget_s:  # the same budget as others
            busy = r.get("step_s", 0.0) + r.get("eval_s", 0.0)  # evaluation is compute too
            if "loss" in r:  # a step (a validation before the first step is none)
                log.append({"t": r["elapsed_s"], "busy_s": busy})
                busy = 0.0
            if "val_loss" in r:
                log.append({"t": r["elapsed_s"], "val_loss": r["val_loss"], "busy_s": busy})
    return log


def run_wan_bench(cfg: WanBenchConfig) -> dict:
    shards = prepared_data(DataSection())
    small = GPTConfig.from_name("small")
    spec = json.dumps(
        {
            "model": {
                k: getattr(small, k)
                for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
            },
            "rows": cfg.rows,
            "seq_len": cfg.seq_len,
            "micro_batches": cfg.micro_batches,
        }
    )
    tokens = cfg.rows * cfg.seq_len
    with tempfile.TemporaryDirectory(prefix="atom-wan-") as tmp:
        work = Path(os.environ.get("ATOM_WAN_WORKDIR", tmp))  # keep the logs when set
        work.mkdir(parents=True, exist_ok=True)
        single = _run_baseline("single", None, cfg, shards.root, spec, work)
        vals = [(r["t"], r["val_loss"]) for r in single[0] if "val_loss" in r]
        target = next((v for t, v in vals if t >= 0.6 * cfg.budget_s), vals[-1][1])
        steps_to_target = next(
            r["step"] for r in single[0] if "val_loss" in r and r["val_loss"] <= target
        )
        with NetLab(cfg.peers, cfg.bandwidth_mbit) as lab:
            atom = _run_atom(lab, cfg, shards.root, work)
            ddp = _run_baseline("ddp", lab, cfg, shards.root, spec, work)
            pipe = _run_baseline("pipeline", lab, cfg, shards.root, spec, work)
    systems = {
        "single": _summary(single, tokens, target),
        "atom": _summary(atom, tokens, target),
        "ddp": _summary(ddp, tokens, target),
        "pipeline": _summary(pipe, tokens, target * 1.0),
    }
    systems["pipeline"]["tokens_per_s"] = _summary(pipe[:1], tokens * cfg.peers, target)[
        "tokens_per_s"
    ]
    for name in ("ddp", "pipeline"):
        s = systems[name]
        s["estimated_time_to_target_s"] = steps_to_target / cfg.peers * s["s_per_step"]
    atom_t = systems["atom"]["time_to_target_s"]

    def speedup(name: str) -> float | None:
        s = systems[name]
        t = s["time_to_target_s"] or s["estimated_time_to_target_s"]
        return t / atom_t if atom_t else None

    return {
        "link": {
            "bandwidth_mbit": cfg.bandwidth_mbit,
            "latency_ms": 0.0,
            "latency_note": "not shaped: this kernel has no netem",
            "gpu_equivalent_bandwidth_mbit": cfg.bandwidth_mbit * cfg.gpu_to_cpu_ratio,
            "gpu_to_cpu_ratio": cfg.gpu_to_cpu_ratio,
        },
        "target_loss": target,
        "single_steps_to_target": steps_to_target,
        "systems": systems,
        "speedup_vs_ddp": speedup("ddp"),
        "speedup_vs_pipeline": speedup("pipeline"),
        "speedups_are_lower_bounds": any(
            systems[n]["time_to_target_s"] is None for n in ("ddp", "pipeline")
        ),
        "config": asdict(cfg),
    }
