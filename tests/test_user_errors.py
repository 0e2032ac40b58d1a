"""Bad input and faults as a new user meets them (issue 17), through the command line.

The promise: a one-line error naming the problem, exit 2, and nothing that already existed is
changed; files a later command reads are replaced in one step; a resume survives a torn write.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from atomtrain.cli.main import main
from atomtrain.train.checkpoint import prune_checkpoints, verify_checkpoint

from .conftest import TINY, run_cli


@pytest.fixture
def atom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """`atomtrain ARGS` in this process (fast; a traceback fails the test), from tmp_path."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def refused(result: tuple[int, str, str], *fragments: str) -> str:
    code, _, err = result
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("atomtrain: error: ")]
    assert len(lines) == 1, err
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def trained(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run with two checkpoints (steps 2 and 4): `<root>/runs/base`."""
    root = tmp_path_factory.mktemp("trained")
    proc = run_cli(
        "train",
        *TINY,
        "--train.steps=4",
        "--train.checkpoint_interval=2",
        f"--data.prepared={prepared}",
        "--name=base",
        "--no-sample",
        "--quiet",
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    return root / "runs" / "base"


@pytest.fixture
def run_copy(trained: Path, tmp_path: Path) -> Path:
    """This test's own copy of the trained run, at tmp_path/runs/base."""
    dst = tmp_path / "runs" / "base"
    shutil.copytree(trained, dst)
    return dst


# --- items 1 and 2: a refused command creates and deletes nothing ---------------------------------


@pytest.mark.parametrize(
    "bad, fragment",
    [
        (["--device-memory", "banana"], "banana"),
        (["--device-memory", "inf"], "engine.device_memory"),
        (["--train.lr=nan"], "train.lr"),
        (["--data.seq_len=0"], "data.seq_len"),
        (["--device-memory=64MB", "--engine.policy=bogus"], "engine.policy"),
    ],
)
def test_refused_overwrite_keeps_the_old_run(atom, tmp_path: Path, prepared: Path, bad, fragment):
    old = tmp_path / "runs" / "quick"
    (old / "checkpoints" / "step_000010").mkdir(parents=True)
    (old / "checkpoints" / "step_000010" / "model.safetensors").write_bytes(b"weights")
    (old / "config.json").write_text("{}")
    before = snapshot(old)
    args = ["train", *TINY, f"--data.prepared={prepared}", "--name", "quick", "--overwrite"]
    refused(atom(*args, *bad), fragment)
    assert snapshot(old) == before


def test_refused_train_leaves_no_run_behind(atom, tmp_path: Path, prepared: Path):
    args = ["train", *TINY, f"--data.prepared={prepared}", "--name", "fresh", "--quiet"]
    refused(atom(*args, "--device-memory", "banana"), "banana")
    refused(atom(*args, "--device-memory", "1KB"))  # accepted value, no plan fits: refused too
    assert not (tmp_path / "runs" / "fresh").exists()
    code, _, err = atom(*args, "--train.steps=1", "--no-sample")
    assert code == 0, err
    assert (tmp_path / "runs" / "fresh" / "checkpoints" / "step_000001").is_dir()


# --- items 4 and 5: one-line errors for values that once gave tracebacks or trained to NaN --------


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["plan", "--device-memory", "inf"], "--device-memory"),
        (["plan", "--device-memory", "nan"], "--device-memory"),
        (["plan", "--model", "tiny", "--tflops", "0"], "--tflops"),
        (["plan", "--model", "tiny", "--h2d-gbps", "0"], "--h2d-gbps"),
        (["train", "--device-memory", "inf"], "engine.device_memory"),
        (["train", "--data.rows=0"], "data.rows"),
        (["train", "--data.seq_len=0"], "data.seq_len"),
        (["train", "--train.lr=nan"], "train.lr"),
        (["train", "--train.lr=inf"], "train.lr"),
        (["train", "--model.preset=tiny", "--data.seq_len=65"], "context"),
        (["train", "--peer.port=70000"], "peer.port"),
        (["train", "--serve", "70000"], "--serve"),
        (["train", "--serve", "-1"], "--serve"),
        (["train", "--train.steps=1e400"], "train.steps"),
        (["train", "--train.ema=1"], "train.ema"),
        (["train", "--train.ema=nan"], "train.ema"),
        (["train", "--train.ema=0.9", "--train.ema_every=0"], "train.ema_every"),
        (["train", "--run.name=../escape"], "run.name"),
        (["data", "prepare", "stdlib", "out", "--tokenizer", "bpe", "--vocab-size", "-5"], "vocab"),
    ],
)
def test_bad_values_are_one_line_errors(atom, tmp_path: Path, prepared: Path, args, fragment):
    if args[0] == "train":  # on a build without the checks, still fail fast, never train long
        args = [*args, f"--data.prepared={prepared}", "--train.steps=1", "--quiet", "--no-sample"]
        args = (
            [a for a in args if a != "--train.steps=1"] if "--train.steps=1e400" in args else args
        )
    refused(atom(*args), fragment)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


