"""`atomtrain dashboard`: a live web page of any swarm (and `atomtrain swarm --dashboard`)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboard",
        help="a live web page of a swarm: peers, traffic, rounds, loss curves",
        description="Join the swarm as a read-only client and serve a page that updates every "
        "second. Open the printed address in a browser.",
    )
    p.add_argument("--join", required=True, metavar="MULTIADDR", help="any live peer")
    p.add_argument("--swarm", default="local", help="swarm name")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free port)")
    p.add_argument("--swarm-key", metavar="FILE", help="the swarm's key, if it has one")
    p.set_defaults(func=run)


def open_dashboard(addr: str, swarm: str, key_file: str | None, host: str, port: int) -> Any:
    """Start the collector and the server; returns (server, dht) to close when done."""
    from atomtrain.cli.swarm_cmd import _client_dht, swarm_owner
    from atomtrain.dashboard.collector import SwarmWatch
    from atomtrain.dashboard.server import start_dashboard
    from atomtrain.errors import AtomError
    from atomtrain.values import check_port

    check_port(port, "--port")
    dht = _client_dht(addr, key_file, swarm)
    watch = SwarmWatch(dht, swarm, swarm_owner(key_file)).start()
    try:
        server = start_dashboard(watch, host, port)
    except OSError as e:
        watch.stop()
        dht.shutdown()
        raise AtomError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    return server, watch, dht


def run(args: argparse.Namespace, _extra: list[str]) -> int:
    server, watch, dht = open_dashboard(args.join, args.swarm, args.swarm_key, args.host, args.port)
    print(f"dashboard of swarm {args.swarm!r} at {server.url()} (Ctrl-C stops)", file=sys.stderr)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()
        watch.stop()
        dht.shutdown()
