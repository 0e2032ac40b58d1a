"""Bytes a peer's averager actually moved: every all-reduce message it sent or received, counted
where hivemind sends and receives them (serialized size), in both roles (as a sender of its own
parts, and as the reducer of its span), and the swarm's state it served to or downloaded from
others. Counters live in shared memory, written by the averager's process and read by the peer.

    traffic = Traffic()                   # before the averager process forks
    sent, received = traffic.totals()     # bytes so far
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import time
from collections.abc import AsyncIterator
from typing import Any

from hivemind.averaging.allreduce import AllReduceRunner

SENT, RECEIVED = 0, 1


class Traffic:
    def __init__(self) -> None:
        # a plain shared array: added to once per message, where a tensor op cost ~7% of the
        # averager's CPU
        self._bytes = mp.get_context("fork").RawArray(ctypes.c_double, 2)

    def add(self, direction: int, message: Any) -> None:
        self._bytes[direction] += message.ByteSize()

    def totals(self) -> tuple[float, float]:
        return float(self._bytes[SENT]), float(self._bytes[RECEIVED])

    async def count(self, direction: int, messages: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for message in messages:
            self.add(direction, message)
            yield message


class _CountedStub:
    """A peer's stub whose streams count what comes back: averages from a reducer, or the state
    a peer serves."""

    def __init__(self, stub: Any, traffic: Traffic) -> None:
        self._stub, self._traffic = stub, traffic

    async def rpc_aggregate_part(self, inputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
        stream = await self._stub.rpc_aggregate_part(inputs)
        return self._traffic.count(RECEIVED, stream)

    async def rpc_download_state(self, request: Any) -> AsyncIterator[Any]:
        stream = await self._stub.rpc_download_state(request)
        return self._traffic.count(RECEIVED, stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)


def counting_state_stubs(servicer: Any, traffic: Traffic) -> Any:
    """A get_stub for one averager instance (hivemind asks it for the stubs it downloads state
    through): the same stubs, counting the state received."""
    plain = type(servicer).get_stub

    def get_stub(p2p: Any, peer: Any, *, namespace: str | None = None) -> Any:
        return _CountedStub(plain(p2p, peer, namespace=namespace), traffic)

    return get_stub


class CountedRunner(AllReduceRunner):
    """hivemind's all-reduce, counting the parts this member sends to each reducer and the
    averages it gets back (the reducer's side is counted by the averager's RPC handler)."""

    def __init__(self, *, traffic: Traffic, **kwargs: Any) -> None:
        self.traffic = traffic
        super().__init__(**kwargs)

    def _get_peer_stub(self, peer: Any) -> Any:
        return _CountedStub(super()._get_peer_stub(peer), self.traffic)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[Any]:
        async for message in super()._generate_input_for_peer(peer_index):
            self.traffic.add(SENT, message)
            yield message


class RateMeter:
    """Bytes a second in each direction between two readings of the totals."""

    def __init__(self) -> None:
        self._last: tuple[float, float, float] | None = None

    def update(self, sent: float, received: float, now: float | None = None) -> tuple[float, float]:
        now = time.monotonic() if now is None else now
        last, self._last = self._last, (now, sent, received)
        if last is None or now <= last[0]:
            return 0.0, 0.0
        dt = now - last[0]
        return (sent - last[1]) / dt, (received - last[2]) / dt
