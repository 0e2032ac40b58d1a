"""The device scheduler and the completions service: preemption at boundaries, consistent
answers, unchanged training, and an HTTP API that refuses bad requests."""

import copy
import http.client
import itertools
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from atomtrain.data.tokenizer import ByteTokenizer
from atomtrain.engine.engine import EngineConfig, SwapEngine
from atomtrain.engine.plan import ExecutionPlan, Policy
from atomtrain.engine.runner import SwapRunner
from atomtrain.models import GPT, GPTConfig, generate
from atomtrain.optim import AdamW, AdamWConfig
from atomtrain.sched.scheduler import DeviceScheduler
from atomtrain.sched.serve import InferenceService, start_server

from .conftest import TINY

CPU = torch.device("cpu")


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=64, vocab_size=256))


def make_runner(model: GPT, budget: int = 1 << 30) -> SwapRunner:
    plan = ExecutionPlan.even(4, 4, Policy.KEEP)
    engine = SwapEngine(model, plan, EngineConfig(budget_bytes=budget), CPU)
    return SwapRunner(engine, AdamW(dict(model.named_parameters()), AdamWConfig()), 2, 1.0)


def batches(n: int):
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, 256, (16, 32), generator=g), torch.randint(0, 256, (16, 32), generator=g))
        for _ in range(n)
    ]


def train(runner: SwapRunner, sched: DeviceScheduler | None, data, losses: list[float]):
    for x, y in data:
        if sched is None:
            losses.append(runner.train_step(x, y, 1e-3)["loss"])
        else:
            with sched.train_step():
                losses.append(runner.train_step(x, y, 1e-3)["loss"])


def run_with_requests(model: GPT, sched: DeviceScheduler, n_requests: int, nbytes: int = 0):
    runner = make_runner(model)
    sched.memory = runner.engine.memory
    runner.engine.boundary_hook = sched.train_boundary
    service = InferenceService(copy.deepcopy(model).eval(), ByteTokenizer(), sched)
    service.nbytes = nbytes
    losses: list[float] = []
    t = threading.Thread(target=train, args=(runner, sched, batches(6), losses))
    t.start()
    for _ in range(n_requests):
        service.complete(
            {
                "prompt": "def ",
                "max_tokens": 4,
                "temperature": 0.0,
                "top_p": 1.0,
                "seed": 0,
                "stream": False,
            }
        )
    t.join()
    runner.close()
    return losses, runner


def test_preemption_happens_at_submodel_boundaries():
    sched = DeviceScheduler(preemptive=True)
    run_with_requests(tiny_model(), sched, n_requests=5)
    events = sched.trace
    starts = [i for i, e in enumerate(events) if e[1] == "infer_start"]
    assert starts and sched.preemptions >= 1
    for i in starts:
        before = [
            e for e in events[:i] if e[1] in ("preempted", "resumed", "step_start", "step_end")
        ]
        # inference starts while training is paused at a boundary, or between steps
        last = before[-1] if before else (0, "step_end", "")
        assert last[1] in ("preempted", "step_end"), last
        if last[1] == "preempted":
            assert last[2].split()[0] in ("forward", "backward")
    resumed = [e for e in events if e[1] == "resumed"]
    preempted = [e for e in events if e[1] == "preempted"]
    assert [e[2] for e in resumed] == [e[2] for e in preempted]  # resumes where it stopped


def test_training_loss_is_unchanged_by_preemption():
    plain: list[float] = []
    runner = make_runner(tiny_model())
    train(runner, None, batches(6), plain)
    runner.close()
    sched = DeviceScheduler(preemptive=True)
    losses, _ = run_with_requests(tiny_model(), sched, n_requests=6)
    assert sched.preemptions >= 1
    assert losses == plain  # bit for bit


def test_evicting_at_every_boundary_changes_nothing():
    """What preemption does when a request needs the memory: sub-models leave the device at a
    boundary and come back from their host masters."""
    plain: list[float] = []
    runner = make_runner(tiny_model())
    train(runner, None, batches(4), plain)
    runner.close()
    evicting = make_runner(tiny_model())
    evicting.engine.boundary_hook = lambda where, evict: evict()
    losses: list[float] = []
    train(evicting, None, batches(4), losses)
    evicting.close()
    assert sum(e == "evicted" for _, e, _ in evicting.engine.trace.events) >= 4 * 8
    assert losses == plain


def test_a_request_that_needs_memory_evicts_training_first():
    x, y = batches(1)[0]
    runner = make_runner(tiny_model())
    eng = runner.engine
    sched = DeviceScheduler(preemptive=True, memory=eng.memory)
    served: list[int] = []
    asker: list[threading.Thread] = []

    def ask(need: int) -> None:
        with sched.inference(need):
            served.append(eng.memory.used)  # with the request's own reservation

    def boundary(where: str, evict) -> None:
        if where == "backward 3" and not asker:  # sub-model 3 is resident here
            resident = sum(ld.nbytes for ld in eng.resident.values()) + sum(
                eng.submodel_bytes[k] for k in eng.pending
            )
            need = eng.memory.budget_bytes - (eng.memory.used - resident)  # fits once it left
            asker.append(threading.Thread(target=ask, args=(need,)))
            asker[0].start()
            while sched._pending == 0:
                time.sleep(0.001)
        sched.train_boundary(where, evict)

    eng.boundary_hook = boundary
    with sched.train_step():
        runner.train_step(x, y, 1e-3)
    asker[0].join()
    runner.close()
    assert served == [eng.memory.budget_bytes]  # the request got all the room it asked for
    assert [e[2] for e in sched.trace if e[1] == "evicted"] == ["backward 3"]


