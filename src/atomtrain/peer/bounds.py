"""The bounds of robust aggregation, and the checks every member makes of what a reducer returns.

`Defence` holds the factors (robust.py's reducers clip and drop by them); `Typical` and
`reducer_bounds` say how large an honest update is expected to be this round from what members
report; `returned_lie` and `returned_pair_lie` say why an average a reducer sent back cannot be
honest: non-finite, or farther from the member's own part than an honest average can be (three
or more members in sync), or larger than the member's own part (fewer, `PAIR_SLACK`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from atomtrain.peer.exclusion import FOLLOW_RATIO, LEAN

DELTA, PROBE = "delta", "probe"
MIN_WEIGHT = 1e-6


@dataclass(frozen=True)
class Defence:
    """Bounds of the robust aggregation."""

    clip: float = 1.0
    """Pseudo-gradient parts farther than this many typical updates from the center are clipped
    (an honest update lies within about 0.9 of its norm from the median of its group's, measured
    on independent updates of equal size: closer when they agree)."""
    reject: float = 20.0
    """...and beyond this many, dropped, and their sender left out of the next rounds for a
    while (not banned: an honest member that caught up can send one)..."""
    ban: float = 1e4
    """...and beyond this many, banned: no honest member sends one (the largest measured, from
    members that had just caught up or trained alone for a while: 25-34), while a member that
    scales its update by a million would otherwise only be left out for a while, and back."""
    reduced: float = 4.0
    """A reducer's average of an update span farther from a member's own part than this many
    times (typical update + that part) is doubted where three or more members are in sync: the
    round is discarded and the reducer left out for a while (reducer_bounds; fewer in sync:
    PAIR_SLACK). Honest averages were measured within 0.97 of such a size in the median case, with
    members whose updates are 3-10x smaller than the others'; in 7 churn runs (a peer killed
    mid-round, restarted, a joiner) no honest reducer was doubted (the churn failures once
    blamed on this check were re-synchronizations that could not land: runtime.py `_apply`).
    At 20 a reducer could move its span by up to about 40 typical updates unseen; at 4, by
    about 8."""
    min_scale: float = 0.0
    """Smallest typical update (RMS), so a group whose updates are near zero (a round right after
    a sync) does not take an honest larger update for an outlier."""
    audit: bool = True
    """A second member recomputes each span's reduction, and every member checks what it
    received against that (audit.py): a reducer that lies is caught the first time."""
    follow: float = FOLLOW_RATIO
    """A member whose update follows this member's little (a cosine below FOLLOW_COSINE and below
    this share of the closest other member's, in the medians of its last 3 rounds) is left out
    for a while (exclusion.FOLLOW_RATIO; 0: never)."""
    lean: float = LEAN
    """A member whose update, less its component along this member's, leans one way by this
    much in a round's reading is left out for a while (exclusion.LEAN; 0: never)."""


NO_DEFENCE = Defence(
    clip=math.inf,
    reject=math.inf,
    reduced=math.inf,
    ban=math.inf,
    audit=False,
    follow=0.0,
    lean=0.0,
)
"""Nothing clipped or refused for its size: the weighted mean of the finite parts (bench attack's
lying reducer in an undefended swarm)."""


def equal_weights(weights: Sequence[float]) -> list[float]:
    """The weights a defended round uses: one for every member that reports having trained, tiny
    for one that reports nothing (or nonsense). Every member computes the same list from the
    same gathered metadata."""
    return [1.0 if math.isfinite(w) and w > 0 else MIN_WEIGHT for w in weights]


@dataclass(frozen=True)
class Typical:
    """How large (RMS per element) an honest contribution is expected to be this round, from
    what members report: in a group of three or more the upper median (the middle value, or the
    larger of the two middle ones), which no single member can move beyond the others' values;
    the upper one, so that where half a group has just joined or re-synchronized (updates of a
    few steps) the other half's larger updates still count as typical. With fewer reports, the
    smaller one (the larger may be a liar's). Only the check of what reducers send back uses it
    (a member sees no one else's update); reducers measure the parts they hold."""

    rms: float

    @classmethod
    def of(cls, reported_rms: Sequence[float], min_scale: float) -> Typical:
        ok = sorted(v for v in reported_rms if math.isfinite(v) and v >= 0)
        middle = len(ok) // 2 if len(ok) >= 3 else 0
        return cls(max(ok[middle] if ok else 0.0, min_scale))


def bound(scale: float, numel: int, factor: float) -> float:
    return factor * scale * math.sqrt(max(numel, 1)) + 1e-12


def reducer_bounds(claims: Sequence[float], defence: Defence) -> Typical:
    """The typical update a reducer's averages are checked against where three or more members
    are in sync (each reducer clips their parts around their median): the upper median of the
    sizes they reported (`claims`, one per member in sync, valid or not), at `defence.reduced`.
    With fewer in sync the pair check applies instead (returned_pair_lie), whatever the reports
    say: a member cannot pick a looser check by reporting nonsense."""
    ok = sorted(c for c in claims if math.isfinite(c) and c >= 0)
    return Typical.of(ok, defence.min_scale)


PAIR_SLACK = 1.25
"""Fewer than three members in sync: an honest average is no larger than the smaller of its
parts, so no larger than a member's own (as the reducer received it, through the codec, and as
the member receives the average, through it again: a few percent either way). A reducer that
returns more is doubted."""


NON_FINITE = "non-finite averages"


def returned_lie(
    kind: str, own: torch.Tensor, average: torch.Tensor, typical: Typical, factor: float
) -> str | None:
    """Why the average a reducer returned for a member's part cannot be honest (None: it can):
    non-finite, or (an update span) farther from the member's own part than `factor` times a
    typical update and that part together, about as far as an honest average can be."""
    delta = average.float() - own.float()
    if not bool(torch.isfinite(delta).all()):
        return NON_FINITE
    size = bound(typical.rms, delta.numel(), 1.0) + float(own.float().norm())
    norm = float(delta.norm())
    if kind != PROBE and norm > size * factor:
        return f"{kind} averages {norm / size:.3g}x typical"
    return None


def returned_pair_lie(
    kind: str, own: torch.Tensor, average: torch.Tensor, min_scale: float = 0.0
) -> str | None:
    """As returned_lie, where fewer than three members are in sync and this member is one of
    them: an honest average (of parts scaled down to the smaller one, or to the group's smallest
    typical update, `min_scale` RMS, where that is larger) is no larger than `own` or that. (A
    member that has just re-synchronized holds an update of a few steps, far below the floor:
    checked against its own part alone, honest reducers returned 1.9x it and were left out.)"""
    if not bool(torch.isfinite(average.float()).all()):
        return NON_FINITE
    size = max(float(own.float().norm()), bound(min_scale, own.numel(), 1.0)) + 1e-12
    norm = float(average.float().norm())
    if kind != PROBE and norm > size * PAIR_SLACK:
        return f"{kind} averages {norm / size:.3g}x this member's part, of two"
    return None
