"""The planner: exact against brute force, a bound that never cuts a plan it should keep, clear
when nothing fits, plans for GPT-3 sizes that fit."""

import itertools
import json
import random
import subprocess
import sys
from dataclasses import replace

import pytest

from atomtrain.engine.plan import ExecutionPlan, Policy, SubModel
from atomtrain.errors import AtomError
from atomtrain.models import GPTConfig
from atomtrain.planner import search
from atomtrain.planner.cost import POLICIES, bwd_slot, outer_bytes, outer_transfer_s, pair_window
from atomtrain.planner.partition import (
    MAX_BLOCKS_PER_SUBMODEL,
    NoPlanFits,
    _best_uniform,
    parse_bytes,
    plan_brute_force,
    plan_dp,
    predict,
)
from atomtrain.planner.profile import BlockCost, DeviceSpec, ModelProfile, analytic_profile
from atomtrain.planner.search import _rest_sums, _Search


def random_profile(rng: random.Random, n: int) -> ModelProfile:
    blocks = tuple(
        BlockCost(
            fwd_s=rng.uniform(0.5, 2),
            bwd_s=rng.uniform(1, 4),
            param_bytes=rng.randint(50, 200),
            grad_bytes=rng.randint(50, 200),
            input_bytes=rng.randint(5, 30),
            saved_bytes=rng.randint(20, 120),
        )
        for _ in range(n)
    )
    return ModelProfile(
        blocks,
        40,
        40,
        30,
        0.3,
        0.6,
        h2d_bytes_per_s=rng.uniform(50, 300),
        d2h_bytes_per_s=rng.uniform(50, 300),
        micro_batch_rows=1,
        seq_len=1,
        device="test",
        measured=False,
    )


@pytest.mark.parametrize("seed", range(40))
def test_dynamic_program_is_optimal_against_brute_force(seed: int):
    rng = random.Random(seed)
    prof = random_profile(rng, rng.randint(1, 6))
    micro = rng.choice([1, 2, 4])
    budget = rng.randint(500, 1500)
    try:
        brute = predict(prof, plan_brute_force(prof, budget, micro, 3), micro).step_s
    except NoPlanFits:
        with pytest.raises(NoPlanFits):
            plan_dp(prof, budget, micro, 3)
        return
    plan = plan_dp(prof, budget, micro, 3)
    pred = predict(prof, plan, micro)
    assert pred.peak_bytes <= budget
    assert pred.step_s == pytest.approx(brute, rel=1e-12)
    assert pred.step_s >= pred.lower_bound_s * (1 - 1e-12)


def _random_plan(rng: random.Random, n: int, max_len: int, m: int) -> ExecutionPlan:
    cuts = [0]
    while cuts[-1] < n:
        cuts.append(min(n, cuts[-1] + rng.randint(1, max_len)))
    subs = (SubModel(a, b, rng.choice(POLICIES)) for a, b in itertools.pairwise(cuts))
    return ExecutionPlan(tuple(subs), m)


@pytest.mark.parametrize("seed", range(24))
def test_the_search_never_bounds_a_partial_plan_above_what_it_costs(seed: int):
    """Branch and bound drops a partial plan when its time plus a bound on what the blocks
    after it must cost exceeds the best plan known: for every prefix of a plan, under the
    tightest budget the plan fits (where the bound counts the most blocks that cannot be
    kept), that sum stays within the plan's own predicted time."""
    rng = random.Random(300 + seed)
    prof = random_profile(rng, rng.randint(2, 16))
    if seed % 2:  # a slow link: transfer-bound
        prof = replace(prof, h2d_bytes_per_s=5.0, d2h_bytes_per_s=5.0)
    max_len = rng.randint(1, 4)
    for _ in range(6):
        micro = rng.choice([1, 2, 4])
        m = rng.choice([d for d in (1, 2, 4) if micro % d == 0])
        plan = _random_plan(rng, len(prof.blocks), max_len, m)
        pred = predict(prof, plan, micro)
        room = pred.peak_bytes - outer_bytes(prof, m)
        search = _Search(prof, room, m, max_len, {}, _rest_sums(prof, m, max_len), float("inf"))
        passes = micro // m
        per_pass = (pred.step_s - outer_transfer_s(prof, passes)) / passes
        c = pred.costs
        t = c[0].load_s / passes + bwd_slot(c[0], None)
        saved, window = c[0].saved, c[0].params + c[0].grads + c[0].workspace
        for k, sub in enumerate(plan.submodels):
            if k:
                t += max(c[k - 1].fwd_s, c[k].load_s) + bwd_slot(c[k], c[k - 1])
                saved += c[k].saved
                window = max(window, pair_window(c[k - 1], c[k]))
            rest = search._rest_bound(sub.end, c[k], saved, window)
            assert t + rest + search.outer_s <= per_pass * (1 + 1e-12)


def test_a_block_too_big_is_named_with_the_missing_bytes():
    prof = random_profile(random.Random(0), 3)
    big = BlockCost(1, 2, 10_000, 10_000, 10, 10)
    prof = ModelProfile((*prof.blocks, big), 40, 40, 30, 0.3, 0.6, 100, 100, 1, 1, "t", False)
    with pytest.raises(NoPlanFits, match=r"block 3 alone needs .* more than the budget"):
        plan_dp(prof, 5_000, 1)


