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

A socket closed between two reads counts in full where the kernel still holds its counters: the
meter also listens for the kernel's notice of each TCP socket it destroys (sock_diag's destroy
group), which holds the socket's last counters. A socket its own process closes with a zero
linger, as libp2p's do, has its counters reset first: it counts as last read (READ_EVERY_S).

Linux only; elsewhere (or if the kernel refuses) `available` is False and totals stay 0.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_INFO = 2
ALL_STATES = 0xFFFFFFFF
DESTROY_GROUPS = 1 | 1 << 2  # SKNLGRP_INET_TCP_DESTROY (1), SKNLGRP_INET6_TCP_DESTROY (3)
GONE_KEPT_S = 300.0
"""How long a socket whose descriptor closed waits for its destroy notice (an orphan in FIN_WAIT2
lingers up to tcp_fin_timeout, 60 s by default) before its last read count is final."""

_NLMSGHDR = struct.Struct("=IHHII")
_REQUEST = struct.Struct("=BBBxI48s")  # inet_diag_req_v2: family, protocol, ext, states, id
_DIAG_MSG = struct.Struct("=BBBB48sIIIII")  # inet_diag_msg: ..., id, expires, rq, wq, uid, inode
_COOKIE = struct.Struct("=Q")  # the last 8 bytes of inet_diag_sockid: unique per socket, per boot
_RTATTR = struct.Struct("=HH")
_ERROR = struct.Struct("=i")  # nlmsgerr.error: 0 or a negative errno
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


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket as sock_diag reports it."""

    inode: int  # 0 once no descriptor holds it (closing)
    family: int
    sock_id: bytes  # inet_diag_sockid: ports, addresses, interface, cookie
    count: SocketCount

    @property
    def cookie(self) -> int:
        return _COOKIE.unpack_from(self.sock_id, 40)[0]


def sock_diag() -> socket.socket:
    nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    nl.settimeout(1.0)  # never hold up a caller (a round being applied) on the kernel
    return nl


class Gone(OSError):
    """The kernel holds no such socket (ENOENT, or ESTALE: another socket on its addresses)."""


_seq = itertools.count(1)


def tcp_sockets(nl: socket.socket) -> dict[int, TcpSocket]:
    """Every TCP socket of this network namespace, by cookie. (A dump walks the kernel's whole
    table of connections: about a millisecond per family here, with almost none open.)"""
    found: dict[int, TcpSocket] = {}
    for family in (socket.AF_INET, socket.AF_INET6):
        seq = _ask(nl, family, NLM_F_REQUEST | NLM_F_DUMP, b"")
        try:
            for tcp in _messages(nl, until_done=True, seq=seq):
                found[tcp.cookie] = tcp
        except OSError as e:
            if family == socket.AF_INET or isinstance(e, TimeoutError):
                raise
            # no IPv6 here (disabled, or no inet6 diag module): IPv4 sockets still count
    return found


def look_up(nl: socket.socket, known: TcpSocket) -> TcpSocket | None:
    """`known` now, found by its addresses and cookie in a few microseconds; None once the
    kernel holds no counters for it (destroyed, or in TIME_WAIT). OSError: no answer."""
    seq = _ask(nl, known.family, NLM_F_REQUEST, known.sock_id)
    try:
        found = next(_messages(nl, until_done=False, seq=seq), None)
    except Gone:
        return None
    return found if found is not None and found.cookie == known.cookie else None


def _ask(nl: socket.socket, family: int, flags: int, sock_id: bytes) -> int:
    seq = next(_seq) & 0xFFFFFFFF
    request = _REQUEST.pack(
        family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), ALL_STATES, sock_id
    )
    nl.send(
        _NLMSGHDR.pack(_NLMSGHDR.size + len(request), SOCK_DIAG_BY_FAMILY, flags, seq, 0) + request
    )
    return seq


def destroy_listener() -> socket.socket | None:
    """A netlink socket the kernel sends each TCP socket's last counters to as it destroys it
    (any process may listen), or None where it refuses."""
    try:
        nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    except OSError:
        return None
    try:
        nl.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        nl.bind((0, DESTROY_GROUPS))
        nl.setblocking(False)
    except OSError:
        nl.close()
        return None
    return nl


def destroyed(nl: socket.socket) -> dict[int, SocketCount]:
    """The sockets destroyed since the last call, by cookie: their last counters. (If more died
    than the buffer held, the kernel dropped notices: those sockets keep their last read count.)"""
    out: dict[int, SocketCount] = {}
    while True:
        try:
            for tcp in _messages(nl, until_done=False):
                out[tcp.cookie] = tcp.count
        except (BlockingIOError, InterruptedError):
            return out
        except OSError:  # ENOBUFS (notices dropped), or one malformed: read on
            continue


def _messages(nl: socket.socket, until_done: bool, seq: int | None = None) -> Iterator[TcpSocket]:
    """Each socket with counters in the next datagram (a dump's: until its end); with `seq`,
    only the replies to that request (a late reply to an earlier one is skipped)."""
    while True:
        data = nl.recv(1 << 16)
        offset, answered = 0, seq is None
        while offset + _NLMSGHDR.size <= len(data):
            length, kind, _, reply_to, _ = _NLMSGHDR.unpack_from(data, offset)
            if length < _NLMSGHDR.size:
                raise OSError("a malformed reply from the kernel (sock_diag)")
            if seq is None or reply_to == seq:
                answered = True
                if kind == NLMSG_DONE:
                    return
                if kind == NLMSG_ERROR:
                    (error,) = _ERROR.unpack_from(data, offset + _NLMSGHDR.size)
                    if -error in (errno.ENOENT, errno.ESTALE):
                        raise Gone(-error, "no such socket")
                    raise OSError(-error, "the kernel refused the socket counters (sock_diag)")
                if kind == SOCK_DIAG_BY_FAMILY:
                    tcp = _parse(data[offset + _NLMSGHDR.size : offset + length])
                    if tcp is not None:
                        yield tcp
            offset += (length + 3) & ~3
        if answered and not until_done:
            return


def _parse(body: bytes) -> TcpSocket | None:
    """One inet_diag message's socket; None where it holds no tcp_info or an unknown family."""
    fields = _DIAG_MSG.unpack_from(body)
    family, sock_id, inode = fields[0], fields[4], fields[-1]
    offset = _DIAG_MSG.size
    while offset + _RTATTR.size <= len(body):
        length, kind = _RTATTR.unpack_from(body, offset)
        if length < _RTATTR.size:
            break
        if kind == INET_DIAG_INFO and family in HEADER_BYTES:
            info = body[offset + _RTATTR.size : offset + length]
            return TcpSocket(inode, family, sock_id, _count(info, HEADER_BYTES[family]))
        offset += (length + 3) & ~3
    return None


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


READ_EVERY_S = 0.25
"""How often a peer's meter reads its daemon's sockets in the background. A socket the daemon
closes itself (a zero linger resets its counters) counts as last read: reading every status
tick (2 s), the peer that stopped second lost the last round it averaged with the first (the
first's exit closed their connection), 0.74 of its link. Most reads look each known socket up
(0.09 ms in all) rather than dump the kernel's table (2.4 ms)."""
DUMP_EVERY_S = (1.0, 2.0)
"""A read dumps the table at most once a second where the daemon holds a socket not seen yet (it
opens a Unix socket per stream: during rounds, nearly always), and at least every 2 s (a socket
seen before it connected was taken for another kind)."""


class WireMeter:
    """The bytes process `pid`'s TCP sockets moved, headers included. A socket whose descriptor
    closes keeps the count it had when last read until the kernel's destroy notice gives its
    last one (none where its process closed it with a zero linger: read often). A connection
    opened and closed between two dumps of the table (DUMP_EVERY_S) is never seen.
    `every_s`: read in a background thread that often too, until `close()`."""

    def __init__(self, pid: int, every_s: float | None = None) -> None:
        self.pid = pid
        self._open: dict[int, TcpSocket] = {}  # by cookie: sockets the process holds
        self._gone: dict[int, tuple[SocketCount, float]] = {}  # closed, awaiting their notice
        self._closed = SocketCount(0, 0)  # counted sockets no longer held, as last known
        self._not_tcp: set[int] = set()  # inodes of the process's other sockets
        self._dumped_at = -math.inf
        self._lock = threading.Lock()  # the training thread and the status publisher read it
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None
        self._notices = destroy_listener()
        self._nl: socket.socket | None = None
        self.available = True
        try:
            self._nl = sock_diag()
        except OSError:
            self.available = False
        self.totals()
        if not self.available:
            self.close()
        elif every_s is not None:
            self._reader = threading.Thread(
                target=self._read_every, args=(every_s,), name="wire-meter", daemon=True
            )
            self._reader.start()

    def totals(self) -> tuple[float, float]:
        """(sent, received) now: reads the kernel's counters."""
        with self._lock:
            if self.available and self._nl is not None:
                try:
                    self._read(self._nl)
                except TimeoutError:  # the kernel slow to answer: the next read catches up
                    self._dumped_at = -math.inf
                except (OSError, struct.error) as e:  # the daemon gone, or a kernel without
                    if os.path.exists(f"/proc/{self.pid}"):
                        log.warning("network figures stop here: %s", e)
                    self.available = False
            return self._sum()

    def last_totals(self) -> tuple[float, float]:
        """(sent, received) as of the last `totals()`, without reading anything."""
        with self._lock:
            return self._sum()

    def close(self) -> None:
        """Stop reading in the background; `last_totals()` keeps the last figures."""
        self._stop.set()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=5)
        with self._lock:
            for nl in (self._notices, self._nl):
                if nl is not None:
                    nl.close()
            self._notices = self._nl = None

    def _read_every(self, seconds: float) -> None:
        while not self._stop.wait(seconds) and self.available:
            self.totals()

    def _sum(self) -> tuple[float, float]:
        sent = self._closed.sent + sum(t.count.sent for t in self._open.values())
        received = self._closed.received + sum(t.count.received for t in self._open.values())
        return float(sent), float(received)

    def _add_closed(self, count: SocketCount, minus: SocketCount = SocketCount(0, 0)) -> None:
        """Add what `count` holds beyond `minus` (nothing for a field where it holds less)."""
        self._closed = SocketCount(
            self._closed.sent + max(count.sent - minus.sent, 0),
            self._closed.received + max(count.received - minus.received, 0),
        )

    def _read(self, nl: socket.socket) -> None:
        if self._notices is not None:  # first the sockets the kernel destroyed meanwhile
            for cookie, last in destroyed(self._notices).items():
                if cookie in self._open:  # (zeros where it was closed with a zero linger)
                    seen = self._open.pop(cookie).count
                    self._add_closed(
                        SocketCount(max(last.sent, seen.sent), max(last.received, seen.received))
                    )
                elif cookie in self._gone:
                    self._add_closed(last, minus=self._gone.pop(cookie)[0])
        mine = socket_inodes(self.pid)
        clock = time.monotonic()
        since = clock - self._dumped_at
        unseen = mine - {t.inode for t in self._open.values()} - self._not_tcp
        if since >= DUMP_EVERY_S[1] or (unseen and since >= DUMP_EVERY_S[0]):
            table = tcp_sockets(nl)
            self._dumped_at = clock
            tcp = {t.inode for t in table.values()}
            self._not_tcp = {i for i in mine if i not in tcp}
            now = {
                cookie: t
                for cookie, t in table.items()
                if t.inode in mine or cookie in self._open  # an orphan (closing) still counts
            }
            for cookie in now.keys() & self._gone.keys():  # taken for gone, yet there
                back = self._gone.pop(cookie)[0]
                self._closed = SocketCount(
                    max(self._closed.sent - back.sent, 0),
                    max(self._closed.received - back.received, 0),
                )
        else:  # each known socket looked up; one that did not answer keeps its last count
            now = {}
            for cookie, old in self._open.items():
                try:
                    found = look_up(nl, old)
                except OSError:
                    found, self._dumped_at = old, -math.inf
                if found is not None:
                    now[cookie] = found
        for cookie, old in self._open.items():
            if cookie not in now:  # gone: counted as last read, until its notice
                self._add_closed(old.count)
                if self._notices is not None:
                    self._gone[cookie] = (old.count, clock)
            elif now[cookie].count.sent < old.count.sent or (
                now[cookie].count.received < old.count.received
            ):  # counters only grow: the socket connected anew, its first connection ended
                self._add_closed(old.count)
        self._gone = {c: g for c, g in self._gone.items() if clock - g[1] < GONE_KEPT_S}
        self._open = now


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
                meter = WireMeter(helper.pid, every_s=READ_EVERY_S)
                return meter if meter.available else None
    return None
