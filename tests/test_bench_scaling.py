"""`atomtrain bench scaling`: its figures from known records, its refusal without root, and the
quick run end to end (as root only): the JSON's structure and finite values, never speed."""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from atomtrain.bench.cgroup import CPU_ROOT
from atomtrain.bench.scaling_launch import Proc, SystemRun, Tail
from atomtrain.bench.scaling_report import baseline_seed, busy_fraction, spread, swarm_seed
from atomtrain.train.metrics import MetricsLog, read_metrics

from .conftest import run_cli


def finished_run(tmp_path: Path, logs: list[list[dict]], launch: float) -> SystemRun:
    run = SystemRun(launch, bytes_before=[(0, 0)] * len(logs))
    for i, records in enumerate(logs):
        path = tmp_path / f"m{i}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        done = subprocess.Popen(["true"])
        done.wait()
        run.procs.append(Proc(f"p{i}", done, Tail(path), tmp_path / f"m{i}.log"))
    run.bytes_after = [(1000 * (i + 1), 0) for i in range(len(logs))]
    return run


def test_metrics_records_carry_unix_time_so_the_bench_can_time_from_launch(tmp_path: Path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    before = time.time()
    log.write({"step": 1, "loss": 2.0})
    after = time.time()
    log.write({"step": 2, "time": 5.0})  # a record's own time is kept
    first, second = read_metrics(tmp_path / "metrics.jsonl")
    assert before <= first["time"] <= after
    assert first["step"] == 1 and first["loss"] == 2.0
    assert second["time"] == 5.0


def test_the_busy_fraction_counts_the_initial_validation():
    """Validation is compute: the one before the first step too (a trainer's step-0 record)."""
    records = [
        {"step": 0, "val_loss": 5.0, "eval_s": 1.0, "elapsed_s": 1.0},
        {"step": 1, "loss": 4.0, "step_s": 2.0, "elapsed_s": 4.0},
    ]
    assert busy_fraction(records) == 0.75


def test_bench_wan_counts_steps_not_the_initial_validation():
    """A trainer's step-0 record (a validation, no step) is compute but not a step."""
    from atomtrain.bench.wan import _summary, trainer_log

    records = [
        {"step": 0, "val_loss": 5.0, "eval_s": 1.0, "elapsed_s": 1.0},
        *[{"step": i, "loss": 4.0, "step_s": 1.0, "elapsed_s": 1.0 + i} for i in range(1, 5)],
    ]
    out = _summary([trainer_log(records, budget_s=60.0)], tokens_per_step=20, target=None)
    assert out["steps"] == 4 and out["tokens_per_s"] == 80 / 5
    assert out["device_busy_fraction"] == 1.0


def test_a_swarm_reaches_the_target_when_its_last_peer_does(tmp_path: Path):
    peer = lambda t_hit, rounds: [  # noqa: E731
        {"step": 50, "loss": 3.0, "step_s": 0.5, "elapsed_s": 1.0, "round": rounds, "time": 101},
        {"step": 51, "round": rounds, "round_s": 2.0 * rounds, "averaging_memory_ratio": 2.5},
        {"step": 100, "val_loss": 2.5, "time": 100 + t_hit},
        {"step": 150, "val_loss": 1.9, "time": 100 + t_hit + 5},
    ]
    run = finished_run(tmp_path, [peer(10, 4), peer(20, 5)], launch=100.0)
    seed = swarm_seed(run, target=2.0)
    assert seed["time_s"] == 25.0  # the second peer, from launch
    assert seed["steps_to_target"] == 150
    assert seed["rounds"] == [4, 5]
    assert seed["bytes_sent_per_round"] == (1000 / 4 + 2000 / 5) / 2
    assert seed["device_busy_fraction"] == 0.5
    assert seed["round_s"] == 9.0  # median of 8 and 10
    assert seed["averaging_memory_ratio"] == 2.5
    assert seed["left_out"] == [[], []]
    blaming = peer(20, 5)
    blaming[1]["stalled_peers"] = ["p0", "p2"]  # p2 only stalled: not the rules' mistake
    blaming[1]["left_out_for_updates"] = ["p0"]  # an honest peer left out by the other
    blamed = finished_run(tmp_path, [peer(10, 4), blaming], launch=100.0)
    assert swarm_seed(blamed, target=2.0)["left_out"] == [[], ["p0"]]
    missing = finished_run(tmp_path, [peer(10, 1), peer(10, 1)[:2]], launch=100.0)
    assert swarm_seed(missing, target=2.0)["time_s"] is None
    late = finished_run(tmp_path, [peer(10, 4), peer(20, 5)], launch=100.0)
    late.stopped_by, late.stopped_at = "budget", 124.0  # the second peer got there at 125
    assert swarm_seed(late, target=2.0)["time_s"] is None


def test_a_baseline_that_misses_the_target_gets_a_lower_bound(tmp_path: Path):
    worker = [
        {"step": s, "loss": 5.0, "busy_s": 0.1, "t": 1.0 + 2.0 * s, "time": 110.0 + 2.0 * s}
        for s in range(10)
    ]  # training started at 109 (time - t), each step 2 s
    run = finished_run(tmp_path, [worker, worker], launch=100.0)
    seed = baseline_seed(run, target=2.0, single_steps=400, world=4)
    assert seed["time_s"] is None and seed["time_is_lower_bound"]
    assert seed["startup_s"] == 9.0
    assert seed["s_per_step"] == 2.0
    assert seed["lower_bound_s"] == 9.0 + 400 / 4 * 2.0


def test_medians_count_a_seed_that_missed_as_slowest():
    assert spread([10.0, None, 30.0])["median_s"] == 30.0
    assert spread([10.0, None, None])["median_s"] is None
    assert spread([10.0, None, None])["reached"] == 1


def test_without_root_it_says_so_in_one_line(tmp_path: Path):
    code = (
        "import os; os.geteuid = lambda: 1000\n"
        "import sys; from atomtrain.cli.main import main\n"
        "sys.exit(main(['bench', 'scaling', '--json']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip() == (
        "atomtrain: error: the scaling bench needs root (cgroup CPU quotas and network namespaces)"
    )


def number(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


@pytest.mark.skipif(
    os.geteuid() != 0
    or not os.access(CPU_ROOT / "cpu.cfs_quota_us", os.W_OK)
    or shutil.which("tc") is None,
    reason="needs root, cgroup v1 `cpu` read-write and iproute2 (tc, ip netns)",
)
@pytest.mark.bench
def test_quick_bench_end_to_end(tmp_path: Path):
    groups_before = {p.name for p in CPU_ROOT.glob("atom*")}
    runs = tmp_path / "runs"
    proc = run_cli(
        "bench", "scaling", "--quick", "--json", "--sync-every=10", f"--out-dir={runs}",
        cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert "[bench scaling] seed 0 single" in proc.stderr
    assert set(out["systems"]) == {"single", "ideal_2", "atom_2", "sync_diloco", "ddp", "pipeline"}
    for key in (
        "speedup_2", "speedup_vs_ddp", "speedup_vs_pipeline", "bytes_per_round", "ceiling_2",
        "step_ceiling_2",
    ):  # fmt: skip
        assert number(out[key]) and out[key] > 0, (key, out["systems"]["atom_2"]["per_seed"])
    assert 0 < out["device_busy_fraction"] <= 1.05
    assert out["averaging_memory_ratio"] is None or number(out["averaging_memory_ratio"])
    for name in ("single", "ideal_2", "atom_2", "ddp", "pipeline"):
        system = out["systems"][name]
        assert number(system["median_s"]) and system["median_s"] > 0, name
        assert system["min_s"] <= system["median_s"] <= system["max_s"]
        assert all(seed["errors"] == [] for seed in system["per_seed"]), name
    single = out["systems"]["single"]["per_seed"][0]
    assert single["stopped_by"] == "target" and single["steps_to_target"] > 0
    assert min(out["systems"]["atom_2"]["per_seed"][0]["rounds"]) > 0
    for name in ("atom_2", "sync_diloco"):  # honest peers, none left out by the other's rules
        assert out["systems"][name]["per_seed"][0]["left_out"] == [[], []], name
    # the counters behind the status table's network figures against the links (issue 16)
    assert abs(out["wire_vs_link_bytes"] - 1) < 0.1, out["wire_vs_link_bytes"]
    for name in ("ddp", "pipeline"):
        seed = out["systems"][name]["per_seed"][0]
        assert number(seed["startup_s"]) and number(seed["s_per_step"]), name
    synced = out["systems"]["sync_diloco"]["per_seed"][0]
    assert synced["errors"] == [] and min(synced["rounds"]) > 0  # blocking rounds ran
    # it reached the target, or ran out of its budget (the quick budget is short)
    assert number(out["speedup_vs_sync_diloco"]) or synced["stopped_by"] == "budget"
    assert out["config"]["seeds"] == 1 and out["config"]["peers"] == [2]
    assert out["link"]["bandwidth_mbit"] == 10.0
    # every CPU group the bench made is gone (this checked groups named after `proc.pid`, which
    # a finished run's result does not have: it passed only while none was left)
    assert {p.name for p in CPU_ROOT.glob("atom*")} <= groups_before


def test_the_ceiling_runs_the_peers_combined_batch_in_one_process_with_their_cpu(tmp_path: Path):
    from atomtrain.bench.cgroup import CpuQuotas
    from atomtrain.bench.scaling import ScalingBenchConfig, common_train_args

    cfg = ScalingBenchConfig()
    args = common_train_args(cfg, tmp_path, 0, tmp_path / "out", batches=4)
    assert f"--data.rows={4 * cfg.rows}" in args
    assert f"--train.micro_batch_rows={4 * cfg.rows}" in args
    assert f"--data.rows={cfg.rows}" in common_train_args(cfg, tmp_path, 0, tmp_path / "out")
    quotas = CpuQuotas(0.45, root=tmp_path)  # the groups' files only, no cgroup mounted here
    peer, ideal = quotas.group("peer"), quotas.group("ideal", cores=4 * 0.45)
    assert (peer / "cpu.cfs_quota_us").read_text() == "45000"
    assert (ideal / "cpu.cfs_quota_us").read_text() == "180000"


def test_the_ceiling_is_the_single_peer_time_and_steps_over_the_ideal_ones(tmp_path: Path):
    from types import SimpleNamespace

    from atomtrain.bench.scaling_report import report

    def run(name: str, hit_s: float, step: int, peers: int = 1) -> SystemRun:
        log = [
            {"step": 10, "loss": 3.0, "step_s": 0.1, "elapsed_s": 1.0, "time": 101.0},
            {"step": step, "val_loss": 2.1, "time": 100.0 + hit_s},
        ]
        (tmp_path / name).mkdir()
        return finished_run(tmp_path / name, [log] * peers, launch=100.0)

    runs = {
        "single": [run("s", 150.0, 1200)],
        "ideal_2": [run("i", 100.0, 1000)],
        "atom_2": [run("a", 160.0, 1300, peers=2)],
    }
    cfg = SimpleNamespace(
        target_loss=2.2, peers=(2,), bandwidth_mbit=10.0, gpu_to_cpu_ratio=1000.0, cpu_per_peer=0.45
    )
    out = report(runs, cfg, 2, config={})
    assert out["ceiling_2"] == 1.5 and out["step_ceiling_2"] == 1.2
    assert out["speedup_2"] == 150.0 / 160.0
    assert out["systems"]["ideal_2"]["per_seed"][0]["steps_to_target"] == 1000
    del runs["ideal_2"]  # --no-ceiling
    assert "ceiling_2" not in report(runs, cfg, 2, config={})


def test_every_system_validates_on_the_same_windows_whatever_its_batch(
    prepared: Path, tmp_path: Path
):
    from atomtrain.config import load_run_config
    from atomtrain.errors import AtomError
    from atomtrain.train.config import TrainConfig
    from atomtrain.train.session import open_session

    from .conftest import TINY

    def val_batches(*extra: str) -> list:
        cfg = load_run_config(
            overrides=[
                *TINY, f"--data.prepared={prepared}", f"--run.out_dir={tmp_path}",
                f"--run.name=r{len(list(tmp_path.iterdir()))}", *extra,
            ]
        )  # fmt: skip
        session = open_session(cfg)
        session.trainer.loader.close()
        return session.trainer.val_batches

    peer = val_batches()  # data.rows 8
    ideal = val_batches("--data.rows=16", "--train.micro_batch_rows=16", "--train.eval_rows=8")
    larger = val_batches("--data.rows=16", "--train.micro_batch_rows=16")
    assert len(peer) == len(ideal) == 2
    for (x, y), (xi, yi) in zip(peer, ideal, strict=True):
        assert torch.equal(x, xi) and torch.equal(y, yi)
    assert larger[0][0].shape[0] == 16  # without eval_rows: the run's own batch size
    with pytest.raises(AtomError, match="eval_rows"):
        TrainConfig(eval_rows=-1)


def test_the_ideal_process_is_launched_with_the_combined_batch_quota_and_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from dataclasses import replace

    from atomtrain.bench import scaling
    from atomtrain.bench.scaling import ScalingBenchConfig, run_ideal
    from atomtrain.errors import AtomError

    started = []

    class Lab:
        def link_bytes(self) -> list:
            return []

    class FakeLauncher:
        lab, work = Lab(), tmp_path

        def start(self, run, host, name, argv, metrics, cores=None, **env):
            started.append((host, name, argv, cores, env))

        def finish(self, run) -> None:
            pass

    monkeypatch.setattr(scaling, "watch", lambda run, target, budget: None)
    monkeypatch.setattr(scaling.os, "sched_getaffinity", lambda pid: {0, 1})
    cfg = ScalingBenchConfig()
    for n, threads in ((2, "1"), (4, "2"), (8, "2")):  # whole cores of the quota, at most 2
        run_ideal(FakeLauncher(), cfg, tmp_path, 0, n)  # type: ignore[arg-type]
        _, name, argv, cores, env = started[-1]
        assert name == f"s0-ideal_{n}" and cores == n * cfg.cpu_per_peer
        assert env == {"OMP_NUM_THREADS": threads}
        assert f"--data.rows={n * cfg.rows}" in argv and f"--train.eval_rows={cfg.rows}" in argv
        # its weight average decays n times a step: it spans as many windows as a peer's
        assert f"--train.ema={cfg.ema**n}" in argv
    assert scaling.check(replace(cfg, peers=(2, 4))) is None
    for bad in ({"ema": 1.0}, {"ema": -0.1}, {"lr": 0.0}, {"lr": float("nan")}):
        with pytest.raises(AtomError, match="lr must be positive and ema"):
            scaling.check(replace(cfg, **bad))  # type: ignore[arg-type]
    with pytest.raises(AtomError, match="distinct"):
        scaling.check(replace(cfg, peers=(2, 2)))


def test_no_ceiling_turns_the_ideal_systems_off(monkeypatch: pytest.MonkeyPatch):
    import argparse

    from atomtrain.bench import cgroup, netlab, scaling
    from atomtrain.cli import bench_cmd

    seen = []
    monkeypatch.setattr(cgroup, "require_cpu_cgroups", lambda: None)
    monkeypatch.setattr(netlab, "require_root_and_tools", lambda: None)
    monkeypatch.setattr(scaling, "run_scaling_bench", lambda cfg, out, progress: seen.append(cfg))
    parser = argparse.ArgumentParser()
    bench_cmd.register(parser.add_subparsers())
    for flags, ceiling in (([], True), (["--no-ceiling"], False)):
        args, extra = parser.parse_known_args(["bench", "scaling", "--json", *flags])
        monkeypatch.setattr(bench_cmd, "_emit", lambda result, as_json: None)
        assert args.func(args, extra) == 0
        assert seen[-1].ceiling is ceiling


def simulate(prepared: Path, *argv: str) -> tuple[list[float], dict]:
    """scripts/simulate_rounds.py on the tiny model: its validation losses and its result."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "simulate_rounds.py"
    common = ["--preset", "tiny", "--data", str(prepared), "--steps", "24", "--eval-every", "8"]
    out = subprocess.run(
        [sys.executable, str(script), *common, *argv], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    losses = [float(line.split(" val ")[1].split()[0]) for line in lines[:-1]]
    return losses, json.loads(lines[-1])


def test_the_round_simulation_changes_nothing_for_one_worker_and_averages_two(prepared: Path):
    """scripts/simulate_rounds.py (the README's "What takes the gain away"): a worker alone
    averages with itself, so its overlapped rounds (own share at the start, the correction at
    the landing) must leave its training as it was; two workers' rounds change it."""
    alone, plain = simulate(prepared, "--workers", "1")
    with_rounds, result = simulate(prepared, "--workers", "1", "--every", "4", "--lands-after", "2")
    assert result["rounds"] == 6 and plain["rounds"] == 0
    assert len(alone) == 3 and all(math.isfinite(v) for v in alone)
    assert with_rounds == pytest.approx(alone, abs=1e-3)
    two, _ = simulate(prepared, "--workers", "2", "--every", "4", "--lands-after", "2")
    assert all(math.isfinite(v) for v in two) and two != pytest.approx(alone, abs=1e-3)
