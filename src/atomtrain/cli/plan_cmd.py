"""`atomtrain plan` (a plan for any preset from its shape and an analytic profile, without
torch) and
`atomtrain profile` (measure a model's blocks on this machine's device)."""

from __future__ import annotations

import argparse
import json
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="partition a model for a device memory budget",
        description="Plan a model without allocating it: the model is sized and "
        "costed from its shape and the device's speed.",
    )
    p.add_argument("--model", default="gpt3-13b", help="a model preset")
    p.add_argument("--device-memory", default="24GB", help="device memory budget, e.g. 24GB")
    p.add_argument("--rows", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0: context)")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step")
    p.add_argument("--dtype-bytes", type=int, default=2, help="bytes per device parameter")
    p.add_argument("--tflops", type=float, default=80.0, help="device TFLOP/s reached")
    p.add_argument("--h2d-gbps", type=float, default=25.0, help="host-to-device GB/s")
    p.add_argument("--max-blocks", type=int, default=8, help="longest sub-model considered")
    p.add_argument(
        "--host-memory", default="", help="host memory, e.g. 512GB (default: this machine's)"
    )
    p.add_argument(
        "--host-adam-gparams",
        type=float,
        default=0.38,
        help="host AdamW throughput in billions of parameters per second",
    )
    p.add_argument(
        "--weight-average",
        action="store_true",
        help="count a float32 moving average of the weights in host memory (train.ema)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan)

    q = sub.add_parser("profile", help="measure a model's per-block costs on this device")
    q.add_argument("--model", default="small", help="a model preset")
    q.add_argument("--rows", type=int, default=16, help="sequences per micro-batch")
    q.add_argument(
        "--seq-len", type=int, help="tokens per sequence (default: the context, at most 128)"
    )
    q.add_argument("--device", default="auto", help="auto, cpu or cuda")
    q.add_argument("--dtype", default="float32", help="device dtype of parameters")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=run_profile)


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def run_plan(args: argparse.Namespace, _extra: list[str]) -> int:
    from atomtrain.errors import AtomError
    from atomtrain.models import GPTConfig
    from atomtrain.planner.host import (
        HostSpec,
        host_memory_line,
        host_need,
        machine_memory_bytes,
        optimizer_cost_s,
    )
    from atomtrain.planner.partition import fmt_bytes, parse_bytes, plan_dp, predict
    from atomtrain.planner.profile import DeviceSpec, analytic_profile
    from atomtrain.values import check_number, parse_size

    cfg = GPTConfig.from_name(args.model)
    budget = parse_size(args.device_memory, "--device-memory")
    seq = args.seq_len or cfg.block_size
    if min(args.rows, seq, args.micro_batches, args.dtype_bytes, args.max_blocks) <= 0:
        raise AtomError(
            "--rows, --seq-len, --micro-batches, --dtype-bytes and --max-blocks must be positive"
        )
    if seq > cfg.block_size:
        raise AtomError(f"--seq-len {seq} exceeds the model's context {cfg.block_size}")
    check_number(args.tflops, "--tflops", 0.0, lo_open=True)
    check_number(args.h2d_gbps, "--h2d-gbps", 0.0, lo_open=True)
    t0 = time.perf_counter()
    prof = analytic_profile(
        cfg,
        args.rows,
        seq,
        DeviceSpec(budget, args.tflops, args.h2d_gbps, args.h2d_gbps),
        args.dtype_bytes,
    )
    plan = plan_dp(prof, budget, args.micro_batches, args.max_blocks)
    pred = predict(prof, plan, args.micro_batches)
    took = time.perf_counter() - t0
    host = HostSpec(
        parse_bytes(args.host_memory) if args.host_memory else machine_memory_bytes(),
        args.host_adam_gparams * 1e9,
        args.dtype_bytes,
        weight_average=args.weight_average,
    )
    host_line = host_memory_line(prof, plan, host)
    opt_s = optimizer_cost_s(prof, pred.step_s, host)
    rows = []
    for k, (s, c) in enumerate(zip(plan.submodels, pred.costs, strict=True)):
        nxt = pred.costs[k + 1].load_s if k + 1 < len(pred.costs) else 0.0
        hidden = 1.0 if nxt == 0 else min(1.0, c.fwd_s / nxt)
        rows.append(
            [
                str(k),
                f"{s.start}-{s.end - 1}",
                s.policy.value,
                fmt_bytes(c.params),
                fmt_bytes(c.saved),
                _ms(c.load_s),
                _ms(c.fwd_s),
                _ms(c.bwd_s),
                f"{hidden:.0%}",
            ]
        )
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "parameters": cfg.num_parameters(),
                    "budget_bytes": budget,
                    "peak_bytes": pred.peak_bytes,
                    "micro_batches_per_load": plan.micro_batches_per_load,
                    "passes": pred.passes,
                    "predicted_step_s": pred.step_s + opt_s,
                    "optimizer_s": opt_s,
                    "host_memory_bytes": host_need(prof, plan, host).total_bytes,
                    "host_memory": host_line,
                    "lower_bound_s": pred.lower_bound_s,
                    "submodels": [
                        {"start": s.start, "end": s.end, "policy": s.policy.value}
                        for s in plan.submodels
                    ],
                    "planning_s": took,
                }
            )
        )
        return 0
    from atomtrain.cli.table import render_table

    print(
        f"{args.model}: {cfg.num_parameters() / 1e9:.2f}B parameters, "
        f"{len(prof.blocks)} blocks, {args.rows}x{seq} tokens per micro-batch, "
        f"{args.micro_batches} micro-batches per step"
    )
    print(
        render_table(
            [
                "sub-model",
                "blocks",
                "policy",
                "params",
                "saved act",
                "load ms",
                "fwd ms",
                "bwd ms",
                "load hidden",
            ],
            rows,
        )
    )
    print(f"micro-batches per load: {plan.micro_batches_per_load} ({pred.passes} passes)")
    print(
        f"predicted step: {pred.step_s + opt_s:.3f} s (host optimizer {opt_s:.3f} s); lower "
        f"bound max(compute, load): {pred.lower_bound_s:.3f} s "
        f"({pred.lower_bound_s / (pred.step_s + opt_s):.0%})"
    )
    print(host_line)
    print(
        f"device peak: {fmt_bytes(pred.peak_bytes)} of {fmt_bytes(budget)}; "
        f"planned in {took:.2f} s ({prof.notes.get('source', '')})"
    )
    return 0


