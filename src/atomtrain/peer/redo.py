"""A stalled group tried again at once, without the members it ended over and without matchmaking.

A try that ends early over a silent member (exact.py, end_early) used to look for a new group: the
leaders declare themselves in the DHT, the others find them there and ask to join, and the group
forms once every member expected has joined (assembly.py). In bench attack's swarms (4 peers, one
stalling) that retry landed about 3 s after the try ended, sometimes 6-7 s (a DHT search waiting on
the frozen staller's node, runs ZD and ZE; later, not traced), where a whole round takes about 3 s:
a stalled round then cost more than one round.

A try is ended over the members whose silence ended it (exact.py, `ended_over`: those that opened no
stream by their start timeout, sent nothing by the sender timeout, or as a reducer sent no
averages), not over every member not heard from yet, which may merely have started later. The
members of a lost try already know one another: the group's members in its order and the metadata
each sealed for this round (gather.py). So a member whose try ended early over some members runs the
same group again, less those, at once: its `redo`. Every member that ended over the same members
forms the same group, with an ID made from the lost group's and the members kept, so the group's
all-reduce needs no leader and no DHT. A member that ended over others forms another group, whose ID
no one else runs: its parts are refused (not in the group, which names no one), its redo ends at
once (exact.py ends a redo as soon as a member answers it is not in it; it waited until the round's
timeout, a round of 19.6 s in bench attack), and it looks for a group as before. (Only a redo ends
so: in a group found by matchmaking, a member that ended its try sooner answers so too, and the late
member that ended at once might stop before its parts reached a member that then named it.) So does
a redo that a member ended over someone too: one redo per group found by matchmaking. A redo is only
formed where its members can make the round's quorum (sync.quorum; less could not be applied): in a
group of three with one staller the others look for a group.

Parts of a redo can reach a member that has not finished the lost try yet (its start timeout counts
from its own, later start): the redo's ID names the group it redoes (`redoes`), so such a member
holds them until that try ends (guarded.py, _group_runner), then runs the same redo or refuses them;
parts of any other redo it refuses at once. It holds them no longer than the start timeout's floor
(`peer.start_timeout_s`): its sender ends the redo over it by then, and asks it for its span. Held
until a long try ended, that ask went unanswered past the asker's reducer timeout, and the asker
named an honest member (bench attack, a seed's first round: an honest peer left out). Once every
other member a redo of that group keeps has sent it parts of the redo within that floor, the try
is lost there too (each honest one of them ended it): that member ends it at once, while it
still runs, over the member the redo leaves out, and so runs the same redo (guarded.py,
_follow_redo), rather than at its own timeouts, which came past that floor where it started the
try later than the others by more. It takes their word only where one member cannot steer it:
for a redo that leaves out one member and keeps two others at least (one of them, then, honest
and out of the try), their parts only. A member whose try landed before their parts came cannot
follow: it holds the try's average while they hold the redo's. Otherwise a redo holds nothing
new to trust: its metadata is what each member sealed for the round and is checked as any
group's, and its all-reduce is the round's usual one, audited where the swarm audits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from typing import Any

from hivemind.averaging.group_info import GroupInfo

TAG = b"atom-redo/"
"""How a redo's group ID starts: hivemind's are 20 random bytes (a DHT ID), so a member can tell
a redo's parts from a group it was not told of."""


ORIGIN_BYTES = 8
"""A redo's ID holds this much of a digest of the ID of the group it redoes."""


def is_redo(group_id: bytes) -> bool:
    return group_id.startswith(TAG)


def redoes(redo_id: bytes, group_id: bytes) -> bool:
    """`redo_id` is a redo of the group `group_id` (of some of its members)."""
    return is_redo(redo_id) and redo_id[len(TAG) : len(TAG) + ORIGIN_BYTES] == _origin(group_id)


def _origin(group_id: bytes) -> bytes:
    return hashlib.sha256(b"origin" + group_id).digest()[:ORIGIN_BYTES]


def redo(group: GroupInfo, ended_over: Collection[Any], own: Any, quorum: int) -> GroupInfo | None:
    """The group to run at once after `group`'s try ended early over `ended_over`: its other
    members, in its order, with the metadata they sealed; None where there is none to run (no
    one ended over, `group` itself a redo, this member ended over, or fewer than `quorum`
    left)."""
    if not ended_over or is_redo(group.group_id) or own in ended_over:
        return None
    kept = [i for i, p in enumerate(group.peer_ids) if p not in ended_over]
    if len(kept) < max(quorum, 2) or len(kept) == len(group.peer_ids):
        return None
    peer_ids = tuple(group.peer_ids[i] for i in kept)
    digest = hashlib.sha256(group.group_id)
    for peer_id in peer_ids:
        digest.update(peer_id.to_bytes())
    redo_id = TAG + _origin(group.group_id) + digest.digest()[:16]
    return GroupInfo(redo_id, peer_ids, tuple(group.gathered[i] for i in kept))
