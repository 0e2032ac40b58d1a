"""The figures of `bench attack`, from the metrics its honest peers left.

Per attack, over seeds: the honest peers' final validation loss with the defences and without
(median and spread; a run whose loss is not finite counts as worst), how it compares with the
clean swarm, how many honest peers an honest peer rejected, and how many rounds the attacker
took part in before every honest peer rejected it."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from atomtrain.peer.exclusion import FOLLOW_WHY, LEAN, LEAN_WHY, LeftOut

Records = list[dict[str, Any]]


@dataclass(frozen=True)
class SwarmRun:
    honest: list[str]
    """The honest peers' names (what groups and rejections name them by)."""
    attacker: str | None
    records: list[Records]
    """Each honest peer's metrics.jsonl records."""
    sybils: list[str] = field(default_factory=list)
    """More identities of the attacker's member (a sybil attack)."""


def final_loss(run: SwarmRun) -> float | None:
    """The honest peers' mean last validation loss (None: one of them has none, or diverged)."""
    losses = [
        next((r["val_loss"] for r in reversed(log) if "val_loss" in r), None) for log in run.records
    ]
    finite = [float(v) for v in losses if v is not None and math.isfinite(v)]
    return statistics.mean(finite) if finite and len(finite) == len(losses) else None


def honest_rejected(run: SwarmRun) -> int:
    """Honest peers that some honest peer rejected."""
    named = {name for log in run.records for r in log for name in r.get("rejected_peers", ())}
    return len(named & set(run.honest))


def honest_left_out(run: SwarmRun) -> int:
    """Honest peers that some honest peer left out of its next rounds (a stall, or a lie its
    audits showed: guarded.py), which costs rounds rather than a ban."""
    named = {name for log in run.records for r in log for name in r.get("stalled_peers", ())}
    return len(named & set(run.honest))


def counted_with(log: Records, members: set[str], after: float = -math.inf) -> int:
    """Rounds this peer applied with one of `members` in its group and in sync, so that its
    update was averaged in (bounded by the robust aggregation; at most: a reducer that named it
    in that round left its part out); an update out of sync is left out (sync.py), as is one
    read only on probation (probation.py, `round_read_only`). `after`: only records whose round
    number is above it (counted_late)."""
    return sum(
        1
        for r in log
        if "round_s" in r
        and int(r.get("round", 0)) > after
        and any(
            ok and name in members and name not in (r.get("round_read_only") or ())
            for name, ok in r.get("round_members") or ()
        )
    )


NEUTRALIZED_WITHIN = 3
"""The issue's bar: the attacker neutralized within this many rounds."""


def counted_late(log: Records, members: set[str], within: int = NEUTRALIZED_WITHIN) -> int:
    """Rounds from round `within` on (counted from 0) that this peer applied with one of
    `members` counted (`counted_with`): its update averaged in after the first `within` rounds,
    whether or not this peer ever named it (one that never met it again after the others left it
    out does not count it; one let back in on probation, exclusion.py, counts its round back).
    Rounds by this peer's own round number, which counts the rounds it landed (or took over with
    a state it downloaded), not those it failed; a landed round's record holds the number of the
    round after it."""
    return counted_with(log, members, after=within)


def rounds_with_attacker(
    log: Records, attacker: str, keys: tuple[str, ...] = ("rejected_peers",)
) -> tuple[int, bool]:
    """(rounds this peer applied with the attacker in its group before it first named it under
    one of `keys`, whether it did)."""
    rounds = 0
    for r in log:
        if any(attacker in r.get(key, ()) for key in keys):
            return rounds, True
        if attacker in r.get("group", ()):
            rounds += 1
    return rounds, False


