"""`atomtrain swarm --peers N` (a local swarm with a live table) and `atomtrain status`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "swarm",
        help="train with N local peers on 127.0.0.1, with a live table",
        description="Launch N `atomtrain train --swarm` processes on this machine. Other "
        "arguments (--config, --section.field=value) go to every peer.",
    )
    p.add_argument("--peers", type=int, default=2, help="number of peers")
    p.add_argument("--name", default="local", help="swarm name, and prefix of the run names")
    p.add_argument("--out-dir", default="runs", help="parent of the peers' run directories")
    p.add_argument("--overwrite", action="store_true", help="replace existing peer runs")
    p.add_argument("--device-memory", metavar="SIZE", help="train each peer through the engine")
    p.add_argument("--config", help="TOML config for every peer")
    p.add_argument("--no-sample", action="store_true", help="skip the text sample at the end")
    p.add_argument("--swarm-key", metavar="FILE", help="the swarm's key (atomtrain keygen)")
    p.add_argument(
        "--dashboard",
        type=int,
        metavar="PORT",
        help="also serve the live web page on 127.0.0.1:PORT (atomtrain dashboard)",
    )
    p.set_defaults(func=run_swarm, accepts_overrides=True)

    s = sub.add_parser("status", help="print the progress table of any swarm")
    s.add_argument("--join", required=True, metavar="MULTIADDR", help="any live peer")
    s.add_argument("--swarm", default="local", help="swarm name")
    s.add_argument("--watch", action="store_true", help="refresh every second until Ctrl-C")
    s.add_argument("--swarm-key", metavar="FILE", help="the swarm's key, if it has one")
    s.set_defaults(func=run_status)

    k = sub.add_parser(
        "keygen",
        help="make a swarm's owner key, or (--member) a member's identity",
        description="Write a new random swarm key to FILE (readable by you only): the owner's "
        "key. Peers holding it (--swarm-key FILE or $ATOM_SWARM_KEY) take part; it admits "
        "others (atomtrain admit). With --member, write a member's identity to FILE and its "
        "public key to FILE.pub, for the owner to admit.",
    )
    k.add_argument("file", type=Path, metavar="FILE")
    k.add_argument("--force", action="store_true", help="replace an existing key file")
    k.add_argument("--member", action="store_true", help="a member's identity, not a swarm key")
    k.set_defaults(func=run_keygen)


def run_keygen(args: argparse.Namespace, _extra: list[str]) -> int:
    from atomtrain.errors import AtomError
    from atomtrain.peer.auth import write_new_key

    for parent in args.file.parents:
        if parent.exists() and not parent.is_dir():
            raise AtomError(f"cannot write {args.file}: {parent} is a file, not a directory")
    if args.file.is_dir():
        raise AtomError(f"{args.file} is a directory; name a file for the key")
    try:
        if args.member:
            from atomtrain.peer.certs import write_new_identity

            identity = write_new_identity(args.file, force=args.force)
            print(
                f"wrote identity of peer {identity.peer_id} to {args.file}; "
                f"give {args.file}.pub to the swarm's owner (atomtrain admit)"
            )
            return 0
        key = write_new_key(args.file, force=args.force)
    except OSError as e:
        raise AtomError(f"cannot write {args.file} ({e.strerror or e})") from None
    print(f"wrote swarm key {key.fingerprint()} to {args.file}")
    return 0


def _client_dht(addr: str, key_file: str | None, swarm: str):
    """A DHT client reading the swarm's records (it signs nothing; it checks what it reads)."""
    from hivemind import DHT
    from hivemind.utils.crypto import RSAPrivateKey

    from atomtrain.errors import AtomError
    from atomtrain.peer.auth import SwarmAuthorizer, load_swarm_key
    from atomtrain.peer.records import swarm_validators

    key = load_swarm_key(key_file or "")
    try:
        return DHT(
            initial_peers=[addr],
            client_mode=True,
            start=True,
            authorizer=SwarmAuthorizer(key) if key else None,
            record_validators=swarm_validators(swarm, RSAPrivateKey.process_wide()),
        )
    except Exception as e:
        hint = "" if key else "; if the swarm has a key, pass --swarm-key"
        raise AtomError(f"cannot reach the swarm at {addr} ({type(e).__name__}{hint})") from None


def swarm_owner(key_file: str | None) -> str | None:
    """The owner whose certificates a keyed swarm's statuses must be signed under (None: open)."""
    from atomtrain.peer.auth import load_swarm_key

    key = load_swarm_key(key_file or "")
    return key.owner() if key else None


def _table(dht, swarm: str, owner: str | None) -> str:
    from atomtrain.cli.table import render_table
    from atomtrain.peer.status import STATUS_HEADERS, read_statuses, status_rows

    return render_table(STATUS_HEADERS, status_rows(read_statuses(dht, swarm, owner)))


