"""Fuzzing the parsers Atom owns: whatever comes in, each answers with its value or its one error
type (a clear message), never another exception. Cases hypothesis once found are kept as examples.
"""

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from atomtrain.config import load_run_config
from atomtrain.data.shards import TokenShards
from atomtrain.errors import AtomError
from atomtrain.peer.auth import parse_key
from atomtrain.peer.status import PeerStatus
from atomtrain.sched.serve import BadRequest, parse_request
from atomtrain.train.checkpoint import verify_checkpoint

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=12,
)


@FUZZ
@given(st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
@example(b'{"max_tokens": 1e400}')
@example(b'{"prompt": "x", "seed": true}')
@example(b"\xff\xfe")
def test_http_request_parser(body: bytes):
    try:
        req = parse_request(body)
    except BadRequest as e:
        assert str(e)
        return
    assert isinstance(req["prompt"], str) and req["max_tokens"] >= 1


status_like = st.fixed_dictionaries(
    {
        "name": json_values,
        "round": json_values,
        "step": json_values,
        "loss": json_values,
        "tokens_per_s": json_values,
        "last_sync": json_values,
    },
    optional={"addrs": json_values, "rejected": json_values, "updated": json_values},
)


@FUZZ
@given(json_values | status_like)
@example({"name": "a", "round": 1e400, "step": 0, "loss": 0, "tokens_per_s": 0, "last_sync": 0})
@example(
    {"name": "a", "round": 1, "step": 0, "loss": 0, "tokens_per_s": 0, "last_sync": 0, "addrs": 5}
)
def test_dht_status_records(value):
    status = PeerStatus.from_record(value)
    assert status is None or isinstance(status, PeerStatus)


@FUZZ
@given(st.text(max_size=80))
@example("0" * 64)
@example(" " + "a" * 64 + "\n")
def test_swarm_key_parser(text: str):
    try:
        key = parse_key(text, "fuzz")
    except AtomError as e:
        assert "not a swarm key" in str(e)
        return
    assert len(key.secret) == 32


override = st.tuples(
    st.sampled_from(["train.lr", "train.steps", "peer.defend", "model.preset", "nope.x", "train"]),
    st.text(max_size=12),
).map(lambda kv: f"--{kv[0]}={kv[1]}")


@FUZZ
@given(st.lists(override | st.text(max_size=15), max_size=4))
@example(["--train.steps=1e99"])
@example(["--peer.defend=maybe"])
def test_config_overrides(args: list[str]):
    try:
        load_run_config(overrides=args)
    except AtomError as e:
        assert str(e) and "\n" not in str(e)


@FUZZ
@given(
    json_values
    | st.fixed_dictionaries({"dtype": json_values, "splits": json_values, "tokenizer": json_values})
)
@example({"dtype": "uint16", "splits": [], "tokenizer": {"kind": "byte"}, "format_version": 1})
def test_shard_manifests(prepared: Path, tmp_path_factory: pytest.TempPathFactory, manifest):
    root = tmp_path_factory.mktemp("shards")
    for f in prepared.iterdir():
        shutil.copy(f, root / f.name)
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(AtomError):
        TokenShards.open(root)


@FUZZ
@given(
    json_values
    | st.dictionaries(st.sampled_from(["model.safetensors", "state.json"]), json_values, max_size=2)
)
@example({"model.safetensors": []})
def test_checkpoint_manifests(tmp_path_factory: pytest.TempPathFactory, manifest):
    ckpt = tmp_path_factory.mktemp("ckpt")
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(AtomError):
        verify_checkpoint(ckpt)
