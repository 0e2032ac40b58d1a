"""The trainer: loss falls, AdamW matches PyTorch's, a resumed run equals an uninterrupted one."""

import json
from pathlib import Path

import pytest
import torch

from atomtrain.config import load_run_config
from atomtrain.errors import AtomError
from atomtrain.optim import AdamW, AdamWConfig
from atomtrain.train.averaged import WARMUP, WeightAverage, check_unaliased, saved_average
from atomtrain.train.checkpoint import latest_checkpoint, load_checkpoint, verify_checkpoint
from atomtrain.train.loading import load_trained
from atomtrain.train.metrics import read_metrics
from atomtrain.train.session import open_session

from .conftest import TINY


def config(prepared: Path, out: Path, *extra: str):
    return load_run_config(
        overrides=[
            *TINY,
            f"--data.prepared={prepared}",
            f"--run.out_dir={out}",
            "--run.name=r",
            *extra,
        ]
    )


def test_adamw_matches_torch_adamw_step_for_step():
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 4)
    b = torch.nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    ours = AdamW(dict(a.named_parameters()), AdamWConfig(weight_decay=0.1))
    ref = torch.optim.AdamW(
        [{"params": [b.weight], "weight_decay": 0.1}, {"params": [b.bias], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    for step in range(5):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        for m in (a, b):
            m.zero_grad()
            m(x).pow(2).mean().backward()
        ours.step([n for n, _ in a.named_parameters()], lr=1e-2)
        ref.step()
    torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=1e-7)
    torch.testing.assert_close(a.bias, b.bias, rtol=0, atol=1e-7)


def test_loss_falls(prepared: Path, tmp_path: Path):
    session = open_session(config(prepared, tmp_path, "--train.steps=40", "--train.lr=1e-2"))
    session.trainer.fit()
    vals = [
        r["val_loss"] for r in read_metrics(session.run_dir / "metrics.jsonl") if "val_loss" in r
    ]
    assert vals[-1] < vals[0] - 1.0


def params_of(session) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in session.model.named_parameters()}


@pytest.mark.parametrize(
    "ema",
    [
        [],
        ["--train.ema=0.9"],
        ["--train.ema=0.9", "--engine.device_memory=4MB"],  # (updated piecewise)
        ["--train.ema=0.9", "--train.ema_every=3"],  # (stopped at step 10: between updates)
        ["--train.ema=0.9", "--train.ema_every=3", "--engine.device_memory=4MB"],
    ],
    ids=[
        "weights",
        "weight-average",
        "weight-average-swap-engine",
        "weight-average-every-3",
        "weight-average-every-3-swap-engine",
    ],
)
def test_resume_continues_exactly(prepared: Path, tmp_path: Path, ema: list[str]):
    whole = open_session(config(prepared, tmp_path / "a", "--train.steps=20", *ema))
    whole.trainer.fit()
    first = open_session(config(prepared, tmp_path / "b", "--train.steps=20", *ema))
    first.trainer.after_step = lambda st, rec: st.step == 10 and first.trainer.stop.set()
    first.trainer.fit()
    assert first.trainer.state.step == 10
    resumed = open_session(
        config(prepared, tmp_path / "b", "--train.steps=20", *ema), resume=first.run_dir
    )
    assert resumed.trainer.state.step == 10
    resumed.trainer.fit()
    a = read_metrics(whole.run_dir / "metrics.jsonl")
    b = read_metrics(resumed.run_dir / "metrics.jsonl")
    assert [r.get("loss") for r in a] == [r.get("loss") for r in b]
    assert [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]
    pa, pb = params_of(whole), params_of(resumed)
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    if ema:  # the average was saved and taken back, not restarted from the resumed weights
        assert whole.trainer.average and resumed.trainer.average
        assert resumed.trainer.average.updates == (18 if "--train.ema_every=3" in ema else 20)
        for name, s in whole.trainer.average.shadow.items():
            assert torch.equal(s, resumed.trainer.average.shadow[name]), name


def test_weight_average_follows_its_formula_and_swaps_in_place():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    params = dict(model.named_parameters())
    average = WeightAverage(params, 0.9)
    expected = {n: p.detach().clone() for n, p in params.items()}
    objects = {n: (p, p.data_ptr()) for n, p in params.items()}
    for t in range(1, 30):
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn_like(p))
        decay = min(0.9, (1 + t) / (WARMUP + t))
        for n, p in params.items():
            expected[n] = decay * expected[n] + (1 - decay) * p.detach()
        average.update(params)
    now = {n: p.detach().clone() for n, p in params.items()}
    for n in params:
        torch.testing.assert_close(average.shadow[n], expected[n], rtol=1e-6, atol=1e-6)
    with average.swapped_in(params):
        for n, p in params.items():  # the same tensors (optimizers, engines keep them)
            assert p is objects[n][0] and p.data_ptr() == objects[n][1]
            torch.testing.assert_close(p.detach(), expected[n], rtol=1e-6, atol=1e-6)
    for n, p in params.items():  # and their own values after, bit for bit
        assert torch.equal(p, now[n])
        torch.testing.assert_close(average.shadow[n], expected[n], rtol=1e-6, atol=1e-6)


