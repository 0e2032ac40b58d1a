"""Equal compute for every process a benchmark compares: one cgroup v1 `cpu` group per process,
each capped with a CFS quota (the same number of cores unless a group asks for its own).

    with CpuQuotas(cores=0.45) as quotas:
        argv = quotas.wrap("peer0", ["python", "-m", "..."])   # joins its group, then execs
        subprocess.Popen(argv)

The wrapper writes its own pid into the group before it execs the command, so interpreter
start-up and every helper the process forks (hivemind's DHT and averager, p2pd) count against
that one quota. Every group is removed on exit, on an exception, and on Ctrl-C or SIGTERM (the
processes still in it are killed first).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from atomtrain.errors import AtomError

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def cpu_cgroups_usable(root: Path = CPU_ROOT) -> bool:
    """Whether this process may create CPU-quota groups (root, cgroup v1 `cpu` read-write)."""
    return os.geteuid() == 0 and (root / "cpu.cfs_quota_us").exists() and os.access(root, os.W_OK)


def require_cpu_cgroups(root: Path = CPU_ROOT) -> None:
    if os.geteuid() != 0:
        raise AtomError("the scaling bench needs root (cgroup CPU quotas and network namespaces)")
    if not (root / "cpu.cfs_quota_us").exists() or not os.access(root, os.W_OK):
        raise AtomError(f"the scaling bench needs cgroup v1 `cpu` mounted read-write at {root}")


class CpuQuotas:
    def __init__(self, cores: float, root: Path = CPU_ROOT) -> None:
        if cores <= 0:
            raise AtomError(f"cpu_per_peer must be > 0 cores, got {cores}")
        self.cores = cores
        self.root = root
        self.tag = f"atom{os.getpid()}"
        self.groups: dict[str, Path] = {}
        self._previous: dict[int, object] = {}

    def __enter__(self) -> CpuQuotas:
        require_cpu_cgroups(self.root)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._interrupted)
        return self

    def _interrupted(self, signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def group(self, name: str, cores: float | None = None) -> Path:
        """The group `name` (created on first use), capped at `cores` CPUs (by default the
        quota every group gets)."""
        if name in self.groups:
            return self.groups[name]
        quota = self.cores if cores is None else cores
        if not quota > 0:
            raise AtomError(f"a CPU quota must be > 0 cores, got {quota}")
        path = self.root / f"{self.tag}-{name}"
        path.mkdir()
        self.groups[name] = path
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(int(quota * PERIOD_US)))
        return path

    def wrap(self, name: str, argv: list[str], cores: float | None = None) -> list[str]:
        """`argv` behind a shell that moves itself into group `name` and then execs it."""
        procs = shlex.quote(str(self.group(name, cores) / "cgroup.procs"))
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]

    def pids(self, name: str) -> list[int]:
        text = (self.groups[name] / "cgroup.procs").read_text()
        return [int(p) for p in text.split()]

    def throttled_s(self, name: str) -> float:
        """Seconds the group's processes were held back by the quota so far."""
        for line in (self.groups[name] / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "throttled_time":
                return int(value) / 1e9
        return 0.0

    def release(self, name: str) -> None:
        """Kill whatever still runs in group `name` and remove the group.

        A wrapped process may join its group at any moment (its shell writes its pid after
        Popen returned), and a group whose last process is still exiting refuses rmdir for a
        moment: kill and remove in turns until the group is gone. Once it is, a late shell's
        write fails and that shell exits without running its command."""
        path = self.groups.get(name)
        if path is None:
            return
        try:
            for _ in range(200):
                self._kill_members(path)
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
            else:  # kept: close() tries again, and leftovers() names it
                print(f"could not remove the CPU group {path}", file=sys.stderr)
                return
        except FileNotFoundError:
            pass
        del self.groups[name]

    def close(self) -> None:
        for name in list(self.groups):
            self.release(name)

    @staticmethod
    def _kill_members(path: Path) -> None:
        for pid in (int(p) for p in (path / "cgroup.procs").read_text().split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]

    def leftovers(self) -> list[str]:
        """Groups this object created that still exist (empty after exit)."""
        return sorted(p.name for p in self.root.glob(f"{self.tag}-*"))
