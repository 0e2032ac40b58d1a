"""Process hygiene: a peer's helper processes die with it, at any moment, even on SIGKILL.

hivemind forks a DHT process and an averager process, and the DHT process starts the p2pd daemon.
Two mechanisms, so that no moment is uncovered:

- `install()`, called once when the `atomtrain` process starts, arms a parent-death signal
  (Linux `PR_SET_PDEATHSIG`, SIGKILL) in every process this one forks: the DHT and averager
  processes die the instant the peer does. A child forked just as its parent dies notices that
  its parent changed and exits.
- `start_watchdog()` starts a watchdog in a process group of its own, and every process forked
  afterwards joins that group, so anything they start (p2pd, which is spawned without Python and
  cannot arm a signal) is in it too. When the peer is gone, the watchdog SIGKILLs the whole group
  (itself last). Membership is inherited at fork, so no helper can be missed, however early
  the peer dies; the group ID stays reserved while any member lives.

The peer itself keeps its own process group, so Ctrl-C from a terminal still reaches it, and the
helpers, which ignore SIGINT anyway, are stopped by the peer's orderly shutdown.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time

import psutil

SNAPSHOT_S = 0.25
"""How often the watchdog notes the peer's descendants while helpers start..."""
SNAPSHOT_LATER_S = 2.0
"""...and after STARTUP_S, when they all run (a snapshot reads /proc for every process: at
0.25 s it cost 2% of a 0.45-core peer)."""
STARTUP_S = 30.0
PR_SET_PDEATHSIG = 1

_installed = False
_group: int | None = None  # the watchdog's process group, which forked helpers join
_fork_parent = 0
_fork_from_main_thread = True
_watchdog: subprocess.Popen | None = None


def _arm_parent_death_signal() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _before_fork() -> None:
    global _fork_parent, _fork_from_main_thread
    _fork_parent = os.getpid()
    _fork_from_main_thread = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    # The signal follows the thread that forked: arm it only for forks from the main thread,
    # which lives as long as the process (the group covers forks from other threads).
    if _fork_from_main_thread:
        _arm_parent_death_signal()
        if os.getppid() != _fork_parent:  # the parent died before the signal was armed
            os._exit(1)
    if _group is not None:
        with contextlib.suppress(OSError):  # the watchdog is gone: nothing to join
            os.setpgid(0, _group)


def install() -> None:
    """At process start, before any child: children forked from now on die with this process."""
    global _installed
    if _installed or not sys.platform.startswith("linux"):
        return
    _installed = True
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def start_watchdog() -> subprocess.Popen:
    """Watch this process; returns the watchdog, which exits by itself after this one does.

    Helpers forked from now on join the watchdog's process group; calling it again returns the
    running watchdog.
    """
    global _watchdog, _group
    install()
    if _watchdog is not None and _watchdog.poll() is None:
        return _watchdog
    _watchdog = subprocess.Popen(
        [sys.executable, "-m", "atomtrain.peer.hygiene", str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        process_group=0,  # its own group, in this session, so forked helpers can join it
    )
    _group = _watchdog.pid
    return _watchdog


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(pid: int, known: dict[int, float]) -> None:
    """Return once `pid` has exited, snapshotting its descendants meanwhile."""
    me = os.getpid()
    pidfd = None
    with contextlib.suppress(OSError, AttributeError):
        pidfd = os.pidfd_open(pid)  # readable the moment the process exits
    started = time.monotonic()
    while _alive(pid):
        for p in _descendants(pid):
            if p.pid != me:
                with contextlib.suppress(psutil.Error):
                    known[p.pid] = p.create_time()
        wait = SNAPSHOT_S if time.monotonic() - started < STARTUP_S else SNAPSHOT_LATER_S
        if pidfd is not None:
            select.select([pidfd], [], [], wait)
        else:
            time.sleep(wait)


def watch(pid: int) -> None:
    known: dict[int, float] = {}  # pid -> create time, so a recycled pid is never killed
    _wait_gone(pid, known)
    for child_pid, created in known.items():  # a helper that somehow left the group
        try:
            p = psutil.Process(child_pid)
            if p.create_time() == created:
                p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    if os.getpgid(0) == os.getpid():  # started by start_watchdog: the group is the helpers'
        os.killpg(os.getpid(), signal.SIGKILL)  # every helper in it, and this watchdog last


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # outlive a Ctrl-C the peer handles
    watch(int(sys.argv[1]))


def lower_thread_priority(nice: int) -> None:
    """Add `nice` to the calling thread's niceness (Linux keeps one per thread; threads it starts
    later inherit it). Lowering one's own priority needs no privilege; elsewhere, nothing."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
