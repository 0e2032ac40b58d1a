import json
from pathlib import Path

import numpy as np
import pytest

from atomtrain.data import (
    BPETokenizer,
    ByteTokenizer,
    LoaderConfig,
    PrepareConfig,
    TokenShards,
    TrainLoader,
    WindowSampler,
    prepare,
)
from atomtrain.data.corpus import resolve_sources
from atomtrain.errors import AtomError


def test_byte_tokenizer_round_trips_unicode():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓'\n"
    assert tok.decode(tok.encode(text)) == text


def test_bpe_tokenizer_trains_locally_and_round_trips(corpus_dir: Path):
    files = resolve_sources(str(corpus_dir))
    tok = BPETokenizer.train(files, vocab_size=400)
    text = files[0].read_text()[:500]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges compress
    assert max(ids) < tok.vocab_size <= 400


def test_prepare_writes_shards_manifest_and_val_split(prepared: Path):
    m = json.loads((prepared / "manifest.json").read_text())
    assert m["tokenizer"]["kind"] == "byte"
    shards = TokenShards.open(prepared)
    train, val = shards.num_tokens("train"), shards.num_tokens("val")
    assert train > 0 and val > 0 and 0.05 < val / (train + val) < 0.5
    assert shards.tokenizer.decode(list(shards.splits["train"][0][:50]))


def test_prepare_with_bpe_and_from_a_single_file(corpus_dir: Path, tmp_path: Path):
    one = sorted(corpus_dir.iterdir())[0]
    m = prepare(str(one), tmp_path / "bpe", PrepareConfig(tokenizer="bpe", bpe_vocab_size=300))
    shards = TokenShards.open(tmp_path / "bpe")
    assert m["tokenizer"]["kind"] == "bpe" and shards.vocab_size <= 300
    assert shards.num_tokens("val") > 0  # one document: its tail is held out


def test_prepare_accepts_a_glob_and_refuses_to_overwrite(corpus_dir: Path, tmp_path: Path):
    prepare(str(corpus_dir / "json_*.py"), tmp_path / "g", PrepareConfig())
    assert json.loads((tmp_path / "g" / "manifest.json").read_text())["num_documents"] == 2
    with pytest.raises(AtomError, match="already holds prepared data"):
        prepare(str(corpus_dir), tmp_path / "g", PrepareConfig())


def test_missing_source_and_missing_or_corrupt_shards_are_named(prepared: Path, tmp_path: Path):
    with pytest.raises(AtomError, match="does not exist"):
        prepare(str(tmp_path / "nope"), tmp_path / "o", PrepareConfig())
    with pytest.raises(AtomError, match="manifest.json is missing"):
        TokenShards.open(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in prepared.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    shard = bad / "train_000.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(AtomError, match="train_000.bin is corrupt: checksum"):
        TokenShards.open(bad)
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(AtomError, match="train_000.bin is corrupt: .* bytes"):
        TokenShards.open(bad)
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(AtomError, match="not a valid shard manifest"):
        TokenShards.open(bad)


def sampler(prepared: Path, **kw) -> WindowSampler:
    return WindowSampler(TokenShards.open(prepared), LoaderConfig(rows=4, seq_len=16, **kw))


def test_windows_depend_only_on_seed_peer_and_step(prepared: Path):
    a, b = sampler(prepared), sampler(prepared)
    assert np.array_equal(a.windows("train", 7), b.windows("train", 7))
    assert not np.array_equal(a.windows("train", 7), a.windows("train", 8))
    other_peer = sampler(prepared, peer_index=1, num_peers=2)
    assert not np.array_equal(a.windows("train", 7), other_peer.windows("train", 7))


def test_targets_are_inputs_shifted_by_one(prepared: Path):
    x, y = TrainLoader(sampler(prepared, prefetch=0)).next_batch()
    assert x.shape == y.shape == (4, 16)
    assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())


def test_disjoint_peer_slices(prepared: Path):
    s0 = sampler(prepared, peer_index=0, num_peers=2)
    s1 = sampler(prepared, peer_index=1, num_peers=2)
    half = s0._index["train"][-1] // 2
    assert all((s0.starts("train", k) < half).all() for k in range(30))
    assert all((s1.starts("train", k) >= half).all() for k in range(30))


def test_loader_resumes_exactly_with_and_without_prefetch(prepared: Path):
    full = TrainLoader(sampler(prepared, prefetch=2))
    seen = [full.next_batch()[0] for _ in range(6)]
    full.close()
    first = TrainLoader(sampler(prepared, prefetch=2))
    for _ in range(3):
        first.next_batch()
    state = first.state_dict()
    first.close()
    resumed = TrainLoader(sampler(prepared, prefetch=0))
    resumed.load_state_dict(state)
    rest = [resumed.next_batch()[0] for _ in range(3)]
    for a, b in zip(seen[3:], rest, strict=True):
        assert np.array_equal(a.numpy(), b.numpy())
