"""Compiled blocks (issue 15): one compilation per distinct block, not one per block; gradients
as eager ones; keep, offload and recompute, micro-batches per load, the boundary hook, the plain
runner; a block that cannot compile runs eagerly with one warning.

The tests compile with the `aot_eager` backend: the same Dynamo capture and AOTAutograd graphs as
Inductor, without generating and building C++ (minutes on a loaded 2-core machine). Inductor
itself is measured by `atomtrain bench compile`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from functools import partial

import pytest
import torch
from torch import nn

from atomtrain.bench.compile import cpu_ms_by_kind
from atomtrain.cli.main import main
from atomtrain.config import EngineSection, RunConfig
from atomtrain.engine.compiled import BlockCompiler, CompileConfig, compiled_blocks
from atomtrain.engine.engine import EngineConfig, SwapEngine
from atomtrain.engine.factory import swap_runner
from atomtrain.engine.plan import ExecutionPlan, Policy, SubModel
from atomtrain.engine.runner import SwapRunner
from atomtrain.models import GPT, GPTConfig
from atomtrain.optim import AdamW, AdamWConfig
from atomtrain.planner.measure import measure_profile
from atomtrain.train.runner import PlainRunner
from atomtrain.train.session import plain_runner

CPU = torch.device("cpu")
TEST_COMPILE = CompileConfig(backend="aot_eager")
MIXED = (
    SubModel(0, 1, Policy.KEEP),
    SubModel(1, 3, Policy.RECOMPUTE),
    SubModel(3, 4, Policy.OFFLOAD),
    SubModel(4, 6, Policy.KEEP),
)


def gpt(n_layer: int = 6, dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            n_layer=n_layer, n_head=2, n_embd=32, block_size=32, vocab_size=64, dropout=dropout
        )
    )


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


def test_compiled_engine_matches_eager_with_every_policy():
    eager_model = gpt(dropout=0.1)  # the recompute draws the forward's dropout masks again
    compiled_model = copy.deepcopy(eager_model)
    plan = ExecutionPlan(MIXED, 2)  # two micro-batches per load
    eager, compiled = runner(eager_model, plan, None), runner(compiled_model, plan, TEST_COMPILE)
    hook_calls: list[str] = []

    def preempt(where: str, evict) -> None:  # as the device scheduler does for a request
        hook_calls.append(where)
        if where in ("forward 2", "backward 1"):
            evict()

    compiled.engine.boundary_hook = preempt
    for step, (x, y) in enumerate(batches(3)):
        torch.manual_seed(step)  # dropout masks drawn alike
        a = eager.train_step(x, y, lr=1e-2)
        torch.manual_seed(step)
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
    # forward under no_grad; evaluation): each mode compiled exactly once, not once per block.
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


def test_plain_runner_and_profiler_run_compiled_blocks():
    eager_model = gpt(2)
    compiled_model = copy.deepcopy(eager_model)
    compiler = BlockCompiler(TEST_COMPILE)
    eager = PlainRunner(
        eager_model, AdamW(dict(eager_model.named_parameters()), AdamWConfig()), 4, 1.0, CPU
    )
    compiled = PlainRunner(
        compiled_model,
        AdamW(dict(compiled_model.named_parameters()), AdamWConfig()),
        4,
        1.0,
        CPU,
        partial(compiled_blocks, compiled_model, compiler),
    )
    for x, y in batches(2):
        assert eager.train_step(x, y, 1e-2)["loss"] == pytest.approx(
            compiled.train_step(x, y, 1e-2)["loss"], rel=1e-5
        )
    for name, p in eager_model.named_parameters():
        assert rel_diff(p.detach(), compiled_model.get_parameter(name).detach()) <= 1e-4, name
    assert dict(compiler.compiles) == {"Block#0 (train, grad)": 1}
    assert isinstance(compiled_model.blocks[0], type(eager_model.blocks[0]))  # restored

    profiler = BlockCompiler(TEST_COMPILE)
    prof = measure_profile(gpt(2), 2, 16, CPU, reps=1, block_call=profiler.call)
    assert prof.notes["blocks"] == "compiled"
    assert set(profiler.compiles) == {"Block#0 (train, no_grad)", "Block#1 (train, grad)"}


def test_run_settings_turn_compiling_on_for_either_runner(monkeypatch, tmp_path):
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    engine = EngineSection(
        device_memory="1GB", submodels=2, compile=True, compile_backend="aot_eager"
    )
    cfg = RunConfig(engine=engine)
    model = gpt(2)
    swap = swap_runner(model, AdamW(dict(model.named_parameters()), AdamWConfig()), cfg, CPU)
    assert swap.engine.compiler is not None
    assert swap.engine.compiler.cfg == CompileConfig("aot_eager", str(tmp_path / "inductor"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    swap.close()
    plain = plain_runner(model, AdamW(dict(model.named_parameters()), AdamWConfig()), cfg, CPU)
    assert isinstance(plain, PlainRunner) and plain.forward_context is not contextlib.nullcontext


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["train", "--engine.compile=maybe"], "engine.compile expects true or false"),
        (["train", "--engine.compile_backend=tvm"], "engine.compile_backend must be one of"),
        (["bench", "compile", "--rows", "0"], "--rows"),
    ],
)
def test_bad_compile_settings_are_one_line_errors(args, fragment, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("atomtrain: error: ")]
    assert len(lines) == 1 and fragment in lines[0], err
    assert not (tmp_path / "runs").exists()


def test_bench_splits_cpu_time_by_kind_of_work():
    model = gpt(2)
    r = runner(model, ExecutionPlan.even(2, 2, Policy.KEEP), None)
    ms = cpu_ms_by_kind(r, batches(1))
    r.close()
    assert set(ms) == {"matmul", "attention", "generated_kernels", "other", "total"}
    assert ms["matmul"] > 0 and ms["attention"] > 0 and ms["generated_kernels"] == 0
    assert ms["total"] == pytest.approx(sum(v for k, v in ms.items() if k != "total"))


def test_a_missing_cxx_compiler_means_eager_with_one_warning(caplog, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing cached to load
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    tensors = {n: p.detach().clone().requires_grad_() for n, p in block.named_parameters()}
    x = torch.randn(3, 8)
    compiler = BlockCompiler(CompileConfig("inductor"))
    with (
        caplog.at_level(logging.WARNING, logger="atomtrain.engine.compiled"),
        torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/g++",)}),
    ):
        outs = [compiler.call(block, tensors, (x,), {}, "block 2") for _ in range(2)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "block 2" in warnings[0], warnings
    assert compiler.failed and compiler.distinct_blocks == 0
    for out in outs:
        torch.testing.assert_close(out, block(x))
