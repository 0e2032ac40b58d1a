"""Starting, watching and stopping one system of `bench scaling`: its processes, each in its own
network namespace and its own CPU quota group, timed from the launch of its first process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atomtrain.bench.cgroup import CpuQuotas
from atomtrain.bench.netlab import NetLab

Progress = Callable[[str], None]
POLL_S = 0.5


class Tail:
    """The complete JSON lines appended to a file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.records: list[dict[str, Any]] = []

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return self.records
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self.offset += end
        for line in data[:end].decode().splitlines():
            if line.strip():
                self.records.append(json.loads(line))
        return self.records


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    metrics: Tail
    log: Path

    def error(self) -> str | None:
        """The last line of its output when it failed, else None."""
        code = self.popen.poll()
        if code in (None, 0, -signal.SIGINT, -signal.SIGKILL, 130):
            return None
        lines = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
        return f"{self.name} exited {code}: {lines[-1] if lines else ''}"[:300]


@dataclass
class SystemRun:
    """What one run of a system left: its launch time and every process's records."""

    launch_time: float
    procs: list[Proc] = field(default_factory=list)
    bytes_before: list[tuple[int, int]] = field(default_factory=list)
    bytes_after: list[tuple[int, int]] = field(default_factory=list)
    stopped_by: str = ""
    stopped_at: float = 0.0
    """Unix time the watch ended (the system is then stopped)."""

    def records(self) -> list[list[dict[str, Any]]]:
        return [p.metrics.read() for p in self.procs]

    def errors(self) -> list[str]:
        return [e for p in self.procs if (e := p.error()) is not None]


@dataclass
class Launcher:
    """Starts processes for the systems of one bench run (one lab, one set of quotas)."""

    lab: NetLab
    quotas: CpuQuotas
    work: Path
    env: dict[str, str] = field(default_factory=dict)

    def start(
        self,
        run: SystemRun,
        host: int,
        name: str,
        argv: list[str],
        metrics: Path,
        cores: float | None = None,
        **env: str,
    ) -> Proc:
        log = self.work / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            popen = subprocess.Popen(
                self.quotas.wrap(name, self.lab.argv(host, argv), cores),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **self.env, **env},
            )
        proc = Proc(name, popen, Tail(metrics), log)
        run.procs.append(proc)
        return proc

    def finish(self, run: SystemRun, grace_s: float = 30.0) -> None:
        """Ctrl-C every process (a trainer saves and exits), then kill whatever is left in
        their groups, helpers included, and remove the groups."""
        for p in run.procs:
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(signal.SIGINT)
        deadline = time.time() + grace_s
        for p in run.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=max(deadline - time.time(), 0.1))
        for p in run.procs:
            self.quotas.release(p.name)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=5)
        run.bytes_after = self.lab.link_bytes()


def wait_for_file(path: Path, procs: list[Proc], timeout_s: float) -> bool:
    """True once `path` exists; False when the time is up or every process has exited."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if path.exists():
            return True
        if all(p.popen.poll() is not None for p in procs):
            return False
        time.sleep(0.2)
    return False


def reached_at(records: list[dict[str, Any]], target: float) -> float | None:
    """Unix time of the first validation at or below `target`."""
    for r in records:
        if "val_loss" in r and "time" in r and r["val_loss"] <= target:
            return float(r["time"])
    return None


def watch(run: SystemRun, target: float, budget_s: float) -> None:
    """Returns once every process has reached the target, the budget from launch is spent, or
    every process has exited."""
    _watch(run, target, budget_s)
    run.stopped_at = time.time()


def _watch(run: SystemRun, target: float, budget_s: float) -> None:
    while True:
        logs = run.records()
        if logs and all(reached_at(r, target) is not None for r in logs):
            run.stopped_by = "target"
            return
        if time.time() - run.launch_time >= budget_s:
            run.stopped_by = "budget"
            return
        if all(p.popen.poll() is not None for p in run.procs):
            run.stopped_by = "exited"
            return
        time.sleep(POLL_S)


def python_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
