"""Property tests of every value parser a user's input reaches (issue 17): whatever comes in, each
answers with a valid value or AtomError (BadRequest over HTTP) in one line, never another
exception, and what it accepts is within its documented range."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from atomtrain.config import RunConfig, load_run_config, parse_overrides, read_toml
from atomtrain.errors import AtomError
from atomtrain.sched.serve import MAX_TOKENS_LIMIT, BadRequest, parse_request
from atomtrain.train.metrics import read_metrics
from atomtrain.train.session import saved_config
from atomtrain.values import MAX_SEED, MAX_SIZE_BYTES, check_number, check_port, parse_size

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def one_line(e: Exception) -> None:
    assert str(e) and "\n" not in str(e)


numbers = (
    st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(min_value=-(10**500), max_value=10**500)
)
number_text = numbers.map(str) | st.sampled_from(["nan", "inf", "-inf", "1e400", "0x10", "", " "])
sizes = st.tuples(
    number_text, st.sampled_from(["", "B", "KB", "MiB", "GB", "TiB", "XB", " gb"])
).map("".join)


@FUZZ
@given(sizes | st.text(max_size=20))
@example("inf GB")
@example("nan")
@example("1e400B")
@example("0.5B")
def test_sizes(text: str):
    try:
        value = parse_size(text, "--device-memory")
    except AtomError as e:
        one_line(e)
        assert "--device-memory" in str(e)
        return
    assert isinstance(value, int) and 1 <= value <= MAX_SIZE_BYTES


@FUZZ
@given(numbers | st.booleans() | st.text(max_size=5))
def test_ports(value):
    try:
        port = check_port(value, "--port")  # type: ignore[arg-type]
    except AtomError as e:
        one_line(e)
        return
    assert isinstance(port, int) and 0 <= port <= 65535


@FUZZ
@given(numbers | st.booleans(), st.floats(-10, 10) | st.none(), st.floats(-10, 10) | st.none())
def test_numbers_in_a_range(value, lo, hi):
    try:
        out = check_number(value, "x", lo, hi)
    except AtomError as e:
        one_line(e)
        return
    assert isinstance(out, int) or math.isfinite(out)
    assert (lo is None or out >= lo) and (hi is None or out <= hi)


def _fields(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type) or f.name in RunConfig.__annotations__:
            out += _fields(getattr(RunConfig(), f.name).__class__, f"{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


FIELDS = _fields(RunConfig)
settings_values = number_text | st.sampled_from(["true", "none", "tiny", "../x", "-1", "0"])
override = st.tuples(st.sampled_from(FIELDS), settings_values).map(lambda kv: f"--{kv[0]}={kv[1]}")


@FUZZ
@given(st.lists(override, min_size=1, max_size=4))
@example(["--train.lr=nan"])
@example(["--data.seq_len=0"])
@example(["--peer.port=70000"])
@example(["--train.steps=1e400"])
@example(["--model.preset=tiny"])
@example(["--run.out_dir=" + "x" * 5000])
def test_every_config_field(args: list[str]):
    try:
        cfg = load_run_config(overrides=args)
    except AtomError as e:
        one_line(e)
        return
    assert cfg.data.seq_len >= 1 and cfg.data.rows >= 1 and math.isfinite(cfg.train.lr)
    assert 0 <= cfg.peer.port <= 65535


def _text_fields() -> list[str]:
    cfg = RunConfig()
    out = []
    for field in FIELDS:
        section, _, name = field.rpartition(".")
        value = getattr(getattr(cfg, section), name) if section else getattr(cfg, name)
        if isinstance(value, str):
            out.append(field)
    return out


@pytest.mark.parametrize("value", ["1" * 400, "x/" * 3000, "a\x00b", "~nobody/x"])
def test_every_text_field_takes_names_no_file_can_have(value: str):
    """Names too long for the file system, NUL bytes: an error that names the field, or a
    value kept as text, never an OSError from looking it up (a tokenizer path once did)."""
    for field in _text_fields():
        try:
            load_run_config(overrides=[f"--{field}={value}"])
        except AtomError as e:
            one_line(e)


@FUZZ
@given(st.lists(st.text(max_size=15), max_size=5))
@example(["--train.lr=1", "--train.lr.x=2"])
@example(["--a..b=1"])
def test_override_syntax(args: list[str]):
    try:
        parse_overrides(args)
    except AtomError as e:
        one_line(e)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-files")


@FUZZ
@given(st.binary(max_size=120) | st.text(max_size=60).map(str.encode))
@example(b'[run]\nname = "caf\xe9"\n')
@example(b"[train]\nlr = nan\n")
def test_config_files(scratch: Path, data: bytes):
    path = scratch / "run.toml"
    path.write_bytes(data)
    try:
        values = read_toml(path)
        load_run_config(RunConfig, str(path))
    except AtomError as e:
        one_line(e)
        return
    assert isinstance(values, dict)


json_lines = st.lists(
    st.dictionaries(st.sampled_from(["step", "loss", "x"]), numbers | st.text(max_size=3))
    .map(json.dumps)
    .map(str.encode)
    | st.binary(max_size=20),
    max_size=5,
).map(b"\n".join)


@FUZZ
@given(json_lines)
@example(b'{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
@example(b'{"step": "1"}\n{"step": 2}\n')
def test_metrics_files(scratch: Path, data: bytes):
    path = scratch / "metrics.jsonl"
    path.write_bytes(data)
    try:
        records = read_metrics(path)
    except AtomError as e:
        one_line(e)
        return
    assert all(isinstance(r, dict) and isinstance(r.get("step", 0), int) for r in records)


@FUZZ
@given(
    st.binary(max_size=60)
    | st.recursive(st.integers() | st.text(max_size=4), st.lists).map(
        lambda v: json.dumps(v).encode()
    )
)
@example(b"[1, 2]")
@example(b'{"run": 3}')
def test_saved_configs(scratch: Path, data: bytes):
    (scratch / "config.json").write_bytes(data)
    try:
        saved = saved_config(scratch)
    except AtomError as e:
        one_line(e)
        return
    assert isinstance(saved, dict)


request_values = numbers | st.booleans() | st.none() | st.text(max_size=8)
requests = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.text(max_size=8) | request_values,
        "max_tokens": request_values,
        "temperature": request_values,
        "top_p": request_values,
        "seed": request_values,
        "stream": request_values,
    },
)


@FUZZ
@given(requests)
@example({"prompt": "x", "max_tokens": 10**400})
@example({"prompt": "x", "seed": 2**64})
@example({"prompt": "\ud800"})
def test_completion_requests(req: dict):
    try:
        body = json.dumps(req).encode()
    except ValueError:  # NaN is valid in Python's JSON; nothing else fails here
        return
    try:
        out = parse_request(body)
    except BadRequest as e:
        one_line(e)
        return
    out["prompt"].encode("utf-8")
    assert 1 <= out["max_tokens"] <= MAX_TOKENS_LIMIT and 0 <= out["seed"] <= MAX_SEED
    assert math.isfinite(out["temperature"]) and math.isfinite(out["top_p"])
