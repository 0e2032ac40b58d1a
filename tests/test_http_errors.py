"""Every bad HTTP request to the completion service gets one JSON error with the right 4xx, over a
real socket, and the service keeps answering (issue 17, item 7)."""

from __future__ import annotations

import http.client
import json
import socket

import pytest
import torch

from atomtrain.data.tokenizer import ByteTokenizer
from atomtrain.models import GPT, GPTConfig
from atomtrain.sched.serve import InferenceService, start_server


@pytest.fixture(scope="module")
def port():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny"))
    server = start_server(InferenceService(model, ByteTokenizer()), "127.0.0.1", 0)
    yield server.server_address[1]
    server.shutdown()


def request(port: int, method: str, path: str, raw: bytes | None = None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(method, path, raw, headers or {"Content-Type": "application/json"})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), body


def json_error(status: int, headers: dict, body: bytes, expected: int) -> str:
    assert status == expected, body
    assert headers["Content-Type"] == "application/json"
    message = json.loads(body)["error"]["message"]
    assert isinstance(message, str) and message and "\n" not in message
    return message


def still_serves(port: int) -> None:
    status, _, body = request(port, "POST", "/v1/completions", b'{"prompt": "a", "max_tokens": 2}')
    assert status == 200 and json.loads(body)["choices"][0]["text"] is not None


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b'{"prompt": "x", "max_tokens": 1' + b"0" * 400 + b"}", "max_tokens"),
        (b'{"prompt": "x", "seed": 1' + b"0" * 30 + b"}", "seed"),
        (b'{"prompt": "x", "seed": -1}', "seed"),
        (b'{"prompt": "\\ud800 lone"}', "prompt"),
        (b'{"max_tokens": 4}', "prompt is missing"),
        (b'{"prompt": "x", "temperature": NaN}', "temperature"),
        (b'{"prompt": "x", "top_p": 1e400}', "top_p"),
    ],
)
def test_bad_bodies_are_400(port: int, raw: bytes, fragment: str):
    status, headers, body = request(port, "POST", "/v1/completions", raw)
    assert fragment in json_error(status, headers, body, 400)
    still_serves(port)


@pytest.mark.parametrize(
    "method, path, expected",
    [
        ("PUT", "/v1/completions", 405),
        ("DELETE", "/v1/completions", 405),
        ("PATCH", "/v1/completions", 405),
        ("GET", "/v1/completions", 405),
        ("POST", "/health", 405),
        ("DELETE", "/health", 405),
        ("PUT", "/nowhere", 404),
        ("BREW", "/v1/completions", 405),
    ],
)
def test_wrong_methods_and_routes(port: int, method: str, path: str, expected: int):
    status, headers, body = request(port, method, path, b"{}")
    json_error(status, headers, body, expected)
    if expected == 405 and method != "BREW":
        assert headers["Allow"] in ("GET", "POST")


def test_bad_lengths(port: int):
    status, headers, body = request(port, "POST", "/v1/completions", None, {"Content-Length": "-5"})
    json_error(status, headers, body, 400)
    status, headers, body = request(
        port, "POST", "/v1/completions", None, {"Content-Length": str(1 << 30)}
    )
    json_error(status, headers, body, 413)
    head, body = raw_exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b" 411 " in head.split(b"\r\n")[0] and json.loads(body)["error"]["message"]


def raw_exchange(port: int, data: bytes) -> tuple[bytes, bytes]:
    """Send bytes, read until the server closes: (status line and headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(data)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return head, body


def test_a_malformed_request_line_gets_json(port: int):
    head, body = raw_exchange(port, b"GARBAGE\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 400 " in head.split(b"\r\n")[0]
    assert b"application/json" in head and json.loads(body)["error"]["message"]
    still_serves(port)
