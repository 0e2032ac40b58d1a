"""`atomtrain bench NAME`: benchmarks that print one JSON object and never judge."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import replace


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measure Atom against its baselines")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    p = bsub.add_parser("swap", help="swap engine against plain resident training")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--preset", default="small")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps-per-round", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--param-dtype", default="float32")
    p.add_argument(
        "--device-memory", default="", help="budget (default: --budget-fraction of the need)"
    )
    p.add_argument("--budget-fraction", type=float, default=0.4)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.set_defaults(func=run_swap)

    k = bsub.add_parser("compile", help="the engine with compiled blocks against eager ones")
    k.add_argument("--json", action="store_true", help="print only the JSON result")
    k.add_argument("--preset", default="small")
    k.add_argument("--seq-len", type=int, default=0, help="tokens per row (0: the preset's)")
    k.add_argument("--rows", type=int, default=16)
    k.add_argument("--rounds", type=int, default=20)
    k.add_argument("--steps-per-round", type=int, default=2)
    k.add_argument("--budget-fraction", type=float, default=0.4)
    k.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    k.set_defaults(func=run_compile)

    c = bsub.add_parser("churn", help="a swarm with a peer killed mid-round and peers joining")
    c.add_argument("--json", action="store_true", help="print only the JSON result")
    c.add_argument("--peers", type=int, default=3)
    c.add_argument("--steps", type=int, default=240)
    c.add_argument("--sync-every", type=int, default=10)
    c.add_argument("--out-dir", default="runs/bench-churn", help="where the peers' runs go")
    c.set_defaults(func=run_churn)

    a = bsub.add_parser(
        "attack", help="a keyed swarm with a poisoning peer, with and without defences"
    )
    a.add_argument("--json", action="store_true", help="print only the JSON result")
    a.add_argument("--steps", type=int, default=600)
    a.add_argument("--sync-every", type=int, default=5)
    a.add_argument("--seeds", type=int, default=3, help="seeds per swarm (median and spread)")
    a.add_argument(
        "--attacks",
        default="all",
        help="comma-separated (nan, scale, noise, stale, sign_flip, alie, ipm, label_flip, push, "
        "inflate, sybil, dht_overwrite, stall, forge_gather, lying_reducer, lying_auditor), "
        "or all",
    )
    a.add_argument(
        "--undefended",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run each attack against swarms without the defences (half the time)",
    )
    a.add_argument(
        "--cpu-per-peer",
        default="auto",
        help="cores each peer process may use, the same in every swarm (a cgroup CPU quota: "
        "root and cgroup v1 `cpu`); 0: none, the peers share the machine's cores; auto "
        "(default): the cores this process may use over the processes of the largest swarm "
        "(4; 6 with the sybil) where quotas can be set, else none",
    )
    a.add_argument(
        "--trace",
        action="store_true",
        help="the peers log debug messages too (each try's start, with wall-clock times)",
    )
    a.add_argument("--out-dir", default="runs/bench-attack", help="where the peers' runs go")
    a.set_defaults(func=run_attack)

    r = bsub.add_parser("reuse", help="data echoing against waiting for a slow input pipeline")
    r.add_argument("--json", action="store_true", help="print only the JSON result")
    r.add_argument("--input-slowdown", type=float, default=4.0)
    r.add_argument(
        "--target-step",
        "--steps",
        type=int,
        default=None,
        help="the target is the loss full-speed runs reach at this step (default 150)",
    )
    r.add_argument("--seeds", type=int, default=3)
    r.add_argument("--max-echo", type=int, default=4)
    r.add_argument("--quick", action="store_true", help="a small run (tests)")
    r.add_argument("--source", default="stdlib", help="text to stream: a file, directory, glob")
    r.set_defaults(func=run_reuse)

    q = bsub.add_parser("preempt", help="inference latency beside training, with preemption")
    q.add_argument("--json", action="store_true", help="print only the JSON result")
    q.add_argument("--requests", type=int, default=25)
    q.add_argument("--max-tokens", type=int, default=16)
    q.set_defaults(func=run_preempt)

    w = bsub.add_parser("wan", help="Atom against DDP and pipeline parallelism on slow links")
    w.add_argument("--json", action="store_true", help="print only the JSON result")
    w.add_argument("--peers", type=int, default=2)
    w.add_argument("--bandwidth-mbit", type=float, default=1.0)
    w.add_argument("--budget-s", type=float, default=60.0, help="wall-clock budget per system")
    w.add_argument("--gpu-to-cpu-ratio", type=float, default=1000.0)
    w.set_defaults(func=run_wan)

    s = bsub.add_parser(
        "scaling",
        help="2 and 4 peers against one peer, their data-parallel ceiling, synchronous DiLoCo, "
        "DDP and the pipeline",
    )
    s.add_argument("--json", action="store_true", help="print only the JSON result")
    s.add_argument("--quick", action="store_true", help="tiny model, one seed, two peers")
    s.add_argument("--peers", default="", help="swarm sizes, comma-separated (default 2,4)")
    s.add_argument("--seeds", type=int, default=0, help="seeds per system (default 3)")
    s.add_argument("--cpu-per-peer", type=float, default=0.0, help="cores per process")
    s.add_argument("--bandwidth-mbit", type=float, default=0.0, help="each host's link rate")
    s.add_argument("--target-loss", type=float, default=0.0, help="validation loss to reach")
    s.add_argument("--budget-s", type=float, default=0.0, help="budget per system from launch")
    s.add_argument("--baseline-budget-s", type=float, default=0.0, help="budget of DDP, pipeline")
    s.add_argument("--sync-every", default="", help="the peers' --peer.sync_every (auto or N)")
    s.add_argument("--compression", default="", help="the peers' --peer.compression")
    s.add_argument("--lr", type=float, default=None, help="every system's learning rate")
    s.add_argument(
        "--ema",
        type=float,
        default=None,
        help="decay of the weight average every system validates (0: the weights themselves)",
    )
    s.add_argument(
        "--no-ceiling",
        action="store_true",
        help="skip ideal_N (one process with N times the batch and CPU: the data-parallel ceiling)",
    )
    s.add_argument("--out-dir", default="runs/bench-scaling", help="where the runs go")
    s.set_defaults(func=run_scaling)


def _emit(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>28}: {value}")


def run_swap(args: argparse.Namespace, _extra: list[str]) -> int:
    from atomtrain.bench.swap import SwapBenchConfig, run_swap_bench
    from atomtrain.planner.partition import parse_bytes

    cfg = SwapBenchConfig(
        preset=args.preset,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        seq_len=args.seq_len,
        rows=args.rows,
        micro_batches=args.micro_batches,
        rounds=args.rounds,
        steps_per_round=args.steps_per_round,
        device=args.device,
        param_dtype=args.param_dtype,
        budget_bytes=parse_bytes(args.device_memory) if args.device_memory else 0,
        budget_fraction=args.budget_fraction,
        precision=args.precision,
    )
    _emit(run_swap_bench(cfg), args.json)
    return 0


def run_compile(args: argparse.Namespace, _extra: list[str]) -> int:
    from atomtrain.bench.compile import CompileBenchConfig, run_compile_bench
    from atomtrain.errors import AtomError

    if min(args.rows, args.rounds, args.steps_per_round) < 1 or args.seq_len < 0:
        raise AtomError("--rows, --rounds and --steps-per-round must be >= 1, --seq-len >= 0")
    if not 0 < args.budget_fraction <= 1:
        raise AtomError(f"--budget-fraction must be in (0, 1], got {args.budget_fraction}")
    cfg = CompileBenchConfig(
        preset=args.preset,
        seq_len=args.seq_len,
        rows=args.rows,
        rounds=args.rounds,
        steps_per_round=args.steps_per_round,
        budget_fraction=args.budget_fraction,
        backend=args.backend,
    )
    print(
        "compile: compiling from an empty cache, then eager and compiled steps...", file=sys.stderr
    )
    _emit(run_compile_bench(cfg), args.json)
    return 0


def run_churn(args: argparse.Namespace, _extra: list[str]) -> int:
    import shutil
    from pathlib import Path

    from atomtrain.peer.churn import ChurnConfig, run_churn

    out = Path(args.out_dir)
    shutil.rmtree(out, ignore_errors=True)
    cfg = ChurnConfig(peers=args.peers, steps=args.steps, sync_every=args.sync_every)
    print("churn: the swarm with a peer killed, a joiner and a restart...", file=sys.stderr)
    result = run_churn(cfg, out / "churn").result
    print("churn: the same swarm without churn, for reference...", file=sys.stderr)
    calm = run_churn(replace(cfg, kill=False), out / "calm", name="calm").result
    result["no_churn_final_loss"] = calm["final_loss"]
    result["survivor_loss_vs_no_churn"] = result["final_loss"] / calm["final_loss"] - 1
    _emit(result, args.json)
    return 0


def _cpu_per_peer(value: str, peers: int) -> float:
    """`--cpu-per-peer` as cores: `auto` splits the cores this process may run on among `peers`
    (the largest swarm's processes) where CPU quotas can be set, and says so where they cannot;
    a number must lie between 0.01 (the kernel's least quota is 1 ms of a 100 ms period) and
    those cores, or be 0 (none)."""
    import os

    from atomtrain.bench.cgroup import cpu_cgroups_usable
    from atomtrain.errors import AtomError

    cores_here = len(os.sched_getaffinity(0))
    if value == "auto":
        if cpu_cgroups_usable():
            return round(cores_here / peers, 3)
        print(
            "[bench attack] no CPU quotas (they need root and cgroup v1 `cpu`): the peers share "
            "this machine's cores, and an attack's swarm has one process more than the clean one",
            file=sys.stderr,
        )
        return 0.0
    try:
        cores = float(value)
    except ValueError:
        cores = math.nan
    if not (cores == 0 or 0.01 <= cores <= cores_here):
        raise AtomError(f"--cpu-per-peer must be auto, 0 or 0.01-{cores_here} cores, got {value!r}")
    if cores > 0 and not cpu_cgroups_usable():
        raise AtomError("--cpu-per-peer needs root and cgroup v1 `cpu` mounted read-write")
    return cores


def run_attack(args: argparse.Namespace, _extra: list[str]) -> int:
    import shutil
    from pathlib import Path

    from atomtrain.bench.attack import AttackConfig, run_attack_bench
    from atomtrain.errors import AtomError
    from atomtrain.peer.attack import ATTACKS, check_attack

    attacks = tuple(a.strip() for a in args.attacks.split(",") if a.strip())
    attacks = ATTACKS if attacks in ((), ("all",)) else attacks
    for attack in attacks:
        check_attack(attack)
    for flag, value in (
        ("--steps", args.steps),
        ("--sync-every", args.sync_every),
        ("--seeds", args.seeds),
    ):
        if value < 1:
            raise AtomError(f"{flag} must be at least 1, got {value}")
    from atomtrain.bench.attack import SYBILS

    most = AttackConfig.honest + 1 + (SYBILS if "sybil" in attacks else 0)  # the largest swarm
    cpu = _cpu_per_peer(args.cpu_per_peer, most)
    out = Path(args.out_dir)
    shutil.rmtree(out, ignore_errors=True)
    cfg = AttackConfig(
        steps=args.steps,
        sync_every=args.sync_every,
        seeds=args.seeds,
        attacks=attacks,
        undefended=args.undefended,
        cpu_per_peer=cpu,
        trace=args.trace,
    )
    _emit(run_attack_bench(cfg, out), args.json)
    return 0


def run_reuse(args: argparse.Namespace, _extra: list[str]) -> int:
    from atomtrain.bench.reuse import ReuseBenchConfig, run_reuse_bench
    from atomtrain.errors import AtomError

    cfg = ReuseBenchConfig.quick() if args.quick else ReuseBenchConfig()
    target_step = cfg.target_step if args.target_step is None else args.target_step
    if args.input_slowdown < 1 or target_step < 1 or args.seeds < 1 or args.max_echo < 1:
        raise AtomError("--input-slowdown, --target-step, --seeds and --max-echo must be >= 1")
    explicit = {
        "target_step": target_step,
        "input_slowdown": args.input_slowdown,
        "seeds": args.seeds,
        "max_echo": args.max_echo,
        "source": args.source,
    }
    cfg = dataclasses.replace(cfg, **explicit)
    _emit(run_reuse_bench(cfg), args.json)
    return 0


def run_preempt(args: argparse.Namespace, _extra: list[str]) -> int:
    from atomtrain.bench.preempt import PreemptBenchConfig, run_preempt_bench

    cfg = PreemptBenchConfig(requests=args.requests, max_tokens=args.max_tokens)
    _emit(run_preempt_bench(cfg), args.json)
    return 0


def run_wan(args: argparse.Namespace, _extra: list[str]) -> int:
    from atomtrain.bench.netlab import require_root_and_tools
    from atomtrain.bench.wan import WanBenchConfig, run_wan_bench

    require_root_and_tools()
    cfg = WanBenchConfig(
        peers=args.peers,
        bandwidth_mbit=args.bandwidth_mbit,
        budget_s=args.budget_s,
        gpu_to_cpu_ratio=args.gpu_to_cpu_ratio,
    )
    _emit(run_wan_bench(cfg), args.json)
    return 0


def run_scaling(args: argparse.Namespace, _extra: list[str]) -> int:
    import sys
    from dataclasses import replace
    from pathlib import Path

    from atomtrain.bench.cgroup import require_cpu_cgroups
    from atomtrain.bench.netlab import require_root_and_tools
    from atomtrain.bench.scaling import QUICK, ScalingBenchConfig, run_scaling_bench
    from atomtrain.errors import AtomError

    require_cpu_cgroups()
    require_root_and_tools()
    cfg = QUICK if args.quick else ScalingBenchConfig()
    try:
        peers = tuple(int(n) for n in args.peers.split(",") if n.strip())
    except ValueError:
        raise AtomError(f"--peers: comma-separated integers, got {args.peers!r}") from None
    given = {
        "peers": peers,
        "seeds": args.seeds,
        "cpu_per_peer": args.cpu_per_peer,
        "bandwidth_mbit": args.bandwidth_mbit,
        "target_loss": args.target_loss,
        "budget_s": args.budget_s,
        "baseline_budget_s": args.baseline_budget_s,
        "sync_every": args.sync_every,
        "compression": args.compression,
    }
    cfg = replace(cfg, **{k: v for k, v in given.items() if v})
    exact = {"lr": args.lr, "ema": args.ema}  # 0 is a value here, not "the default"
    cfg = replace(cfg, **{k: v for k, v in exact.items() if v is not None})
    if args.no_ceiling:
        cfg = replace(cfg, ceiling=False)

    def progress(line: str) -> None:
        print(f"[bench scaling] {line}", file=sys.stderr, flush=True)

    _emit(run_scaling_bench(cfg, Path(args.out_dir), progress), args.json)
    return 0
