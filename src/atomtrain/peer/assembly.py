"""When a leader forms its group: at once when every member it expects has joined.

hivemind's leader forms its group when `target_group_size` members have joined, or when its
matchmaking time ends. In a swarm smaller than that target (64 by default) every round waited out
the whole matchmaking time, even when each live member had joined in its first tenth: in bench
attack's clean swarms (3 peers, `matchmaking_s` 1.5) matchmaking took a median 1.75 s of a 2.9 s
round, and a round retried after a stall paid it twice. A leader now forms its group as soon as
every member it expects has joined: the live peers whose statuses the training process last read
(presence.py), less those this peer leaves out of its rounds or banned (guarded.py). A peer it
does not know of yet (a joiner whose status it has not read) finds the group formed and takes part
in the next round; one it expects that does not come is waited for as before, until the
matchmaking time ends. Where more peers are live than the target, hivemind's rule comes first.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Iterable
from typing import Any

ID_BYTES = 64
"""Room for one base58 peer ID (46-53 characters) and its separator."""


class ExpectedMembers:
    """The live others' peer IDs (base58), written by the training process before each round and
    read by the averager's process at its step (shared memory, made before the averager forks).
    """

    def __init__(self, most: int) -> None:
        """`most`: peer IDs it holds; with more live others than that, it holds none (hivemind's
        `target_group_size` forms the group first: pass that)."""
        self._buffer: Any = mp.get_context("fork").RawArray("c", max(most, 1) * ID_BYTES)
        self._most = most

    def write(self, peer_ids: Iterable[str]) -> None:
        ids = [p for p in peer_ids if p and "\n" not in p]
        data = "\n".join(ids).encode()
        if len(ids) >= self._most or len(data) >= len(self._buffer):
            data = b""  # too many to wait for every one
        self._buffer.value = data

    def read(self) -> list[str]:
        return [p for p in self._buffer.value.decode("ascii", "replace").split("\n") if p]


def all_expected_joined(
    own: Any, joined: Iterable[Any], expected: Iterable[Any], counts: Callable[[Any], bool]
) -> bool:
    """Every expected member that `counts` (not left out, not banned) has joined this leader's
    group (`joined`: its followers), and there is at least one: a group of two or more."""
    waited = {p for p in expected if p != own and counts(p)}
    return bool(waited) and waited <= set(joined)
