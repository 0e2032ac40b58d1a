"""Mixed precision through the engine: fp32 masters, 16-bit compute, the loss curve of fp32."""

import copy

import pytest
import torch

from atomtrain.engine.engine import EngineConfig, SwapEngine
from atomtrain.engine.plan import ExecutionPlan, Policy, SubModel
from atomtrain.engine.runner import SwapRunner
from atomtrain.errors import AtomError
from atomtrain.optim import AdamW, AdamWConfig, LossScaler
from atomtrain.train.runner import PlainRunner

from .test_engine import ForCausalLM
from .test_engine_exact import batches, gpt

CPU = torch.device("cpu")
PLAN = ExecutionPlan(
    (
        SubModel(0, 2, Policy.KEEP),
        SubModel(2, 4, Policy.RECOMPUTE),
        SubModel(4, 6, Policy.OFFLOAD),
    )
)


@pytest.mark.parametrize(
    "precision,param_dtype",
    [("bf16", "bfloat16"), ("bf16", "float32"), ("fp16", "float16")],
)
def test_mixed_precision_follows_the_fp32_loss_curve(precision: str, param_dtype: str):
    model = gpt()
    twin = copy.deepcopy(model)
    plain = PlainRunner(model, AdamW(dict(model.named_parameters()), AdamWConfig()), 8, 1.0, CPU)
    cfg = EngineConfig(budget_bytes=1 << 30, param_dtype=param_dtype, precision=precision)
    engine = SwapEngine(twin, PLAN, cfg, CPU)
    swap = SwapRunner(engine, AdamW(dict(twin.named_parameters()), AdamWConfig()), 8, 1.0)
    data = batches(4) * 3  # 12 steps: the loss falls
    a = [plain.train_step(x, y, lr=3e-3)["loss"] for x, y in data]
    b = [swap.train_step(x, y, lr=3e-3)["loss"] for x, y in data]
    params = swap.host_parameters()
    assert all(p.dtype == torch.float32 for p in params.values())  # masters stay fp32
    assert a[-1] < a[0] - 0.1 and b[-1] < b[0] - 0.1
    for la, lb in zip(a, b, strict=True):
        assert lb == pytest.approx(la, rel=0.02)
    assert b != a  # 16-bit compute really ran
    swap.close()


def test_buffers_keep_their_dtype_on_the_device():
    torch.manual_seed(0)
    model = ForCausalLM()
    cfg = EngineConfig(budget_bytes=1 << 28, param_dtype="bfloat16", precision="bf16")
    engine = SwapEngine(model, ExecutionPlan.even(4, 2), cfg, CPU)
    outer = engine._load_outer()
    assert outer["model.inv_freq"].dtype == torch.float32
    assert outer["lm_head.weight"].dtype == torch.bfloat16
    engine.close()


def test_fp16_loss_scale_halves_on_overflow_and_the_step_is_skipped():
    model = gpt()
    cfg = EngineConfig(budget_bytes=1 << 30, param_dtype="float16", precision="fp16")
    engine = SwapEngine(model, PLAN, cfg, CPU)
    # A scale that overflows float16 gradients: the step must be skipped, the scale halved.
    swap = SwapRunner(
        engine,
        AdamW(dict(model.named_parameters()), AdamWConfig()),
        8,
        1.0,
        LossScaler(2.0**40, dynamic=True),
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batches(1)[0]
    out = swap.train_step(x, y, lr=1e-2)
    assert not torch.isfinite(torch.tensor(out["grad_norm"]))
    assert swap.scaler.scale == 2.0**39
    for n, p in swap.host_parameters().items():
        assert torch.equal(p.detach(), before[n]), n
    for _ in range(30):  # it comes down to a scale that works, then trains
        out = swap.train_step(x, y, lr=1e-2)
        if torch.isfinite(torch.tensor(out["grad_norm"])):
            break
    assert torch.isfinite(torch.tensor(out["grad_norm"]))
    swap.sync()
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    swap.close()


def test_unknown_precision_is_refused():
    with pytest.raises(AtomError, match="engine.precision"):
        LossScaler.for_precision("fp8")


def test_the_weight_average_swapped_in_is_what_a_16_bit_engine_evaluates():
    """The engine loads low-precision staging copies of the masters (param_dtype): after the
    average is exchanged into the masters, an evaluation must read it, not the old copies."""
    from atomtrain.train.averaged import WeightAverage

    model = gpt()
    initial = copy.deepcopy(model)
    cfg = EngineConfig(budget_bytes=1 << 30, param_dtype="bfloat16", precision="bf16")
    swap = SwapRunner(
        SwapEngine(model, PLAN, cfg, CPU),
        AdamW(dict(model.named_parameters()), AdamWConfig()),
        8,
        1.0,
    )
    average = WeightAverage(swap.host_parameters(), 0.99)  # the initial weights, kept so
    data = batches(4) * 3
    for x, y in data:
        swap.train_step(x, y, lr=3e-3)
    x, y = data[0]
    trained = swap.eval_loss(x, y)
    reference = PlainRunner(
        initial, AdamW(dict(initial.named_parameters()), AdamWConfig()), 8, 1.0, CPU
    )
    with average.swapped_in(swap.host_parameters(), swap.parameters_written):
        averaged = swap.eval_loss(x, y)
    assert averaged == pytest.approx(reference.eval_loss(x, y), rel=0.01)
    assert abs(averaged - trained) > 0.1  # the trained weights are another model
    assert swap.eval_loss(x, y) == trained  # and back after the block
    swap.close()
