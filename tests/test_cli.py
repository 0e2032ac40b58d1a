"""The CLI end to end on `tiny`, as a user runs it: outputs, files, and one-line errors."""

import json
from pathlib import Path

import pytest

from .conftest import TINY, run_cli


def assert_one_line_error(proc, *fragments: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("atomtrain: error")]
    assert len(lines) == 1, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_train_writes_a_run_and_prints_a_sample(prepared: Path, tmp_path: Path):
    proc = run_cli(
        "train",
        *TINY,
        "--train.steps=12",
        f"--data.prepared={prepared}",
        "--name=e2e",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "runs" / "e2e"
    for f in ("config.json", "metrics.jsonl", "loss.png", "tokenizer.json"):
        assert (run / f).is_file(), f
    assert (run / "checkpoints" / "step_000012" / "model.safetensors").is_file()
    assert "sample:" in proc.stdout and f"loss plot: {Path('runs/e2e/loss.png')}" in proc.stdout
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 12 and "tokens_per_s" in records[-1]

    again = run_cli(
        "train",
        *TINY,
        "--train.steps=12",
        f"--data.prepared={prepared}",
        "--name=e2e",
        cwd=tmp_path,
    )
    assert_one_line_error(again, "runs/e2e already exists", "--overwrite")

    sample = run_cli("sample", str(run), "--tokens=20", "--prompt=import ", cwd=tmp_path)
    assert sample.returncode == 0 and sample.stdout.startswith("import ")

    more = run_cli("train", "--resume", str(run), "--train.steps=15", cwd=tmp_path)
    assert more.returncode == 0, more.stderr
    assert "resuming" in more.stderr
    assert (run / "checkpoints" / "step_000015").is_dir()


def test_bad_inputs_give_one_line_errors(prepared: Path, tmp_path: Path):
    cases = [
        (["train", "--model.preset=gpt5"], ["unknown model preset 'gpt5'"]),
        (["train", "--train.lr=abc"], ["train.lr expects float"]),
        (["train", "--data.prepared=/nonexistent"], ["/nonexistent/manifest.json is missing"]),
        (["train", "--config=missing.toml"], ["missing.toml does not exist"]),
        (["train", "--resume=runs/none"], ["runs/none does not exist"]),
        (["sample", "runs/none"], ["runs/none does not exist"]),
        (["data", "prepare", "no/such/dir", "out"], ["'no/such/dir' does not exist"]),
        (
            ["train", *TINY, f"--data.prepared={prepared}", "--data.seq_len=1000"],
            ["data.seq_len (1000) exceeds"],
        ),
    ]
    for args, fragments in cases:
        assert_one_line_error(run_cli(*args, cwd=tmp_path), *fragments)


def test_truncated_checkpoint_is_refused_and_left_alone(prepared: Path, tmp_path: Path):
    proc = run_cli(
        "train",
        *TINY,
        "--train.steps=3",
        f"--data.prepared={prepared}",
        "--name=t",
        "--no-sample",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    weights = tmp_path / "runs/t/checkpoints/step_000003/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    before = weights.read_bytes()
    resumed = run_cli("train", "--resume", "runs/t", "--train.steps=6", cwd=tmp_path)
    assert_one_line_error(resumed, "truncated", "model.safetensors")
    assert weights.read_bytes() == before


def test_data_prepare_command(corpus_dir: Path, tmp_path: Path):
    proc = run_cli("data", "prepare", str(corpus_dir), "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "training and" in proc.stdout and (tmp_path / "out/manifest.json").is_file()


def test_plan_for_gpt3_on_a_24gb_device(tmp_path: Path):
    proc = run_cli("plan", "--model", "gpt3-175b", "--device-memory", "24GB", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "predicted step" in proc.stdout and "lower bound" in proc.stdout
    small = run_cli("plan", "--model", "gpt3-175b", "--device-memory", "2GB", cwd=tmp_path)
    assert_one_line_error(small, "block", "alone needs", "more than the budget")
    bad = run_cli("plan", "--model", "gpt3-175b", "--device-memory", "lots", cwd=tmp_path)
    assert_one_line_error(bad, "cannot read 'lots' as a size")


def test_plan_counts_a_weight_average_in_host_memory(tmp_path: Path):
    """`--weight-average` (a run with train.ema) adds a float32 copy of the weights."""
    plans = [
        json.loads(
            run_cli(
                "plan", "--model", "small", "--host-memory", "64GB", "--json", *extra, cwd=tmp_path
            ).stdout
        )
        for extra in ([], ["--weight-average"])
    ]
    assert (
        plans[1]["host_memory_bytes"] - plans[0]["host_memory_bytes"] == 4 * plans[0]["parameters"]
    )
    assert "weight average" in plans[1]["host_memory"]
    assert "weight average" not in plans[0]["host_memory"]


def test_train_through_the_engine_and_resume_plainly(prepared: Path, tmp_path: Path):
    proc = run_cli(
        "train",
        *TINY,
        "--train.steps=6",
        f"--data.prepared={prepared}",
        "--name=sw",
        "--device-memory=4MB",
        "--no-sample",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "plan:" in proc.stderr
    plain = run_cli(
        "train",
        "--resume",
        "runs/sw",
        "--train.steps=8",
        "--engine.device_memory=",
        "--no-sample",
        cwd=tmp_path,
    )
    assert plain.returncode == 0, plain.stderr
    assert (tmp_path / "runs/sw/checkpoints/step_000008").is_dir()


@pytest.mark.bench
def test_bench_swap_prints_its_fields(tmp_path: Path):
    proc = run_cli(
        "bench",
        "swap",
        "--json",
        "--n-layer=4",
        "--n-embd=64",
        "--n-head=2",
        "--seq-len=16",
        "--rows=4",
        "--rounds=1",
        "--steps-per-round=2",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in (
        "resident_tokens_per_s",
        "swapped_tokens_per_s",
        "ratio",
        "budget_bytes",
        "model_bytes",
        "peak_device_bytes",
        "num_submodels",
        "max_abs_loss_diff",
        "max_rel_grad_diff",
        "optimizer_s",
        "overlap_fraction",
        "optimizer_vs_torch",
    ):
        assert key in out, key
    assert out["peak_device_bytes"] <= out["budget_bytes"]
    assert out["max_rel_grad_diff"] <= 1e-5 and out["num_submodels"] >= 2
    # The setting: at most 40% of resident training's need, activations off the device.
    assert out["budget_bytes"] <= 0.4 * out["resident_need_bytes"] + 1
    assert out["policies"]["offload"] + out["policies"]["recompute"] > 0
    lo, hi = out["optimizer_vs_torch_range"]
    assert 0 < lo <= out["optimizer_vs_torch"] <= hi and 0 <= out["overlap_fraction"] <= 1


def test_verbose_logs_atoms_debug_messages_not_a_plots_font_search(capsys, caplog, monkeypatch):
    """`atomtrain --verbose`: debug messages (bench attack --trace's peers), without matplotlib's
    and PIL's line-by-line font search for the loss plot; without it, from INFO up."""
    import logging

    from atomtrain.cli import main as cli

    levels: list[int] = []
    monkeypatch.setattr(cli.logging, "basicConfig", lambda **kw: levels.append(kw["level"]))
    with caplog.at_level(logging.DEBUG):  # (what basicConfig would set, under pytest's handlers)
        for argv in (["--verbose"], []):
            assert cli.main([*argv, "bench", "attack", "--steps", "0"]) == 2
            assert "--steps must be at least 1" in capsys.readouterr().err
        for noisy in ("matplotlib.font_manager", "PIL.PngImagePlugin"):
            assert not logging.getLogger(noisy).isEnabledFor(logging.DEBUG)
    assert levels == [logging.DEBUG, logging.INFO]
