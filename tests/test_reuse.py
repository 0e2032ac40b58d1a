"""Streaming input and data echoing: adaptive, never back to back, lossless, resumable."""

import itertools
import math
import time
from pathlib import Path

import numpy as np

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
        "--train.steps=20",
        f"--data.prepared={prepared}",
        f"--data.source={corpus_dir}",
        "--input-rate=4000",
        "--name=s",
        "--no-sample",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    records = [r for r in read_metrics(tmp_path / "runs/s/metrics.jsonl") if "loss" in r]
    assert all("echo" in r for r in records) and records[-1]["echo"] > 1.0
