"""`atomtrain bench swap`: the same model and data trained plainly (all on the device) and through
the swap engine under a budget of 40% of what resident training needs, so that the plan must
offload or recompute activations besides streaming parameters.

Both runners train their own copy from the same initial weights on the same batches, in
interleaved rounds so that a noisy machine slows both alike. Numerics are checked on the first
batch (gradients) and on every step (losses). The host optimizer is timed against
`torch.optim.AdamW(fused=True)` on the same tensors, interleaved, in the same run.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

import torch

from atomtrain.engine.engine import EngineConfig, SwapEngine
from atomtrain.engine.factory import DTYPES, gpu_reserve
from atomtrain.engine.plan import Policy
from atomtrain.engine.runner import SwapRunner
from atomtrain.models import GPT, GPTConfig
from atomtrain.optim import AdamW, AdamWConfig
from atomtrain.planner.measure import measure_profile
from atomtrain.planner.partition import plan_dp, predict
from atomtrain.planner.profile import ModelProfile
from atomtrain.train.runner import PlainRunner


@dataclass(frozen=True)
class SwapBenchConfig:
    """Shape and length of the swap benchmark (defaults: about a minute on 2 CPU cores)."""

    preset: str = "small"
    n_layer: int = 8
    """Blocks (overrides the preset)."""
    n_embd: int = 512
    n_head: int = 8
    seq_len: int = 64
    rows: int = 16
    """Sequences per micro-batch."""
    micro_batches: int = 1
    """Micro-batches per step."""
    rounds: int = 5
    steps_per_round: int = 3
    device: str = "cpu"
    param_dtype: str = "float32"
    budget_bytes: int = 0
    """Device budget (0: `budget_fraction` of the resident need)."""
    budget_fraction: float = 0.4
    """Budget as a share of what resident training needs on the device (parameters,
    gradients and every saved activation; Adam moments, kept on the host, not counted)."""
    precision: str = "fp32"
    """Engine compute precision (fp32, bf16, fp16); the resident baseline stays fp32."""
    seed: int = 0


def resident_need(prof: ModelProfile, micro_batches: int) -> int:
    """Device bytes of resident training without its optimizer state: every parameter and
    gradient, and every activation of a micro-batch saved for its backward."""
    blocks = sum(b.param_bytes + b.grad_bytes + b.saved_bytes for b in prof.blocks)
    del micro_batches  # micro-batches run one after another: one's activations at a time
    return prof.outer_param_bytes + prof.outer_grad_bytes + prof.outer_saved_bytes + blocks


def optimizer_throughput(model: torch.nn.Module, reps: int = 9) -> dict[str, float]:
    """Parameters per second of our host AdamW and of torch.optim.AdamW(fused=True) stepping
    the same tensors (copies of the model's), in pairs whose order alternates, median of
    `reps` each; `vs_torch` is the median of each pair's speed ratio (ours / torch), with its
    range, so that a load change on a shared machine moves both sides of a pair alike."""
    ours_p = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref_p = [p.detach().clone().requires_grad_() for p in model.parameters()]
    g = torch.Generator().manual_seed(0)
    for p, r in zip(ours_p.values(), ref_p, strict=True):
        p.grad = torch.randn(p.shape, generator=g)
        r.grad = p.grad.clone()
    ours = AdamW(ours_p, AdamWConfig())
    ref = torch.optim.AdamW(ref_p, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    names = list(ours_p)
    steps = {"ours": lambda: ours.step(names, 1e-3), "torch": ref.step}
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    for i in range(reps + 1):  # the first pair warms up
        for name in ("ours", "torch") if i % 2 else ("torch", "ours"):
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    n = sum(p.numel() for p in ours_p.values())
    ratios = [t / o for o, t in zip(times["ours"][1:], times["torch"][1:], strict=True)]
    return {
        "ours": n / statistics.median(times["ours"][1:]),
        "torch": n / statistics.median(times["torch"][1:]),
        "vs_torch": statistics.median(ratios),
        "vs_torch_min": min(ratios),
        "vs_torch_max": max(ratios),
    }


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_swap_bench(cfg: SwapBenchConfig) -> dict:
    device = torch.device(cfg.device)
    mc = GPTConfig.from_name(
        cfg.preset,
        n_layer=cfg.n_layer,
        n_embd=cfg.n_embd,
        n_head=cfg.n_head,
        block_size=max(cfg.seq_len, 8),
    )
    torch.manual_seed(cfg.seed)
    host_model = GPT(mc)
    plain_model = copy.deepcopy(host_model).to(device)
    dtype = DTYPES[cfg.param_dtype]
    prof = measure_profile(host_model, cfg.rows, cfg.seq_len, device, dtype)
    need = resident_need(prof, cfg.micro_batches)
    budget = cfg.budget_bytes or int(need * cfg.budget_fraction)
    reserve = gpu_reserve(budget, device)
    plan = plan_dp(prof, budget - reserve, cfg.micro_batches)
    pred = predict(prof, plan, cfg.micro_batches)
    engine = SwapEngine(
        host_model,
        plan,
        EngineConfig(budget, cfg.param_dtype, reserve_bytes=reserve, precision=cfg.precision),
        device,
    )
    total_rows = cfg.rows * cfg.micro_batches
    gen = torch.Generator().manual_seed(cfg.seed)
    steps = cfg.rounds * cfg.steps_per_round + 1
    batches = [
        (
            torch.randint(0, mc.vocab_size, (total_rows, cfg.seq_len), generator=gen),
            torch.randint(0, mc.vocab_size, (total_rows, cfg.seq_len), generator=gen),
        )
        for _ in range(steps)
    ]
    # Gradients on the first batch, before any update.
    x0, y0 = batches[0]
    _, loss = plain_model(x0.to(device), y0.to(device))
    loss.backward()
    g_plain = _grads(plain_model)
    engine.run_pass(x0, y0, 1.0, first=True, final=True)
    engine.finish_step()
    g_swap = _grads(host_model)
    rel = max(
        float(
            (g_plain[n].float().cpu() - g_swap[n].float()).abs().max()
            / g_plain[n].float().abs().max().clamp_min(1e-12)
        )
        for n in g_plain
    )
    plain = PlainRunner(
        plain_model,
        AdamW(dict(plain_model.named_parameters()), AdamWConfig()),
        cfg.rows,
        1.0,
        device,
    )
    swap = SwapRunner(
        engine, AdamW(dict(host_model.named_parameters()), AdamWConfig()), cfg.rows, 1.0
    )
    engine.memory.reset_peak()
    opt_speed = optimizer_throughput(host_model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = {"plain": 0.0, "swap": 0.0}
    losses: dict[str, list[float]] = {"plain": [], "swap": []}
    runners: dict[str, PlainRunner | SwapRunner] = {"plain": plain, "swap": swap}
    cursor = {"plain": 0, "swap": 0}
    swap_peak = [0]

    def run(name: str, n: int) -> None:
        runner = runners[name]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)  # the resident model's, among others
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = batches[cursor[name]]
            cursor[name] += 1
            losses[name].append(runner.train_step(x, y, 1e-3)["loss"])
        if name == "swap":
            swap.sync()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            if name == "swap":
                used = torch.cuda.max_memory_allocated(device) - base
                swap_peak[0] = max(swap_peak[0], used)
        times[name] += time.perf_counter() - t0

    run("plain", 1)  # warm-up step for both, not timed below
    run("swap", 1)
    times = {"plain": 0.0, "swap": 0.0}
    swap.stats.optimizer_s = engine.gate_wait_s = 0.0
    for _ in range(cfg.rounds):
        run("plain", cfg.steps_per_round)
        run("swap", cfg.steps_per_round)
    tokens = cfg.rounds * cfg.steps_per_round * total_rows * cfg.seq_len
    resident = tokens / times["plain"]
    swapped = tokens / times["swap"]
    n_params = sum(p.numel() for p in host_model.parameters())
    swap.close()
    result = {
        "resident_tokens_per_s": resident,
        "swapped_tokens_per_s": swapped,
        "ratio": swapped / resident,
        "budget_bytes": budget,
        "resident_need_bytes": need,
        "budget_fraction": budget / need,
        # parameters and gradients at the device dtype: Adam's moments never go to the device
        "model_bytes": prof.model_param_bytes
        + prof.outer_grad_bytes
        + sum(b.grad_bytes for b in prof.blocks),
        "peak_device_bytes": engine.memory.peak,
        "num_submodels": len(plan.submodels),
        "max_abs_loss_diff": max(
            abs(a - b) for a, b in zip(losses["plain"], losses["swap"], strict=True)
        ),
        "max_rel_grad_diff": rel,
        "plan": plan.describe(),
        "policies": {p.value: sum(1 for s in plan.submodels if s.policy is p) for p in Policy},
        "optimizer_s": swap.stats.optimizer_s,
        "optimizer_wait_s": swap.stats.waited_s,
        "overlap_fraction": swap.stats.overlap_fraction,
        "optimizer_params_per_s": opt_speed["ours"],
        "torch_fused_adamw_params_per_s": opt_speed["torch"],
        "optimizer_vs_torch": opt_speed["vs_torch"],
        "optimizer_vs_torch_range": [opt_speed["vs_torch_min"], opt_speed["vs_torch_max"]],
        "precision": cfg.precision,
        "micro_batches_per_load": plan.micro_batches_per_load,
        "predicted_step_s": pred.step_s,
        "predicted_peak_bytes": pred.peak_bytes,
        "device": prof.device,
        "model": {"n_layer": mc.n_layer, "n_embd": mc.n_embd, "parameters": n_params},
        "tokens_per_step": total_rows * cfg.seq_len,
        "timed_steps": cfg.rounds * cfg.steps_per_round,
    }
    if device.type == "cuda":
        # Allocated by the swapped steps above what was allocated before them.
        result["cuda_max_allocated_bytes"] = swap_peak[0]
    return result
