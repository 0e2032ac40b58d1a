"""The figures of `bench scaling`, from the records its systems left.

A run that did not reach the target within its budget counts as infinitely slow in medians, so
a median that is not reached reads null (with `reached` saying how many seeds did)."""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Any

from atomtrain.bench.scaling_launch import SystemRun, reached_at

Records = list[dict[str, Any]]


def busy_fraction(records: Records) -> float | None:
    """Compute seconds / wall seconds while training (a trainer's steps and validations, the
    initial one included, or a baseline worker's `busy_s`)."""
    steps = [r for r in records if "step_s" in r or "eval_s" in r or "busy_s" in r]
    if not steps:
        return None
    busy = sum(r.get("step_s", 0.0) + r.get("eval_s", 0.0) + r.get("busy_s", 0.0) for r in steps)
    wall = max(float(r["elapsed_s"] if "elapsed_s" in r else r["t"]) for r in steps)
    return busy / wall if wall > 0 else None


def last_value(records: Records, key: str) -> Any:
    return next((r[key] for r in reversed(records) if key in r), None)


def blamed(record: dict[str, Any]) -> list[str]:
    """The peers a record names as banned, or left out for what their updates read as (not
    for a stall, which a loaded link or machine makes of an honest peer)."""
    return [*record.get("left_out_for_updates", ()), *record.get("rejected_peers", ())]


def swarm_seed(run: SystemRun, target: float) -> dict[str, Any]:
    """One seed of `single` or of a swarm: reached when every process has."""
    logs = run.records()
    # a validation written while the processes shut down, after the budget, does not count
    end = run.stopped_at if run.stopped_by == "budget" else math.inf
    times = [
        t if t is not None and t <= end else None for t in (reached_at(r, target) for r in logs)
    ]
    done = bool(logs) and all(t is not None for t in times)
    rounds = [max((r.get("round", 0) for r in log), default=0) for log in logs]
    sent = [
        after[0] - before[0]
        for before, after in zip(run.bytes_before, run.bytes_after, strict=False)
    ][: len(logs)]
    per_round = [s / n for s, n in zip(sent, rounds, strict=True) if n > 0]
    moved = [  # both directions, on the link and as the averager counted them
        (after[0] - before[0]) + (after[1] - before[1])
        for before, after in zip(run.bytes_before, run.bytes_after, strict=False)
    ][: len(logs)]
    counted = [last_value(log, "averager_bytes") for log in logs]
    agree = [
        c / m
        for c, m, n in zip(counted, moved, rounds, strict=True)
        if c is not None and m > 0 and n > 0
    ]
    # the counters the status table's network figures come from (wire.py), at the peer's exit
    wire = [last_value(log, "wire_bytes") for log in logs]
    wire_agree = [
        w / m for w, m, n in zip(wire, moved, rounds, strict=True) if w and m > 0 and n > 0
    ]
    memory = [
        r["averaging_memory_ratio"]
        for log in logs
        for r in log
        if r.get("averaging_memory_ratio") is not None
    ]
    busy = [b for log in logs if (b := busy_fraction(log)) is not None]
    round_s = [r["round_s"] for log in logs for r in log if r.get("round_s") is not None]
    reach = [
        next((r["step"] for r in log if r.get("val_loss", math.inf) <= target), None)
        for log in logs
    ]
    return {
        "time_s": max(t for t in times if t is not None) - run.launch_time if done else None,
        "steps_to_target": max(s for s in reach if s is not None) if done else None,
        "stopped_by": run.stopped_by,
        "rounds": rounds,
        "sync_every": [last_value(log, "sync_every") for log in logs],
        "round_s": statistics.median(round_s) if round_s else None,
        "bytes_sent_per_round": statistics.mean(per_round) if per_round else None,
        "averager_vs_link_bytes": statistics.mean(agree) if agree else None,
        "wire_vs_link_bytes": statistics.mean(wire_agree) if wire_agree else None,
        "averaging_memory_ratio": max(memory) if memory else None,
        "device_busy_fraction": statistics.mean(busy) if busy else None,
        "final_val_loss": [last_value(log, "val_loss") for log in logs],
        # every peer here is honest: one banned, or left out for its updates, by another is
        # the defence's mistake
        "left_out": [sorted({n for r in log for n in blamed(r)}) for log in logs],
        "errors": run.errors(),
    }


def step_seconds(records: Records) -> float | None:
    """Median seconds between consecutive training steps (validations excluded)."""
    ts = [r["t"] for r in records if "loss" in r and "t" in r]
    gaps = [b - a for a, b in itertools.pairwise(ts)]
    return statistics.median(gaps) if gaps else None


def baseline_seed(run: SystemRun, target: float, single_steps: float | None, world: int) -> dict:
    """DDP or the pipeline: measured when it reached the target, else bounded from below by its
    start-up plus the single peer's steps / world at its measured seconds per step."""
    logs = run.records()
    reached = [t for log in logs if (t := reached_at(log, target)) is not None]
    first = next((log[0] for log in logs if log), None)
    startup = first["time"] - first["t"] - run.launch_time if first else None
    s_step = step_seconds(logs[0]) if logs else None
    bound = None
    if startup is not None and s_step is not None and single_steps is not None:
        bound = startup + single_steps / world * s_step
    busy = [b for log in logs if (b := busy_fraction(log)) is not None]
    return {
        "time_s": min(reached) - run.launch_time if reached else None,
        "time_is_lower_bound": not reached,
        "lower_bound_s": bound,
        "startup_s": startup,
        "s_per_step": s_step,
        "steps": len([r for r in logs[0] if "loss" in r]) if logs else 0,
        "final_val_loss": next(
            (v for log in logs if (v := last_value(log, "val_loss")) is not None), None
        ),
        "device_busy_fraction": statistics.mean(busy) if busy else None,
        "stopped_by": run.stopped_by,
        "errors": run.errors(),
    }


