"""The swap engine against the plain model: same losses, same gradients, same parameters."""

import copy
import math

import pytest
import torch
from torch import nn

from atomtrain.engine.engine import EngineConfig, SwapEngine
from atomtrain.engine.layout import find_blocks
from atomtrain.engine.plan import ExecutionPlan, Policy, SubModel
from atomtrain.engine.runner import SwapRunner
from atomtrain.errors import AtomError
from atomtrain.models import GPT, GPTConfig
from atomtrain.optim import AdamW, AdamWConfig
from atomtrain.planner.measure import measure_profile
from atomtrain.planner.partition import plan_dp, predict
from atomtrain.train.runner import PlainRunner

CPU = torch.device("cpu")
MIXED = ExecutionPlan(
    (
        SubModel(0, 1, Policy.KEEP),
        SubModel(1, 3, Policy.RECOMPUTE),
        SubModel(3, 4, Policy.OFFLOAD),
        SubModel(4, 6, Policy.KEEP),
    ),
    1,
)


def gpt(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(
        GPTConfig(n_layer=6, n_head=2, n_embd=32, block_size=32, vocab_size=64, dropout=dropout)
    )


def batches(n: int, rows: int = 8, vocab: int = 64):
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, vocab, (rows, 16), generator=g),
            torch.randint(0, vocab, (rows, 16), generator=g),
        )
        for _ in range(n)
    ]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("m", [1, 2], ids=["1-per-load", "2-per-load"])
def test_swapped_training_matches_plain(clip: float, m: int):
    plain_model = gpt(dropout=0.1)
    swap_model = copy.deepcopy(plain_model)
    plan = ExecutionPlan(MIXED.submodels, m)
    plain = PlainRunner(
        plain_model, AdamW(dict(plain_model.named_parameters()), AdamWConfig()), 2 * m, clip, CPU
    )
    engine = SwapEngine(swap_model, plan, EngineConfig(budget_bytes=1 << 30), CPU)
    swap = SwapRunner(engine, AdamW(dict(swap_model.named_parameters()), AdamWConfig()), 2, clip)
    for step, (x, y) in enumerate(batches(5)):
        torch.manual_seed(100 + step)  # dropout masks drawn alike
        a = plain.train_step(x, y, lr=1e-2)
        torch.manual_seed(100 + step)
        b = swap.train_step(x, y, lr=1e-2)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        swap.sync()  # the host optimizer may still be scaling (clipping) gradients
        for name, p in plain_model.named_parameters():
            assert rel_diff(p.grad, swap_model.get_parameter(name).grad) <= 1e-5, name
    swapped = swap.host_parameters()
    for name, p in plain_model.named_parameters():
        assert rel_diff(p.detach(), swapped[name].detach()) <= 1e-5, name
    assert swap.eval_loss(*batches(1)[0]) == pytest.approx(plain.eval_loss(*batches(1)[0]))
    swap.close()
    assert engine.memory.used == 0  # everything reserved was released


def test_the_weight_average_follows_each_submodel_as_plain_training_averages_the_whole():
    """train.ema with the swap engine: the average is updated on the optimizer thread as each
    sub-model is stepped (a skipped step included), and ends where the plain runner's average,
    updated after each whole step, does."""
    from atomtrain.train.averaged import WeightAverage

    plain_model = gpt()
    swap_model = copy.deepcopy(plain_model)
    plain = PlainRunner(
        plain_model, AdamW(dict(plain_model.named_parameters()), AdamWConfig()), 2, 1.0, CPU
    )
    engine = SwapEngine(swap_model, MIXED, EngineConfig(budget_bytes=1 << 30), CPU)
    swap = SwapRunner(engine, AdamW(dict(swap_model.named_parameters()), AdamWConfig()), 2, 1.0)
    averages = [WeightAverage(r.host_parameters(), 0.9) for r in (plain, swap)]
    swap_params = swap.host_parameters()
    for step, (x, y) in enumerate(batches(5)):
        if step == 4:  # the last step's gradients overflow (block 1's backward): skipped by both
            swap.sync()  # (the optimizer thread may still be stepping the weight)
            with torch.no_grad():
                for model in (plain_model, swap_model):
                    model.blocks[1].mlp.fc.weight[0, 0] = 1e30
        plain.train_step(x, y, lr=1e-2)
        averages[0].update(plain.host_parameters())
        swap.stepped = averages[1].follow(swap_params)
        swap.train_step(x, y, lr=1e-2)
    swap.sync()
    assert swap.stepped is None  # each follow() is one step's
    assert averages[0].updates == averages[1].updates == 5
    for name, s in averages[0].shadow.items():
        assert rel_diff(s, averages[1].shadow[name]) <= 1e-5, name
        assert not torch.equal(s, plain_model.get_parameter(name)), name  # an average, not them
    swap.close()


