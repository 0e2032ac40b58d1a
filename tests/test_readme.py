"""The README's own examples, run as written (issue 17, item 6).

Every `atomtrain ...` line in the README's code blocks is listed in COMMANDS, with what the test
adds to it: nothing (run as written), a few steps through the `--train.steps=N` override the README
shows (a full run takes minutes), or a reason it is covered elsewhere. A new README command fails
`test_every_readme_command_is_considered` until it is listed here.
"""

from __future__ import annotations

import http.client
import json
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from atomtrain.cli.main import main

pytestmark = pytest.mark.timeout(900)  # a shared 2-core machine runs these slowly

README = Path(__file__).resolve().parent.parent / "README.md"
FEW_STEPS = ["--train.steps=2", "--no-sample", "--quiet"]

AS_WRITTEN: list[str] = []
COMMANDS: dict[str, list[str] | str] = {
    # the README's quick run and its resume, with fewer steps through the override they show
    "atomtrain train --model.preset=tiny --train.steps=100 --name quick": ["--train.steps=4"],
    "atomtrain train --resume runs/quick --train.steps=200": ["--train.steps=6"],
    'atomtrain sample runs/quick --prompt "def " --tokens 200': AS_WRITTEN,
    "atomtrain serve runs/quick --port 8000": "run with the README's curl (another port if busy)",
    "atomtrain data prepare ~/texts out/texts --tokenizer bpe --vocab-size 8192": AS_WRITTEN,
    "atomtrain keygen swarm.key": AS_WRITTEN,
    "atomtrain plan --model gpt3-175b --device-memory 24GB": AS_WRITTEN,
    "atomtrain profile --model small": AS_WRITTEN,
    "atomtrain train --config run.toml --train.lr=1e-3": FEW_STEPS,
    "atomtrain train": FEW_STEPS,
    "atomtrain train --device-memory 512MB": FEW_STEPS,
    "atomtrain train --input-rate 20000": FEW_STEPS,
    "atomtrain train --device-memory 64MB --serve 8000": "test_sched: serving beside training",
    "atomtrain bench swap --json": "test_cli: bench swap",
    "atomtrain train --device-memory 512MB --engine.compile=true": (
        "test_compile: run settings, engine and plain runner with compiled blocks (aot_eager: "
        "Inductor builds C++ for a minute or more)"
    ),
    "atomtrain bench compile --json": (
        "test_compile: its parts and its bad input (Inductor compiles for a minute or more)"
    ),
    "atomtrain bench churn --json": "test_peer: the churn scenario",
    "atomtrain bench attack --json": "test_attacks: its attacks and report; test_security",
    "atomtrain bench preempt --json": "test_sched: preemption",
    "atomtrain bench reuse --json": "test_reuse: data echoing",
    "atomtrain swarm --peers 3": "test_peer: local swarms",
    "atomtrain train --swarm mine": "test_peer: peers of a swarm",
    "atomtrain train --swarm mine --join /ip4/…/p2p/…": "needs a live peer's address",
    "atomtrain status --join /ip4/…/p2p/… --swarm mine": "needs a live peer's address",
    "atomtrain train --swarm mine --swarm-key swarm.key": "test_security: keyed swarms",
    "atomtrain keygen --member alice.id": "test_members: keygen, admit and a certificate's checks",
    "atomtrain admit alice.id.pub --member alice --swarm-key swarm.key": (
        "test_members: keygen, admit and a certificate's checks"
    ),
    "atomtrain train --swarm mine --swarm-cert alice.cert --peer.identity=alice.id --join /ip4/…/p2p/…": (  # noqa: E501
        "needs a live peer's address"
    ),
    "atomtrain revoke alice --swarm mine --swarm-key swarm.key --join /ip4/…/p2p/…": (
        "needs a live peer's address"
    ),
    "atomtrain dashboard --join /ip4/…/p2p/… --swarm mine": "needs a live peer's address",
    "atomtrain swarm --peers 2 --dashboard 8080": (
        "test_dashboard: the page in a browser, of `atomtrain swarm --dashboard`"
    ),
    "atomtrain train --log.tensorboard=true": "test_train: TensorBoard event files",
    "sudo atomtrain bench wan --json": "needs root and network namespaces",
    "sudo atomtrain bench scaling --json": "test_bench_scaling: the quick run",
    # the transformers section: its commands are tested with tiny models from configs
    "atomtrain train --model.hf=~/models/my-llama --data.source=~/texts \\": "test_hf_io",
    'atomtrain train --model.hf_config="$CFG" --data.source=src --train.steps=4 --name base': (
        "test_hf_io: a model from a config"
    ),
    "atomtrain train --model.hf=out/base --data.source=src --device-memory 40MB \\": (
        "test_hf_io: fine-tuning through the engine"
    ),
    "atomtrain export runs/base --format hf out/base": "test_hf_io: export round trip",
    "atomtrain export runs/ft --format hf out/ft": "test_hf_io: export round trip",
    "atomtrain export runs/ft --format hf out/my-llama-ft": "test_hf_io: export round trip",
}


