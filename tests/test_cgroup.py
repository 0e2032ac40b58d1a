"""CPU quota groups: the quota is set, a wrapped process runs inside its group from exec (its
children too), and every group is gone after exit, also after an exception."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from atomtrain.bench.cgroup import CPU_ROOT, CpuQuotas
from atomtrain.errors import AtomError

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(CPU_ROOT / "cpu.cfs_quota_us", os.W_OK),
    reason="needs root and cgroup v1 `cpu` mounted read-write",
)

# prints its own cgroup and its child's, then waits for stdin to close
SHOW = (
    "import subprocess, sys\n"
    "own = open('/proc/self/cgroup').read()\n"
    "child = subprocess.run(['cat', '/proc/self/cgroup'], capture_output=True, text=True).stdout\n"
    "print(repr(own)); print(repr(child), flush=True)\n"
    "sys.stdin.read()\n"
)


def cpu_line(cgroup_text: str) -> str:
    return next(x for x in cgroup_text.splitlines() if x.split(":")[1] == "cpu")


def test_quota_is_set_and_the_process_and_its_children_run_inside():
    with CpuQuotas(cores=0.45) as quotas:
        argv = quotas.wrap("probe", [sys.executable, "-c", SHOW])
        group = quotas.groups["probe"]
        assert (group / "cpu.cfs_quota_us").read_text().strip() == "45000"
        assert (group / "cpu.cfs_period_us").read_text().strip() == "100000"
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        own, child = (eval(proc.stdout.readline()) for _ in range(2))
        assert cpu_line(own).endswith("/" + group.name)  # the interpreter itself: joined pre-exec
        assert cpu_line(child).endswith("/" + group.name)
        assert proc.pid in quotas.pids("probe")
        proc.communicate("", timeout=30)
    assert quotas.leftovers() == []
    assert not group.exists()


def test_groups_are_removed_and_their_processes_killed_after_an_exception():
    with pytest.raises(RuntimeError), CpuQuotas(cores=0.2) as quotas:
        proc = subprocess.Popen(quotas.wrap("sleeper", ["sleep", "600"]))
        group = quotas.groups["sleeper"]
        raise RuntimeError("boom")
    assert proc.wait(timeout=30) != 0  # killed with its group
    assert not group.exists()
    assert quotas.leftovers() == []


def test_a_quota_of_no_cores_is_refused():
    with pytest.raises(AtomError, match="cpu_per_peer"):
        CpuQuotas(cores=0.0)


def test_quota_holds_a_busy_process_to_its_share(tmp_path: Path):
    """A spinning process is throttled: the group's own accounting says so."""
    with CpuQuotas(cores=0.1) as quotas:
        spin = "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass\n"
        proc = subprocess.run(quotas.wrap("spin", [sys.executable, "-c", spin]), timeout=60)
        assert proc.returncode == 0
        assert quotas.throttled_s("spin") > 0.3  # 1 s of wall at 0.1 core: mostly held back
