"""`atomtrain bench scaling`: do more peers reach a target loss sooner than one?

Systems, each timed from the launch of its first process to the moment it reached a validation
loss fixed in advance (`target_loss`, the same for every system and seed):

- `single`: one plain `atomtrain train`, no swarm;
- `atom_N`: N peers of `atomtrain train --peer.swarm=...`, started as the README says (the first
  alone, the others with `--peer.join` at its address); reached when EVERY peer has validated
  at or below the target;
- `sync_diloco`: the largest swarm with blocking rounds (`--peer.sync_mode=blocking`);
- `ideal_N`: the ceiling of data parallelism, one `atomtrain train` with N times the batch and
  N times the CPU quota, so N peers' batches are combined every step with no communication, no
  staleness and no helper processes: what a data-parallel swarm approaches from below as its
  rounds get cheaper, more frequent and fresher. `ceiling_N` (time of `single` / of `ideal_N`)
  and `step_ceiling_N` (single's steps to the target / ideal_N's) say how much N peers' data
  gives on this workload with the same hyperparameters (the learning rate is the peers'; the
  steps are counted at the validation interval);
- `ddp` (float16 gradients all-reduced every step) and `pipeline` (N stages, GPipe) over gloo,
  run once for a short budget: unless they reach the target, they are credited with a lower
  bound, their start-up plus the single peer's steps to target / N times their seconds per step.

Equal compute: every process (peer, worker, the single baseline; `ideal_N` gets N shares) runs
in its own cgroup capped at `cpu_per_peer` cores, joined before exec so start-up and helpers
(hivemind's DHT, p2pd) count, and in its own network namespace behind `tc tbf` links of
`bandwidth_mbit`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hivemind.p2p import P2P, PeerID

from atomtrain.bench.cgroup import CpuQuotas
from atomtrain.bench.netlab import NetLab
from atomtrain.bench.scaling_launch import (
    Launcher,
    Progress,
    SystemRun,
    python_argv,
    watch,
)
from atomtrain.bench.scaling_report import report
from atomtrain.config import DataSection
from atomtrain.errors import AtomError
from atomtrain.models import GPTConfig
from atomtrain.train.session import prepared_data

BASELINE_PORTS = {"ddp": 29500, "pipeline": 29501}
FIRST_PEER_PORT = 31337


@dataclass(frozen=True)
class ScalingBenchConfig:
    peers: tuple[int, ...] = (2, 4)
    """Swarm sizes compared with one peer; the largest also sets DDP's and the pipeline's
    worker count and synchronous DiLoCo's peer count."""
    seeds: int = 3
    """Runs of each swarm and of the single peer, with `--train.seed` and `--data.seed` 0..n-1."""
    cpu_per_peer: float = 0.45
    """CPU cores of each process's quota (4 peers fit in 2 cores)."""
    bandwidth_mbit: float = 10.0
    """Rate of each host's link, both directions."""
    gpu_to_cpu_ratio: float = 1000.0
    """Assumed: about 45 GFLOP/s in a 0.45-core quota against about 45 TFLOP/s of a consumer
    GPU, so a link of B Mbit/s here is as slow, relative to compute, as B * ratio between GPUs."""
    target_loss: float = 2.2
    """Validation loss every system must reach. Chosen from one calibration run of `single`
    (small model, seed 0, 0.45 cores, quiet machine, lr 2e-3 and its weights validated, as the
    bench was then): it first validated at 2.194 after 158 s from launch, and hovered around
    2.16-2.21 by 190 s. With its weight average at lr 1.4e-3 the single peer reaches it in
    81-98 s (09d3049, 3 seeds), so the swarms' first rounds weigh more than they did."""
    budget_s: float = 300.0
    """Wall-clock budget of each system from launch; a system stops as soon as it reaches the
    target. At a round every few seconds it leaves room for well over 20 rounds."""
    baseline_budget_s: float = 60.0
    """Budget of DDP and of the pipeline (about 100x slower: measured briefly, then bounded)."""
    preset: str = "small"
    rows: int = 8
    seq_len: int = 64
    lr: float = 1.4e-3
    """Every system's learning rate, constant (min_lr the same), tuned for the single peer with
    its weight average (`ema`). In this bench's launch code (seed 0, 3c36a83) the single peer
    reached the target in 81.6 s (850 steps) at 1.4e-3 with the average, against 107.4 s (1150)
    at 2e-3 without, the setting before. In an earlier simulation of the same model and data (3
    seeds, steps until the average validated at 2.2; not scripts/simulate_rounds.py): 800, 1000,
    1000 at 1.4e-3; 1350, 1500, 1100 at 2e-3; 900 at 1e-3 (seed 0); two peers averaging every 32
    steps needed 900 and 950 at 1.4e-3 and 900 at 2e-3. Without the average (2ffade1, seed 0):
    1200 steps at both 1.41e-3 and 2e-3 for the single peer, and at 2.83e-3 atom_2 needed 1700."""
    ema: float = 0.98
    """Every system validates the moving average of its weights (`--train.ema`), as a user of
    a constant learning rate would: the weights themselves carry each step's noise, and a
    validation loss that swings by 0.05 between evaluations makes the time it first crosses the
    target a matter of luck. Swarm peers average their own local weights the same way; DDP
    and the pipeline, bounded from the single peer's steps, validate their weights."""
    ema_every: int = 4
    """Every system that keeps an average (all but DDP and the pipeline) updates it every this
    many steps (`--train.ema_every`; by ema**ema_every): a pass over the model each step took
    2-3% of a peer's time in its 0.45-core quota (device busy 0.928 against 0.947 without an
    average, at 09d3049)."""
    eval_interval: int = 50
    """Steps between validations, for every system (about 7% of a peer's compute)."""
    eval_batches: int = 16
    micro_batches: int = 4
    """Micro-batches of the pipeline (GPipe)."""
    sync_every: str = "auto"
    """Passed to every peer as --peer.sync_every."""
    compression: str = "int8"
    """Passed to every peer as --peer.compression: 8 bits an element, as a user on a slow link
    would choose. A 2-peer round at 10 Mbit/s took 1.05 s in int8 against 1.84 s in float16 and
    0.64 s in int4 (medians of 33-49 rounds, seed 0), and neither 8 nor 4 bits cost loss in a
    simulation of 2 workers with error feedback (a round every 10 steps landing 5 steps late;
    validation loss after 750 and 1000 steps: 2.18 and 2.16 in int8, 2.18 and 2.15 in int4,
    2.18-2.19 and 2.10-2.16 unrounded). int4 was not chosen for its CPU: its rounds come more
    often and its codec costs more passes, and in 0.45-core quotas a 2-peer swarm's wall time per
    step rose from about 0.135 s (float16, int8) to 0.153-0.16 s against the single peer's 0.128 s
    (seed 0: atom_2 took 166 s, single 151 s)."""
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    """The outer step for every swarm (Atom's and synchronous DiLoCo's): plain averaging. At the
    few steps between rounds these links allow (5-30), it beat DiLoCo's Nesterov (0.7, 0.9),
    tuned for hundreds of steps, in a simulation of 4 workers: loss 2.54 against 2.75 after 200
    steps at H = 10, 2.67 against 2.75 at H = 30 (the README has the table); and in this bench
    (atom_2 at 07c3131, seeds 0 and 1): 119.5 and 132.8 s plain, 181.1 and 240.0 s with
    Nesterov (0.7, 0.9), 1300 and 1950 steps against 1050 and 1150. An outer learning rate of
    sqrt(2) (extrapolating the average, as the square-root scaling rule would for twice the
    batch; no momentum) did no better: 1050 and 1700 steps, 136.9 and 219.0 s (2ffade1)."""
    ceiling: bool = True
    """Also run `ideal_N` for every swarm size: what data parallelism over N peers gives on this
    workload with the same hyperparameters when its communication is free (the module
    docstring)."""
    matchmaking_s: float = 1.0
    """Time a round waits to gather its group: peers on one switch find each other fast."""


