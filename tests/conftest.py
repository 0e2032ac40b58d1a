"""Shared fixtures: a small prepared corpus, and a way to run the CLI as a user does."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from atomtrain.data.corpus import stdlib_dir
from atomtrain.data.shards import PrepareConfig, prepare

CORPUS_FILES = [
    "json/decoder.py",
    "json/encoder.py",
    "textwrap.py",
    "heapq.py",
    "bisect.py",
    "fnmatch.py",
    "colorsys.py",
    "keyword.py",
]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few standard-library files copied into a directory: text every machine has."""
    root = tmp_path_factory.mktemp("corpus")
    for rel in CORPUS_FILES:
        src = stdlib_dir() / rel
        (root / rel.replace("/", "_")).write_text(src.read_text())
    return root


@pytest.fixture(scope="session")
def prepared(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prepared")
    prepare(str(corpus_dir), out, PrepareConfig(val_fraction=0.1), overwrite=True)
    return out


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


def run_cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`atomtrain ARGS` in a child process, as a user would run it. Its output goes to files and
    its exit is waited for, not the end of its output: a helper the child's torch starts
    (torch_shm_manager) holds a pipe open 2-3 s after the child has exited."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    argv = [sys.executable, "-m", "atomtrain.cli.main", *args]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err)
        try:
            proc.wait(timeout=timeout)
        except BaseException as e:  # pytest's own timeout too: no CLI left running after it
            proc.kill()
            proc.wait()
            if isinstance(e, subprocess.TimeoutExpired):  # with what it printed, as run() gives
                out.seek(0)
                err.seek(0)
                e.stdout, e.stderr = out.read(), err.read()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, proc.returncode, out.read(), err.read())


TINY = [
    "--model.preset=tiny",
    "--data.seq_len=32",
    "--data.rows=8",
    "--train.micro_batch_rows=4",
    "--train.warmup_steps=2",
    "--train.eval_interval=5",
    "--train.eval_batches=2",
]
"""Overrides that make `atomtrain train` take a second or two."""