def neutralized(run: SwarmRun) -> dict[str, Any]:
    """Rounds the attacker was in an honest peer's applied round before that peer rejected it
    (the most over honest peers), and whether every honest peer did."""
    if run.attacker is None:
        return {
            "rounds_until_rejected": None,
            "rejected_by_all": False,
            "rounds_until_left_out": None,
            "left_out_by_all": False,
            "rounds_applied_with_attacker": 0,
            "rounds_counted_with_attacker": 0,
            "rounds_counted_with_attacker_late": 0,
        }
    seen = [rounds_with_attacker(log, run.attacker) for log in run.records]
    either = ("rejected_peers", "stalled_peers")
    out_ = [rounds_with_attacker(log, run.attacker, either) for log in run.records]
    out = {
        "rounds_until_rejected": max(n for n, _ in seen) if all(r for _, r in seen) else None,
        "rejected_by_all": all(r for _, r in seen),
        # or left out for a while (a lying reducer or auditor, a staller): not banned
        "rounds_until_left_out": max(n for n, _ in out_) if all(r for _, r in out_) else None,
        "left_out_by_all": all(r for _, r in out_),
        "rounds_applied_with_attacker": max(
            sum(1 for r in log if run.attacker in r.get("group", ())) for log in run.records
        ),
        "rounds_counted_with_attacker": max(
            (counted_with(log, {run.attacker, *run.sybils}) for log in run.records), default=0
        ),
        "rounds_counted_with_attacker_late": max(
            (counted_late(log, {run.attacker, *run.sybils}) for log in run.records), default=0
        ),
    }
    if run.sybils:  # rounds an honest peer applied with one of the sybils in its group
        out["rounds_applied_with_sybils"] = max(
            sum(1 for r in log if set(r.get("group", ())) & set(run.sybils)) for log in run.records
        )
    return out


def rounds_applied(run: SwarmRun) -> int:
    """Rounds the honest peer that applied fewest applied (the issue asks for at least 20: enough
    for the outer momentum to matter)."""
    return min((sum(1 for r in log if "round_s" in r) for log in run.records), default=0)


def rounds_failed(run: SwarmRun) -> int:
    """Rounds the honest peer that failed most failed (a stall should cost one per stall)."""
    return max((sum(1 for r in log if "failed_round_s" in r) for log in run.records), default=0)


def failed_round_s(run: SwarmRun) -> float | None:
    """The median wall time of the honest peers' failed rounds, from each round's start (what a
    stall holds a round for); None when none failed."""
    times = [r["failed_round_s"] for log in run.records for r in log if "failed_round_s" in r]
    return statistics.median(times) if times else None


def lost_attempt_cost(run: SwarmRun) -> dict[str, Any]:
    """What the rounds whose all-reduce was lost (a stall ends one; its group runs again without the
    staller, peer/redo.py, or hivemind retries with another group, if time allows) cost the
    honest peers, in rounds: a round that landed after a retry, its wall time over the median of
    the rounds that landed at their first attempt, less one; a round that failed after running
    an all-reduce, its whole wall time over that median (nothing of it landed; its progress goes
    with the next round). The issue's bar: a stall costs at most one round. Rounds that found no
    group (attempts 0) are not counted; rounds whose all-reduce ran and was not applied (a pair
    short of the quorum, a discard) are, in clean runs too (`clean_lost_attempt_cost`)."""
    typical = [
        r["round_s"] for log in run.records for r in log
        if "round_s" in r and r.get("round_attempts") == 1
    ]  # fmt: skip
    landed = [
        r["round_s"] for log in run.records for r in log
        if "round_s" in r and r.get("round_attempts", 0) > 1
    ]  # fmt: skip
    failed = [
        r["failed_round_s"] for log in run.records for r in log
        if "failed_round_s" in r and "round_s" not in r and r.get("round_attempts", 0) >= 1
    ]  # fmt: skip
    if not typical or not (landed or failed):
        return {"n": len(landed) + len(failed)}
    base = statistics.median(typical)
    costs = sorted([t / base - 1.0 for t in landed] + [t / base for t in failed])
    return {"n": len(costs), "median": statistics.median(costs), "max": costs[-1],
            "typical_round_s": base}  # fmt: skip


def agreement(run: SwarmRun, threshold: float) -> dict[str, Any]:
    """The cosines the honest peers' reducers read (metrics' `agreement`: [name, peer ID,
    cosine, lean] each): of the attacker's update with theirs (and its sybils'), and of each
    other's, with how many of the honest readings fell below `threshold` (where the
    opposing-update rule counts a round against a member); and the leans (exclusion.LEAN)."""

    def summary(values: list[float]) -> dict[str, Any]:
        if not values:
            return {"n": 0}
        ordered = sorted(values)
        return {"n": len(ordered), "min": ordered[0], "median": statistics.median(ordered),
                "max": ordered[-1]}  # fmt: skip

    readings = [
        (who, c, _lean(rest))
        for log in run.records
        for r in log
        for who, _, c, *rest in r.get("agreement", ())
    ]
    honest = [c for who, c, _ in readings if who in run.honest]
    out = {"honest": summary(honest), "honest_below": sum(1 for c in honest if c < threshold)}
    # how far each update, less its component along the reader's, leans one way
    honest_leans = [abs(x) for who, _, x in readings if who in run.honest and x is not None]
    out["honest_lean"] = summary(honest_leans)
    out["honest_lean_at_bar"] = sum(1 for x in honest_leans if x >= LEAN)
    if run.attacker is not None:
        out["attacker"] = summary([c for who, c, _ in readings if who == run.attacker])
        leans = [x for who, _, x in readings if who == run.attacker and x is not None]
        out["attacker_lean"] = summary(leans)
    if run.sybils:  # the member's other identities
        out["sybils"] = summary([c for who, c, _ in readings if who in run.sybils])
    return out


