"""Process hygiene: a peer's helper processes die with it, even when it is SIGKILLed.

hivemind forks a DHT process and an averager process, and the DHT process starts the p2pd daemon.
A watchdog process (`python -m atomtrain.peer.hygiene PID`) snapshots the peer's descendants
every quarter second; when the peer is gone it SIGKILLs every process of the last snapshot. The
peer keeps its own process group, so Ctrl-C from a terminal still reaches it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

SNAPSHOT_S = 0.25


def start_watchdog() -> subprocess.Popen:
    """Watch this process; returns the watchdog, which exits by itself after this one does."""
    return subprocess.Popen(
        [sys.executable, "-m", "atomtrain.peer.hygiene", str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def watch(pid: int) -> None:
    me = os.getpid()
    known: dict[int, float] = {}  # pid -> create time, so a recycled pid is never killed
    while True:
        try:
            alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        if not alive:
            break
        for p in _descendants(pid):
            if p.pid != me:
                with contextlib.suppress(psutil.Error):
                    known[p.pid] = p.create_time()
        time.sleep(SNAPSHOT_S)
    for child_pid, created in known.items():
        try:
            p = psutil.Process(child_pid)
            if p.create_time() == created:
                p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


if __name__ == "__main__":
    watch(int(sys.argv[1]))
