"""The budget on a real GPU: what the allocator really holds, with another process beside."""

import subprocess
import sys

import pytest
import torch

from atomtrain.engine.engine import EngineConfig, SwapEngine
from atomtrain.engine.factory import gpu_reserve
from atomtrain.engine.runner import SwapRunner
from atomtrain.models import GPT, GPTConfig
from atomtrain.optim import AdamW, AdamWConfig
from atomtrain.planner.measure import measure_profile
from atomtrain.planner.partition import plan_dp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NEIGHBOUR = """
import sys, torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB held by another process
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def neighbour():
    proc = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOUR], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_allocated_memory_stays_within_the_budget(neighbour, precision: str):
    cuda = torch.device("cuda")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_head=8, n_embd=512, block_size=256, vocab_size=512))
    prof = measure_profile(model, rows=8, seq_len=256, device=cuda, reps=1)
    need = prof.model_param_bytes * 2 + sum(b.saved_bytes for b in prof.blocks)
    budget = int(need * 0.4)
    reserve = gpu_reserve(budget, cuda)
    plan = plan_dp(prof, budget - reserve, 1)
    cfg = EngineConfig(budget_bytes=budget, reserve_bytes=reserve, precision=precision)
    engine = SwapEngine(model, plan, cfg, cuda)
    runner = SwapRunner(engine, AdamW(dict(model.named_parameters()), AdamWConfig()), 8, 1.0)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 512, (8, 256), generator=g)
        out = runner.train_step(x, x.roll(-1, 1), lr=1e-3)
        assert torch.isfinite(torch.tensor(out["loss"]))
    runner.close()
    torch.cuda.synchronize()
    real = torch.cuda.max_memory_allocated() - base
    print(f"budget {budget} accounted {engine.memory.peak} allocated {real} ({precision})")
    assert engine.memory.peak <= budget
    assert real <= budget, (real, budget)
