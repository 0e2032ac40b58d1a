"""The swap engine on the cases beyond a plain GPT: frozen parameters, a non-finite step,
auxiliary outputs, stateful keyword arguments, the planner's tightest budget, an accounted peak
that does not depend on thread timing, and copies to the host off the training thread."""

import copy
import threading
from concurrent.futures import Future

import pytest
import torch
from torch import nn

from atomtrain.engine.engine import EngineConfig, SwapEngine
from atomtrain.engine.memory import BudgetExceeded
from atomtrain.engine.plan import ExecutionPlan, Policy, SubModel
from atomtrain.engine.runner import SwapRunner
from atomtrain.errors import AtomError
from atomtrain.models import GPT, GPTConfig
from atomtrain.optim import AdamW, AdamWConfig
from atomtrain.planner.measure import measure_profile
from atomtrain.planner.partition import NoPlanFits, plan_dp
from atomtrain.train.runner import PlainRunner

CPU = torch.device("cpu")
BIG = 1 << 30
MIXED = ExecutionPlan(
    (
        SubModel(0, 1, Policy.KEEP),
        SubModel(1, 2, Policy.RECOMPUTE),
        SubModel(2, 3, Policy.OFFLOAD),
        SubModel(3, 4, Policy.RECOMPUTE),
    )
)


def gpt(n_layer: int = 6) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=32, vocab_size=64))


def batches(n: int, rows: int = 8, vocab: int = 64, seq: int = 16):
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, vocab, (rows, seq), generator=g),
            torch.randint(0, vocab, (rows, seq), generator=g),
        )
        for _ in range(n)
    ]


def pair(model: nn.Module, plan: ExecutionPlan, clip: float, budget: int = BIG):
    """A plain runner and a swap runner on two copies of `model`."""
    twin = copy.deepcopy(model)
    plain = PlainRunner(model, AdamW(dict(model.named_parameters()), AdamWConfig()), 8, clip, CPU)
    engine = SwapEngine(twin, plan, EngineConfig(budget_bytes=budget), CPU)
    swap = SwapRunner(engine, AdamW(dict(twin.named_parameters()), AdamWConfig()), 8, clip)
    return plain, swap, twin


