"""Streaming input and data echoing: adaptive, never back to back, lossless, resumable."""

import itertools
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import pytest

from atomtrain.data.corpus import resolve_sources
from atomtrain.data.reuse import EchoingLoader, ReuseConfig
from atomtrain.data.stream import StreamConfig, StreamingSource
from atomtrain.train.metrics import read_metrics

from .conftest import TINY, run_cli

SEQ = 16


def source(corpus_dir: Path, rate: float = 0.0, rows: int = 4) -> StreamingSource:
    return StreamingSource(
        resolve_sources(str(corpus_dir)),
        StreamConfig(rows=rows, chunk_len=SEQ + 1 + 8, rate_tokens_per_s=rate),
    )


def loader(corpus_dir: Path, rate: float, max_echo: int = 4) -> EchoingLoader:
    return EchoingLoader(source(corpus_dir, rate), ReuseConfig(max_echo=max_echo, seq_len=SEQ))


def batch_tokens() -> int:
    return 4 * (SEQ + 1 + 8)


def test_echo_factor_follows_upstream_and_step_times(corpus_dir: Path):
    step_s = 0.01
    slow = loader(corpus_dir, rate=batch_tokens() / (3 * step_s), max_echo=8)  # 3x a step
    for _ in range(60):
        slow.next_batch()
        time.sleep(step_s)
    slow.close()
    # the echo factor follows the times it measured (a busy machine stretches both), nominally 3
    assert slow.up_s is not None and slow.step_s is not None
    ratio = min(8.0, slow.up_s / slow.step_s)
    assert ratio > 1.5  # upstream was the bottleneck
    assert ratio - 1.0 <= slow.echo_factor <= math.ceil(ratio) + 1.0
    fast = loader(corpus_dir, rate=0.0)  # upstream keeps up: nothing is reused
    for _ in range(30):
        fast.next_batch()
        time.sleep(step_s)
    fast.close()
    assert fast.echo_factor == 1.0 and fast.echoed == 0
    capped = loader(corpus_dir, rate=batch_tokens() / (20 * step_s), max_echo=2)
    for _ in range(30):
        capped.next_batch()
    capped.close()
    assert capped.echo_factor <= 2.0 + 1e-9


def test_no_batch_repeats_back_to_back_and_every_upstream_batch_is_used(corpus_dir: Path):
    ld = loader(corpus_dir, rate=batch_tokens() / 0.03)
    out = [ld.next_batch()[0].numpy() for _ in range(80)]
    ld.close()
    assert ld.echoed > 20  # reuse happened
    for a, b in itertools.pairwise(out):
        assert not np.array_equal(a, b)
    reference = source(corpus_dir)  # the same stream, read without delay
    upstream = [reference.take()[:, :SEQ] for _ in range(ld.fresh)]
    reference.close()
    emitted = iter(out)
    for batch in upstream:  # each upstream batch appears, in order, as it came
        assert any(np.array_equal(batch, o) for o in emitted)


def test_stream_and_reuse_resume_exactly(corpus_dir: Path):
    rate = batch_tokens() / 0.05  # far slower than these instant steps: always 2 reuses

    def run(n: int, state=None):  # type: ignore[no-untyped-def]
        ld = loader(corpus_dir, rate, max_echo=3)
        if state is not None:
            ld.load_state_dict(state)
        out = [ld.next_batch()[0].numpy() for _ in range(n)]
        st = ld.state_dict()
        ld.close()
        return out, st

    whole, _ = run(12)
    first, state = run(6)
    rest, _ = run(6, state)
    for a, b in zip(whole, first + rest, strict=True):
        assert np.array_equal(a, b)


def test_streaming_source_cursor_resumes(corpus_dir: Path):
    a = source(corpus_dir)
    seq = [a.take() for _ in range(10)]
    a.close()
    b = source(corpus_dir)
    for _ in range(4):
        b.take()
    state = b.state_dict()
    b.close()
    c = source(corpus_dir)
    c.load_state_dict(state)
    for want in seq[4:]:
        assert np.array_equal(c.take(), want)
    c.close()


