"""`atomtrain train`: with no arguments, trains the `small` GPT on the Python standard library."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from atomtrain.errors import AtomError
from atomtrain.values import check_port

if TYPE_CHECKING:  # the run config imports torch (the optimizer's): not with every command
    from atomtrain.config import RunConfig
    from atomtrain.train.session import Session


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (default: `small` on the stdlib corpus)",
        description="Train a model. Settings come from --config run.toml and overrides such as "
        "--train.steps=200 --model.preset=tiny --data.source=corpus.txt.",
    )
    p.add_argument("--config", help="TOML file with [run], [model], [data], [train], [optim]")
    p.add_argument("--resume", type=Path, help="continue a run directory or a checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    p.add_argument("--name", help="run name (same as --run.name)")
    p.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="train through the swap engine within SIZE of device memory (e.g. 24GB)",
    )
    p.add_argument(
        "--input-rate",
        type=float,
        metavar="TOKENS_PER_S",
        help="stream raw text at most this fast (data echoing fills the gaps)",
    )
    p.add_argument("--swarm", metavar="NAME", help="train as a peer of swarm NAME")
    p.add_argument(
        "--join",
        metavar="MULTIADDR",
        action="append",
        default=[],
        help="a live peer to join (repeatable)",
    )
    p.add_argument(
        "--swarm-key",
        metavar="FILE",
        help="the swarm's key (atomtrain keygen); default: $ATOM_SWARM_KEY, else an open swarm",
    )
    p.add_argument(
        "--swarm-cert",
        metavar="FILE",
        help="this member's certificate (atomtrain admit), with --peer.identity it was issued for",
    )
    p.add_argument(
        "--serve",
        type=int,
        metavar="PORT",
        help="serve completions on 127.0.0.1:PORT from the model being trained",
    )
    p.add_argument("--no-sample", action="store_true", help="skip the text sample at the end")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run, accepts_overrides=True)


def resolve_config(args: argparse.Namespace, overrides: list[str]) -> RunConfig:
    from atomtrain.config import RunConfig, load_run_config
    from atomtrain.train.session import resolve_resume, saved_config

    if args.name:
        overrides = [*overrides, f"--run.name={args.name}"]
    if args.input_rate is not None:
        overrides = [*overrides, "--data.input=stream", f"--data.input_rate={args.input_rate}"]
    if args.swarm:
        overrides = [*overrides, f"--peer.swarm={args.swarm}"]
    if args.join:
        overrides = [*overrides, f"--peer.join={','.join(args.join)}"]
    if args.swarm_key:
        overrides = [*overrides, f"--peer.swarm_key={args.swarm_key}"]
    if args.swarm_cert:
        overrides = [*overrides, f"--peer.swarm_cert={args.swarm_cert}"]
    if args.device_memory:
        overrides = [*overrides, f"--engine.device_memory={args.device_memory}"]
    if args.serve is not None:
        check_port(args.serve, "--serve")
    base = None
    if args.resume is not None:
        if not args.resume.exists():
            raise AtomError(f"--resume {args.resume} does not exist")
        base = saved_config(resolve_resume(args.resume)[0])
    return load_run_config(RunConfig, args.config, overrides, base)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from atomtrain.cli.progress import ProgressBar
    from atomtrain.train.session import open_session

    cfg = resolve_config(args, overrides)
    session = open_session(cfg, resume=args.resume, overwrite=args.overwrite)
    trainer = session.trainer
    if session.resumed_from:
        print(f"resuming {session.run_dir} from {session.resumed_from.name}", file=sys.stderr)
    previous = {
        s: signal.signal(s, lambda *_: trainer.stop.set()) for s in (signal.SIGINT, signal.SIGTERM)
    }
    bar = None
    try:
        if session.peer is not None:
            session.peer.start(session.resumed_peer_state, trainer.state)
        if args.serve is not None:
            from atomtrain.sched.beside import serve_beside_training

            server, _ = serve_beside_training(session, "127.0.0.1", args.serve)
            host, port = str(server.server_address[0]), int(server.server_address[1])
            print(f"serving completions on http://{host}:{port}/v1/completions", file=sys.stderr)
        bar = None if args.quiet else ProgressBar(cfg.train.steps, trainer.state.step, "train")
        trainer.on_step = bar.update if bar else None
        if session.peer is not None:  # the peer's helpers (and a server) first, then training
            from atomtrain.peer.hygiene import lower_thread_priority

            lower_thread_priority(cfg.peer.train_nice)
        trainer.fit()
        if bar:
            bar.close()
        return _report(args, cfg, session)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if bar:
            bar.close()
        trainer.loader.close()
        trainer.runner.close()
        if session.peer is not None:
            session.peer.shutdown()


def _report(args: argparse.Namespace, cfg: RunConfig, session: Session) -> int:
    from atomtrain.cli.sample_cmd import sample_text
    from atomtrain.train.metrics import plot_losses
    from atomtrain.train.session import model_label

    trainer = session.trainer
    plot = plot_losses(
        session.run_dir / "metrics.jsonl",
        session.run_dir / "loss.png",
        title=f"{model_label(cfg.model)} on {cfg.data.source}",
    )
    val = trainer.evaluate()
    first = _first_val_loss(session.run_dir)
    of = " (of the weight average, train.ema)" if trainer.average is not None else ""
    print(
        f"validation loss{of}: {first:.3f} -> {val:.3f}"
        if first is not None
        else f"validation loss{of}: {val:.3f}"
    )
    if not args.no_sample:
        trainer.runner.host_parameters()  # waits for any optimizer step still running
        with trainer.averaged_weights():
            text = sample_text(
                session.model,
                session.shards.tokenizer,
                prompt="def ",
                max_new_tokens=200,
                temperature=0.8,
                top_k=40,
            )
        print("sample:\n" + text)
    print(f"checkpoint: {trainer.save()}")
    print(f"loss plot: {plot}")
    if trainer.stop.is_set():
        print("stopped early; continue with: atomtrain train --resume " + str(session.run_dir))
        return 130
    return 0


def _first_val_loss(run_dir: Path) -> float | None:
    from atomtrain.train.metrics import read_metrics

    vals = [r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]
    return vals[0] if vals else None
