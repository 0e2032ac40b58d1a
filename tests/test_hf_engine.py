"""transformers models through the planner and the swap engine: the same step as plain training."""

import copy

import pytest
import torch

pytest.importorskip("transformers", reason="transformers not installed (pip install atomtrain[hf])")

from atomtrain.engine.engine import EngineConfig, SwapEngine
from atomtrain.engine.plan import ExecutionPlan, Policy
from atomtrain.engine.runner import SwapRunner
from atomtrain.models.hf import hf_from_config
from atomtrain.optim import AdamW, AdamWConfig
from atomtrain.planner.measure import measure_profile
from atomtrain.planner.partition import NoPlanFits, plan_dp
from atomtrain.planner.profile import ModelProfile
from atomtrain.train.runner import PlainRunner

from .hf_models import VOCAB, tiny_config

CPU = torch.device("cpu")
ROWS, MICRO, SEQ = 8, 4, 16


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return x, torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-12))


def smallest_budget(prof: ModelProfile, micro_batches: int) -> int:
    """The least budget the planner finds a plan for (bisection on bytes)."""
    lo, hi = 1, 4 * prof.model_param_bytes + 4 * sum(b.saved_bytes for b in prof.blocks)
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            plan_dp(prof, mid, micro_batches)
            hi = mid
        except NoPlanFits:
            lo = mid + 1
    return hi


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_planned_engine_step_matches_plain_step(kind: str):
    model = hf_from_config(tiny_config(kind))
    swap_model = copy.deepcopy(model)
    prof = measure_profile(model, rows=MICRO, seq_len=SEQ, device=CPU, reps=1)
    # A quarter above the least that fits: too little for fewer than three sub-models.
    budget = smallest_budget(prof, ROWS // MICRO) * 5 // 4
    plan = plan_dp(prof, budget, ROWS // MICRO)
    assert len(plan.submodels) >= 3, plan.describe()
    assert budget < prof.model_param_bytes * 3  # parameters, gradients, Adam state: no fit
    plain = PlainRunner(
        model, AdamW(dict(model.named_parameters()), AdamWConfig()), MICRO, 1.0, CPU
    )
    engine = SwapEngine(swap_model, plan, EngineConfig(budget_bytes=budget), CPU)
    swap = SwapRunner(engine, AdamW(dict(swap_model.named_parameters()), AdamWConfig()), MICRO, 1.0)
    x, y = batch()
    a = plain.train_step(x, y, lr=1e-2)
    b = swap.train_step(x, y, lr=1e-2)
    swap.sync()
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    for name, p in model.named_parameters():
        assert rel_diff(p.grad, swap_model.get_parameter(name).grad) <= 1e-5, name
    after = swap.host_parameters()
    for name, p in model.named_parameters():
        assert rel_diff(p.detach(), after[name].detach()) <= 1e-5, name
    assert 0 < engine.memory.peak <= budget
    swap.close()


def test_engine_runs_a_raw_transformers_model_through_call():
    """No adapter: `call=` says how to call the library's model and the loss is its `.loss`."""
    import transformers

    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", layers=4))
    lm.config.use_cache = False
    swap_lm = copy.deepcopy(lm)
    x, _ = batch()
    lm(input_ids=x, labels=x).loss.backward()
    engine = SwapEngine(
        swap_lm,
        ExecutionPlan.even(4, 3, Policy.RECOMPUTE),
        EngineConfig(budget_bytes=1 << 30),
        CPU,
        call=lambda m, x, y: m(input_ids=x, labels=y, use_cache=False),
    )
    engine.run_pass(x, x, 1.0, first=True, final=True)
    engine.finish_step()
    for name, p in lm.named_parameters():
        assert rel_diff(p.grad, swap_lm.get_parameter(name).grad) <= 1e-5, name
    engine.close()


@pytest.mark.parametrize("policy", list(Policy), ids=lambda p: p.value)
def test_frozen_parameters_stay_frozen_through_the_engine(policy: Policy):
    """Frozen embeddings and a frozen first layer: later layers still get their gradients."""
    model = hf_from_config(tiny_config("llama", layers=4))
    frozen = [n for n, p in model.named_parameters() if "layers.0." in n or "embed" in n]
    for n in frozen:
        model.get_parameter(n).requires_grad_(False)
    before = {n: model.get_parameter(n).detach().clone() for n in frozen}
    plain_model = copy.deepcopy(model)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    engine = SwapEngine(
        model, ExecutionPlan.even(4, 2, policy), EngineConfig(budget_bytes=1 << 30), CPU
    )
    swap = SwapRunner(engine, AdamW(trainable, AdamWConfig()), MICRO, 1.0)
    plain_params = {n: p for n, p in plain_model.named_parameters() if p.requires_grad}
    plain = PlainRunner(plain_model, AdamW(plain_params, AdamWConfig()), MICRO, 1.0, CPU)
    x, y = batch()
    plain.train_step(x, y, lr=1e-2)
    swap.train_step(x, y, lr=1e-2)
    after = swap.host_parameters()
    for n in frozen:
        assert torch.equal(after[n], before[n]) and after[n].grad is None, n
    for n, p in plain_model.named_parameters():
        assert rel_diff(p.detach(), after[n].detach()) <= 1e-5, n
    swap.close()
