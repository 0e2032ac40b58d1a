"""`atomtrain swarm --peers N`: N peer processes on 127.0.0.1, each its own process group.

Peer 0 starts a swarm and writes its multiaddrs to `<run dir>/peer.json`; the others join it.
Every peer is a plain `atomtrain train --swarm ...` process, started as a user would start it.
"""

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

from atomtrain.errors import AtomError

STARTUP_TIMEOUT_S = 90.0


@dataclass
class PeerProcess:
    index: int
    run_dir: Path
    log_path: Path
    proc: subprocess.Popen

    def addr(self) -> str | None:
        try:
            return json.loads((self.run_dir / "peer.json").read_text())["addrs"][0]
        except (OSError, ValueError, KeyError, IndexError):
            return None


@dataclass
class Swarm:
    name: str
    out_dir: Path
    base: str
    overrides: list[str]
    wait_for: int = 0
    """Peers each launched peer waits for before its first step (0: none)."""
    expected: int = 1
    """Peers expected to run at once on this machine (they share its cores)."""
    wrap: Callable[[str, list[str]], list[str]] | None = None
    """Runs each peer's command line, named by its run, through this (bench attack: a CPU quota,
    bench/cgroup.py `CpuQuotas.wrap`)."""
    threads: int = 0
    """Threads each peer's torch uses (0: the machine's cores over `expected`)."""
    verbose: bool = False
    """Peers log debug messages too (`atomtrain -v`: bench attack's --trace)."""
    peers: list[PeerProcess] = field(default_factory=list)

    def peer_args(self, i: int, n: int, join: str | None) -> list[str]:
        args = [
            sys.executable,
            "-m",
            "atomtrain.cli.main",
            *(["--verbose"] if self.verbose else []),
            "train",
            "--quiet",
            "--no-sample",
            f"--peer.swarm={self.name}",
            f"--peer.index={i}",
            f"--peer.num_peers={n}",
            f"--run.name={self.base}-peer{i}",
            f"--run.out_dir={self.out_dir}",
            f"--peer.wait_for={self.wait_for}",
            *self.overrides,
        ]
        if join:
            args.append(f"--peer.join={join}")
        return args

    def launch(
        self, i: int, n: int, join: str | None, extra: list[str] | None = None
    ) -> PeerProcess:
        run_dir = self.out_dir / f"{self.base}-peer{i}"
        log_path = self.out_dir / f"{self.base}-peer{i}.log"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "w")  # noqa: SIM115 (the child process writes it; closed below)
        # Peers sharing this machine split its cores instead of each taking all of them.
        threads = self.threads or max(1, (os.cpu_count() or 1) // max(self.expected, 1))
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
        argv = [*self.peer_args(i, n, join), *(extra or [])]
        proc = subprocess.Popen(
            self.wrap(f"{self.base}-peer{i}", argv) if self.wrap else argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        log.close()
        peer = PeerProcess(i, run_dir, log_path, proc)
        self.peers.append(peer)
        return peer

    def wait_addr(self, peer: PeerProcess) -> str:
        deadline = time.time() + STARTUP_TIMEOUT_S
        while time.time() < deadline:
            addr = peer.addr()  # the run directory was new, so peer.json is this run's
            if addr:
                return addr
            if peer.proc.poll() is not None:
                tail = peer.log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
                raise AtomError(
                    f"peer {peer.index} exited with code {peer.proc.returncode}: {tail[0]}"
                )
            time.sleep(0.2)
        raise AtomError(f"peer {peer.index} did not start within {STARTUP_TIMEOUT_S:.0f}s")

    def signal_all(self, sig: int) -> None:
        for p in self.peers:
            if p.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, sig)

    def stop(self, grace_s: float = 20.0) -> None:
        """Ctrl-C for every peer (each checkpoints), then SIGKILL for any still running."""
        self.signal_all(signal.SIGINT)
        deadline = time.time() + grace_s
        while time.time() < deadline and any(p.proc.poll() is None for p in self.peers):
            time.sleep(0.1)
        self.signal_all(signal.SIGKILL)
        for p in self.peers:
            p.proc.wait()

    def running(self) -> bool:
        return any(p.proc.poll() is None for p in self.peers)