def spread(values: list[float | None]) -> dict[str, Any]:
    finite = [math.inf if v is None else v for v in values]
    med = statistics.median(finite) if finite else math.inf
    return {
        "median_s": med if math.isfinite(med) else None,
        "min_s": min(finite) if finite and math.isfinite(min(finite)) else None,
        "max_s": max(finite) if finite and math.isfinite(max(finite)) else None,
        "reached": sum(v is not None for v in values),
        "seeds": len(values),
    }


def median_of(seeds: list[dict], key: str) -> float | None:
    values = [s[key] for s in seeds if s.get(key) is not None]
    return statistics.median(values) if values else None


def ratio(slow: float | None, fast: float | None) -> float | None:
    return slow / fast if slow is not None and fast else None


def report(runs: dict[str, list[SystemRun]], cfg: Any, largest: int, config: dict) -> dict:
    target = cfg.target_loss
    systems: dict[str, dict[str, Any]] = {}
    ideal = [f"ideal_{n}" for n in cfg.peers if f"ideal_{n}" in runs]
    for name in ["single", *ideal, *(f"atom_{n}" for n in cfg.peers), "sync_diloco"]:
        seeds = [swarm_seed(r, target) for r in runs.get(name, [])]
        systems[name] = {**spread([s["time_s"] for s in seeds]), "per_seed": seeds}
        for key in (
            "bytes_sent_per_round",
            "averager_vs_link_bytes",
            "wire_vs_link_bytes",
            "averaging_memory_ratio",
            "device_busy_fraction",
        ):
            systems[name][key] = median_of(seeds, key)
    single_steps = median_of(systems["single"]["per_seed"], "steps_to_target")
    for name in ("ddp", "pipeline"):
        seeds = [baseline_seed(r, target, single_steps, largest) for r in runs.get(name, [])]
        measured = [s["time_s"] if s["time_s"] is not None else s["lower_bound_s"] for s in seeds]
        systems[name] = {
            **spread(measured),
            "is_lower_bound": any(s["time_is_lower_bound"] for s in seeds),
            "per_seed": seeds,
        }
    single = systems["single"]["median_s"]
    big = systems[f"atom_{largest}"]
    out: dict[str, Any] = {
        "target_loss": target,
        "link": link(cfg),
        "single_steps_to_target": single_steps,
    }
    for n in cfg.peers:
        out[f"speedup_{n}"] = ratio(single, systems[f"atom_{n}"]["median_s"])
    for n in cfg.peers:  # the data-parallel ceiling with the same settings (scaling.py)
        if f"ideal_{n}" in systems:
            seeds = systems[f"ideal_{n}"]["per_seed"]
            out[f"ceiling_{n}"] = ratio(single, systems[f"ideal_{n}"]["median_s"])
            steps = spread([s["steps_to_target"] for s in seeds])["median_s"]  # missed: slowest
            out[f"step_ceiling_{n}"] = ratio(single_steps, steps)
    for name in ("ddp", "pipeline", "sync_diloco"):
        out[f"speedup_vs_{name}"] = ratio(systems[name]["median_s"], big["median_s"])
    out["speedups_vs_ddp_pipeline_are_lower_bounds"] = any(
        systems[n]["is_lower_bound"] for n in ("ddp", "pipeline")
    )
    out["device_busy_fraction"] = big["device_busy_fraction"]
    out["averaging_memory_ratio"] = big["averaging_memory_ratio"]
    out["bytes_per_round"] = big["bytes_sent_per_round"]
    out["averager_vs_link_bytes"] = big["averager_vs_link_bytes"]
    out["wire_vs_link_bytes"] = big["wire_vs_link_bytes"]
    out["notes"] = (
        f"figures of the swarm (device busy, memory, bytes) are those of atom_{largest}, "
        "median over seeds; bytes_per_round: bytes each peer sent per round on its link (DHT "
        "traffic included); averager_vs_link_bytes: the bytes each peer's averager counted "
        "(sent and received, traffic.py) over the bytes its link carried both ways; "
        "wire_vs_link_bytes: the bytes each peer counted on the wire (the kernel's counters of "
        "its p2p daemon's sockets and their headers: wire.py, where the status table's Mb/s "
        "and round MB come from) over the bytes its link carried both ways; a swarm reaches "
        "the target when every peer has validated at or below it; all times from the launch "
        "of a system's first process; ceiling_N: time of single / of ideal_N (one process with "
        "N times the batch and the CPU quota: N peers' batches combined every step for free), "
        "step_ceiling_N: single's steps to the target / ideal_N's, the steps N peers' data saves "
        "when combined exactly every step"
    )
    out["systems"] = systems
    out["config"] = config
    return finite(out)


def finite(value: Any) -> Any:
    """`value` with NaN and infinities as None, so the output is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def link(cfg: Any) -> dict[str, Any]:
    return {
        "bandwidth_mbit": cfg.bandwidth_mbit,
        "latency_ms": 0.0,
        "latency_note": "not shaped: this kernel has no netem",
        "gpu_to_cpu_ratio": cfg.gpu_to_cpu_ratio,
        "gpu_equivalent_bandwidth_mbit": cfg.bandwidth_mbit * cfg.gpu_to_cpu_ratio,
        "gpu_equivalence": (
            f"each process computes in {cfg.cpu_per_peer} cores, about {cfg.gpu_to_cpu_ratio:g}x "
            "slower than a consumer GPU, so this link is as slow relative to compute as "
            f"{cfg.bandwidth_mbit * cfg.gpu_to_cpu_ratio:g} Mbit/s between GPU machines"
        ),
    }
