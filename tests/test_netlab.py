"""The slow-network lab: real namespaces and tc rate limits, and nothing left behind."""

import os
import subprocess
import sys

import pytest

from atomtrain.bench.netlab import NetLab

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or subprocess.run(["which", "tc"], capture_output=True).returncode != 0,
    reason="needs root and iproute2",
)

SERVER = """
import socket, time
s = socket.socket(); s.bind(("0.0.0.0", 5555)); s.listen(); c, _ = s.accept(); n = 0
t0 = time.perf_counter()
while True:
    d = c.recv(65536)
    if not d: break
    n += len(d)
print(n, time.perf_counter() - t0)
"""


def test_links_are_rate_limited_and_everything_is_deleted():
    with NetLab(2, bandwidth_mbit=2.0) as lab:
        server = lab.popen(1, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        send = (  # retries until the server listens (its start takes longer on a busy machine)
            "import socket, time\n"
            "for _ in range(200):\n"
            f"    try: s = socket.create_connection(('{lab.address(1)}', 5555)); break\n"
            "    except ConnectionRefusedError: time.sleep(0.1)\n"
            "s.sendall(b'x' * 500_000); s.close()\n"
        )
        assert lab.popen(0, [sys.executable, "-c", send]).wait(timeout=30) == 0
        out, _ = server.communicate(timeout=30)
        received, seconds = out.split()
        mbit = 500_000 * 8 / 1e6 / float(seconds)  # timed by the receiver, from its accept
        assert int(received) == 500_000
        assert 1.0 < mbit < 2.5  # shaped to 2 Mbit/s
        assert len(lab.leftovers()) == 5
    assert lab.leftovers() == []


def test_cleanup_on_an_exception_and_on_ctrl_c():
    with pytest.raises(RuntimeError), NetLab(2, bandwidth_mbit=1.0) as lab:
        raise RuntimeError("boom")
    assert lab.leftovers() == []
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import time, sys\n"
                "from atomtrain.bench.netlab import NetLab\n"
                "with NetLab(2, 1.0) as lab:\n"
                "    print(lab.namespaces[0], flush=True)\n"
                "    time.sleep(60)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    ns = child.stdout.readline().strip()
    assert ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    child.send_signal(2)  # Ctrl-C
    child.wait(timeout=30)
    assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_bench_wan_without_root_says_so_in_one_line(tmp_path):
    code = (
        "import os; os.geteuid = lambda: 1000\n"
        "import sys; from atomtrain.cli.main import main\n"
        "sys.exit(main(['bench', 'wan', '--json']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "atomtrain: error: the slow-network lab needs root (network namespaces and tc)"
    )


RING_SERVER = """
import socket
s = socket.socket(); s.bind(("0.0.0.0", 5556)); s.listen(); c, _ = s.accept(); n = 0
while True:
    d = c.recv(65536)
    if not d: break
    n += len(d)
print(n)
"""


def test_four_hosts_reach_each_other_and_their_links_count_bytes():
    size = 200_000
    with NetLab(4, bandwidth_mbit=8.0) as lab:
        before = lab.link_bytes()
        servers = [
            lab.popen(i, [sys.executable, "-c", RING_SERVER], stdout=subprocess.PIPE, text=True)
            for i in range(4)
        ]
        senders = []
        for i in range(4):  # host i sends to host i + 1: every host sends and receives
            to = lab.address((i + 1) % 4)
            send = (
                "import socket, time\n"
                "for _ in range(200):\n"
                f"    try: s = socket.create_connection(('{to}', 5556)); break\n"
                "    except ConnectionRefusedError: time.sleep(0.1)\n"
                f"s.sendall(b'x' * {size}); s.close()\n"
            )
            senders.append(lab.popen(i, [sys.executable, "-c", send]))
        assert [p.wait(timeout=60) for p in senders] == [0, 0, 0, 0]
        assert [int(s.communicate(timeout=60)[0]) for s in servers] == [size] * 4
        after = lab.link_bytes()
        for (sent0, recv0), (sent1, recv1) in zip(before, after, strict=True):
            assert size <= sent1 - sent0 < size * 1.2  # payload plus TCP/IP headers
            assert size <= recv1 - recv0 < size * 1.2
        assert len(lab.leftovers()) == 9  # 4 namespaces, 4 veths, the bridge
    assert lab.leftovers() == []


ECHO_SERVER = """
import socket
s = socket.socket(); s.bind(("0.0.0.0", 5557)); s.listen(); c, _ = s.accept(); n = 0
while n < 1_000_000:
    n += len(c.recv(65536))
c.sendall(b"y" * 400_000); c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""

METERED_CLIENT = """
import os, socket, sys, time
from atomtrain.peer.wire import WireMeter
for _ in range(200):
    try: s = socket.create_connection((sys.argv[1], 5557)); break
    except ConnectionRefusedError: time.sleep(0.1)
often, seldom = WireMeter(os.getpid()), WireMeter(os.getpid())  # both see it, still empty
s.sendall(b"x" * 1_000_000); n = 0
while (d := s.recv(65536)):
    n += len(d)
time.sleep(0.2)  # the last acknowledgements
print(*often.totals())  # read while the socket is open
s.close(); time.sleep(0.5)
print(*seldom.totals())  # read next once it is gone: what it moved meanwhile still counts
"""


def test_the_wire_meter_counts_what_the_link_counts():
    """A process's own socket counters (payload, segments, headers) against its link's, read
    while its connection is open, and read only before it carried anything and once it closed
    (its last counters then come from the kernel's notice of the socket's end)."""
    with NetLab(2, bandwidth_mbit=16.0) as lab:
        server = lab.popen(1, [sys.executable, "-c", ECHO_SERVER])
        before = lab.link_bytes()
        client = lab.popen(
            0,
            [sys.executable, "-c", METERED_CLIENT, lab.address(1)],
            stdout=subprocess.PIPE,
            text=True,
        )
        out, _ = client.communicate(timeout=60)
        assert client.returncode == 0 and len(out.splitlines()) == 2, out
        assert server.wait(timeout=30) == 0
        link_sent, link_received = (
            a - b for a, b in zip(lab.link_bytes()[0], before[0], strict=True)
        )
        for line in out.splitlines():  # read while open; read only before and once closed
            sent, received = (float(x) for x in line.split())
            assert sent > 1_000_000 and received > 400_000  # headers on top of the payload
            assert abs(sent / link_sent - 1) < 0.02, (sent, link_sent)
            assert abs(received / link_received - 1) < 0.02, (received, link_received)