def run_status(args: argparse.Namespace, _extra: list[str]) -> int:
    dht = _client_dht(args.join, args.swarm_key, args.swarm)
    owner = swarm_owner(args.swarm_key)
    try:
        while True:
            print(_table(dht, args.swarm, owner), flush=True)
            if not args.watch:
                return 0
            time.sleep(1.0)
            print()
    finally:
        dht.shutdown()


def run_swarm(args: argparse.Namespace, overrides: list[str]) -> int:
    import shutil

    from atomtrain.errors import AtomError
    from atomtrain.peer.launcher import Swarm

    if args.peers < 1:
        raise AtomError("--peers must be at least 1")
    if args.dashboard is not None:
        from atomtrain.values import check_port

        check_port(args.dashboard, "--dashboard")
    out = Path(args.out_dir)
    extra = [*overrides]
    if args.config:
        extra.append(f"--config={args.config}")
    if args.device_memory:
        extra.append(f"--engine.device_memory={args.device_memory}")
    if args.swarm_key:
        from atomtrain.peer.auth import load_swarm_key

        load_swarm_key(args.swarm_key)  # a bad key fails here, once, not in every peer
        extra.append(f"--peer.swarm_key={Path(args.swarm_key).resolve()}")
    swarm = Swarm(args.name, out, args.name, extra, wait_for=args.peers, expected=args.peers)
    _check_peer_config(swarm, args.peers)
    for i in range(args.peers):  # only now, with every setting accepted, is anything replaced
        run_dir = out / f"{args.name}-peer{i}"
        if run_dir.exists():
            if not args.overwrite:
                raise AtomError(f"run directory {run_dir} already exists; pass --overwrite")
            shutil.rmtree(run_dir)
    first = swarm.launch(0, args.peers, None)
    try:
        addr = swarm.wait_addr(first)
        print(f"swarm {args.name!r}: peer 0 at {addr}", file=sys.stderr)
        for i in range(1, args.peers):
            swarm.launch(i, args.peers, addr)
        _watch(swarm, addr, args.swarm_key, args.dashboard)
    except KeyboardInterrupt:
        print("stopping the swarm (each peer writes a checkpoint)...", file=sys.stderr)
        swarm.stop()
        return 130
    finally:
        if swarm.running():
            swarm.stop()
    return _summary(swarm, args)


def _check_peer_config(swarm, n: int) -> None:
    """Every peer's settings, checked here once, before any run directory is replaced."""
    from atomtrain.cli.main import build_parser
    from atomtrain.cli.train_cmd import resolve_config

    argv = swarm.peer_args(n - 1, n, "/ip4/127.0.0.1/tcp/1/p2p/x")
    start = argv.index("train")
    args, overrides = build_parser().parse_known_args(argv[start:])
    resolve_config(args, overrides)


def _watch(swarm, addr: str, key_file: str | None, dashboard: int | None = None) -> None:
    dht = _client_dht(addr, key_file, swarm.name)
    owner = swarm_owner(key_file)
    tty = sys.stdout.isatty()
    lines = 0
    server = watch = None
    try:
        if dashboard is not None:
            from atomtrain.dashboard.collector import SwarmWatch
            from atomtrain.dashboard.server import start_dashboard
            from atomtrain.errors import AtomError

            watch = SwarmWatch(dht, swarm.name, owner).start()
            try:
                server = start_dashboard(watch, "127.0.0.1", dashboard)
            except OSError as e:
                raise AtomError(f"cannot listen on 127.0.0.1:{dashboard} ({e.strerror})") from None
            print(f"dashboard at {server.url()}", file=sys.stderr, flush=True)
        while swarm.running():
            table = _table(dht, swarm.name, owner)
            if tty and lines:
                sys.stdout.write(f"\x1b[{lines}F\x1b[J")
            print(table, flush=True)
            lines = table.count("\n") + 1
            time.sleep(1.0 if tty else 10.0)
    finally:
        if server is not None:
            server.shutdown()
        if watch is not None:
            watch.stop()
        dht.shutdown()


def _summary(swarm, args: argparse.Namespace) -> int:
    from atomtrain.cli.sample_cmd import sample_text
    from atomtrain.peer.plot import plot_swarm
    from atomtrain.train.loading import load_trained
    from atomtrain.train.metrics import read_metrics

    failed = [p for p in swarm.peers if p.proc.returncode not in (0, None)]
    for p in swarm.peers:
        vals = [r["val_loss"] for r in read_metrics(p.run_dir / "metrics.jsonl") if "val_loss" in r]
        loss = f"validation loss {vals[0]:.3f} -> {vals[-1]:.3f}" if vals else "no metrics"
        print(f"peer {p.index}: exit {p.proc.returncode}, {loss} ({p.log_path})")
    if failed:
        return 1
    if not args.no_sample:
        model, tok, _ = load_trained(swarm.peers[0].run_dir)
        print("sample:\n" + sample_text(model, tok, "def ", 200, 0.8, 40))
    plot = plot_swarm([p.run_dir for p in swarm.peers], swarm.out_dir / f"{swarm.base}-loss.png")
    print(f"loss plot: {plot}")
    return 0
