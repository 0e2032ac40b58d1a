"""`atomtrain serve`: an HTTP inference service with a subset of the OpenAI completions API.

    GET  /health              {"status": "ok", "parameters_version": N}
    POST /v1/completions      {"prompt": str, "max_tokens": int, "temperature": float,
                               "top_p": float, "stream": bool}

It answers from its own copy of the model. Beside a training job that copy is refreshed between
requests from a snapshot training publishes after an optimizer step, so an answer never mixes two
versions of the parameters. Requests go through the device scheduler.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import nullcontext
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import torch
from torch import nn

from atomtrain.data.tokenizer import Tokenizer
from atomtrain.models.gpt import sample_next
from atomtrain.sched.scheduler import DeviceScheduler
from atomtrain.values import MAX_SEED

log = logging.getLogger(__name__)

MAX_TOKENS_LIMIT = 1024
MAX_BODY_BYTES = 1 << 20
READ_TIMEOUT_S = 30.0
"""A client that declares a body and does not send it is answered 408 after this long."""
ROUTES = {"/health": "GET", "/v1/completions": "POST"}


class BadRequest(Exception):
    pass


def parse_request(body: bytes) -> dict[str, Any]:
    """The validated request, or BadRequest naming the field at fault."""
    try:
        req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("body is not valid JSON") from None
    if not isinstance(req, dict):
        raise BadRequest("body must be a JSON object")
    if "prompt" not in req:
        raise BadRequest("prompt is missing")
    prompt = req["prompt"]
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # JSON allows lone surrogates ("\ud800"); text cannot hold them
        raise BadRequest("prompt is not valid Unicode text (a lone surrogate)") from None
    out: dict[str, Any] = {"prompt": prompt}
    checks = {
        "max_tokens": (int, 16, 1, MAX_TOKENS_LIMIT),
        "temperature": (float, 1.0, 0.0, 5.0),
        "top_p": (float, 1.0, 0.0, 1.0),
    }
    for name, (kind, default, lo, hi) in checks.items():
        value = req.get(name, default)
        # an int is compared as it is: float() of a huge one overflows
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (kind is int and not whole)
        ):
            raise BadRequest(f"{name} must be a {'integer' if kind is int else 'number'}")
        if not lo <= value <= hi:  # also refuses NaN
            raise BadRequest(f"{name} must be between {lo} and {hi}")
        out[name] = kind(value)
    stream = req.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false")
    out["stream"] = stream
    unknown = set(req) - {"prompt", "max_tokens", "temperature", "top_p", "stream", "model", "seed"}
    if unknown:
        raise BadRequest(f"unknown field {sorted(unknown)[0]!r}")
    seed = req.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise BadRequest("seed must be an integer")
    if not 0 <= seed <= MAX_SEED:
        raise BadRequest(f"seed must be between 0 and {MAX_SEED}")
    out["seed"] = seed
    return out


class InferenceService:
    """Generation from a model copy that only changes between requests."""

    def __init__(
        self, model: nn.Module, tokenizer: Tokenizer, scheduler: DeviceScheduler | None = None
    ) -> None:
        self.model = model.eval()
        self.tok = tokenizer
        self.scheduler = scheduler
        self.version = 0
        self._lock = threading.Lock()  # one request at a time on the model
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._stage_lock = threading.Lock()
        self.nbytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def stage(self, params: dict[str, torch.Tensor]) -> None:
        """Called by training right after an optimizer step: a consistent copy to switch to."""
        copy = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
        with self._stage_lock:
            version = (self._staged[0] if self._staged else self.version) + 1
            self._staged = (version, copy)

    def _refresh(self) -> None:
        with self._stage_lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            version, params = staged
            own = dict(self.model.named_parameters())
            with torch.no_grad():
                for n, p in params.items():
                    own[n].copy_(p)
            self.version = version

    def generate(self, req: dict[str, Any]) -> Iterator[str]:
        """Yields the completion's text piece by piece (one token each)."""
        with self._lock:
            self._refresh()  # between requests, never during one
            gate = self.scheduler.inference(self.nbytes) if self.scheduler else nullcontext()
            with gate, torch.no_grad():
                device = next(self.model.parameters()).device
                ids = self.tok.encode(req["prompt"]) or [0]
                idx = torch.tensor([ids], dtype=torch.long, device=device)
                gen = torch.Generator(device=device).manual_seed(req["seed"])
                block = int(self.model.config.block_size)  # type: ignore[union-attr, arg-type]
                pending: list[int] = []
                for _ in range(req["max_tokens"]):
                    logits, _ = self.model(idx[:, -block:])
                    logits = logits[:, -1, :]
                    if req["temperature"] == 0:
                        nxt = logits.argmax(-1, keepdim=True)
                    else:
                        nxt = sample_next(logits / req["temperature"], None, req["top_p"], gen)
                    idx = torch.cat([idx, nxt], dim=1)
                    pending.append(int(nxt))
                    text = self.tok.decode(pending)
                    if "\ufffd" not in text:  # a whole character: emit it
                        pending = []
                        yield text
                if pending:
                    yield self.tok.decode(pending)

    def complete(self, req: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        text = "".join(self.generate(req))
        return {
            "object": "text_completion",
            "model": "atom",
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": {"completion_tokens": req["max_tokens"]},
            "parameters_version": self.version,
            "latency_ms": (time.perf_counter() - t0) * 1e3,
        }


def make_handler(service: InferenceService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # a request line too malformed to name its version is answered with a status line and
        # headers (HTTP/0.9 would send the JSON body bare)
        default_request_version = "HTTP/1.0"
        timeout = READ_TIMEOUT_S  # of each socket read, so a stalled client cannot hold a thread

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _json(self, status: int, payload: dict[str, Any]) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: HTTPStatus, message: str, **headers: str) -> None:
            """One JSON error; the connection closes, as a body may be left unread."""
            body = json.dumps(
                {"error": {"message": message, "type": "invalid_request_error"}}
            ).encode()
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            self.close_connection = True

        def send_error(self, code: int, message: str | None = None, explain: str | None = None):
            """http.server's own errors (a malformed request line, headers, an unknown method)
            as JSON, like every other error."""
            if code == HTTPStatus.NOT_IMPLEMENTED:  # a method no route has
                code, message = HTTPStatus.METHOD_NOT_ALLOWED, f"method {self.command} not allowed"
            status = HTTPStatus(code)
            self._error(status, message or status.phrase)

        def _route(self) -> str | None:
            """The route of this request when the method is the route's; else answers an error."""
            path = urlsplit(self.path).path
            allowed = ROUTES.get(path)
            if allowed is None:
                self._error(HTTPStatus.NOT_FOUND, f"no route {path}")
                return None
            if self.command != allowed:
                self._error(
                    HTTPStatus.METHOD_NOT_ALLOWED,
                    f"{path} accepts {allowed}, not {self.command}",
                    Allow=allowed,
                )
                return None
            return path

        def _other_method(self) -> None:
            self._route()  # 404 or 405

        do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _other_method

        def do_GET(self) -> None:
            if self._route():
                self._json(200, {"status": "ok", "parameters_version": service.version})

        def _read_body(self) -> bytes | None:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                self._error(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length")
                return None
            text = self.headers.get("Content-Length")
            if text is None:
                self._error(HTTPStatus.LENGTH_REQUIRED, "Content-Length is missing")
                return None
            try:
                length = int(text)
            except ValueError:
                length = -1
            if length < 0:
                self._error(HTTPStatus.BAD_REQUEST, f"Content-Length {text!r} is not a size")
                return None
            if length > MAX_BODY_BYTES:
                self._error(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY_BYTES} bytes"
                )
                return None
            try:
                body = self.rfile.read(length)
            except TimeoutError:
                body = b""
            if len(body) < length:
                self._error(HTTPStatus.REQUEST_TIMEOUT, "body shorter than its Content-Length")
                return None
            return body

        def do_POST(self) -> None:
            if not self._route():
                return
            body = self._read_body()
            if body is None:
                return
            try:
                req = parse_request(body)
            except BadRequest as e:
                self._error(HTTPStatus.BAD_REQUEST, str(e))
                return
            if not req["stream"]:
                try:
                    answer = service.complete(req)
                except Exception:  # a bug: logged with its traceback, answered in JSON
                    log.exception("completion failed")
                    self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "generation failed")
                    return
                self._json(200, answer)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for piece in service.generate(req):
                chunk = {"object": "text_completion", "choices": [{"index": 0, "text": piece}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

    return Handler


def start_server(service: InferenceService, host: str, port: int) -> ThreadingHTTPServer:
    """Serve in a daemon thread; `server.server_address` has the bound port."""
    server = ThreadingHTTPServer((host, port), make_handler(service))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="atom-serve").start()
    return server
