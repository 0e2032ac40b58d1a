"""transformers models in and out: fine-tuning a saved directory, resuming, exporting, errors."""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers not installed (pip install atomtrain[hf])")

from safetensors.torch import load_file

from atomtrain.config import load_run_config
from atomtrain.data.tokenizer import BPETokenizer
from atomtrain.errors import AtomError
from atomtrain.models.hf import hf_from_config, load_hf
from atomtrain.train.loading import load_trained
from atomtrain.train.metrics import read_metrics
from atomtrain.train.session import open_session

from .conftest import TINY, run_cli
from .hf_models import VOCAB, tiny_config

FINE_TUNE = [
    "--data.seq_len=32",
    "--data.rows=8",
    "--train.micro_batch_rows=4",
    "--train.warmup_steps=2",
    "--train.eval_interval=2",
    "--train.eval_batches=1",
    "--run.name=ft",
]


@pytest.fixture(scope="module")
def llama_dir(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny Llama in several safetensors shards, with a BPE tokenizer trained here."""
    root = tmp_path_factory.mktemp("llama")
    model = hf_from_config(tiny_config("llama", layers=4), seed=3)
    model.lm.save_pretrained(root, max_shard_size="40KB")
    tok = BPETokenizer.train(sorted(corpus_dir.iterdir()), VOCAB)
    (root / "tokenizer.json").write_text(tok.spec()["json"])  # type: ignore[arg-type]
    return root


def saved_weights(root: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_loads_sharded_weights_exactly(llama_dir: Path):
    assert len(list(llama_dir.glob("*.safetensors"))) > 1
    model = load_hf(llama_dir)
    weights = saved_weights(llama_dir)
    params = dict(model.named_parameters())
    assert {f"lm.{k}" for k in weights} == set(params)
    for k, v in weights.items():
        assert torch.equal(params[f"lm.{k}"].detach(), v), k


def session_cfg(llama_dir: Path, corpus_dir: Path, out: Path, *extra: str):
    return load_run_config(
        overrides=[
            *FINE_TUNE,
            f"--model.hf={llama_dir}",
            f"--data.source={corpus_dir}",
            f"--run.out_dir={out}",
            "--engine.device_memory=64MB",
            *extra,
        ]
    )


def test_fine_tune_starts_from_the_saved_weights_and_resumes_exactly(
    llama_dir: Path, corpus_dir: Path, tmp_path: Path
):
    whole = open_session(session_cfg(llama_dir, corpus_dir, tmp_path / "a", "--train.steps=4"))
    assert whole.shards.manifest["tokenizer"]["kind"] == "hf"  # the model's own tokenizer
    for k, v in saved_weights(llama_dir).items():
        assert torch.equal(whole.model.get_parameter(f"lm.{k}").detach(), v), k
    whole.trainer.fit()
    whole.trainer.runner.close()
    first = open_session(session_cfg(llama_dir, corpus_dir, tmp_path / "b", "--train.steps=4"))
    first.trainer.after_step = lambda st, rec: st.step == 2 and first.trainer.stop.set()
    first.trainer.fit()
    first.trainer.runner.close()
    resumed = open_session(
        session_cfg(llama_dir, corpus_dir, tmp_path / "b", "--train.steps=4"),
        resume=first.run_dir,
    )
    assert resumed.trainer.state.step == 2
    resumed.trainer.fit()
    resumed.trainer.runner.close()
    a = read_metrics(whole.run_dir / "metrics.jsonl")
    b = read_metrics(resumed.run_dir / "metrics.jsonl")
    assert [r.get("loss") for r in a] == [r.get("loss") for r in b]
    pa = whole.trainer.runner.host_parameters()
    pb = resumed.trainer.runner.host_parameters()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    trained, tok, _ = load_trained(resumed.run_dir)
    for name, p in trained.named_parameters():
        assert torch.equal(p, pb[name]), name
    assert tok.decode(tok.encode("def f(x):")) == "def f(x):"


def exported_logits_match(run_dir: Path, out: Path, tmp_path: Path) -> None:
    import transformers

    r = run_cli("export", str(run_dir), "--format", "hf", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    model, tok, _ = load_trained(run_dir)
    lm = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([tok.encode("def add(a, b):\n    return a + b\n")])
    with torch.no_grad():
        ours = model(ids)[0]
        theirs = lm(ids).logits
    assert (ours - theirs).abs().max() <= 1e-5 * ours.abs().max()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok("def add(a, b):", add_special_tokens=False)["input_ids"] == tok.encode(
        "def add(a, b):"
    )


def trained_run(cfg) -> Path:
    session = open_session(cfg)
    session.trainer.fit()
    session.trainer.runner.close()
    return session.run_dir


def test_export_round_trips_our_gpt_as_gpt2(prepared: Path, tmp_path: Path):
    out = f"--run.out_dir={tmp_path / 'runs'}"
    cfg = load_run_config(
        overrides=[*TINY, "--train.steps=2", f"--data.prepared={prepared}", "--run.name=gpt", out]
    )
    exported_logits_match(trained_run(cfg), tmp_path / "gpt-hf", tmp_path)
    config = json.loads((tmp_path / "gpt-hf" / "config.json").read_text())
    assert config["model_type"] == "gpt2"


def test_export_round_trips_a_fine_tuned_transformers_model(
    llama_dir: Path, corpus_dir: Path, tmp_path: Path
):
    cfg = session_cfg(llama_dir, corpus_dir, tmp_path / "runs", "--train.steps=2")
    run_dir = trained_run(cfg)
    exported_logits_match(run_dir, tmp_path / "ft-hf", tmp_path)
    assert (tmp_path / "ft-hf" / "config.json").read_text().count('"llama"') == 1
    r = run_cli("export", str(run_dir), str(tmp_path / "ft-hf"), cwd=tmp_path)
    assert r.returncode == 2 and "--overwrite" in r.stderr


def test_bad_model_directories_give_one_line_errors(llama_dir: Path, tmp_path: Path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AtomError, match="not a transformers model directory"):
        load_hf(empty)
    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(AtomError, match="unsupported architecture.*t5"):
        load_hf(t5)
    with pytest.raises(AtomError, match="unsupported architecture"):
        hf_from_config('{"model_type": "no-such-model"}')
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    config = json.loads((llama_dir / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    for f in llama_dir.glob("*.safetensors*"):
        (wrong / f.name).write_bytes(f.read_bytes())
    with pytest.raises(AtomError, match="do not match its config: wrong shape"):
        load_hf(wrong)
    r = run_cli("train", f"--model.hf={wrong}", "--train.steps=1", cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "do not match its config" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