def test_config_file_that_is_not_toml_text(atom, tmp_path: Path):
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "latin1.toml").write_bytes(b'[run]\nname = "caf\xe9"\n')
    refused(atom("train", "--config", "dir.toml"), "dir.toml", "directory")
    refused(atom("train", "--config", "latin1.toml"), "latin1.toml", "UTF-8")


def test_data_prepare_never_writes_over_a_file(atom, tmp_path: Path, corpus_dir: Path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    refused(atom("data", "prepare", str(corpus_dir), "notes.txt"), "notes.txt")
    refused(atom("data", "prepare", str(corpus_dir), "notes.txt", "--overwrite"), "notes.txt")
    refused(atom("data", "prepare", str(corpus_dir), "notes.txt/out"), "notes.txt")
    assert notes.read_text() == "mine"


def test_keygen_under_a_file(atom, tmp_path: Path):
    (tmp_path / "afile").write_text("x")
    refused(atom("keygen", "afile/swarm.key"), "afile")
    assert (tmp_path / "afile").read_text() == "x"


def test_serve_port_out_of_range(atom, run_copy: Path):
    refused(atom("serve", str(run_copy), "--port", "70000"), "--port")
    refused(atom("serve", str(run_copy), "--port", "-1"), "--port")


def test_sample_refuses_a_negative_temperature(atom, run_copy: Path):
    refused(atom("sample", str(run_copy), "--temperature", "-1"), "--temperature")
    refused(atom("sample", str(run_copy), "--temperature", "nan"), "--temperature")


def test_resume_with_a_config_that_is_not_an_object(atom, run_copy: Path):
    for text in ("[1, 2]", '{"run": 3}', "\xff not json"):
        (run_copy / "config.json").write_text(text, encoding="latin-1")
        before = snapshot(run_copy)
        refused(atom("train", "--resume", str(run_copy), "--quiet"), "config.json")
        assert snapshot(run_copy) == before


# --- item 8 and torn writes: resume names what is missing, survives a kill, replaces atomically --


def test_resume_after_a_torn_metrics_line(atom, run_copy: Path):
    metrics = run_copy / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 4, "lo')  # killed mid-write
    config_inode = (run_copy / "config.json").stat().st_ino
    code, _, err = atom("train", "--resume", str(run_copy), "--train.steps=6", "--quiet")
    assert code == 0, err
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 6
    # config.json was replaced by a new file, not rewritten in place (a kill mid-write tears it)
    assert (run_copy / "config.json").stat().st_ino != config_inode
    assert json.loads((run_copy / "config.json").read_text())["train"]["steps"] == 6


def test_resume_names_a_missing_manifest(atom, run_copy: Path):
    ckpt = run_copy / "checkpoints" / "step_000004"
    (ckpt / "manifest.json").unlink()
    before = snapshot(run_copy)
    refused(atom("train", "--resume", str(ckpt), "--quiet"), "manifest.json")
    refused(atom("train", "--resume", str(run_copy), "--quiet"), "manifest.json")
    assert snapshot(run_copy) == before


class Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs."""


def test_a_kill_during_pruning_leaves_only_whole_checkpoints(
    run_copy: Path, monkeypatch: pytest.MonkeyPatch
):
    import os

    real_unlink = os.unlink
    calls = []

    def unlink_then_die(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        calls.append(path)
        raise Killed

    monkeypatch.setattr(os, "unlink", unlink_then_die)
    with pytest.raises(Killed):
        prune_checkpoints(run_copy, keep=1)  # deletes step_000002; killed after its first file
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert calls
    for ckpt in (run_copy / "checkpoints").glob("step_*"):
        verify_checkpoint(ckpt)  # every checkpoint under its real name is whole
    assert [p.name for p in (run_copy / "checkpoints").glob("step_*")] == ["step_000004"]
    prune_checkpoints(run_copy, keep=1)  # the next prune removes what the kill left
    assert [p.name for p in (run_copy / "checkpoints").iterdir()] == ["step_000004"]


def test_profile_fits_the_sequence_to_a_short_context(atom):
    code, out, err = atom("profile", "--model", "tiny", "--json")
    assert code == 0, err
    assert json.loads(out)["blocks"]
    refused(atom("profile", "--model", "tiny", "--seq-len", "65"), "context")
    refused(atom("profile", "--model", "tiny", "--seq-len", "0"), "--seq-len")
