"""Bytes a peer put on the network and took from it, as the kernel counts them.

All of a peer's network traffic goes through its p2p daemon (p2pd): the averager's rounds, the
DHT (status records, matchmaking, membership), state downloads, the transport's encryption and
framing. The kernel keeps per-socket TCP counters (`tcp_info`: payload bytes sent, including
retransmissions, payload bytes received, segments each way); this module asks for them over
netlink (sock_diag, what `ss -ti` reads) for the daemon's sockets, and adds each segment's
Ethernet, IP and TCP headers. The result is what a link between the peer and the network
carries, where traffic.py counts only what the averager's messages hold.

    meter = WireMeter(p2pd_pid)
    sent, received = meter.totals()      # bytes so far; sockets closed meanwhile keep counting

Linux only; elsewhere (or if the kernel refuses) `available` is False and totals stay 0.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_INFO = 2

_NLMSGHDR = struct.Struct("=IHHII")
_REQUEST = struct.Struct("=BBBxI48s")  # inet_diag_req_v2: family, protocol, ext, states, id
_DIAG_MSG = struct.Struct("=BBBB48sIIIII")  # inet_diag_msg: ..., id, expires, rq, wq, uid, inode
_RTATTR = struct.Struct("=HH")
# offsets in struct tcp_info (include/uapi/linux/tcp.h)
_BYTES_RECEIVED = struct.Struct("=Q")  # at 128
_SEGS = struct.Struct("=II")  # segs_out, segs_in at 136
_BYTES_SENT = struct.Struct("=Q")  # at 200 (Linux 4.19+)
_TCP_INFO_MIN = 208

ETHERNET_HEADER = 14
"""Counted by a link's interface; the frame check sequence is not."""
TCP_HEADER = 32  # 20 bytes and the timestamp option Linux sends by default
HEADER_BYTES = {
    socket.AF_INET: ETHERNET_HEADER + 20 + TCP_HEADER,
    socket.AF_INET6: ETHERNET_HEADER + 40 + TCP_HEADER,
}


@dataclass(frozen=True)
class SocketCount:
    sent: int  # payload and headers
    received: int


def tcp_counts() -> dict[int, SocketCount]:
    """Every TCP socket of this network namespace, by inode: bytes each way with headers."""
    counts: dict[int, SocketCount] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)  # never hold up a caller (a round being applied) on the kernel
        for family in (socket.AF_INET, socket.AF_INET6):
            request = _REQUEST.pack(
                family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0xFFFFFFFF, b""
            )
            header = _NLMSGHDR.pack(
                _NLMSGHDR.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0
            )
            nl.send(header + request)
            try:
                counts.update(_read_dump(nl, HEADER_BYTES[family]))
            except OSError:
                if family == socket.AF_INET:
                    raise
                # no IPv6 here (disabled, or no inet6 diag module): IPv4 sockets still count
    return counts


def _read_dump(nl: socket.socket, header_bytes: int) -> dict[int, SocketCount]:
    counts: dict[int, SocketCount] = {}
    while True:
        data = nl.recv(1 << 16)
        offset = 0
        while offset + _NLMSGHDR.size <= len(data):
            length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, offset)
            if kind == NLMSG_DONE:
                return counts
            if kind == NLMSG_ERROR or length < _NLMSGHDR.size:
                raise OSError("the kernel refused the socket counters (sock_diag)")
            body = data[offset + _NLMSGHDR.size : offset + length]
            inode, info = _parse(body)
            if info is not None and inode:
                counts[inode] = _count(info, header_bytes)
            offset += (length + 3) & ~3


def _parse(body: bytes) -> tuple[int, bytes | None]:
    inode = _DIAG_MSG.unpack_from(body)[-1]
    offset = _DIAG_MSG.size
    while offset + _RTATTR.size <= len(body):
        length, kind = _RTATTR.unpack_from(body, offset)
        if length < _RTATTR.size:
            break
        if kind == INET_DIAG_INFO:
            return inode, body[offset + _RTATTR.size : offset + length]
        offset += (length + 3) & ~3
    return inode, None


def _count(info: bytes, header_bytes: int) -> SocketCount:
    if len(info) < _TCP_INFO_MIN:  # a kernel older than 4.19
        raise OSError("this kernel's tcp_info has no byte counters")
    (received,) = _BYTES_RECEIVED.unpack_from(info, 128)
    segs_out, segs_in = _SEGS.unpack_from(info, 136)
    (sent,) = _BYTES_SENT.unpack_from(info, 200)
    return SocketCount(sent + segs_out * header_bytes, received + segs_in * header_bytes)


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process `pid` holds open (OSError: they cannot be listed)."""
    inodes = set()
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        with contextlib.suppress(OSError):  # a descriptor closed meanwhile
            target = os.readlink(f"{fds}/{fd}")
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


class WireMeter:
    """The bytes process `pid`'s TCP sockets moved, headers included. A socket that closes keeps
    the count it had when last read, so read often (each status publication does)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._last: dict[int, SocketCount] = {}
        self._closed = SocketCount(0, 0)
        self._lock = threading.Lock()  # the training thread and the status publisher read it
        self.available = True
        self.totals()

    def totals(self) -> tuple[float, float]:
        """(sent, received) now: reads the kernel's counters."""
        with self._lock:
            if self.available:
                try:
                    self._read()
                except (OSError, struct.error):  # the daemon gone, or a reply cut short
                    self.available = False
            return self._sum()

    def last_totals(self) -> tuple[float, float]:
        """(sent, received) as of the last `totals()`, without reading anything."""
        with self._lock:
            return self._sum()

    def _sum(self) -> tuple[float, float]:
        sent = self._closed.sent + sum(c.sent for c in self._last.values())
        received = self._closed.received + sum(c.received for c in self._last.values())
        return float(sent), float(received)

    def _read(self) -> None:
        mine = socket_inodes(self.pid)
        counts = tcp_counts()
        now = {inode: counts[inode] for inode in mine if inode in counts}
        # closed since the last read, or (its counters lower: they only grow) a new socket on
        # a reused inode: the old socket's count is kept
        ended = [
            c
            for inode, c in self._last.items()
            if inode not in now or now[inode].sent < c.sent or now[inode].received < c.received
        ]
        self._closed = SocketCount(
            self._closed.sent + sum(c.sent for c in ended),
            self._closed.received + sum(c.received for c in ended),
        )
        self._last = now


def daemon_meter(dht_pid: int) -> WireMeter | None:
    """A meter on the p2p daemon a hivemind DHT process started (None if there is none)."""
    import psutil

    try:
        helpers = psutil.Process(dht_pid).children(recursive=True)
    except psutil.Error:
        return None
    for helper in helpers:
        with contextlib.suppress(psutil.Error):
            if helper.name() == "p2pd":
                meter = WireMeter(helper.pid)
                return meter if meter.available else None
    return None