QUICK = ScalingBenchConfig(
    peers=(2,),
    seeds=1,
    target_loss=3.0,
    budget_s=90.0,
    baseline_budget_s=8.0,
    preset="tiny",
    eval_interval=20,
)
"""--quick: the tiny model, one seed, two peers (target: a loss the tiny model passes early)."""


def common_train_args(
    cfg: ScalingBenchConfig, data: Path, seed: int, out: Path, batches: int = 1
) -> list[str]:
    """`atomtrain train`'s arguments for every system, with `batches` times the peers' batch
    (`ideal_N`, whose weight average decays `batches` times per step: it spans as many training
    windows as everyone else's)."""
    rows = cfg.rows * batches
    return [
        "train",
        "--quiet",
        "--no-sample",
        f"--run.out_dir={out}",
        f"--data.prepared={data}",
        f"--data.rows={rows}",
        f"--data.seq_len={cfg.seq_len}",
        f"--data.seed={seed}",
        f"--train.seed={seed}",
        f"--train.micro_batch_rows={rows}",
        "--train.steps=1000000",
        f"--train.eval_interval={cfg.eval_interval}",
        f"--train.eval_batches={cfg.eval_batches}",
        f"--train.eval_rows={cfg.rows}",  # every system validates on the same windows
        "--train.warmup_steps=10",
        f"--train.lr={cfg.lr}",
        f"--train.min_lr={cfg.lr}",  # a constant rate: no schedule tied to a step count
        f"--train.ema={cfg.ema**batches}",
        f"--train.ema_every={cfg.ema_every}",
        "--train.checkpoint_interval=1000000",
        f"--model.preset={cfg.preset}",
    ]