def run_profile(args: argparse.Namespace, _extra: list[str]) -> int:
    from atomtrain.checks import DEFAULT_SEQ_LEN_CAP
    from atomtrain.cli.table import render_table
    from atomtrain.engine.factory import DTYPES
    from atomtrain.errors import AtomError
    from atomtrain.models import GPT, GPTConfig
    from atomtrain.planner.measure import cached_profile
    from atomtrain.planner.partition import fmt_bytes
    from atomtrain.train.session import cache_dir, resolve_device

    if args.dtype not in DTYPES:
        raise AtomError(f"--dtype must be one of {', '.join(DTYPES)}")
    device = resolve_device(args.device)
    cfg = GPTConfig.from_name(args.model)
    seq = min(cfg.block_size, DEFAULT_SEQ_LEN_CAP) if args.seq_len is None else args.seq_len
    if args.rows <= 0 or seq <= 0:
        raise AtomError("--rows and --seq-len must be positive")
    if seq > cfg.block_size:
        raise AtomError(f"--seq-len {seq} exceeds the model's context {cfg.block_size}")
    model = GPT(cfg)
    prof = cached_profile(
        model, args.rows, seq, device, DTYPES[args.dtype], cache_dir() / "profiles"
    )
    if args.json:
        print(prof.to_json())
        return 0
    rows = [
        [
            str(i),
            _ms(b.fwd_s),
            _ms(b.bwd_s),
            fmt_bytes(b.param_bytes),
            fmt_bytes(b.input_bytes),
            fmt_bytes(b.saved_bytes),
        ]
        for i, b in enumerate(prof.blocks)
    ]
    print(render_table(["block", "fwd ms", "bwd ms", "params", "input", "saved"], rows))
    print(
        f"outer part: {fmt_bytes(prof.outer_param_bytes)} parameters, "
        f"{fmt_bytes(prof.outer_saved_bytes)} saved; host-to-device "
        f"{prof.h2d_bytes_per_s / 1e9:.1f} GB/s on {prof.device}"
    )
    return 0
