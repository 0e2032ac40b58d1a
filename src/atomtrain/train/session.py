"""Assembles a run from a RunConfig: data, model, runner, trainer, run directory, resume."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from atomtrain.checks import resolve_and_validate
from atomtrain.config import DataSection, ModelSection, RunConfig
from atomtrain.data import (
    LoaderConfig,
    PrepareConfig,
    TokenShards,
    TrainLoader,
    WindowSampler,
    prepare,
    validation_batches,
)
from atomtrain.errors import AtomError
from atomtrain.models import GPT, GPTConfig
from atomtrain.optim import AdamW
from atomtrain.train.averaged import WeightAverage, check_unaliased, saved_average
from atomtrain.train.checkpoint import (
    FILES as CHECKPOINT_FILES,
)
from atomtrain.train.checkpoint import (
    Checkpoint,
    check_matches,
    latest_checkpoint,
    load_checkpoint,
)
from atomtrain.train.metrics import MetricsLog
from atomtrain.train.runner import PlainRunner, StepRunner
from atomtrain.train.trainer import Trainer, TrainState
from atomtrain.values import atomic_write_text

if TYPE_CHECKING:
    from atomtrain.data.reuse import EchoingLoader
    from atomtrain.engine.compiled import CompileConfig
    from atomtrain.models.hf import HFCausalLM
    from atomtrain.peer.runtime import PeerRuntime

log = logging.getLogger(__name__)

RunnerFactory = Callable[[nn.Module, AdamW, RunConfig, torch.device], StepRunner]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise AtomError("run.device is 'cuda' but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise AtomError(f"run.device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def cache_dir() -> Path:
    return Path(os.environ.get("ATOM_CACHE_DIR", Path.home() / ".cache" / "atomtrain"))


def data_tokenizer(cfg: DataSection, model: ModelSection | None = None) -> str:
    """`data.tokenizer` with `auto` resolved: the `model.hf` directory's tokenizer, else byte."""
    if cfg.tokenizer != "auto":
        return cfg.tokenizer
    if model is not None and model.hf and (Path(model.hf) / "tokenizer.json").is_file():
        return str(Path(model.hf).resolve())
    return "byte"


def prepared_data(cfg: DataSection, model: ModelSection | None = None) -> TokenShards:
    """The prepared shards the config names, preparing (once, cached) when it names a source."""
    if cfg.prepared:
        return TokenShards.open(cfg.prepared)
    tokenizer = data_tokenizer(cfg, model)
    where = "" if cfg.source == "stdlib" else str(Path(cfg.source).resolve())
    kind = tokenizer
    if tokenizer not in ("byte", "bpe"):  # a model's tokenizer: keyed by its contents
        tok_file = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else tokenizer
        try:
            kind = "hf-" + hashlib.sha256(Path(tok_file).read_bytes()).hexdigest()[:12]
        except OSError:
            raise AtomError(f"data.tokenizer: cannot read {tok_file}") from None
    key = f"{cfg.source}|{kind}|{where}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    label = "stdlib" if cfg.source == "stdlib" else Path(cfg.source).name or "data"
    root = cache_dir() / "data" / f"{label}-{kind.split('-')[0]}-{digest}"
    if not (root / "manifest.json").exists():
        prepare(cfg.source, root, PrepareConfig(tokenizer=tokenizer), overwrite=True)
    return TokenShards.open(root)


REUSE_SLACK = 64
"""Extra tokens per streamed row: reused windows start at a fresh offset within them."""


def streaming_loader(
    cfg: RunConfig, shards: TokenShards, index: int, num_peers: int
) -> EchoingLoader:
    """Raw text tokenized on the fly (the validation documents left out), with data echoing."""
    from atomtrain.data.corpus import resolve_sources
    from atomtrain.data.reuse import EchoingLoader, ReuseConfig
    from atomtrain.data.stream import StreamConfig, StreamingSource

    d = cfg.data
    if d.input_rate < 0 or d.max_echo < 1 or d.reuse not in ("auto", "off"):
        raise AtomError("data.input_rate must be >= 0, data.max_echo >= 1, data.reuse auto/off")
    held_out = set(shards.manifest.get("val_documents", []))
    files = [f for f in resolve_sources(d.source) if str(f) not in held_out]
    source = StreamingSource(
        files,
        StreamConfig(
            rows=d.rows,
            chunk_len=d.seq_len + 1 + REUSE_SLACK,
            seed=d.seed,
            rate_tokens_per_s=d.input_rate,
        ),
        shards.tokenizer,
        index if num_peers else 0,  # a stream reads files round-robin: no seeded draw
        max(num_peers, 1),
    )
    return EchoingLoader(
        source,
        ReuseConfig(enabled=d.reuse == "auto", max_echo=d.max_echo, seq_len=d.seq_len, seed=d.seed),
    )