def test_completions_beside_training_equal_those_of_the_same_parameters_alone():
    model = tiny_model()
    runner = make_runner(model)
    sched = DeviceScheduler(preemptive=True)
    runner.engine.boundary_hook = sched.train_boundary
    service = InferenceService(copy.deepcopy(model).eval(), ByteTokenizer(), sched)
    stop = threading.Event()

    def loop() -> None:
        for x, y in itertools.cycle(batches(8)):  # trains until the requests are done
            if stop.is_set():
                return
            with sched.train_step():
                runner.train_step(x, y, 1e-2)
            service.stage(runner.host_parameters())

    t = threading.Thread(target=loop)
    t.start()
    req = {
        "prompt": "import ",
        "max_tokens": 12,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": 0,
        "stream": False,
    }
    try:
        versions = []
        for _ in range(3):
            seen = service.version
            deadline = time.monotonic() + 60
            # wait for a step newer than the last answer (a fixed sleep is not enough on a busy CI)
            while service._staged is None or service._staged[0] <= seen:
                assert time.monotonic() < deadline and t.is_alive(), "training staged nothing new"
                time.sleep(0.005)
            got = service.complete(req)
            versions.append(got["parameters_version"])
            with service._lock:  # the parameters it answered from
                params = {n: p.detach().clone() for n, p in service.model.named_parameters()}
            alone = tiny_model().eval()
            alone.load_state_dict(params, strict=False)
            alone.lm_head.weight = alone.wte.weight
            ids = torch.tensor([ByteTokenizer().encode("import ")])
            want = ByteTokenizer().decode(generate(alone, ids, 12, temperature=0)[0, 7:].tolist())
            assert got["choices"][0]["text"] == want
        assert versions[0] < versions[1] < versions[2]  # newer parameters between requests
    finally:
        stop.set()
        t.join()
        runner.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(port: int, method: str, path: str, body: object = None, raw: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, payload


@pytest.fixture(scope="module")
def served():
    model = tiny_model()
    server = start_server(InferenceService(model.eval(), ByteTokenizer()), "127.0.0.1", 0)
    yield server.server_address[1]
    server.shutdown()


def test_http_api_answers_good_requests(served: int):
    status, body = call(served, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body = call(
        served, "POST", "/v1/completions", {"prompt": "def ", "max_tokens": 5, "temperature": 0}
    )
    out = json.loads(body)
    assert status == 200 and isinstance(out["choices"][0]["text"], str)
    status, body = call(
        served,
        "POST",
        "/v1/completions",
        {"prompt": "def ", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "stream": True},
    )
    events = [line[6:] for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert all("choices" in json.loads(e) for e in events[:-1])


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"prompt": 3}).encode(), "prompt must be a string"),
        (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), "max_tokens must be between"),
        (json.dumps({"prompt": "x", "max_tokens": 2.5}).encode(), "max_tokens must be a integer"),
        (
            json.dumps({"prompt": "x", "temperature": "hot"}).encode(),
            "temperature must be a number",
        ),
        (json.dumps({"prompt": "x", "top_p": 2}).encode(), "top_p must be between"),
        (json.dumps({"prompt": "x", "stream": "yes"}).encode(), "stream must be true or false"),
        (json.dumps({"prompt": "x", "bogus": 1}).encode(), "unknown field 'bogus'"),
    ],
)
def test_http_api_refuses_bad_requests(served: int, raw: bytes, fragment: str):
    status, body = call(served, "POST", "/v1/completions", raw=raw)
    assert status == 400
    assert fragment in json.loads(body)["error"]["message"]


def test_unknown_route_is_404(served: int):
    status, body = call(served, "GET", "/v2/nothing")
    assert status == 404 and "error" in json.loads(body)


def test_train_with_serve_answers_while_training(prepared: Path, tmp_path: Path):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "atomtrain.cli.main",
            "train",
            *TINY,
            "--train.steps=400",
            f"--data.prepared={prepared}",
            "--device-memory=16MB",
            "--name=srv",
            "--no-sample",
            "--quiet",
            f"--serve={port}",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 60
        status = None
        while time.time() < deadline:
            try:
                status, body = call(
                    port,
                    "POST",
                    "/v1/completions",
                    {"prompt": "def ", "max_tokens": 4, "temperature": 0},
                )
                break
            except OSError:
                time.sleep(0.2)
        assert status == 200, "the service never answered"
        assert json.loads(body)["choices"][0]["text"] is not None
        assert proc.wait(timeout=240) == 0
    finally:
        proc.kill()