def readme_commands() -> list[str]:
    """The `atomtrain` lines of the README's bash blocks, without their comments."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    lines = [line.split(" #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(("atomtrain ", "sudo atomtrain "))] + [
        line for line in lines if line == "atomtrain"
    ]


def readme_toml() -> str:
    return re.findall(r"```toml\n(.*?)```", README.read_text(), re.S)[0]


def test_every_readme_command_is_considered():
    found = readme_commands()
    assert set(found) == set(COMMANDS), set(found) ^ set(COMMANDS)


def atom(command: str, extra: list[str]) -> str:
    """Run a README command line in this process; its stdout."""
    argv = [str(Path(a).expanduser()) if a.startswith("~") else a for a in shlex.split(command)]
    assert argv[0] == "atomtrain"
    code = main([*argv[1:], *extra])
    assert code == 0, command
    return command


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path):
    """A working directory and $HOME shared by the examples, with ~/texts and run.toml."""
    root = tmp_path_factory.mktemp("home")
    (root / "texts").mkdir()
    for f in sorted(corpus_dir.iterdir())[:3]:
        (root / "texts" / f.name).write_text(f.read_text())
    (root / "run.toml").write_text(readme_toml())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(root))
        mp.chdir(root)
        yield root


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _serve_and_curl(home: Path) -> dict:
    """`atomtrain serve runs/quick --port 8000` and the README's curl body (another free port
    where 8000 is taken on this machine)."""
    command = "atomtrain serve runs/quick --port 8000"
    argv = shlex.split(command)[1:]
    port = 8000
    if not _free(port):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argv[-1] = str(port)
    proc = subprocess.Popen(
        [sys.executable, "-m", "atomtrain.cli.main", *argv],
        cwd=home,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # printed once it listens
        assert "serving" in line, line
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", '{"prompt": "def ", "max_tokens": 32}')
        resp = conn.getresponse()
        assert resp.status == 200
        return json.loads(resp.read())
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_quick_run_resume_sample_and_serve(home: Path, capsys: pytest.CaptureFixture):
    for command in list(COMMANDS)[:3]:
        atom(command, COMMANDS[command])  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "validation loss:" in out and "sample:" in out
    records = [json.loads(x) for x in (home / "runs/quick/metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 6  # the resume continued the quick run


def test_serve_the_quick_run_and_curl_it(home: Path):
    if not (home / "runs/quick").is_dir():
        pytest.skip("needs the quick run, which failed")
    assert len(_serve_and_curl(home)["choices"][0]["text"]) > 0


@pytest.mark.parametrize(
    "command",
    [c for c, extra in COMMANDS.items() if extra is AS_WRITTEN and "runs/quick" not in c]
    + [c for c, extra in COMMANDS.items() if extra is FEW_STEPS],
)
def test_readme_example(home: Path, command: str):
    atom(command, COMMANDS[command])  # type: ignore[arg-type]
    if command.startswith("atomtrain data"):
        assert (home / "out/texts/manifest.json").is_file()
    if command.startswith("atomtrain keygen"):
        assert (home / "swarm.key").is_file()
