"""Compiled blocks (issue 15): one compilation per distinct block, whatever the depth; gradients
as eager ones; keep, offload and recompute, micro-batches per load, the boundary hook, the plain
runner; a block that cannot compile runs eagerly with one warning.

The tests compile with the `aot_eager` backend: the same Dynamo capture and AOTAutograd graphs as
Inductor, without generating and building C++ (minutes on a loaded 2-core machine). Inductor
itself is measured by `atomtrain bench compile`.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from atomtrain.engine.compiled import BlockCompiler, CompileConfig
from atomtrain.engine.engine import EngineConfig, SwapEngine
from atomtrain.engine.plan import ExecutionPlan, Policy, SubModel
from atomtrain.engine.runner import SwapRunner
from atomtrain.models import GPT, GPTConfig
from atomtrain.optim import AdamW, AdamWConfig

CPU = torch.device("cpu")
TEST_COMPILE = CompileConfig(backend="aot_eager")
MIXED = (
    SubModel(0, 1, Policy.KEEP),
    SubModel(1, 3, Policy.RECOMPUTE),
    SubModel(3, 4, Policy.OFFLOAD),
    SubModel(4, 6, Policy.KEEP),
)


def gpt(n_layer: int = 6) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=32, vocab_size=64))


def batches(n: int, rows: int = 4):
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, 64, (rows, 16), generator=g),
            torch.randint(0, 64, (rows, 16), generator=g),
        )
        for _ in range(n)
    ]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-12))


def runner(model: GPT, plan: ExecutionPlan, compile: CompileConfig | None) -> SwapRunner:
    engine = SwapEngine(model, plan, EngineConfig(1 << 30, compile=compile), CPU)
    return SwapRunner(engine, AdamW(dict(model.named_parameters()), AdamWConfig()), 2, 1.0)


@pytest.mark.parametrize("m", [1, 2], ids=["1-per-load", "2-per-load"])
def test_compiled_engine_matches_eager_with_every_policy(m: int):
    eager_model = gpt()
    compiled_model = copy.deepcopy(eager_model)
    plan = ExecutionPlan(MIXED, m)
    eager, compiled = runner(eager_model, plan, None), runner(compiled_model, plan, TEST_COMPILE)
    hook_calls: list[str] = []
    compiled.engine.boundary_hook = lambda where, evict: hook_calls.append(where)
    for x, y in batches(3):
        a = eager.train_step(x, y, lr=1e-2)
        b = compiled.train_step(x, y, lr=1e-2)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        eager.sync()
        compiled.sync()
        for name, p in eager_model.named_parameters():
            assert rel_diff(p.grad, compiled_model.get_parameter(name).grad) <= 1e-4, name
    assert eager.eval_loss(*batches(1)[0]) == pytest.approx(compiled.eval_loss(*batches(1)[0]))
    compiler = compiled.engine.compiler
    assert compiler is not None and not compiler.failed
    # Six blocks of one type, in three modes (training with grad; the recomputing sub-model's
    # forward under no_grad; evaluation): each compiled exactly once.
    assert compiler.distinct_blocks == 3
    assert sorted(compiler.compiles) == [
        "Block#0 (train, grad)",
        "Block#1 (train, no_grad)",
        "Block#2 (eval, no_grad)",
    ]
    assert list(compiler.compiles.values()) == [1, 1, 1]
    assert "forward 0" in hook_calls and "backward 3" in hook_calls
    eager.close()
    compiled.close()
    assert compiled.engine.memory.used == 0


def test_compilations_do_not_multiply_with_depth():
    counts = []
    for n_layer in (2, 8):
        model = gpt(n_layer)
        plan = ExecutionPlan.even(n_layer, 2, Policy.KEEP)
        r = runner(model, plan, TEST_COMPILE)
        for x, y in batches(2):
            r.train_step(x, y, lr=1e-2)
        assert r.engine.compiler is not None
        counts.append(dict(r.engine.compiler.compiles))
        r.close()
    assert [sum(c.values()) for c in counts] == [1, 1]


class Odd(nn.Module):
    """A block Dynamo cannot capture whole: it reads a tensor's value into Python."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.sum()) > 1e9:  # data-dependent control flow: a graph break
            return x
        return torch.tanh(self.lin(x))


def test_a_block_that_cannot_compile_runs_eagerly_with_one_warning(caplog):
    block = Odd()
    compiler = BlockCompiler(TEST_COMPILE)
    tensors = {n: p.detach().clone().requires_grad_() for n, p in block.named_parameters()}
    x = torch.randn(3, 8)
    with caplog.at_level(logging.WARNING, logger="atomtrain.engine.compiled"):
        outs = [compiler.call(block, tensors, (x,), {}, "block 7") for _ in range(3)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "block 7" in warnings[0] and "eagerly" in warnings[0]
    assert compiler.failed == ["Odd#0 (train, grad)"] and compiler.distinct_blocks == 0
    expected = block(x)
    for out in outs:
        torch.testing.assert_close(out, expected)
