"""Every field of a RunConfig checked in one place, before anything is created or deleted.

`load_run_config` calls `resolve_and_validate` on every config it builds (defaults, TOML file,
overrides, a resumed run's saved config), so a command that is going to fail fails here: no run
directory made, none replaced, no checkpoint touched. Each check names the field at fault.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from atomtrain.errors import AtomError
from atomtrain.values import check_choice, check_number, check_port, check_seed, parse_size

if TYPE_CHECKING:
    from atomtrain.config import RunConfig

DEFAULT_SEQ_LEN_CAP = 128
"""An unset `data.seq_len` is the model's context, but no more than this."""


def resolve_and_validate(cfg: RunConfig, seq_len_given: bool = True) -> RunConfig:
    """`cfg`, all checked; an unset data.seq_len (`seq_len_given` false) fitted to the model."""
    from atomtrain.models import GPTConfig

    _check_run(cfg)
    m = cfg.model
    mc = GPTConfig.from_name(m.preset)  # names the known presets when it is not one
    for name in ("n_layer", "n_embd", "n_head"):
        check_number(getattr(m, name), f"model.{name}", 0)
    n_embd, n_head = m.n_embd or mc.n_embd, m.n_head or mc.n_head
    if n_embd % n_head:
        raise AtomError(f"model.n_embd ({n_embd}) must be a multiple of model.n_head ({n_head})")
    check_number(m.dropout, "model.dropout", 0.0, 1.0)
    if m.dropout >= 1.0:
        raise AtomError(f"model.dropout must be below 1, got {m.dropout}")
    d = cfg.data
    seq_len = d.seq_len if seq_len_given else min(mc.block_size, DEFAULT_SEQ_LEN_CAP)
    check_number(seq_len, "data.seq_len", 1)
    if seq_len > mc.block_size:
        raise AtomError(
            f"data.seq_len ({seq_len}) exceeds model {m.preset!r}'s context ({mc.block_size}); "
            f"pass --data.seq_len={mc.block_size} or less"
        )
    _check_data(cfg)
    _check_train(cfg)
    _check_engine(cfg)
    _check_peer(cfg)
    if seq_len != d.seq_len:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(d, seq_len=seq_len))
    return cfg


def _check_run(cfg: RunConfig) -> None:
    name = cfg.run.name
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise AtomError(f"run.name must be a plain name without slashes, got {name!r}")
    check_choice(cfg.run.device, "run.device", ("auto", "cpu", "cuda"))
    out = Path(cfg.run.out_dir)
    if not cfg.run.out_dir or "\0" in cfg.run.out_dir:
        raise AtomError(f"run.out_dir must name a directory, got {cfg.run.out_dir!r}")
    try:
        for parent in (out, *out.parents):
            if parent.exists() and not parent.is_dir():
                raise AtomError(f"run.out_dir {out}: {parent} is a file, not a directory")
    except OSError as e:  # a name too long, a directory we may not look into
        raise AtomError(f"run.out_dir {out} cannot be used ({e.strerror})") from None
    if cfg.log.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise AtomError(
            "log.tensorboard needs the tensorboard package: pip install 'atomtrain[tensorboard]'"
        )