def _lean(rest: list[Any]) -> float | None:
    """A reading's lean (metrics' fourth field, robust.RobustReducer.leans: read two ways, and
    none in a pair, since 0bb4806; one way (less the component along the reader's update) from
    8d7317d to 0f3e718, times the sine of the angle at b3a5986; the plain difference at e37b844
    and c7f7c2a; None where not read)."""
    return float(rest[0]) if rest and rest[0] is not None else None


def follow_replay(run: SwarmRun) -> dict[str, Any]:
    """The update rules (exclusion.LeftOut: opposing, leaning, following) replayed on each
    honest peer's readings as its metrics kept them: how many honest (reader, member) pairs the
    replay leaves out for not following (`honest_left_out_for_following`) and for leaning
    (`honest_left_out_for_leaning`), and at which of each honest peer's logged readings of the
    attacker it leaves it out by any rule (`attacker_left_out_at_reading`; null: never).
    Approximate: the metrics keep no try or round-begun count, so a record's readings are
    taken as one try (a member read twice in one record starts another), a round as the
    records of one applied-round count (a failed round's readings go with the next), and
    exclusions for stalls are not replayed."""
    following = leaning = 0
    attacker_at = []
    for log in run.records:
        named, at = _replayed(log, run.attacker)
        attacker_at.append(at)
        for peer, whys in named.items():
            if peer in run.honest:
                following += any(why.startswith(FOLLOW_WHY) for why in whys)
                leaning += any(why.startswith(LEAN_WHY) for why in whys)
    return {
        "honest_left_out_for_following": following,
        "honest_left_out_for_leaning": leaning,
        "attacker_left_out_at_reading": attacker_at,
    }


def _tries(log: list[dict]) -> list[tuple[int, dict[str, tuple[float, float]]]]:
    """(applied-round count, {member: (cosine, lean)}) per try, as far as the records tell them
    apart (lean NaN where not read)."""
    tries: list[tuple[int, dict[str, tuple[float, float]]]] = []
    for r in log:
        row: dict[str, tuple[float, float]] = {}
        for who, _, cosine, *rest in r.get("agreement", ()):
            if who in row:  # read twice in one record: another try
                tries.append((int(r.get("round", 0)), row))
                row = {}
            lean = _lean(rest)
            row[who] = (float(cosine), math.nan if lean is None else lean)
        if row:
            tries.append((int(r.get("round", 0)), row))
    return tries


def _replayed(log: list[dict], attacker: str | None) -> tuple[dict[str, list[str]], int | None]:
    """(member -> why the replay left it out, each time, the reading of `attacker` at which it
    was first) for one honest peer's metrics."""
    named: dict[str, list[str]] = {}

    def tell(peer: str, why: str, kind: str) -> None:
        if kind == "stall":
            named.setdefault(peer, []).append(why)

    ledger = LeftOut(tell, lambda peer: False)
    readings, at, current = 0, None, None
    for rnd, row in [*_tries(log), (None, {})]:
        if rnd != current or rnd is None:
            ledger.next_round()  # (judges the round before)
            current = rnd
        if at is None and attacker in named:
            at = readings
        readings += attacker in row
        ledger.readings({w: c for w, (c, _) in row.items()}, {w: x for w, (_, x) in row.items()})
    return named, at


def spread(values: list[float | None]) -> dict[str, Any]:
    ranked = [math.inf if v is None else v for v in values]
    med = statistics.median(ranked) if ranked else math.inf
    return {
        "median": med if math.isfinite(med) else None,
        "min": min(ranked) if ranked and math.isfinite(min(ranked)) else None,
        "max": max(ranked) if ranked and math.isfinite(max(ranked)) else None,
        "per_seed": values,
    }