def run_single(launcher: Launcher, cfg: ScalingBenchConfig, data: Path, seed: int) -> SystemRun:
    return _run_one_process(launcher, cfg, data, seed, "single")


def run_ideal(
    launcher: Launcher, cfg: ScalingBenchConfig, data: Path, seed: int, peers: int
) -> SystemRun:
    """One process with `peers` times the batch and the CPU quota, and as many compute threads
    as that quota has whole cores (one thread in 0.9 cores: a second would only share them),
    at most the cores this process may run on: the peers' combined batch every step at no
    cost. Its start-up runs at the larger quota too (a few seconds of its time)."""
    cores = peers * cfg.cpu_per_peer
    threads = str(max(1, min(math.ceil(cores - 1e-9), len(os.sched_getaffinity(0)))))
    return _run_one_process(
        launcher, cfg, data, seed, f"ideal_{peers}", peers, cores, OMP_NUM_THREADS=threads
    )


def _run_one_process(
    launcher: Launcher,
    cfg: ScalingBenchConfig,
    data: Path,
    seed: int,
    system: str,
    batches: int = 1,
    cores: float | None = None,
    **env: str,
) -> SystemRun:
    """A system of one `atomtrain train` (no swarm), timed from its launch to the target."""
    out = launcher.work / f"seed{seed}" / system
    argv = python_argv("atomtrain.cli.main", *common_train_args(cfg, data, seed, out, batches))
    run = SystemRun(time.time(), bytes_before=launcher.lab.link_bytes())
    launcher.start(
        run,
        0,
        f"s{seed}-{system}",
        [*argv, "--run.name=p0"],
        out / "p0/metrics.jsonl",
        cores=cores,
        **env,
    )
    watch(run, cfg.target_loss, cfg.budget_s)
    launcher.finish(run)
    return run


def run_swarm(
    launcher: Launcher, cfg: ScalingBenchConfig, data: Path, seed: int, peers: int, system: str
) -> SystemRun:
    out = launcher.work / f"seed{seed}" / system
    base = python_argv("atomtrain.cli.main", *common_train_args(cfg, data, seed, out))
    flags = [
        f"--peer.swarm=s{seed}{system.replace('_', '')}{int(time.time()) % 100000}",
        f"--peer.sync_every={cfg.sync_every}",
        f"--peer.compression={cfg.compression}",
        "--peer.final_sync=false",
        f"--peer.outer_lr={cfg.outer_lr}",
        f"--peer.outer_momentum={cfg.outer_momentum}",
        f"--peer.matchmaking_s={cfg.matchmaking_s}",
        # a swarm of known size: a round starts once every peer has joined its group, instead
        # of waiting out the matchmaking time for peers that do not exist
        f"--peer.target_group_size={peers}",
    ]
    if system == "sync_diloco":
        flags.append("--peer.sync_mode=blocking")
    # The first peer gets a fixed identity and port, so its address is known before it starts
    # and every peer is launched at once (joiners retry until it answers), as machines whose
    # owners agreed on one address would be.
    out.mkdir(parents=True, exist_ok=True)
    identity = out / "p0.key"
    P2P.generate_identity(str(identity))
    peer_id = PeerID.from_identity(identity.read_bytes()).to_base58()
    port = FIRST_PEER_PORT
    addr = f"/ip4/{launcher.lab.address(0)}/tcp/{port}/p2p/{peer_id}"
    run = SystemRun(time.time(), bytes_before=launcher.lab.link_bytes())
    for i in range(peers):
        where = [f"--peer.identity={identity}", f"--peer.port={port}"] if i == 0 else []
        join = [] if i == 0 else [f"--peer.join={addr}"]
        argv = [
            *base,
            *flags,
            f"--peer.host={launcher.lab.address(i)}",
            f"--run.name=p{i}",
            *where,
            *join,
        ]
        launcher.start(run, i, f"s{seed}-{system}-p{i}", argv, out / f"p{i}/metrics.jsonl")
    watch(run, cfg.target_loss, cfg.budget_s)
    launcher.finish(run)
    return run


