"""Which members of a round hold the group's synchronized parameters.

Each member tells the group a sketch of its synchronized parameters (layout.Sketcher) and the
size of its own update in the same measure. Members of a round apply the same bits of the average
(exact.py), so honest members' parameters stay identical (up to the last bits, across machines
whose arithmetic rounds differently); a member that missed a round, or restarted from an old
checkpoint, sits an outer step or more away. The reference is the member most others agree
with (ties: the most rounds, then group order, the same for every member); members farther from it
than `SYNC_TOL` updates are out of sync: their updates are left out (they were made from other
parameters) and they download the swarm's state instead of drifting further.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from atomtrain.peer.layout import sketch_distance

SYNC_TOL = 0.1
"""Out of sync beyond this many updates (sketch RMS of the group's typical pseudo-gradient, the
lower median of what members report, so that no member widens it by claiming a large update: a
missed outer step is about one update)."""
MIN_TOL = 1e-7


def lower_median(values: Sequence[float]) -> float:
    ok = sorted(v for v in values if math.isfinite(v) and v >= 0)
    return ok[(len(ok) - 1) // 2] if ok else 0.0


def in_sync_flags(
    sketches: Sequence[Sequence[float]], update_sizes: Sequence[float], rounds: Sequence[int]
) -> list[bool]:
    """For each member, whether it holds the reference's synchronized parameters."""
    n = len(sketches)
    if n == 0:
        return []
    tol = max(SYNC_TOL * lower_median(update_sizes), MIN_TOL)
    close = [
        [sketch_distance(list(sketches[i]), list(sketches[j])) <= tol for j in range(n)]
        for i in range(n)
    ]
    ref = max(range(n), key=lambda i: (sum(close[i]), rounds[i], -i))
    return close[ref]


QUORUM = 3
"""Members in sync a defended round needs once the swarm has that many live members."""


def quorum(live_members: int, keyed: bool) -> int:
    """Members in sync a round needs before it is applied, in a swarm of `live_members` (this
    peer included) that could take part; `keyed`: a defended swarm whose members hold
    certificates.

    A state is checked by those that hold it: a drifted peer or a joiner takes a downloaded state
    only when two other members vouch for its digests (agreement.py). Of a pair, one may be a
    liar that vouches for nothing afterwards, and what its honest partner applied is then a state
    no other peer can take: that partner sits out of step with every other for good. (bench
    attack's sybil run: a sign-flipping member paired with each honest peer in turn and published
    no digest of what it applied; the three honest peers ended on three states no download could
    check, and one of them applied 2 rounds of 23.) Three in sync hold two honest members when at
    most one lies. So while three members could take part, a round of two is not applied: its
    progress goes with the next round. In a swarm of three, a member that stays away keeps the
    other two from applying pairs (each trains on, its progress kept for the first round of
    three): safety over liveness, where one liar of three leaves no other choice.

    Only where membership is certified: in an open swarm anyone can bring a third identity, so a
    quorum would cost honest pairs their rounds (on 2 loaded cores, three open peers mostly meet
    in pairs: the churn test's survivors applied 1 round of 8) and stop no one; an undefended
    swarm takes downloads unchecked."""
    return QUORUM if keyed and live_members >= QUORUM else 2


def needed_in_sync(live_members: int, keyed: bool, target_group_size: int) -> int:
    """Members in sync a round needs to be applied (quorum), never more than a group holds.
    (A leader forms no group smaller than this where it and the members it waits for can make
    it up: assembly.least_group, in rounds that may retry. A first version, every round's
    matchmaking closing no group smaller than this, 8df815a, was taken out: rounds of three took
    7-12 s instead of 2-3 s, and the quick scaling bench 173 s instead of 72.)"""
    return min(quorum(live_members, keyed), target_group_size)


def why_not_applied(in_sync: Sequence[bool], need: int, final: bool) -> str:
    """Why a round whose members' in-sync flags are `in_sync` (this peer among them, in sync)
    is not applied, `need` in sync being the quorum ("": applied; no flags: nothing to check).
    `final`: the last round of a run, applied by a member in sync even alone.

    With no other member in sync, the reducers left the others' updates out and the "average" is
    this peer's own update alone. Applied, it made a round only this peer held: the partner that
    went to download the swarm's state found no other peer to vouch for it (agreement.py), and
    this peer raced ahead on rounds of one (churn: a joiner at round 20 while the rest sat at 11,
    to the end of the run). (Undefended rounds leave such updates out too, exact.py: the same
    holds there.) Short of the quorum, a pair's state, one of them possibly a liar, no third
    peer could take; the last round's too: every finisher takes the result of the group holding
    the smallest peer ID (finish.py), and of {an honest member, a sign-flipping one} that was the
    honest member's last 50 steps cancelled, for all (bench attack's sybil run: 3.49 against 2.86
    clean). Lost, the finishers take its synchronized state. Either way the progress goes with
    the next round."""
    held = sum(bool(ok) for ok in in_sync)
    if in_sync and held < 2 and not final:
        return "no other member in sync"
    if in_sync and need > 2 and held < need:
        return f"{held} members in sync while {need} could take part (sync.quorum)"
    return ""


def group_live(peers: Sequence[dict[str, object]]) -> int:
    """The live members a round's group counts, from what each member told it (`live`): the
    largest claim, so every member decides the same from the same metadata (a member's own
    reading of the statuses and its own bans differ from another's, and a pair where one applied
    and the other did not made the very state only one peer holds). A member that claims more
    only makes the round need three; one that claims fewer moves nothing."""
    claims = [1]
    for g in peers:
        if not isinstance(g, dict):
            continue
        try:
            claims.append(max(1, min(int(g.get("live", 1)), 1 << 20)))  # type: ignore[call-overload]
        except (TypeError, ValueError, OverflowError):
            continue
    return max(claims)


def membership(peers: list[dict[str, Any]]) -> list[bool]:
    """In-sync flags from the round's metadata; everyone in sync when sketches are missing."""
    try:
        sketches = [[float(x) for x in g["sketch"]] for g in peers]
        sizes = [float(g["update_size"]) for g in peers]
        rounds = [int(g["round"]) for g in peers]
    except (KeyError, TypeError, ValueError, OverflowError):  # malformed, or int(inf)
        return [True] * len(peers)
    try:
        return in_sync_flags(sketches, sizes, rounds)
    except (OverflowError, ValueError):  # values no honest member sends (1e300, NaN)
        return [True] * len(peers)