def _is_file(path: Path) -> bool:
    """Whether `path` is a file; False where it cannot be looked at (a name too long, a NUL,
    a directory we may not enter)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _check_data(cfg: RunConfig) -> None:
    d = cfg.data
    if not d.source:
        raise AtomError("data.source must name a file, a directory, a glob or stdlib")
    t = d.tokenizer
    if t not in ("auto", "byte", "bpe") and not (
        _is_file(Path(t)) or _is_file(Path(t) / "tokenizer.json")
    ):
        raise AtomError(
            f"data.tokenizer must be auto, byte, bpe or a directory with a tokenizer.json, "
            f"got {t!r}"
        )
    check_number(d.rows, "data.rows", 1)
    check_seed(d.seed, "data.seed")
    check_choice(d.input, "data.input", ("shards", "stream"))
    check_number(d.input_rate, "data.input_rate", 0.0)
    check_choice(d.reuse, "data.reuse", ("auto", "off"))
    check_number(d.max_echo, "data.max_echo", 1)


def _check_train(cfg: RunConfig) -> None:
    t = cfg.train  # TrainConfig checks its own ranges; these need other sections
    check_seed(t.seed, "train.seed")
    if cfg.data.rows % t.micro_batch_rows:
        raise AtomError(
            f"data.rows ({cfg.data.rows}) must be a multiple of "
            f"train.micro_batch_rows ({t.micro_batch_rows})"
        )
    o = cfg.optim
    check_number(o.beta1, "optim.beta1", 0.0, 1.0)
    check_number(o.beta2, "optim.beta2", 0.0, 1.0)
    check_number(o.eps, "optim.eps", 0.0, lo_open=True)
    check_number(o.weight_decay, "optim.weight_decay", 0.0)
    if o.beta1 >= 1.0 or o.beta2 >= 1.0:
        raise AtomError("optim.beta1 and optim.beta2 must be below 1")


COMPILE_BACKENDS = ("inductor", "aot_eager")


def _check_engine(cfg: RunConfig) -> None:
    e = cfg.engine
    check_choice(e.compile_backend, "engine.compile_backend", COMPILE_BACKENDS)
    if not e.device_memory:
        return
    from atomtrain.engine.factory import check_engine_section

    parse_size(e.device_memory, "engine.device_memory")
    check_engine_section(e)
    check_choice(e.policy, "engine.policy", ("keep", "offload", "recompute"))


def _check_peer(cfg: RunConfig) -> None:
    p = cfg.peer
    check_port(p.port, "peer.port")
    check_number(p.num_peers, "peer.num_peers", 1)
    if not -1 <= p.index < p.num_peers:
        raise AtomError(f"peer.index must be -1 (auto) or in 0-{p.num_peers - 1}, got {p.index}")
    for name in ("matchmaking_s", "averaging_timeout_s", "state_timeout_s", "join_timeout_s"):
        check_number(getattr(p, name), f"peer.{name}", 0.0, lo_open=True)
    if p.sync_every != "auto":
        check_number(p.fixed_sync_every, "peer.sync_every", 1)
    check_number(p.min_sync_every, "peer.min_sync_every", 1)
    check_number(p.max_sync_every, "peer.max_sync_every", p.min_sync_every)
    check_choice(p.sync_mode, "peer.sync_mode", ("async", "blocking"))
    check_number(p.final_wait_s, "peer.final_wait_s", 0.0)
    check_number(p.target_group_size, "peer.target_group_size", 2)
    check_number(p.wait_for, "peer.wait_for", 0)
    check_number(p.outer_lr, "peer.outer_lr", 0.0, lo_open=True)
    check_number(p.outer_momentum, "peer.outer_momentum", 0.0, 1.0)
    check_number(p.follow_ratio, "peer.follow_ratio", 0.0, 0.5)
    check_number(p.lean, "peer.lean", 0.0, 1.0)
    if 0 < p.lean < 0.1:
        raise AtomError(f"peer.lean must be 0 (off) or in [0.1, 1.0], got {p.lean}")
    check_choice(p.compression, "peer.compression", ("float16", "int8", "int4", "none"))
    if "\0" in p.identity:
        raise AtomError(f"peer.identity must name a file, got {p.identity!r}")
    if "\0" in p.swarm_key:
        raise AtomError(f"peer.swarm_key must name a file, got {p.swarm_key!r}")
    if "\0" in p.swarm_cert:
        raise AtomError(f"peer.swarm_cert must name a file, got {p.swarm_cert!r}")
    if p.swarm:
        from atomtrain.peer.attack import check_attack
        from atomtrain.peer.auth import load_swarm_key

        check_attack(p.attack)
        if p.swarm_cert:  # a missing or malformed certificate or identity is named here
            from atomtrain.peer.auth import Membership

            Membership.admitted(p.swarm_cert, p.identity)
        else:
            load_swarm_key(p.swarm_key)  # a missing or malformed key file is named here