def assert_same_params(a: nn.Module, b: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    for name, p in a.named_parameters():
        q = b[name].detach()
        diff = float((p.detach() - q).abs().max() / p.detach().abs().max().clamp_min(1e-12))
        assert diff <= tol, (name, diff)


# ----- 1. frozen parameters -------------------------------------------------------------------


def test_frozen_parameters_stay_frozen_and_the_rest_trains_as_plain():
    model = gpt()
    frozen = ["wpe.weight", "blocks.2.attn.qkv.weight", "blocks.4.ln_1.weight"]
    for n in frozen:
        model.get_parameter(n).requires_grad_(False)
    before = {n: model.get_parameter(n).detach().clone() for n in frozen}
    plain, swap, _ = pair(model, ExecutionPlan.even(6, 3, Policy.KEEP), clip=1.0)
    for x, y in batches(3):
        a = plain.train_step(x, y, lr=1e-2)
        b = swap.train_step(x, y, lr=1e-2)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    swapped = swap.host_parameters()
    for n in frozen:
        assert torch.equal(swapped[n], before[n]), n
        assert swapped[n].grad is None and not swapped[n].requires_grad
    assert_same_params(model, swapped)
    swap.close()


# ----- 2. a non-finite step is skipped whole --------------------------------------------------


@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clipped", "unclipped"])
def test_a_step_with_non_finite_gradients_changes_nothing(clip: float):
    model = gpt()
    with torch.no_grad():  # overflows the attention of block 1 only in the backward
        model.blocks[1].mlp.fc.weight[0, 0] = 1e30
    plain, swap, twin = pair(model, ExecutionPlan.even(6, 3, Policy.KEEP), clip)
    before = {n: p.detach().clone() for n, p in twin.named_parameters()}
    x, y = batches(1)[0]
    a = plain.train_step(x, y, lr=1e-2)
    b = swap.train_step(x, y, lr=1e-2)
    assert not torch.isfinite(torch.tensor(a["grad_norm"]))
    assert not torch.isfinite(torch.tensor(b["grad_norm"]))
    swapped = swap.host_parameters()
    for n, p in swapped.items():
        assert torch.equal(p.detach(), before[n]), n
    assert swap.optimizer.state == {} and plain.optimizer.state == {}
    swap.close()


# ----- 3. every output of a block gets its gradient -------------------------------------------


class AuxBlock(nn.Module):
    """A block returning an auxiliary loss beside its output (as an MoE router does)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.router = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + torch.tanh(self.fc(x))
        aux = self.router(h).softmax(-1).pow(2).sum(-1).mean()
        return h, aux


class AuxModel(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([AuxBlock(d) for _ in range(n)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        h, aux = self.emb(idx), 0.0
        for b in self.blocks:
            h, a = b(h)
            aux = aux + a
        logits = self.head(h)
        ce = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, ce + 0.5 * aux


def test_auxiliary_outputs_of_blocks_get_gradients():
    torch.manual_seed(0)
    model = AuxModel()
    twin = copy.deepcopy(model)
    x, y = batches(1)[0]
    model(x, y)[1].backward()
    engine = SwapEngine(twin, MIXED, EngineConfig(budget_bytes=BIG), CPU)
    engine.run_pass(x, y, 1.0, first=True, final=True)
    engine.finish_step()
    for n, p in model.named_parameters():
        g = twin.get_parameter(n).grad
        assert g is not None, n
        assert torch.allclose(p.grad, g, rtol=1e-5, atol=1e-7), n
    engine.close()


# ----- 4. keyword arguments as they were at forward time --------------------------------------


class Cache:
    """Keys per layer, extended by each layer's forward (as a transformers DynamicCache)."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}

    def update(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        old = self.keys.get(layer)
        self.keys[layer] = k if old is None else torch.cat([old, k], dim=1)
        return self.keys[layer]


class CachedLayer(nn.Module):
    def __init__(self, d: int, idx: int) -> None:
        super().__init__()
        self.idx = idx
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, cache: Cache | None = None, scale: tuple = ()) -> tuple:
        keys = cache.update(self.idx, self.k(h))  # (B, T_cached, d)
        att = (self.q(h) @ keys.transpose(1, 2) * scale[0]).softmax(-1)  # (B, T, T_cached)
        return (h + att @ keys,)


class CachedModel(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([CachedLayer(d, i) for i in range(n)])
        self.head = nn.Linear(d, vocab)
        self.temp = nn.Parameter(torch.tensor(0.25))
        self.learn_temp = False

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        cache = Cache()
        scale = (self.temp if self.learn_temp else self.temp.detach(),)
        h = self.emb(idx)
        for layer in self.layers:
            h = layer(h, cache=cache, scale=scale)[0]
        logits = self.head(h)
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_recompute_sees_keyword_arguments_as_they_were_at_forward_time():
    torch.manual_seed(0)
    model = CachedModel()
    twin = copy.deepcopy(model)
    x, y = batches(1)[0]
    model(x, y)[1].backward()
    engine = SwapEngine(twin, MIXED, EngineConfig(budget_bytes=BIG), CPU)
    engine.run_pass(x, y, 1.0, first=True, final=True)
    engine.finish_step()
    for n, p in model.named_parameters():
        if n == "temp":
            continue
        assert torch.allclose(p.grad, twin.get_parameter(n).grad, rtol=1e-5, atol=1e-7), n
    engine.close()


def test_a_nested_input_that_needs_a_gradient_is_refused():
    torch.manual_seed(0)
    model = CachedModel()
    model.learn_temp = True  # blocks get (temp,): a tensor in a tuple that needs a gradient
    engine = SwapEngine(model, MIXED, EngineConfig(budget_bytes=BIG), CPU)
    with pytest.raises(AtomError, match="needs a gradient"):
        engine.run_pass(*batches(1)[0], 1.0, first=True, final=True)
    engine.close()


# ----- 5. the planner's tightest budget runs, and the accounted peak is deterministic ----------


def min_budget(prof, micro_batches: int) -> int:
    lo, hi = 1, 1 << 32
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            plan_dp(prof, mid, micro_batches)
            hi = mid
        except NoPlanFits:
            lo = mid + 1
    return lo


def test_the_planners_smallest_budget_runs_with_offloaded_activations():
    model = gpt()
    prof = measure_profile(model, rows=8, seq_len=16, device=CPU, reps=1)
    budget = min_budget(prof, 1)
    plan = plan_dp(prof, budget, 1)
    assert any(s.policy is Policy.OFFLOAD for s in plan.submodels), plan.describe()
    plain, swap, _ = pair(model, plan, clip=1.0, budget=budget)
    for x, y in batches(2):
        a = plain.train_step(x, y, lr=1e-2)
        b = swap.train_step(x, y, lr=1e-2)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    swap.close()
    assert 0 < swap.engine.memory.peak <= budget


class _Deferred(Future):
    """A copy task run only when its result is asked for."""

    def __init__(self, fn, args) -> None:
        super().__init__()
        self._call = (fn, args)

    def result(self, timeout=None):
        if self._call is not None:
            fn, args = self._call
            self._call = None
            try:
                self.set_result(fn(*args))
            except BaseException as e:  # handed to whoever asks, as a pool does
                self.set_exception(e)
        return super().result(timeout)


class _CopyThread:
    """The engine's copy worker at either extreme of thread timing: every task done the moment
    it is submitted (`eager`), or none until the engine waits for it."""

    def __init__(self, eager: bool) -> None:
        self.eager = eager

    def submit(self, fn, *args) -> Future:
        fut = _Deferred(fn, args)
        if self.eager:
            fut.result()
        return fut

    def shutdown(self, wait: bool = True) -> None:
        pass


def test_the_accounted_peak_does_not_depend_on_when_the_copy_thread_runs():
    """Bytes go back to the budget in program order: the copy thread at its fastest, at its
    slowest and as it really runs gives one peak (on main it varied with the copy thread's
    timing, which the budget then had to cover)."""
    plan = ExecutionPlan(
        (
            SubModel(0, 2, Policy.KEEP),
            SubModel(2, 3, Policy.OFFLOAD),
            SubModel(3, 4, Policy.RECOMPUTE),
            SubModel(4, 6, Policy.OFFLOAD),
        )
    )
    peaks, params = [], []
    for eager in (None, True, False):
        model = gpt()
        engine = SwapEngine(model, plan, EngineConfig(budget_bytes=BIG), CPU)
        if eager is not None:
            engine.offloader.shutdown(wait=True)
            engine.offloader = _CopyThread(eager)  # type: ignore[assignment]
        runner = SwapRunner(engine, AdamW(dict(model.named_parameters()), AdamWConfig()), 4, 0.0)
        for x, y in batches(2):
            runner.train_step(x, y, lr=1e-3)
        runner.close()
        peaks.append(engine.memory.peak)
        params.append(dict(model.named_parameters()))
    assert len(set(peaks)) == 1, peaks
    for other in params[1:]:  # and the same training
        for name, p in params[0].items():
            assert torch.equal(p, other[name]), name


def test_budget_exceeded_is_an_atom_error():
    assert issubclass(BudgetExceeded, AtomError)


def test_gradient_copies_reuse_a_bounded_pool_and_the_host_gradients():
    model = gpt()
    engine = SwapEngine(model, MIXED_6, EngineConfig(budget_bytes=BIG), CPU)
    runner = SwapRunner(engine, AdamW(dict(model.named_parameters()), AdamWConfig()), 4, 1.0)
    runner.train_step(*batches(1)[0], lr=1e-3)
    runner.sync()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for x, y in batches(2):
        runner.train_step(x, y, lr=1e-3)
    runner.close()
    assert engine.grad_pool._made <= engine.grad_pool.count == 2
    assert all(p.grad is grads[n] for n, p in model.named_parameters())  # written in place


def test_offloaded_activations_are_copied_off_the_compute_thread(monkeypatch):
    """The forward goes on while an offloaded activation's copy to host memory runs on the
    copy thread (on main the training thread made every copy itself)."""
    copiers: list[str] = []
    to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        if args[:1] == ("cpu",) and kwargs.get("copy"):  # a copy out to host memory
            copiers.append(threading.current_thread().name)
        return to(self, *args, **kwargs)

    model = gpt()
    engine = SwapEngine(model, MIXED_6, EngineConfig(budget_bytes=BIG), CPU)
    runner = SwapRunner(engine, AdamW(dict(model.named_parameters()), AdamWConfig()), 4, 1.0)
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    runner.train_step(*batches(1)[0], lr=1e-3)
    runner.close()
    monkeypatch.undo()
    assert copiers and threading.main_thread().name not in copiers, copiers


MIXED_6 = ExecutionPlan(
    (
        SubModel(0, 2, Policy.KEEP),
        SubModel(2, 3, Policy.OFFLOAD),
        SubModel(3, 4, Policy.RECOMPUTE),
        SubModel(4, 6, Policy.OFFLOAD),
    )
)


def test_a_transformers_llama_with_its_cache_recomputes_exactly():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg)

    class Call(nn.Module):  # the engine calls model(x, y); the cache stays on
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor, y: torch.Tensor):
            return self.inner(input_ids=x, labels=y, use_cache=True)

    twin = Call(copy.deepcopy(model))
    x = batches(1, rows=2)[0][0]
    model(input_ids=x, labels=x, use_cache=True).loss.backward()
    engine = SwapEngine(twin, ExecutionPlan.even(4, 2), EngineConfig(budget_bytes=BIG), CPU)
    engine.run_pass(x, x, 1.0, first=True, final=True)
    engine.finish_step()
    for n, p in model.named_parameters():
        g = twin.inner.get_parameter(n).grad
        assert torch.allclose(p.grad, g, rtol=1e-4, atol=1e-6), n
    engine.close()