def attack_report(
    clean: list[SwarmRun], cases: dict[str, dict[str, list[SwarmRun]]], threshold: float
) -> dict:
    """`threshold`: the cosine below which a reading counts against a member (OPPOSED_COSINE)."""
    clean_loss = spread([final_loss(r) for r in clean])
    reference = clean_loss["median"]
    attacks = []
    for attack, runs in cases.items():
        defended, undefended = runs.get("defended", []), runs.get("undefended", [])
        d = spread([final_loss(r) for r in defended])
        u = spread([final_loss(r) for r in undefended])
        ratio = d["median"] / reference if d["median"] is not None and reference else None
        attacks.append(
            {
                "attack": attack,
                "final_loss_defended": d,
                "final_loss_undefended": u,
                "defended_vs_clean": ratio,
                "defended_within_5pct": ratio is not None and ratio <= 1.05,
                "honest_peers_rejected": max((honest_rejected(r) for r in defended), default=0),
                "honest_peers_left_out": max((honest_left_out(r) for r in defended), default=0),
                "neutralized": [neutralized(r) for r in defended],
                "rounds_applied_defended": [rounds_applied(r) for r in defended],
                "rounds_applied_undefended": [rounds_applied(r) for r in undefended],
                "rounds_failed_defended": [rounds_failed(r) for r in defended],
                "failed_round_s_defended": [failed_round_s(r) for r in defended],
                "lost_attempt_cost_defended": [lost_attempt_cost(r) for r in defended],
                "agreement_defended": [agreement(r, threshold) for r in defended],
                "follow_replay_defended": [follow_replay(r) for r in defended],
            }
        )
    return {
        "clean_final_loss": clean_loss,
        "clean_rounds_applied": [rounds_applied(r) for r in clean],
        "clean_agreement": [agreement(r, threshold) for r in clean],
        "clean_follow_replay": [follow_replay(r) for r in clean],
        "clean_lost_attempt_cost": [lost_attempt_cost(r) for r in clean],
        "opposed_cosine": threshold,
        "attacks": attacks,
        "notes": (
            "final losses: the honest peers' mean last validation loss, median over seeds (a "
            "run that diverged counts as worst); defended_within_5pct: the defended median at "
            "most 5% above the clean median; neutralized, per seed: rounds an honest peer "
            "applied with the attacker in its group before rejecting it (the most over honest "
            "peers; null when some honest peer never rejected it: its influence is then only "
            "bounded by the robust aggregation); rounds_until_left_out: the same, counting an "
            "exclusion for a while as well (lying reducers and auditors, stallers); "
            "rounds_applied_with_attacker: all the rounds an honest peer applied with it in "
            "its group; rounds_counted_with_attacker: the rounds an honest peer applied with "
            "it (or one of its sybils) in its group and in sync, its update averaged in "
            "(clipped; at most: unless its reducer dropped it); "
            "rounds_counted_with_attacker_late: the same from round 3 on (each honest peer's "
            "round number, landed rounds; 0: "
            "neutralized within 3 rounds in effect, whether or not every honest peer named it); "
            "honest_peers_left_out: honest peers "
            "another honest peer excluded for a while; rounds_applied: per seed, the rounds "
            "the honest peer that applied fewest "
            "applied; rounds_failed: per seed, the rounds the honest peer that failed most "
            "failed; failed_round_s: per seed, the median wall time of the honest peers' failed "
            "rounds; lost_attempt_cost, per seed: rounds whose all-reduce was lost, in rounds: "
            "one that landed after a retry, its wall time over the median of rounds that landed "
            "at their first attempt, less one; one that failed after running an all-reduce, "
            "its whole wall time over that median (n, median, max; a stall should cost at most "
            "one round); agreement, per seed: the cosines the honest peers' reducers read of the "
            "attacker's update and of each other's against their own (n, min, median, max), "
            "and how many honest readings fell below opposed_cosine; honest_lean: how far "
            "the honest updates, less their component along the reader's, leaned one way, and "
            "that less how far the reader's, less its component along theirs, did, halved, the "
            "lesser where both lean the same way, else 0 (robust.RobustReducer.leans; as "
            "absolute values; exclusion.LEAN leaves a member out; honest_lean_at_bar: how "
            "many reached it), attacker_lean: the "
            "attacker's (signed); follow_replay, per seed: "
            "the update rules replayed, approximately, on the honest peers' logged readings (a "
            "record's as one try, a round as one applied-round count): honest (reader, member) "
            "pairs the follow rule and the lean rule would leave out, and at which of each "
            "honest peer's logged readings of the attacker any rule would leave it out (null: "
            "never)"
        ),
    }
