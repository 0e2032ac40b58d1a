"""A member on probation is read in its round back, not averaged in.

A member left out of this peer's rounds for its updates (exclusion.py: opposing, leaning,
not following) is let back in after its rounds out, on probation: the first round that reads
it judges it again, and one failing reading leaves it out again, for twice as long. That round
used to average its update in, clipped (robust.py), since only its reading could tell; so every
attacker left out in its first rounds came back, 16 rounds on, for one round averaged in (bench
attack's LN3-LN5: ALIE, the sign flip, the label flip, IPM and the sybil, 1-3 rounds per seed
from round 3 on, most of them that round back).

Now each member tells its group, in the round metadata it seals (gather.py), the members it
holds on probation (`PROBATION_KEY`; at most `MOST_DECLARED`). A member in sync that more than
half of the group's members declare, two at least (`DECLARERS`), is *read only* in that round,
where two members at least are left to average: its update parts weigh nothing in every span,
as an out-of-sync member's do (robust.py, `reads`), and each reducer still reads them against
its own (cosine and lean), so its probation ends there, passed or failed. The rule reads only
the group's metadata, which every member and every auditor of the same protocol version holds
alike (protocol.py: 4), so a replay of a span (audit.py) leaves the same parts out.

Why a majority of the group, two at least: one member's word alone would let any member
silence an honest one, and a fixed two would let two members (a member's two certified
identities) silence every honest member of a larger group, leaving only their own updates to
average, unjudged (a fresh-context review's case: five members, two of them colluding).
Dishonest members alone, a minority, make no one read only. In bench attack's swarms (four
peers, one attacker) a member let back in meets only those that let it back in (those that
still leave it out refuse its groups), most of them left it out at about the same round, and
a group needs three in sync (sync.quorum): in a group of three, both honest members declare it
where both left it out; in a group of four, three must. A peer that never left it out declares
nothing, and where only two of four members declare it, it is averaged in as before. Each
member's bounds on the averages it receives (robust.py, `reducer_bounds`) still count the
read-only members as in sync, as before: a read-only member checks what it applies. (Measured:
bench attack's LN8, the sign flip and ALIE, averaged in from round 3 on in no seed, against one
round per seed before, docs/robustness-history.md, session 55.)

What the rule does not settle:
- Members that are a majority of a group (a member with enough certified identities there:
  certificates are per peer ID, one member may hold several) can declare an honest member and
  keep its update out of that round. The honest member still applies the round, in sync, and
  loses its own update of that round. Such a majority outvotes the robust average anyway.
- An honest member that an honest peer left out wrongly, and holds on probation, can be tipped
  read only by an attacker's declaration: in a group of three, the round then averages the
  attacker's clipped part and one honest part as a pair, where it faced the median of three.
  It needs an honest peer's wrong exclusion first (none in the bench attack runs since LN3:
  `honest_peers_left_out`).
- The read-only member still counts toward the quorum (it holds the state: sync.quorum is about
  who vouches for a state, not whose update it holds) and is named in the round's record
  (`round_read_only`), so that bench attack counts its update as left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

PROBATION_KEY = "probation"
"""The round metadata's field: the base58 peer IDs this member holds on probation."""
DECLARERS = 2
"""The fewest other members whose declaration makes a member read only (besides more than half
of the group's members: in a pair, one declarer makes no majority of two)."""
MOST_DECLARED = 16
"""No member's declaration counts beyond this many peer IDs (metadata kept small)."""


def _base58(peer_id: Any) -> str:
    return peer_id.to_base58() if hasattr(peer_id, "to_base58") else str(peer_id)


def declared(user: Any) -> set[str]:
    """The peer IDs one member's metadata declares on probation (nothing where malformed)."""
    if not isinstance(user, dict):
        return set()
    ids = user.get(PROBATION_KEY)
    if not isinstance(ids, list | tuple):
        return set()
    return {x for x in ids[:MOST_DECLARED] if isinstance(x, str) and 0 < len(x) <= 128}


def read_only(
    users: Sequence[Any], peer_ids: Sequence[Any], in_sync: Sequence[bool] | None = None
) -> list[bool]:
    """Per member, in group order: read only this round (declared on probation by more than
    half of the group's members, DECLARERS at least, and in sync: an update made from other
    parameters is neither averaged nor read), where two members at least are left to average;
    else none. `users`: what each member told the group, in the same order; `in_sync`: each
    member's flag (sync.membership; None: all)."""
    ids = [_base58(p) for p in peer_ids]
    counts = dict.fromkeys(ids, 0)
    for own, user in zip(ids, users, strict=False):
        for named in declared(user):
            if named in counts and named != own:
                counts[named] += 1
    synced = list(in_sync) if in_sync is not None else [True] * len(ids)
    marked = [
        ok and counts[p] >= DECLARERS and 2 * counts[p] > len(ids)
        for p, ok in zip(ids, synced, strict=True)
    ]
    averaged = sum(ok and not ro for ok, ro in zip(synced, marked, strict=True))
    return marked if averaged >= 2 else [False] * len(ids)


def declare(data_for_gather: bytes, probation: Iterable[Any], serializer: Any) -> bytes:
    """`data_for_gather` (hivemind's [bandwidth, mode, user metadata], serialized) with the
    members this peer holds on probation added to its metadata."""
    bandwidth, mode, user_bytes = serializer.loads(data_for_gather)
    user = serializer.loads(user_bytes)
    if not isinstance(user, dict):
        return data_for_gather
    user[PROBATION_KEY] = sorted(_base58(p) for p in probation)[:MOST_DECLARED]
    return serializer.dumps([bandwidth, mode, serializer.dumps(user)])
