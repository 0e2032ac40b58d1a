"""Building a swap runner for a run: profile (cached), plan, engine, runner."""

from __future__ import annotations

import logging

import torch
from torch import nn

from atomtrain.config import EngineSection, RunConfig
from atomtrain.engine.engine import EngineConfig, SwapEngine
from atomtrain.engine.plan import ExecutionPlan, Policy
from atomtrain.engine.runner import SwapRunner
from atomtrain.errors import AtomError
from atomtrain.optim import AdamW, LossScaler
from atomtrain.planner.host import HostSpec, check_host_memory, machine_memory_bytes
from atomtrain.planner.measure import cached_profile
from atomtrain.planner.partition import parse_bytes, plan_dp, predict

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def choose_plan(model: nn.Module, cfg: RunConfig, device: torch.device) -> ExecutionPlan:
    from atomtrain.engine.layout import find_blocks
    from atomtrain.train.session import cache_dir, compile_config

    ec = cfg.engine
    budget = parse_bytes(ec.device_memory)
    n_blocks = len(find_blocks(model, ec.blocks or None))
    micro_batches = cfg.data.rows // cfg.train.micro_batch_rows
    if ec.submodels:
        try:
            policy = Policy(ec.policy)
        except ValueError:
            raise AtomError(
                f"engine.policy must be keep, offload or recompute, got {ec.policy!r}"
            ) from None
        return ExecutionPlan.even(n_blocks, ec.submodels, policy)
    prof = cached_profile(
        model,
        cfg.train.micro_batch_rows,
        cfg.data.seq_len,
        device,
        DTYPES[ec.param_dtype],
        cache_dir() / "profiles",
        ec.blocks,
        compile_config(cfg) if ec.compile else None,
    )
    plan = plan_dp(
        prof, budget - gpu_reserve(budget, device), micro_batches, ec.max_blocks_per_submodel
    )
    pred = predict(prof, plan, micro_batches)
    itemsize = torch.empty((), dtype=DTYPES[ec.param_dtype]).element_size()
    host = HostSpec(
        machine_memory_bytes(), device_itemsize=itemsize, weight_average=cfg.train.ema > 0
    )
    check_host_memory(prof, plan, host)
    log.info(
        "plan: %s, %d micro-batches per load; predicted step %.3fs (bound %.3fs), "
        "peak %d of %d bytes",
        plan.describe(),
        plan.micro_batches_per_load,
        pred.step_s,
        pred.lower_bound_s,
        pred.peak_bytes,
        budget,
    )
    return plan


def check_engine_section(ec: EngineSection) -> None:
    if ec.param_dtype not in DTYPES:
        raise AtomError(
            f"engine.param_dtype must be one of {', '.join(DTYPES)}, got {ec.param_dtype!r}"
        )
    LossScaler.for_precision(ec.precision)  # a one-line error for an unknown precision
    if ec.submodels < 0 or ec.max_blocks_per_submodel < 1:
        raise AtomError("engine.submodels must be >= 0 and engine.max_blocks_per_submodel >= 1")


def gpu_reserve(budget: int, device: torch.device) -> int:
    """Bytes of the budget held back on a GPU for what the engine cannot count (context
    workspaces, allocator rounding, stream pools): 5%, at least 256 MiB, at most half."""
    if device.type != "cuda":
        return 0
    return min(budget // 2, max(256 << 20, budget // 20))


def swap_runner(model: nn.Module, opt: AdamW, cfg: RunConfig, device: torch.device) -> SwapRunner:
    """The engine's runner for `model`, which stays in host memory."""
    check_engine_section(cfg.engine)
    budget = parse_bytes(cfg.engine.device_memory)
    plan = choose_plan(model, cfg, device)
    ec = cfg.engine
    from atomtrain.train.session import compile_config

    compile = compile_config(cfg) if ec.compile else None
    reserve = gpu_reserve(budget, device)
    engine = SwapEngine(
        model,
        plan,
        EngineConfig(budget, ec.param_dtype, ec.blocks, reserve, ec.precision, compile),
        device,
    )
    return SwapRunner(engine, opt, cfg.train.micro_batch_rows, cfg.train.grad_clip)
