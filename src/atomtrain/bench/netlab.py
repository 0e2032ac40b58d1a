"""Hosts joined by slow links on one machine: network namespaces, veth pairs, a bridge, and
`tc tbf` rate limits in both directions (this kernel has no `netem`, so latency is not shaped).

    with NetLab(2, bandwidth_mbit=1.0) as lab:
        proc = lab.popen(0, ["python", "-m", "..."])     # runs inside host 0's namespace
        lab.address(1)                                   # host 1's IP

Everything created is deleted on exit, on an exception, and on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
from pathlib import Path
from types import FrameType

from atomtrain.errors import AtomError


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], capture_output=True, text=True, check=True)


def require_root_and_tools() -> None:
    if os.geteuid() != 0:
        raise AtomError("the slow-network lab needs root (network namespaces and tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise AtomError(f"the slow-network lab needs `{tool}` (install iproute2)")


class NetLab:
    def __init__(self, hosts: int, bandwidth_mbit: float) -> None:
        self.hosts = hosts
        self.bandwidth_mbit = bandwidth_mbit
        tag = f"{os.getpid() % 100000:05d}{random.randint(0, 99):02d}"
        self.tag = tag
        self.bridge = f"atbr{tag}"
        self.subnet = f"10.{200 + random.randint(0, 50)}.{random.randint(0, 255)}"
        self.namespaces = [f"atom{tag}h{i}" for i in range(hosts)]
        self.veths = [(f"at{tag}a{i}", f"at{tag}b{i}") for i in range(hosts)]
        self._previous: dict[int, object] = {}

    def address(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def __enter__(self) -> NetLab:
        require_root_and_tools()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._interrupted)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _interrupted(self, signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def _create(self) -> None:
        rate = f"{self.bandwidth_mbit}mbit"
        # A burst of at least one MTU-sized frame; the queue bounded to about a second of data.
        burst = str(max(1600, int(self.bandwidth_mbit * 1e6 / 8 / 100)))
        limit = str(max(16000, int(self.bandwidth_mbit * 1e6 / 8)))
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for ns, (outer, inner), i in zip(
            self.namespaces, self.veths, range(self.hosts), strict=True
        ):
            _ip("netns", "add", ns)
            # one frame a TCP segment, as on a physical link: without it the kernel hands a veth
            # large segments with one set of headers for many (its byte counters then miss them)
            _ip(
                "link",
                "add",
                outer,
                "gso_max_segs",
                "1",
                "type",
                "veth",
                "peer",
                "name",
                inner,
                "gso_max_segs",
                "1",
            )
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # egress of the host (its uploads) and of the bridge port (its downloads)
            shape = ["root", "tbf", "rate", rate, "burst", burst, "limit", limit]
            _tc("-n", ns, "qdisc", "add", "dev", inner, *shape)
            _tc("qdisc", "add", "dev", outer, *shape)

    def argv(self, i: int, argv: list[str]) -> list[str]:
        """`argv` as a command that runs inside host i's namespace."""
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def popen(self, i: int, argv: list[str], **kwargs: object) -> subprocess.Popen:
        """Start `argv` inside host i's namespace, in its own process group."""
        return subprocess.Popen(self.argv(i, argv), start_new_session=True, **kwargs)  # type: ignore[call-overload]

    def link_bytes(self) -> list[tuple[int, int]]:
        """(bytes sent, bytes received) by each host so far, from its veth's counters.

        Read on the bridge side, in this namespace's /proc/net/dev: what the bridge port
        receives is what the host sent."""
        counters: dict[str, tuple[int, int]] = {}
        for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
            name, _, rest = line.partition(":")
            fields = rest.split()
            counters[name.strip()] = (int(fields[0]), int(fields[8]))  # rx bytes, tx bytes
        return [counters.get(outer, (0, 0)) for outer, _ in self.veths]

    def close(self) -> None:
        for ns in self.namespaces:
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
        for outer, _ in self.veths:
            _ip("link", "del", outer, check=False)
        _ip("link", "del", self.bridge, check=False)

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]

    def leftovers(self) -> list[str]:
        """Names of anything this lab created that still exists (empty after exit)."""
        out = []
        names = _ip("netns", "list", check=False).stdout
        out += [ns for ns in self.namespaces if ns in names]
        links = _ip("link", "show", check=False).stdout
        out += [
            n
            for n in [self.bridge, *(o for o, _ in self.veths)]
            if f" {n}:" in links or f" {n}@" in links
        ]
        return out
