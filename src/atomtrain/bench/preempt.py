"""`atomtrain bench preempt`: inference requests over HTTP, served alone, beside training without
preemption, and beside training with preemption at sub-model boundaries.

Training runs through the swap engine in a thread of the same process (as `atomtrain train
--serve` does), one block per sub-model and many micro-batches per step, so boundaries are close
together while a step is long. Without preemption each job keeps the device for its whole unit of
work (a training step, a request), as work already queued on a GPU does; the result also reports
the two simply running as uncoordinated threads (`concurrent_p99_ms`).
"""

from __future__ import annotations

import copy
import http.client
import json
import statistics
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from atomtrain.data.tokenizer import ByteTokenizer
from atomtrain.engine.engine import EngineConfig, SwapEngine
from atomtrain.engine.plan import ExecutionPlan, Policy
from atomtrain.engine.runner import SwapRunner
from atomtrain.models import GPT, GPTConfig
from atomtrain.optim import AdamW, AdamWConfig
from atomtrain.sched.scheduler import DeviceScheduler
from atomtrain.sched.serve import InferenceService, start_server


@dataclass(frozen=True)
class PreemptBenchConfig:
    """Defaults finish in about a minute on 2 CPU cores."""

    n_layer: int = 6
    n_embd: int = 192
    n_head: int = 6
    seq_len: int = 64
    train_rows: int = 128
    """Sequences per training step."""
    micro_batch_rows: int = 4
    """Sequences per pass: a step makes train_rows / micro_batch_rows passes."""
    requests: int = 25
    max_tokens: int = 16
    prompt: str = "def fibonacci(n):\n    "
    think_s: float = 0.1
    """Pause between a response and the next request."""
    seed: int = 0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _request(port: int, body: dict) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"request failed with HTTP {resp.status}")
    return (time.perf_counter() - t0) * 1e3


class _Training(threading.Thread):
    def __init__(
        self, runner: SwapRunner, cfg: PreemptBenchConfig, sched: DeviceScheduler | None, vocab: int
    ) -> None:
        super().__init__(daemon=True, name="bench-train")
        self.runner, self.cfg, self.sched = runner, cfg, sched
        self.stop = threading.Event()
        self.tokens = 0
        self.seconds = 0.0
        g = torch.Generator().manual_seed(cfg.seed)
        self.batch = (
            torch.randint(0, vocab, (cfg.train_rows, cfg.seq_len), generator=g),
            torch.randint(0, vocab, (cfg.train_rows, cfg.seq_len), generator=g),
        )
        self.started = threading.Event()

    def run(self) -> None:
        t0 = time.perf_counter()
        while not self.stop.is_set():
            with self.sched.train_step() if self.sched else nullcontext():
                self.runner.train_step(*self.batch, lr=1e-4)
            self.tokens += self.batch[0].numel()
            self.seconds = time.perf_counter() - t0
            self.started.set()


def run_preempt_bench(cfg: PreemptBenchConfig) -> dict:
    torch.manual_seed(cfg.seed)
    mc = GPTConfig(
        n_layer=cfg.n_layer,
        n_embd=cfg.n_embd,
        n_head=cfg.n_head,
        block_size=max(cfg.seq_len, 64),
        vocab_size=256,
    )
    train_model = GPT(mc)
    serve_model = copy.deepcopy(train_model).eval()
    plan = ExecutionPlan.even(cfg.n_layer, cfg.n_layer, Policy.KEEP, 1)
    engine = SwapEngine(train_model, plan, EngineConfig(budget_bytes=1 << 34), torch.device("cpu"))
    engine.trace.enabled = False
    runner = SwapRunner(
        engine,
        AdamW(dict(train_model.named_parameters()), AdamWConfig()),
        cfg.micro_batch_rows,
        1.0,
    )
    body = {"prompt": cfg.prompt, "max_tokens": cfg.max_tokens, "temperature": 0}

    def phase(sched: DeviceScheduler | None, with_training: bool) -> tuple[list[float], float]:
        service = InferenceService(serve_model, ByteTokenizer(), sched)
        server = start_server(service, "127.0.0.1", 0)
        port = server.server_address[1]
        engine.boundary_hook = sched.train_boundary if sched and sched.preemptive else None
        training = _Training(runner, cfg, sched, mc.vocab_size) if with_training else None
        try:
            _request(port, body)  # warm-up
            if training:
                training.start()
                training.started.wait(60)
            lat = []
            for _ in range(cfg.requests):
                lat.append(_request(port, body))
                time.sleep(cfg.think_s)
            rate = 0.0
            if training:
                rate = training.tokens / max(training.seconds, 1e-9)
            return lat, rate
        finally:
            if training:
                training.stop.set()
                training.join()
            server.shutdown()
            server.server_close()

    alone, _ = phase(None, False)
    # Training alone, for its throughput without inference load.
    solo = _Training(runner, cfg, None, mc.vocab_size)
    solo.start()
    time.sleep(6.0)
    solo.stop.set()
    solo.join()
    solo_rate = solo.tokens / max(solo.seconds, 1e-9)
    shared, _ = phase(DeviceScheduler(preemptive=False), True)
    concurrent, _ = phase(None, True)
    sched = DeviceScheduler(preemptive=True, memory=engine.memory)
    preemptive, pre_rate = phase(sched, True)
    runner.close()
    return {
        "alone_p50_ms": statistics.median(alone),
        "alone_p99_ms": _percentile(alone, 0.99),
        "shared_p99_ms": _percentile(shared, 0.99),
        "preemptive_p99_ms": _percentile(preemptive, 0.99),
        "preemptive_p50_ms": statistics.median(preemptive),
        "concurrent_p99_ms": _percentile(concurrent, 0.99),
        "training_tokens_per_s_ratio": pre_rate / solo_rate,
        "training_tokens_per_s_alone": solo_rate,
        "preemptions": sched.preemptions,
        "requests": cfg.requests,
        "submodels": len(plan.submodels),
        "passes_per_step": cfg.train_rows // cfg.micro_batch_rows,
    }
