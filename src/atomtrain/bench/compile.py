"""`atomtrain bench compile`: the swap engine with eager blocks against the same engine with
compiled blocks (`engine.compile`), on the same model, plan, budget and batches, in one run.

Both engines train their own copy from the same initial weights, in interleaved rounds so that a
noisy machine slows both alike; throughput is measured after one warm-up step each (the compiled
engine's first step is where it compiles, reported apart as `compile_s`). The compile starts from an
empty cache directory made for the run; `compile_s_cached` is the same first compile in a fresh
process on that directory, as a restarted peer pays it. Gradients are compared on the first batch.

Where the time goes: a few more steps of each under the profiler, their CPU time split into
matrix products and attention (library kernels, which compiled code calls just as eager code
does), Inductor's generated kernels, and everything else. `speedup_ceiling` is the most compiling
could give if it made everything but those library kernels free; `block_speedup` is one block's
forward and backward alone, eager against compiled.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch

from atomtrain.engine.compiled import CompileConfig
from atomtrain.engine.engine import EngineConfig, SwapEngine
from atomtrain.engine.plan import ExecutionPlan, Policy
from atomtrain.engine.runner import SwapRunner
from atomtrain.models import GPT, GPTConfig
from atomtrain.optim import AdamW, AdamWConfig
from atomtrain.planner.measure import measure_profile
from atomtrain.planner.partition import plan_dp

CPU = torch.device("cpu")


@dataclass(frozen=True)
class CompileBenchConfig:
    """Shape and length of the compile benchmark (defaults: the `small` preset as it is)."""

    preset: str = "small"
    seq_len: int = 0
    """Tokens per row (0: the preset's block size)."""
    rows: int = 16
    """Sequences per micro-batch."""
    rounds: int = 20
    """Rounds of eager then compiled steps: many short ones, so that each pair sees the same
    load on a shared machine."""
    steps_per_round: int = 2
    budget_fraction: float = 0.4
    """Budget as a share of what resident training needs (as in `bench swap`): several
    sub-models, with the activation policies the planner picks for it."""
    backend: str = "inductor"
    seed: int = 0


def _model(cfg: CompileBenchConfig) -> tuple[GPT, int]:
    mc = GPTConfig.from_name(cfg.preset)
    seq_len = cfg.seq_len or mc.block_size
    torch.manual_seed(cfg.seed)
    return GPT(GPTConfig.from_name(cfg.preset, block_size=max(seq_len, mc.block_size))), seq_len


def _plan(model: GPT, cfg: CompileBenchConfig, seq_len: int) -> tuple[ExecutionPlan, int]:
    from atomtrain.bench.swap import resident_need

    prof = measure_profile(model, cfg.rows, seq_len, CPU, torch.float32)
    budget = int(resident_need(prof, 1) * cfg.budget_fraction)
    return plan_dp(prof, budget, 1), budget


def _runner(model: GPT, plan: ExecutionPlan, budget: int, comp: CompileConfig | None) -> SwapRunner:
    engine = SwapEngine(model, plan, EngineConfig(budget, compile=comp), CPU)
    return SwapRunner(engine, AdamW(dict(model.named_parameters()), AdamWConfig()), 10**9, 1.0)


def _batches(
    cfg: CompileBenchConfig, seq_len: int, vocab: int, n: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(cfg.seed)
    shape = (cfg.rows, seq_len)
    return [
        (
            torch.randint(0, vocab, shape, generator=gen),
            torch.randint(0, vocab, shape, generator=gen),
        )
        for _ in range(n)
    ]


def first_compile_s(cfg: CompileBenchConfig, plan: ExecutionPlan, budget: int, cache: str) -> float:
    """Seconds the compiled engine's first step spends compiling (or loading) its blocks: run in
    a fresh process, on the cache directory `cache`."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    model, seq_len = _model(cfg)
    runner = _runner(model, plan, budget, CompileConfig(cfg.backend, cache))
    x, y = _batches(cfg, seq_len, model.config.vocab_size, 1)[0]
    runner.train_step(x, y, 1e-3)
    runner.close()
    assert runner.engine.compiler is not None
    return runner.engine.compiler.compile_s


def _quartiles(values: list[float]) -> list[float]:
    return statistics.quantiles(values, n=4) if len(values) > 1 else list(values)


def _grad_diff(eager: SwapRunner, compiled: SwapRunner, x: torch.Tensor, y: torch.Tensor) -> float:
    worst = 0.0
    for r in (eager, compiled):
        r.engine.run_pass(x, y, 1.0, first=True, final=True)
        r.engine.finish_step()
    a, b = eager.engine.host_params, compiled.engine.host_params
    for n, p in a.items():
        ga, gb = p.grad, b[n].grad
        assert ga is not None and gb is not None
        worst = max(worst, float((ga - gb).abs().max() / ga.abs().max().clamp_min(1e-12)))
    return worst


LIBRARY_KERNELS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::"),
    "attention": ("scaled_dot_product",),
}


def cpu_ms_by_kind(runner: SwapRunner, batches: list) -> dict[str, float]:
    """CPU milliseconds per step (all threads), by kind of work."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x, y in batches:
            runner.train_step(x, y, 1e-3)
        runner.sync()
    ms = dict.fromkeys([*LIBRARY_KERNELS, "generated_kernels", "other"], 0.0)
    for event in prof.key_averages():
        kind = next(
            (k for k, names in LIBRARY_KERNELS.items() if any(n in event.key for n in names)),
            "generated_kernels" if "CompiledFxGraph" in event.key else "other",
        )
        ms[kind] += event.self_cpu_time_total / 1e3 / len(batches)
    ms["total"] = sum(ms.values())
    return ms


def block_ms(model: GPT, cfg: CompileBenchConfig, seq_len: int, cache: str) -> dict[str, float]:
    """Forward and backward of the first block alone, eager and compiled (its own compiler:
    loaded from the run's cache), interleaved: what compiling does to the part it touches."""
    from atomtrain.engine.compiled import BlockCompiler, eager_call

    block = model.blocks[0]
    compiler = BlockCompiler(CompileConfig(cfg.backend, cache))
    tensors = {n: p.detach().clone().requires_grad_() for n, p in block.named_parameters()}
    x = torch.randn(cfg.rows, seq_len, model.config.n_embd, requires_grad=True)
    g = torch.randn_like(x)
    calls = {"eager": eager_call, "compiled": compiler.call}
    times: dict[str, list[float]] = {k: [] for k in calls}
    for rep in range(2 * cfg.rounds + 1):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call(block, tensors, (x,), {}, "block 0").backward(g)
            if rep:  # the first compiles (or loads)
                times[name].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def run_compile_bench(cfg: CompileBenchConfig) -> dict:
    with tempfile.TemporaryDirectory(prefix="atom-bench-compile-") as cache:
        previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # an empty cache: the cold figure
        try:
            return _run(cfg, cache)
        finally:
            if previous is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def _run(cfg: CompileBenchConfig, cache: str) -> dict:
    model, seq_len = _model(cfg)
    plan, budget = _plan(model, cfg, seq_len)
    runners = {
        "eager": _runner(copy.deepcopy(model), plan, budget, None),
        "compiled": _runner(model, plan, budget, CompileConfig(cfg.backend, cache)),
    }
    steps = cfg.rounds * cfg.steps_per_round
    batches = _batches(cfg, seq_len, model.config.vocab_size, steps + 2)
    rel = _grad_diff(runners["eager"], runners["compiled"], *batches[0])
    compiler = runners["compiled"].engine.compiler
    assert compiler is not None
    compile_s = compiler.compile_s
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    cpu: dict[str, list[float]] = {"eager": [], "compiled": []}
    cursor = {"eager": 1, "compiled": 1}

    def run(name: str, n: int) -> None:
        r = runners[name]
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            x, y = batches[cursor[name]]
            r.train_step(x, y, 1e-3)
            cursor[name] += 1
        r.sync()
        times[name].append((time.perf_counter() - t0) / n)
        cpu[name].append((time.process_time() - c0) / n)

    run("eager", 1)  # warm-up, not counted
    run("compiled", 1)
    times = {"eager": [], "compiled": []}
    cpu = {"eager": [], "compiled": []}
    for _ in range(cfg.rounds):
        run("eager", cfg.steps_per_round)
        run("compiled", cfg.steps_per_round)
    profile_batches = batches[-1:] * cfg.steps_per_round
    cpu_ms = {k: cpu_ms_by_kind(r, profile_batches) for k, r in runners.items()}
    for r in runners.values():
        r.close()
    one_block = block_ms(model, cfg, seq_len, cache)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        cached = pool.submit(first_compile_s, cfg, plan, budget, cache).result()
    tokens_per_step = cfg.rows * seq_len
    eager_s, compiled_s = (statistics.median(times[k]) for k in ("eager", "compiled"))
    paired = sorted(a / b for a, b in zip(times["eager"], times["compiled"], strict=True))
    return {
        "eager_tokens_per_s": tokens_per_step / eager_s,
        "compiled_tokens_per_s": tokens_per_step / compiled_s,
        "speedup": eager_s / compiled_s,
        # the same ratio round by round (each round's eager steps over its compiled ones)
        "speedup_per_round_quartiles": _quartiles(paired),
        "compile_s": compile_s,
        "compile_s_cached": cached,
        "max_rel_grad_diff": rel,
        "distinct_blocks_compiled": compiler.distinct_blocks,
        "compilations": dict(compiler.compiles),
        "fell_back_to_eager": list(compiler.failed),
        "step_s_quartiles": {k: _quartiles(v) for k, v in times.items()},
        # CPU seconds of this process per step (all threads): on a machine shared with other
        # work, wall time also measures how much of the CPU the others left
        "step_cpu_s_quartiles": {k: _quartiles(v) for k, v in cpu.items()},
        "cpu_time_speedup": statistics.median(cpu["eager"]) / statistics.median(cpu["compiled"]),
        "cpu_ms_per_step": cpu_ms,
        "block_fwd_bwd_ms": one_block,
        "block_speedup": one_block["eager"] / one_block["compiled"],
        "speedup_ceiling": cpu_ms["eager"]["total"]
        / (cpu_ms["eager"]["matmul"] + cpu_ms["eager"]["attention"]),
        "plan": plan.describe(),
        "policies": {p.value: sum(1 for s in plan.submodels if s.policy is p) for p in Policy},
        "budget_bytes": budget,
        "backend": cfg.backend,
        "torch_threads": torch.get_num_threads(),
        "config": asdict(cfg) | {"seq_len": seq_len},
        "model": {
            "n_layer": model.config.n_layer,
            "n_embd": model.config.n_embd,
            "parameters": sum(p.numel() for p in model.parameters()),
        },
    }
