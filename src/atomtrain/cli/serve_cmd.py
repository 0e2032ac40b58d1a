"""`atomtrain serve RUN`: completions over HTTP from a trained checkpoint."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve /v1/completions from a run or checkpoint")
    p.add_argument("path", type=Path, help="run directory or checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, _extra: list[str]) -> int:
    from atomtrain.errors import AtomError
    from atomtrain.sched.serve import InferenceService, start_server
    from atomtrain.train.loading import load_trained
    from atomtrain.train.session import resolve_device
    from atomtrain.values import check_port

    check_port(args.port, "--port")
    model, tok, ckpt = load_trained(args.path)
    model.to(resolve_device(args.device))
    try:
        server = start_server(InferenceService(model, tok), args.host, args.port)
    except OSError as e:
        raise AtomError(f"cannot listen on {args.host}:{args.port} ({e.strerror})") from None
    host, port = str(server.server_address[0]), int(server.server_address[1])
    print(
        f"serving {ckpt} on http://{host}:{port}/v1/completions (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()