def model_config(cfg: ModelSection, vocab_size: int, seq_len: int) -> GPTConfig:
    base = GPTConfig.from_name(cfg.preset)
    shape = {k: getattr(cfg, k) for k in ("n_layer", "n_embd", "n_head") if getattr(cfg, k)}
    mc = GPTConfig.from_name(
        cfg.preset, dropout=cfg.dropout, vocab_size=max(base.vocab_size, vocab_size), **shape
    )
    if seq_len > mc.block_size:
        raise AtomError(f"data.seq_len ({seq_len}) exceeds the model's context ({mc.block_size})")
    return mc


def build_model(mc: GPTConfig, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(mc)


def hf_model(cfg: ModelSection, seed: int) -> HFCausalLM | None:
    """The transformers model the section names (None for our GPT presets)."""
    if not (cfg.hf or cfg.hf_config):
        return None
    from atomtrain.models.hf import hf_from_config, load_hf

    if cfg.hf and cfg.hf_config:
        raise AtomError("set model.hf (a model directory) or model.hf_config, not both")
    torch.manual_seed(seed)  # loading draws (and discards) an initialization
    return load_hf(cfg.hf) if cfg.hf else hf_from_config(cfg.hf_config, seed)


def model_from_section(
    cfg: ModelSection, vocab_size: int, seq_len: int, seed: int, hf: HFCausalLM | None = None
) -> tuple[nn.Module, dict]:
    """The run's model (`hf`, when already loaded) and what a checkpoint records to rebuild it
    (`train/loading.py`)."""
    if hf is None:
        hf = hf_model(cfg, seed)
    if hf is None:
        mc = model_config(cfg, vocab_size, seq_len)
        return build_model(mc, seed), {"model": mc.__dict__, "preset": cfg.preset}
    from atomtrain.models.hf import config_to_dict

    shape = hf.config
    if vocab_size > shape.vocab_size:
        raise AtomError(
            f"the data's tokenizer has {vocab_size} token ids but the model only "
            f"{shape.vocab_size}; prepare the data with the model's tokenizer"
        )
    if seq_len > shape.block_size:
        raise AtomError(
            f"data.seq_len ({seq_len}) exceeds the model's context ({shape.block_size})"
        )
    return hf, {"model": {"kind": "hf", "config": config_to_dict(hf.hf_config)}}


def plain_runner(model: nn.Module, opt: AdamW, cfg: RunConfig, device: torch.device) -> StepRunner:
    model.to(device)
    context: Callable[[], AbstractContextManager] = contextlib.nullcontext
    if cfg.engine.compile:
        from atomtrain.engine.compiled import BlockCompiler, compiled_blocks

        compiler = BlockCompiler(compile_config(cfg))
        context = partial(compiled_blocks, model, compiler, cfg.engine.blocks)
    return PlainRunner(model, opt, cfg.train.micro_batch_rows, cfg.train.grad_clip, device, context)


def compile_config(cfg: RunConfig) -> CompileConfig:
    """How blocks are compiled: the run's backend, artefacts in the project's cache."""
    from atomtrain.engine.compiled import CompileConfig

    return CompileConfig(cfg.engine.compile_backend, str(cache_dir() / "inductor"))


@dataclass
class Session:
    cfg: RunConfig
    run_dir: Path
    model: nn.Module
    shards: TokenShards
    trainer: Trainer
    resumed_from: Path | None
    peer: PeerRuntime | None = None
    resumed_peer_state: dict | None = None


def model_label(cfg: ModelSection) -> str:
    """A short name for the model, for run names and titles."""
    if cfg.hf:
        return Path(cfg.hf).resolve().name
    return "hf" if cfg.hf_config else cfg.preset


def planned_run_dir(cfg: RunConfig, overwrite: bool) -> Path:
    """Where a new run goes; AtomError, before anything is touched, when it cannot go there."""
    name = cfg.run.name or f"{model_label(cfg.model)}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.run.out_dir) / name
    n = 1
    while not cfg.run.name and (run_dir.exists() or run_dir.is_symlink()):
        n += 1  # two unnamed runs started in the same second
        run_dir = Path(cfg.run.out_dir) / f"{name}-{n}"
    if run_dir.exists() or run_dir.is_symlink():
        if not overwrite:
            raise AtomError(
                f"run directory {run_dir} already exists; pass --overwrite to replace "
                f"it or --resume {run_dir} to continue it"
            )
        if not run_dir.is_dir() or run_dir.is_symlink():
            raise AtomError(f"{run_dir} is not a run directory; --overwrite replaces only those")
    return run_dir


def new_run_dir(cfg: RunConfig, overwrite: bool) -> Path:
    """Create the run directory, replacing an existing one only with `overwrite`.

    The old directory is first renamed aside, so a crash in between never leaves a half-deleted
    run under the real name.
    """
    run_dir = planned_run_dir(cfg, overwrite)
    if run_dir.exists():
        aside = run_dir.with_name(f".{run_dir.name}.replaced-{os.getpid()}")
        os.replace(run_dir, aside)
        shutil.rmtree(aside, ignore_errors=True)
    run_dir.mkdir(parents=True)
    return run_dir


def resolve_resume(path: Path) -> tuple[Path, Path]:
    """(run directory, checkpoint) from either a run directory or a checkpoint directory."""
    if not path.is_dir():
        raise AtomError(f"--resume {path} is not a run or checkpoint directory")
    if (path / "manifest.json").exists() or any((path / f).exists() for f in CHECKPOINT_FILES):
        return path.parent.parent, path  # a checkpoint; load_checkpoint names any missing file
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise AtomError(f"{path} holds no checkpoint to resume from")
    return path, ckpt


def saved_config(run_dir: Path) -> dict:
    where = run_dir / "config.json"
    try:
        saved = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AtomError(f"{where} is missing") from None
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise AtomError(f"{where} is unreadable ({type(e).__name__})") from None
    if not isinstance(saved, dict) or not all(isinstance(v, dict) for v in saved.values()):
        raise AtomError(f"{where} is not a config: it must be an object of sections")
    return saved


def open_session(
    cfg: RunConfig,
    resume: Path | None = None,
    overwrite: bool = False,
    runner_factory: RunnerFactory = plain_runner,
) -> Session:
    """Everything a run needs, ready for `session.trainer.fit()`.

    Everything that can be refused is checked before the run directory is created, replaced or
    written to, so a refused command leaves what existed as it was.
    """
    cfg = resolve_and_validate(cfg)
    device = resolve_device(cfg.run.device)
    hf = hf_model(cfg.model, cfg.train.seed)  # a bad model directory fails before data work
    shards = prepared_data(cfg.data, cfg.model)
    model, described = model_from_section(
        cfg.model, shards.vocab_size, cfg.data.seq_len, cfg.train.seed, hf
    )
    ckpt = None
    if resume is not None:
        run_dir, ckpt_path = resolve_resume(resume)
        ckpt = load_checkpoint(ckpt_path)  # verified before anything is touched
    else:
        run_dir = planned_run_dir(cfg, overwrite)
    params = dict(model.named_parameters())
    opt = AdamW({n: p for n, p in params.items() if p.requires_grad}, cfg.optim)
    token = read_peer_token(run_dir) if ckpt is not None else None
    token = token or os.urandom(8).hex()
    index, num_peers = data_slice(cfg, token)
    loader_cfg = LoaderConfig(
        rows=cfg.data.rows,
        seq_len=cfg.data.seq_len,
        seed=cfg.data.seed,
        peer_index=index,
        num_peers=num_peers,
    )
    sampler = WindowSampler(shards, loader_cfg)
    val_rows = cfg.train.eval_rows or cfg.data.rows
    val_sampler = (
        sampler
        if val_rows == cfg.data.rows
        else WindowSampler(shards, replace(loader_cfg, rows=val_rows))
    )
    loader: TrainLoader | EchoingLoader = (
        streaming_loader(cfg, shards, index, num_peers)
        if cfg.data.input == "stream"
        else TrainLoader(sampler)
    )
    state = TrainState()
    saved, saved_updates = None, 0
    if cfg.train.ema:
        check_unaliased(params)
    if ckpt is not None:
        check_matches(ckpt, params)
        if cfg.train.ema:  # refused here, before anything is written
            saved = saved_average(ckpt.extra, params, ckpt.path)
            saved_updates = count_field(ckpt.state, "ema_updates", ckpt.path)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(ckpt.params[name])
        opt.load_state_dict(ckpt.optimizer)
        loader.load_state_dict(ckpt.state["loader"])
        if ckpt.rng_state is not None:
            torch.set_rng_state(ckpt.rng_state)
        state = TrainState(
            step=int(ckpt.state["step"]),
            tokens=int(ckpt.state["tokens"]),
            schedule_offset=int(ckpt.state.get("schedule_offset", 0)),
        )
    if cfg.engine.device_memory and runner_factory is plain_runner:
        from atomtrain.engine.factory import swap_runner

        runner_factory = swap_runner
    try:
        runner = runner_factory(model, opt, cfg, device)
    except BaseException:
        loader.close()
        raise
    # Nothing was refused: only now is the run directory made, replaced or written to.
    if ckpt is None:
        run_dir = new_run_dir(cfg, overwrite)
    else:
        MetricsLog(run_dir / "metrics.jsonl").truncate_after(state.step)
    if cfg.peer.swarm:
        atomic_write_text(run_dir / "peer_token", token)
    atomic_write_text(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=1))
    atomic_write_text(run_dir / "tokenizer.json", json.dumps(shards.manifest["tokenizer"]))
    trainer = Trainer(
        runner=runner,
        loader=loader,
        val_batches=validation_batches(val_sampler, cfg.train.eval_batches),
        cfg=cfg.train,
        run_dir=run_dir,
        state=state,
        checkpoint_extra=described,
        tensorboard=cfg.log.tensorboard,
    )
    if cfg.train.ema:
        trainer.average = WeightAverage(
            runner.host_parameters(), cfg.train.ema, cfg.train.ema_every
        )
        if saved is not None:
            trainer.average.take(saved, saved_updates)
        elif ckpt is not None:
            log.warning("%s has no weight average: it starts from the resumed weights", ckpt.path)
    session = Session(cfg, run_dir, model, shards, trainer, ckpt.path if ckpt else None)
    if cfg.peer.swarm:
        attach_peer(session, ckpt)
    return session


