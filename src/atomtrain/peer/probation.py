"""A member on probation is read in its round back, not averaged in.

A member left out of this peer's rounds for its updates (exclusion.py: opposing, leaning,
not following) is let back in after its rounds out, on probation: the first round that reads
it judges it again, and one failing reading leaves it out again, for twice as long. That round
used to average its update in, clipped (robust.py), since only its reading could tell; so every
attacker left out in its first rounds came back, 16 rounds on, for one round averaged in (bench
attack's LN3-LN5: ALIE, the sign flip, the label flip, IPM and the sybil, 1-3 rounds per seed
from round 3 on, most of them that round back).

Now each member tells its group, in the round metadata it seals (gather.py), the members it
holds on probation (`PROBATION_KEY`; at most `MOST_DECLARED`). A member that at least
`DECLARERS` other members of the group declare is *read only* in that round: its update parts
weigh nothing in every span, as an out-of-sync member's do (robust.py, `reads`), and each
reducer still reads them against its own (cosine and lean), so its probation ends there,
passed or failed. The rule reads only the group's metadata, which every member and every
auditor holds alike, so a replay of a span (audit.py) leaves the same parts out.

Why two declarers: one member's word alone would let any member silence an honest one. In
bench attack's swarms every honest member that meets a member let back in holds it on
probation (those that still leave it out refuse its groups), and a group needs three in sync
(sync.quorum), so it meets at least two of them.

What the rule does not settle:
- A member with two certified identities in a group (certificates are per peer ID, one member
  may hold several) can declare an honest member and keep its update out of that round. The
  honest member still applies the round, in sync, and loses its own update of that round. The
  rule cannot tell such a pair from two honest declarers by the metadata alone.
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
"""Other members that must declare a member on probation for it to be read only."""
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


def read_only(users: Sequence[Any], peer_ids: Sequence[Any]) -> list[bool]:
    """Per member, in group order: read only this round (at least DECLARERS others declare it
    on probation). `users`: what each member told the group, in the same order."""
    ids = [_base58(p) for p in peer_ids]
    counts = dict.fromkeys(ids, 0)
    for own, user in zip(ids, users, strict=False):
        for named in declared(user):
            if named in counts and named != own:
                counts[named] += 1
    return [counts[p] >= DECLARERS for p in ids]


def declare(data_for_gather: bytes, probation: Iterable[Any], serializer: Any) -> bytes:
    """`data_for_gather` (hivemind's [bandwidth, mode, user metadata], serialized) with the
    members this peer holds on probation added to its metadata."""
    bandwidth, mode, user_bytes = serializer.loads(data_for_gather)
    user = serializer.loads(user_bytes)
    if not isinstance(user, dict):
        return data_for_gather
    user[PROBATION_KEY] = sorted(_base58(p) for p in probation)[:MOST_DECLARED]
    return serializer.dumps([bandwidth, mode, serializer.dumps(user)])
