"""When a leader forms a retry's group: at once when every member it expects has joined; and
never, at its matchmaking time, one smaller than a quorum those it waits for can make up.

(A try that ended early over a staller is first run again by the rest of its group with no
matchmaking at all, where they make the quorum: redo.py. What follows is the matchmaking a retry
goes through where they do not, or where that redo was lost too.)

hivemind's leader forms its group when `target_group_size` members have joined, or when its
matchmaking time ends. In a swarm smaller than that target (64 by default) every try waits out the
whole matchmaking time, and a round retried after a stall paid it twice: in bench attack (3-4 peers,
`matchmaking_s` 1.5) matchmaking took a median 1.75 s of a 2.9 s round. In a retry (the round ran a
group that failed: a stall ended it early, exact.py), a leader now forms its group as soon as every
member it expects has joined: the live peers whose statuses the training process last read
(presence.py), less those this peer leaves out of its rounds or banned, and those an earlier try of
the round ended early unheard from (SUSPECT_ROUNDS, exact.py `suspects`; exact.py names them only
later, if at all). A group formed early never holds fewer members than the round needs in sync
(sync.quorum): one that could not be applied is better left to the matchmaking time, for more to
join. One it expects that does not come is waited for as before, until the matchmaking time ends; a
peer it does not know of yet (a joiner whose status it has not read) finds the group formed. Where
more peers are live than the target, hivemind's rule comes first.

A round's first try still waits out its matchmaking time (`always` forms it early too: the
tests' harness). Forming every group early (228b469 to acb3212) gave bench attack's clean swarms
36-54 rounds in 600 steps (H fixed at 5 steps) against 15-28 before, and no lower loss: 2.850,
2.908 and 2.957 at the median in three runs, against 2.724-2.894 in the eleven before (though
the next run, first tries as before, ended its seed 2 above those too); nor did it make a stall
cheaper in rounds (docs/robustness-history.md). So the cadence every swarm trained at is kept.
A round prepared for a slot (H auto) never tries twice and forms its group at its time.

Nor does a leader form, at the end of its matchmaking time, a group smaller than the round's quorum
where it and the expected members it waits for can make the quorum up (`least_group`): hivemind's
leader formed a pair there, which the quorum then refused (sync.quorum: three in sync in a keyed
swarm of three or more live members). Its members now look on, within the round's time, for the
rest. Expected members are the live ones the runtime counts for the quorum (presence.live_other_ids:
a member left out or rejected counts for neither, so where the rest are left out a pair is applied
as before); the members it waits for are those less any it excludes, banned, or an earlier try of
the round ended early unheard from: where those cannot make the quorum up, hivemind's 2 stands and a
pair fails at once, as before. A round prepared for a slot (H auto) keeps hivemind's rule: not
measured there. An earlier version, every round's matchmaking closing no group smaller than the
quorum (8df815a, in sync.py), was taken out after rounds of three took 7-12 s instead of 2-3 s; in
bench attack's swarms this one left the typical round as it was (2.5-3.2 s). Measured in
docs/robustness-history.md (session 41): far fewer failed rounds, and a round that lost an attempt
costs more, its retry waiting for the third member where it had failed at once as a pair.

Known limit: a hostile leader that keeps an honest member from its group's word (accepted, never
told the round began) makes the others end that try early over the member; their retry then does
not wait for it where the quorum does not need it, and the leader is not named. Without this
module the retry waited for it.
"""

from __future__ import annotations

import multiprocessing as mp
import re
from collections.abc import Callable, Iterable
from typing import Any