def count_field(state: dict, name: str, where: object) -> int:
    """A non-negative integer field of a checkpoint's state.json (0 when absent)."""
    value = state.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AtomError(f"checkpoint {where}: state.json's {name} is not a count: {value!r}")
    return value


def read_peer_token(run_dir: Path) -> str | None:
    """The random identity of a run's peer, kept in its run directory (a resumed peer keeps
    it): it names the peer and seeds its batches when no index is given."""
    try:
        token = (run_dir / "peer_token").read_text().strip()
        int(token, 16)
        return token
    except (OSError, ValueError):
        return None


def data_slice(cfg: RunConfig, token: str) -> tuple[int, int]:
    """(index, slices) of this run's batches. A swarm peer without an index draws windows over
    the whole split from a seed of its own (its token): peers started alike read different
    batches, however many there are."""
    if not cfg.peer.swarm or cfg.peer.index >= 0:
        return max(cfg.peer.index, 0), cfg.peer.num_peers if cfg.peer.index >= 0 else 1
    return 1 + int(token, 16) % (2**62), 0


def attach_peer(session: Session, ckpt: Checkpoint | None) -> None:
    """Hook a peer runtime into the trainer; `session.peer.start()` joins the swarm."""
    from atomtrain.peer.runtime import PeerRuntime

    cfg = session.cfg
    if cfg.run.name:
        name = cfg.run.name
    elif cfg.peer.index >= 0:
        name = f"peer{cfg.peer.index}"
    else:
        name = f"peer-{(read_peer_token(session.run_dir) or 'unknown')[:6]}"
    peer = PeerRuntime(
        cfg.peer, session.trainer.runner, name, cfg.train.steps, session.run_dir, cfg.train.lr
    )
    if cfg.peer.attack == "label_flip":  # `bench attack` only: this peer trains on poisoned data
        from atomtrain.peer.attack import LabelFlippedLoader

        session.trainer.loader = LabelFlippedLoader(
            session.trainer.loader, session.shards.vocab_size
        )  # type: ignore[assignment]
    session.trainer.after_step = peer.after_step
    session.trainer.extra_state = peer.extra_state
    peer.on_replaced = session.trainer.restart_average
    peer.on_moved = session.trainer.shift_average
    peer.on_final = session.trainer.adopt_average
    session.peer = peer
    if ckpt is not None and "peer/theta_sync" in ckpt.extra:
        session.resumed_peer_state = {
            "meta": {"round": int(ckpt.state.get("peer_round", 0))},
            "tensors": [ckpt.extra["peer/theta_sync"], ckpt.extra["peer/momentum"]],
        }