def test_accounted_peak_stays_under_the_planned_budget():
    model = gpt()
    prof = measure_profile(model, rows=4, seq_len=16, device=CPU, reps=1)
    whole = prof.model_param_bytes * 2 + sum(b.saved_bytes for b in prof.blocks) * 2
    budget = whole // 2
    plan = plan_dp(prof, budget, micro_batches=2)
    assert len(plan.submodels) >= 2
    engine = SwapEngine(model, plan, EngineConfig(budget_bytes=budget), CPU)
    runner = SwapRunner(engine, AdamW(dict(model.named_parameters()), AdamWConfig()), 4, 1.0)
    for x, y in batches(3):
        runner.train_step(x, y, lr=1e-3)
    runner.close()
    assert 0 < engine.memory.peak <= budget
    assert engine.memory.peak <= predict(prof, plan, 2).peak_bytes  # the model is conservative


def test_budget_is_enforced_not_just_reported():
    model = gpt()
    engine = SwapEngine(model, ExecutionPlan.even(6, 6), EngineConfig(budget_bytes=10_000), CPU)
    with pytest.raises(AtomError, match="device budget exceeded"):
        engine.run_pass(*batches(1)[0], weight=1.0, first=True, final=True)


def test_next_submodel_loads_while_the_current_one_computes():
    model = gpt()
    engine = SwapEngine(model, ExecutionPlan.even(6, 3), EngineConfig(budget_bytes=1 << 30), CPU)
    engine.run_pass(*batches(1)[0], weight=1.0, first=True, final=True)
    engine.finish_step()
    t = engine.trace
    for k in range(2):  # forward: load of k+1 begins before compute of k ends
        assert t.first("load_start", k + 1) < t.first("compute_end", k)
        assert t.first("compute_start", k) < t.first("load_start", k + 1)
    # the last sub-model of the forward is not reloaded for the backward
    assert [e for _, e, k in t.events if k == 2 and e == "load_start"] == ["load_start"]
    # backward: sub-model 0 reloads during sub-model 1's backward
    loads_of_0 = [s for s, e, k in t.events if e == "load_start" and k == 0]
    assert t.first("bwd_start", 1) < loads_of_0[-1] < t.first("bwd_end", 1)


