"""A peer's helpers die with it at any moment, even a SIGKILL during startup (issue 17, item 3).

The peer is killed the instant a helper appears: its forked DHT process, then (another run) the
p2pd daemon that process starts. Nothing the peer started may outlive it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from .conftest import TINY

STARTUP_TIMEOUT_S = 240.0
DEATH_TIMEOUT_S = 30.0


def _is_forked_helper(child: psutil.Process, peer: psutil.Process) -> bool:
    return child.cmdline() == peer.cmdline()  # a fork, not the watchdog or p2pd


def _is_p2pd(child: psutil.Process, peer: psutil.Process) -> bool:
    return "p2pd" in os.path.basename((child.cmdline() or [""])[0])


@pytest.mark.parametrize("moment", [_is_forked_helper, _is_p2pd], ids=["dht-forked", "p2pd"])
def test_helpers_die_with_a_peer_killed_during_startup(prepared: Path, tmp_path: Path, moment):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "atomtrain.cli.main",
            "train",
            *TINY,
            "--train.steps=100000",
            f"--data.prepared={prepared}",
            "--swarm=hygiene",
            "--name=peer",
            "--quiet",
            "--no-sample",
        ],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # as the launcher starts peers
    )
    seen: dict[int, psutil.Process] = {}
    try:
        peer = psutil.Process(proc.pid)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        found = False
        while not found:
            assert time.monotonic() < deadline, "the peer never started its helpers"
            assert proc.poll() is None, "the peer exited during startup"
            for child in peer.children(recursive=True):
                try:
                    seen[child.pid] = child
                    found = found or moment(child, peer)
                except psutil.Error:
                    continue
        proc.send_signal(signal.SIGKILL)  # the instant the helper appeared
        proc.wait()
        for p in list(seen.values()):  # anything they started meanwhile is theirs too
            with contextlib.suppress(psutil.Error):
                seen.update({c.pid: c for c in p.children(recursive=True)})
        _, alive = psutil.wait_procs(list(seen.values()), timeout=DEATH_TIMEOUT_S)
        assert not alive, f"outlived their peer: {[(p.pid, p.cmdline()) for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in seen.values():  # reap whatever a failing run left
            with contextlib.suppress(psutil.Error):
                p.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_the_training_thread_lowers_only_its_own_priority_and_what_it_starts():
    from atomtrain.peer.hygiene import lower_thread_priority

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before, seen = nice(), {}

    def training() -> None:
        lower_thread_priority(5)
        seen["training"] = nice()
        loader = threading.Thread(target=lambda: seen.setdefault("started by it", nice()))
        loader.start()
        loader.join()

    t = threading.Thread(target=training)
    t.start()
    t.join()
    assert seen == {"training": min(before + 5, 19), "started by it": min(before + 5, 19)}
    assert nice() == before  # the rest of the process (a server, the status thread) keeps its own