def test_a_run_with_a_weight_average_validates_and_exports_the_average(
    prepared: Path, tmp_path: Path
):
    """What the run reports as its validation loss is the loss of the model `export`, `sample`
    and `serve` load from its checkpoint (the average), not of the weights it trained."""
    session = open_session(config(prepared, tmp_path, "--train.steps=30", "--train.ema=0.9"))
    session.trainer.fit()
    reported = session.trainer.evaluate()
    model, _, _ = load_trained(session.run_dir)
    batches = session.trainer.val_batches
    with torch.no_grad():
        loaded = sum(float(model(x, y)[1]) for x, y in batches) / len(batches)
    assert loaded == pytest.approx(reported, rel=1e-5)
    raw = session.trainer._validate()  # the trained weights themselves: another model
    assert raw != pytest.approx(reported, rel=1e-5)


def test_checkpoint_is_checked_before_use(prepared: Path, tmp_path: Path):
    s = open_session(config(prepared, tmp_path, "--train.steps=3"))
    s.trainer.fit()
    ckpt = latest_checkpoint(s.run_dir)
    assert ckpt is not None and ckpt.name == "step_000003"
    verify_checkpoint(ckpt)
    assert load_checkpoint(ckpt).state["step"] == 3
    weights = ckpt / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[: len(original) // 2])
    with pytest.raises(AtomError, match="truncated: model.safetensors"):
        load_checkpoint(ckpt)
    tampered = bytearray(original)
    tampered[-5] ^= 1
    weights.write_bytes(bytes(tampered))
    with pytest.raises(AtomError, match="corrupt or tampered"):
        load_checkpoint(ckpt)
    weights.write_bytes(original)
    other = config(prepared, tmp_path / "o", "--model.n_embd=48", "--model.n_head=2")
    with pytest.raises(AtomError, match="for another model"):
        open_session(other, resume=ckpt)


def test_existing_run_is_never_overwritten_without_the_flag(prepared: Path, tmp_path: Path):
    s = open_session(config(prepared, tmp_path, "--train.steps=2"))
    s.trainer.fit()
    marker = (s.run_dir / "metrics.jsonl").read_text()
    with pytest.raises(AtomError, match="already exists; pass --overwrite"):
        open_session(config(prepared, tmp_path, "--train.steps=2"))
    assert (s.run_dir / "metrics.jsonl").read_text() == marker
    again = open_session(config(prepared, tmp_path, "--train.steps=2"), overwrite=True)
    assert not (again.run_dir / "metrics.jsonl").exists()


def test_run_dir_holds_resolved_config(prepared: Path, tmp_path: Path):
    s = open_session(config(prepared, tmp_path, "--train.steps=2", "--train.lr=0.002"))
    saved = json.loads((s.run_dir / "config.json").read_text())
    assert saved["train"]["lr"] == 0.002 and saved["model"]["preset"] == "tiny"


def test_tensorboard_event_files_hold_the_same_numbers_as_metrics_jsonl(
    prepared: Path, tmp_path: Path
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    session = open_session(config(prepared, tmp_path, "--train.steps=10", "--log.tensorboard=true"))
    session.trainer.fit()
    records = read_metrics(session.run_dir / "metrics.jsonl")
    events = EventAccumulator(str(session.run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "val/val_loss"} <= set(tags)
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    want = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert losses.keys() == want.keys()
    assert all(abs(losses[k] - want[k]) <= 1e-6 * abs(want[k]) for k in want)
    vals = [e.step for e in events.Scalars("val/val_loss")]
    assert vals == [r["step"] for r in records if "val_loss" in r]


def test_a_saved_average_for_other_parameters_is_refused_by_name():
    params = dict(torch.nn.Linear(4, 3).named_parameters())
    good = {f"ema/{n}": p.detach().clone() for n, p in params.items()}
    assert saved_average({"peer/theta_sync": torch.zeros(3)}, params, "c") is None  # none saved
    assert set(saved_average(good, params, "c") or {}) == {"weight", "bias"}
    with pytest.raises(AtomError, match="weight average .ema/. does not match 'bias'"):
        saved_average({"ema/weight": good["ema/weight"]}, params, "c")  # one missing
    with pytest.raises(AtomError, match="weight average .ema/. does not match 'other'"):
        saved_average({**good, "ema/other": torch.zeros(1)}, params, "c")
    with pytest.raises(AtomError, match="weight average of 'bias' is \\(4,\\)"):
        saved_average({**good, "ema/bias": torch.zeros(4)}, params, "c")
    average = WeightAverage(params, 0.9)
    with torch.no_grad():
        params["weight"].add_(1.0)
    average.update(params)
    average.restart(params)  # the weights were replaced: the average starts from them
    assert average.updates == 0 and torch.equal(average.shadow["weight"], params["weight"])


def test_parameters_sharing_memory_are_refused_and_views_of_one_buffer_are_not():
    flat = torch.zeros(10)
    apart = {"a": flat[:4], "b": flat[4:], "empty": torch.zeros(0), "none": flat[4:4]}
    check_unaliased(apart)  # views side by side, and empty ones anywhere
    WeightAverage(apart, 0.9)
    with pytest.raises(AtomError, match="share memory"):
        check_unaliased({"a": flat[:5], "b": flat[4:]})
    with pytest.raises(AtomError, match="share memory"):
        WeightAverage({"a": flat, "b": flat}, 0.9)  # one tensor under two names


def test_adopting_the_average_makes_it_the_weights():
    """Before a swarm's last round each peer takes its average as its weights (finish.py), so
    the round averages the peers' averages and every finisher exports the same model."""
    params = dict(torch.nn.Linear(4, 3).named_parameters())
    average = WeightAverage(params, 0.5)
    with torch.no_grad():
        params["weight"].add_(2.0)
    average.update(params)
    average.adopt(params)
    for name, s in average.shadow.items():
        assert torch.equal(params[name], s)
