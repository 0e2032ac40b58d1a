"""The dashboard's HTTP server: the page and its assets (shipped in the package, nothing fetched
from the internet), `/api/swarm` (one snapshot, JSON) and `/events` (a snapshot a second as
server-sent events, so the page updates without reloading)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from atomtrain.dashboard.collector import SwarmWatch

ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}
PUSH_EVERY_S = 1.0


def _asset(name: str) -> bytes:
    return resources.files("atomtrain.dashboard").joinpath("static", name).read_bytes()


class DashboardServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], watch: SwarmWatch) -> None:
        self.watch = watch
        self.closing = threading.Event()
        super().__init__(address, _Handler)

    def url(self) -> str:
        host, port = str(self.server_address[0]), int(self.server_address[1])
        return f"http://{host}:{port}/"

    def shutdown(self) -> None:
        self.closing.set()  # ends every open event stream
        super().shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: DashboardServer

    def log_message(self, format: str, *args: Any) -> None:  # no line per request
        pass

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in ASSETS:
            name, kind = ASSETS[path]
            self._send(200, kind, _asset(name))
        elif path == "/api/swarm":
            self._send(200, "application/json", json.dumps(self.server.watch.snapshot()).encode())
        elif path == "/events":
            self._events()
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found\n")

    def _send(self, code: int, kind: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _events(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        try:
            while not self.server.closing.is_set():
                data = json.dumps(self.server.watch.snapshot())
                self.wfile.write(f"data: {data}\n\n".encode())
                self.wfile.flush()
                self.server.closing.wait(PUSH_EVERY_S)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the page was closed


def start_dashboard(watch: SwarmWatch, host: str, port: int) -> DashboardServer:
    """Serve in a background thread; returns the running server (its .url() says where)."""
    server = DashboardServer((host, port), watch)
    threading.Thread(target=server.serve_forever, daemon=True, name="atom-dashboard-http").start()
    return server
