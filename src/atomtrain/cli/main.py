"""`atomtrain`: the command line. Each subcommand lives in its own module and registers itself."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from atomtrain.errors import AtomError


def build_parser() -> argparse.ArgumentParser:
    from atomtrain.cli import (
        bench_cmd,
        dashboard_cmd,
        data_cmd,
        export_cmd,
        members_cmd,
        plan_cmd,
        sample_cmd,
        serve_cmd,
        swarm_cmd,
        train_cmd,
    )

    parser = argparse.ArgumentParser(
        prog="atomtrain",
        description="Train models larger than your GPU, on the machines you have.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (
        train_cmd,
        swarm_cmd,
        members_cmd,
        dashboard_cmd,
        sample_cmd,
        serve_cmd,
        data_cmd,
        plan_cmd,
        bench_cmd,
        export_cmd,
    ):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # hivemind logs expected events (a round without a group, a peer gone) as errors with
    # tracebacks; the peer runtime reports them in one line each.
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "CRITICAL")
    from atomtrain.peer.hygiene import install

    install()  # before any child process: every helper this process forks dies with it
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C stops a run even when the parent ignored it (a background job, or a process
        # that started a hivemind averager, which ignores SIGINT and passes that on)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    for noisy in ("matplotlib", "PIL"):  # (--verbose: a loss plot's font search, line by line)
        logging.getLogger(noisy).setLevel(logging.INFO)
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args, extra) or 0)
    except AtomError as e:
        print(f"atomtrain: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.filename is None:  # not about a file the user named: a bug, keep the traceback
            raise
        # a file the system refused (permissions, a full disk): the user can fix it
        print(f"atomtrain: error: {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("atomtrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