ID_BYTES = 64
"""Room for one base58 peer ID (46-53 characters) and its separator."""
RETRIES, ALWAYS = "retries", "always"
"""Which tries a leader forms early: a round's retries (the default), or every try."""
SUSPECT_ROUNDS = 0
"""A member not heard from when a try of this peer's round ended early (exact.py: it had sent
nothing, or as a reducer no averages) is not waited for in the rest of that round, nor in this
peer's next this many rounds, unless it takes part in a try meanwhile. bench attack's staller froze
its averager for 17 s (5-9 rounds) while its training process kept its status fresh, and until it
was named, at the reducer timeout, each round waited out the matchmaking time for it. 4 rounds
(770bdd8, run Z5 in docs/robustness-history.md) measured no better than the round alone (run Z4):
`lost_attempt_cost` 0.94, 1.17, 1.02 at the median against 0.86, 0.94, 1.07, the honest peers'
rounds applied 28, 25, 21 against 25, 25, 29; and in a larger swarm an honest member that once
started a group late, then came last to matchmaking, would have missed those rounds. A first version
without the quorum guard left such a member out of pairs the quorum refuses."""
PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,60}")
"""What a base58 peer ID looks like: anything else a status claims is dropped (in an open swarm a
status's peer ID is its writer's word; a NUL in it would end the list early)."""


class ExpectedMembers:
    """The live others' peer IDs (base58), written by the training process before each round and
    read by the averager's process at its step (shared memory, made before the averager forks).
    """

    def __init__(self, most: int) -> None:
        """`most`: hivemind's `target_group_size`. With that many live others or more it holds
        none: hivemind's own rule forms the group first."""
        self._buffer: Any = mp.get_context("fork").RawArray("c", max(most, 1) * ID_BYTES)
        self._most = most

    def write(self, peer_ids: Iterable[str]) -> None:
        ids = [p for p in peer_ids if PEER_ID.fullmatch(p)]
        data = "\n".join(ids).encode("ascii")
        if len(ids) >= self._most or len(data) >= len(self._buffer):
            data = b""  # too many to wait for every one
        self._buffer.value = data

    def read(self) -> list[str]:
        return [p for p in self._buffer.value.decode("ascii", "replace").split("\n") if p]


class Suspects:
    """The members a leader does not wait for (SUSPECT_ROUNDS), counted in this peer's rounds."""

    def __init__(self) -> None:
        self._since: dict[Any, int] = {}  # peer -> the round of this peer's it was suspected in

    def __contains__(self, peer_id: Any) -> bool:
        return peer_id in self._since

    def tried(self, members: Iterable[Any], ended_over: set[Any], round_: int) -> None:
        """A try of round `round_` with `members` ended, early over `ended_over` (or not)."""
        for p in members:
            if p in ended_over:
                self._since[p] = round_
            else:
                self._since.pop(p, None)  # it took part

    def next_round(self, round_: int) -> None:
        self._since = {p: r for p, r in self._since.items() if round_ - r <= SUSPECT_ROUNDS}


def all_expected_joined(
    own: Any,
    joined: Iterable[Any],
    expected: Iterable[Any],
    counts: Callable[[Any], bool],
    least: int = 2,
) -> bool:
    """Some other member is expected (none: hivemind's own rule), every expected one that
    `counts` (not left out, not banned, not suspect) has joined this leader's group (`joined`:
    its followers), and the group holds at least `least` members, this leader included (the
    round's quorum). Where every expected one is a suspect, a quorum of them that came back is
    enough."""
    joined = set(joined)
    others = [p for p in expected if p != own]
    waited = {p for p in others if counts(p)}
    return bool(others) and waited <= joined and len(joined | {own}) >= max(least, 2)


def least_group(
    own: Any, expected: Iterable[Any], counts: Callable[[Any], bool], quorum: int
) -> int:
    """The fewest members a leader's group forms with when its matchmaking time ends: the round's
    `quorum` where this peer and the expected others that `counts` can make it up (a smaller
    group could not be applied: its members look on, within the round's time, for the rest),
    hivemind's 2 where they cannot (a pair then lands where the quorum is 2, or fails at once as
    before, and the rounds that exclusions are counted in go on)."""
    others = {p for p in expected if p != own and counts(p)}
    return quorum if 1 + len(others) >= quorum else 2