class RotaryLayer(nn.Module):
    """A decoder layer in the style of other libraries: extra keyword inputs, tuple output."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        cos, sin = position_embeddings
        h = self.norm(hidden_states)
        q = self.q(h) * cos + self.q(h).roll(1, dims=-1) * sin
        att = (q @ h.transpose(1, 2)) / math.sqrt(h.size(-1)) + attention_mask
        hidden_states = hidden_states + self.o(att.softmax(-1) @ h)
        return (hidden_states + self.mlp(hidden_states), None)


class Inner(nn.Module):
    def __init__(self, vocab: int, d: int, n: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([RotaryLayer(d) for _ in range(n)])
        self.norm = nn.LayerNorm(d)
        self.register_buffer("inv_freq", 1.0 / (100 ** (torch.arange(d) / d)))

    def forward(self, input_ids):
        T = input_ids.size(1)
        ang = torch.arange(T, device=input_ids.device)[:, None].float() * self.inv_freq
        pos = (ang.cos(), ang.sin())
        mask = torch.full((T, T), float("-inf"), device=input_ids.device).triu(1)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=pos)[0]
        return self.norm(h)


class ForCausalLM(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.model = Inner(vocab, d, n)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, labels=None):
        logits = self.lm_head(self.model(input_ids))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"logits": logits, "loss": loss}


def test_a_model_in_another_library_style_trains_through_the_engine():
    torch.manual_seed(0)
    plain_model = ForCausalLM()
    swap_model = copy.deepcopy(plain_model)
    layout = find_blocks(swap_model)
    assert layout.path == "model.layers" and len(layout) == 4
    plan = ExecutionPlan(
        (
            SubModel(0, 2, Policy.KEEP),
            SubModel(2, 3, Policy.OFFLOAD),
            SubModel(3, 4, Policy.RECOMPUTE),
        )
    )
    engine = SwapEngine(swap_model, plan, EngineConfig(budget_bytes=1 << 28), CPU)
    opt_a = AdamW(dict(plain_model.named_parameters()), AdamWConfig())
    swap = SwapRunner(engine, AdamW(dict(swap_model.named_parameters()), AdamWConfig()), 4, 1.0)
    for x, y in batches(3, rows=4, vocab=50):
        for p in plain_model.parameters():
            p.grad = None
        loss = plain_model(x, y)["loss"]
        loss.backward()
        from atomtrain.optim import clip_scale, grad_norm

        grads = {n: p.grad for n, p in plain_model.named_parameters()}
        opt_a.step(sorted(grads), 1e-2, clip_scale(grad_norm(grads), 1.0))
        out = swap.train_step(x, y, lr=1e-2)
        assert out["loss"] == pytest.approx(loss.item(), rel=1e-6)
    swapped = swap.host_parameters()
    for name, p in plain_model.named_parameters():
        assert rel_diff(p.detach(), swapped[name].detach()) <= 1e-5, name
    swap.close()


def test_find_blocks_by_path_and_clear_errors():
    model = gpt()
    assert find_blocks(model).path == "blocks"
    assert find_blocks(model, "blocks").keys == [str(i) for i in range(6)]
    with pytest.raises(AtomError, match="no submodule 'nope'"):
        find_blocks(model, "nope")
    with pytest.raises(AtomError, match="not a ModuleList"):
        find_blocks(model, "ln_f")
    with pytest.raises(AtomError, match="found no ModuleList"):
        find_blocks(nn.Linear(2, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_path_matches_plain(dtype: str):
    cuda = torch.device("cuda")
    plain_model = gpt().to(cuda)
    swap_model = copy.deepcopy(gpt())
    plan = ExecutionPlan(MIXED.submodels, 1)
    engine = SwapEngine(
        swap_model, plan, EngineConfig(budget_bytes=1 << 30, param_dtype=dtype), cuda
    )
    swap = SwapRunner(engine, AdamW(dict(swap_model.named_parameters()), AdamWConfig()), 8, 1.0)
    plain = PlainRunner(
        plain_model, AdamW(dict(plain_model.named_parameters()), AdamWConfig()), 8, 1.0, cuda
    )
    tol = 1e-5 if dtype == "float32" else 5e-2
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for x, y in batches(3):
        a = plain.train_step(x, y, lr=1e-3)
        b = swap.train_step(x, y, lr=1e-3)
        assert a["loss"] == pytest.approx(b["loss"], rel=tol)
    swapped = swap.host_parameters()
    for name, p in plain_model.named_parameters():
        assert rel_diff(p.detach().cpu(), swapped[name].detach()) <= max(tol, 1e-4), name
    swap.close()
    assert engine.memory.peak <= engine.cfg.budget_bytes
    assert torch.cuda.max_memory_allocated() - base > 0
