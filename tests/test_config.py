from pathlib import Path

import pytest

from atomtrain.config import RunConfig, load_run_config, parse_overrides
from atomtrain.errors import AtomError


def test_defaults_train_small_on_stdlib():
    cfg = load_run_config()
    assert cfg.model.preset == "small" and cfg.data.source == "stdlib"


def test_toml_then_overrides(tmp_path: Path):
    f = tmp_path / "run.toml"
    f.write_text('[train]\nlr = 0.01\nsteps = 50\n[model]\npreset = "tiny"\n')
    cfg = load_run_config(RunConfig, str(f), ["--train.steps=7", "--data.rows", "32"])
    assert (cfg.train.lr, cfg.train.steps, cfg.data.rows, cfg.model.preset) == (0.01, 7, 32, "tiny")


@pytest.mark.parametrize(
    "override, message",
    [
        ("--train.lrr=1", "unknown setting train.lrr"),
        ("--train.steps=many", "train.steps expects int"),
        ("--train.steps=-3", "train.steps must be positive"),
        ("--train.steps=2.5", "train.steps expects"),
        ("--nosection.x=1", "unknown setting nosection"),
        ("--train.lr=0", "train.lr must be positive"),
        ("--peer.follow_ratio=0.6", r"peer.follow_ratio must be in \[0.0, 0.5\], got 0.6"),
        ("--peer.follow_ratio=-0.1", r"peer.follow_ratio must be in \[0.0, 0.5\], got -0.1"),
        ("--peer.follow_ratio=nan", "peer.follow_ratio must be a finite number"),
        ("--peer.lean=1.5", r"peer.lean must be in \[0.0, 1.0\], got 1.5"),
        ("--peer.lean=0.05", r"peer.lean must be 0 \(off\) or in \[0.1, 1.0\], got 0.05"),
    ],
)
def test_invalid_values_name_the_field(override, message):
    with pytest.raises(AtomError, match=message):
        load_run_config(overrides=[override])


def test_bad_toml_and_missing_file(tmp_path: Path):
    with pytest.raises(AtomError, match="does not exist"):
        load_run_config(RunConfig, str(tmp_path / "none.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(AtomError, match="not valid TOML"):
        load_run_config(RunConfig, str(bad))


def test_override_syntax():
    assert parse_overrides(["--a.b=1", "--a.c", "2"]) == {"a": {"b": "1", "c": "2"}}
    with pytest.raises(AtomError, match="unrecognized argument"):
        parse_overrides(["--steps=3"])


def test_the_follow_ratio_and_lean_default_to_the_rules_bars_and_are_off_undefended():
    from atomtrain.config import PeerSection
    from atomtrain.peer.bounds import NO_DEFENCE, Defence
    from atomtrain.peer.exclusion import FOLLOW_RATIO, LEAN

    assert PeerSection().follow_ratio == Defence().follow == FOLLOW_RATIO
    assert NO_DEFENCE.follow == 0.0
    assert PeerSection().lean == Defence().lean == LEAN and NO_DEFENCE.lean == 0.0