def test_training_from_a_slow_stream_reports_the_echo_factor(
    prepared: Path, corpus_dir: Path, tmp_path: Path
):
    proc = run_cli(
        "train",
        *TINY,
        "--train.steps=12",
        f"--data.prepared={prepared}",
        f"--data.source={corpus_dir}",
        # ~2 s a batch: slower than a step of the tiny model even on a crowded machine
        "--input-rate=400",
        "--name=s",
        "--no-sample",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    records = [r for r in read_metrics(tmp_path / "runs/s/metrics.jsonl") if "loss" in r]
    assert all("echo" in r for r in records) and records[-1]["echo"] > 1.0


def test_echoes_the_model_has_learnt_are_dropped_then_tried_again(corpus_dir: Path):
    # upstream (0.1 s a batch) far slower than these instant steps, even in a starved process:
    # every fresh batch may have 3 echoes
    ld = EchoingLoader(
        source(corpus_dir, rate=batch_tokens() / 0.1),
        ReuseConfig(max_echo=4, seq_len=SEQ, gap_window=4, recover_fresh=6),
    )

    def train(n: int, echo_gap: float) -> list[bool]:
        kinds = []
        for _ in range(n):
            before = ld.fresh
            ld.next_batch()
            fresh = ld.fresh > before
            ld.record_loss(3.0 if fresh else 3.0 + echo_gap)  # echoes as the model sees them
            kinds.append(fresh)
        return kinds

    def echo_share(kinds: list[bool]) -> float:
        return 1 - sum(kinds) / len(kinds)

    assert echo_share(train(40, -0.05)) > 0.6  # echoes nearly as hard as fresh: all are kept
    assert ld.cap == 4
    train(30, -1.0)  # echoes far easier than fresh batches: learnt by heart
    # the cap falls to 1 (only fresh batches) and is probed at 2 now and then
    assert ld.cap <= 2 and echo_share(train(40, -1.0)) < 0.35
    assert echo_share(train(60, -0.05)) > 0.4  # worth it again: the cap rises back
    assert ld.cap == 4 and ld.state_dict()["cap"] == 4
    ld.close()


@pytest.mark.bench
def test_bench_reuse_quick_reports_medians_over_seeds(corpus_dir: Path, tmp_path: Path):
    proc = run_cli(
        "bench", "reuse", "--quick", "--json", f"--source={corpus_dir}", cwd=tmp_path, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["seeds"] == [0, 1, 2] and len(out["per_seed"]) == 3
    # the target was fixed from the full-speed runs, before the slowed ones
    assert out["target_loss"] == statistics.median(out["target_losses_per_seed"])
    assert out["target_loss"] < math.log(256)  # below a model that knows nothing
    speedups = []
    for s in out["per_seed"]:
        assert s["steps_reuse"] > s["steps_no_reuse"] > 0  # reuse kept the device busier
        assert s["echo_factor"] > 1.0
        assert math.isfinite(s["final_loss_reuse"]) and math.isfinite(s["final_loss_no_reuse"])
        if s["speedup"] is not None:
            want = s["no_reuse_time_to_target_s"] / s["reuse_time_to_target_s"]
            assert s["speedup"] == want
            speedups.append(want)
    assert out["seeds_reached"] == len(speedups)
    if speedups:
        assert out["speedup_median"] == statistics.median(speedups)
        assert out["speedup_min"] == min(speedups)
    want_diff = (out["final_loss_reuse"] - out["final_loss_no_reuse"]) / out["final_loss_no_reuse"]
    assert out["final_loss_rel_diff"] == want_diff


def test_bench_reuse_rejects_a_bad_flag_in_one_line(tmp_path: Path):
    proc = run_cli("bench", "reuse", "--seeds=0", cwd=tmp_path)
    assert proc.returncode == 2
    assert "--seeds" in proc.stderr and "Traceback" not in proc.stderr