@pytest.mark.parametrize("name", ["gpt3-13b", "gpt3-175b"])
@pytest.mark.parametrize("gb", [24, 80])
def test_gpt3_plans_are_proved_optimal_and_fit(name: str, gb: int, monkeypatch):
    """No state's Pareto front reaches the cap where labels would be merged: the search stays
    exact for GPT-3 shapes, its plan fits and is no slower than any simple plan."""

    def merged(*_):
        raise AssertionError("a front reached the cap: the plan is not proved optimal")

    monkeypatch.setattr(search, "_thin", merged)
    cfg = GPTConfig.from_name(name)
    budget = gb * 10**9
    prof = analytic_profile(cfg, 1, 2048, DeviceSpec(budget))
    plan = plan_dp(prof, budget, 8)
    pred = predict(prof, plan, 8)
    assert pred.peak_bytes <= budget and len(plan.submodels) > 1
    simple = [_best_uniform(prof, budget, 8, m, MAX_BLOCKS_PER_SUBMODEL) for m in (1, 2, 4, 8)]
    assert pred.step_s <= min(s[0] for s in simple if s is not None) * (1 + 1e-12)


def test_parse_bytes():
    assert parse_bytes("24GB") == 24 * 10**9
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("1.5e3") == 1500
    with pytest.raises(AtomError, match="cannot read"):
        parse_bytes("lots")


@pytest.mark.parametrize("seed", range(12))
def test_no_plan_beats_the_lower_bound(seed: int):
    rng = random.Random(100 + seed)
    prof = random_profile(rng, rng.randint(2, 4))
    if seed % 2:  # a slow link: transfer-bound
        prof = replace(prof, h2d_bytes_per_s=5.0, d2h_bytes_per_s=5.0)
    for micro in (1, 2, 4):
        for k in range(1, len(prof.blocks) + 1):
            for m in (d for d in (1, 2, 4) if micro % d == 0):
                for policy in (Policy.KEEP, Policy.OFFLOAD, Policy.RECOMPUTE):
                    pred = predict(prof, ExecutionPlan.even(len(prof.blocks), k, policy, m), micro)
                    assert pred.step_s >= pred.lower_bound_s * (1 - 1e-12)


def test_the_prediction_counts_the_outer_part_and_the_shared_link():
    prof = random_profile(random.Random(7), 3)
    plan = ExecutionPlan.even(3, 3, Policy.KEEP)
    base = predict(prof, plan, 2).step_s
    heavier = replace(prof, outer_param_bytes=prof.outer_param_bytes + 1000)
    assert predict(heavier, plan, 2).step_s == pytest.approx(base + 1000 / prof.h2d_bytes_per_s)
    slow = replace(prof, blocks=tuple(replace(b, bwd_s=1e-6) for b in prof.blocks))
    off = predict(slow, ExecutionPlan.even(3, 3, Policy.OFFLOAD), 1)
    c1, c2 = off.costs[1], off.costs[0]
    assert c1.restore_s > 0
    # sub-model 1's backward slot: the load of sub-model 0 and its own restore, one after another
    assert off.step_s >= c2.load_s + c1.restore_s


def test_host_memory_is_checked_with_a_one_line_answer():
    from atomtrain.planner.host import (
        HostSpec,
        check_host_memory,
        host_memory_line,
        host_need,
        num_params,
    )

    cfg = GPTConfig.from_name("gpt3-175b")
    prof = analytic_profile(cfg, 1, 2048, DeviceSpec(80 * 10**9))
    plan = ExecutionPlan.even(len(prof.blocks), len(prof.blocks), Policy.OFFLOAD)
    small = HostSpec(512 * 10**9, device_itemsize=2)
    line = host_memory_line(prof, plan, small)
    assert "\n" not in line and "short" in line and "AdamW" in line
    with pytest.raises(AtomError, match=r"host memory: needs 2\.9 TiB .* short"):
        check_host_memory(prof, plan, small)
    check_host_memory(prof, plan, HostSpec(4 * 10**12, device_itemsize=2))  # fits: no error
    # a weight average (train.ema) is one more float32 copy of the model: 175e9 x 4 bytes
    averaged = HostSpec(4 * 10**12, device_itemsize=2, weight_average=True)
    grown = host_need(prof, plan, averaged).total_bytes - host_need(prof, plan, small).total_bytes
    assert grown == num_params(prof, 2) * 4 and 0.17e12 * 4 < grown < 0.18e12 * 4
    assert "weight average 6" in host_memory_line(prof, plan, averaged)


def test_atomtrain_plan_sizes_a_model_without_torch():
    """The plan command works from shapes and numbers alone: it starts without loading torch
    (seconds of a 175B plan's time from launch otherwise)."""
    code = (
        "import sys; from atomtrain.cli.main import main; "
        "rc = main(['plan', '--model', 'gpt3-175b', '--device-memory', '80GB', '--json']); "
        "assert rc == 0 and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["peak_bytes"] <= plan["budget_bytes"] == 80 * 10**9
    assert plan["parameters"] == GPTConfig.from_name("gpt3-175b").num_parameters()