def baseline_spec(cfg: ScalingBenchConfig, seed: int) -> str:
    model = GPTConfig.from_name(cfg.preset)
    return json.dumps(
        {
            "model": {
                k: getattr(model, k)
                for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
            },
            "rows": cfg.rows,
            "seq_len": cfg.seq_len,
            "micro_batches": cfg.micro_batches,
            "lr": cfg.lr,
            "seed": seed,
            "data_seed": seed,
            "eval_batches": cfg.eval_batches,
            "eval_every": cfg.eval_interval,
            "target_loss": cfg.target_loss,
        }
    )


def run_baseline(
    launcher: Launcher, cfg: ScalingBenchConfig, data: Path, system: str, world: int
) -> SystemRun:
    out = launcher.work / "seed0" / system
    out.mkdir(parents=True, exist_ok=True)
    master = f"{launcher.lab.address(0)}:{BASELINE_PORTS[system]}"
    spec = baseline_spec(cfg, 0)
    run = SystemRun(time.time(), bytes_before=launcher.lab.link_bytes())
    for r in range(world):
        metrics = out / f"w{r}.jsonl"
        args = [system, str(r), str(world), master, str(data), str(cfg.baseline_budget_s)]
        argv = python_argv("atomtrain.bench.wan_worker", *args, str(metrics), spec)
        # gloo picks its interface from the hostname (loopback here): name the host's veth
        ifname = launcher.lab.veths[r][1]
        launcher.start(run, r, f"s0-{system}-w{r}", argv, metrics, GLOO_SOCKET_IFNAME=ifname)
    # the workers stop themselves at their budget (counted from their start of training)
    watch(run, cfg.target_loss, cfg.baseline_budget_s + cfg.budget_s)
    launcher.finish(run, grace_s=60.0)
    return run


def check(cfg: ScalingBenchConfig) -> None:
    if not cfg.peers or min(cfg.peers) < 2 or len(set(cfg.peers)) != len(cfg.peers):
        raise AtomError(f"peers: distinct swarm sizes of 2 or more, got {cfg.peers}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)) or not 0 <= cfg.ema < 1:
        raise AtomError(f"lr must be positive and ema in [0, 1), got {cfg.lr} and {cfg.ema}")
    if cfg.seeds < 1 or cfg.budget_s <= 0 or cfg.baseline_budget_s <= 0:
        raise AtomError("seeds must be >= 1 and budget_s, baseline_budget_s > 0")


def run_scaling_bench(
    cfg: ScalingBenchConfig, out_dir: Path, progress: Progress = lambda _: None
) -> dict:
    check(cfg)
    shards = prepared_data(DataSection())
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    largest = max(cfg.peers)
    runs: dict[str, list[SystemRun]] = {}
    env = {"OMP_NUM_THREADS": "1", "HIVEMIND_LOGLEVEL": "CRITICAL"}
    with NetLab(largest, cfg.bandwidth_mbit) as lab, CpuQuotas(cfg.cpu_per_peer) as quotas:
        launcher = Launcher(lab, quotas, out_dir.resolve(), env)
        for seed in range(cfg.seeds):
            _record(runs, "single", run_single(launcher, cfg, shards.root, seed), progress, seed)
            for n in cfg.peers if cfg.ceiling else ():
                run = run_ideal(launcher, cfg, shards.root, seed, n)
                _record(runs, f"ideal_{n}", run, progress, seed)
            for n in cfg.peers:
                run = run_swarm(launcher, cfg, shards.root, seed, n, f"atom_{n}")
                _record(runs, f"atom_{n}", run, progress, seed)
            run = run_swarm(launcher, cfg, shards.root, seed, largest, "sync_diloco")
            _record(runs, "sync_diloco", run, progress, seed)
        for system in ("ddp", "pipeline"):
            run = run_baseline(launcher, cfg, shards.root, system, largest)
            _record(runs, system, run, progress, 0)
    return report(runs, cfg, largest, config=asdict(cfg))


def _record(
    runs: dict[str, list[SystemRun]], system: str, run: SystemRun, progress: Progress, seed: int
) -> None:
    runs.setdefault(system, []).append(run)
    errors = "; ".join(run.errors())
    progress(
        f"seed {seed} {system}: stopped by {run.stopped_by} after "
        f"{run.stopped_at - run.launch_time:.0f} s" + (f" ({errors})" if errors else "")
    )


def quick_config(**overrides: object) -> ScalingBenchConfig:
    return replace(QUICK, **overrides)  # type: ignore[arg-type]
