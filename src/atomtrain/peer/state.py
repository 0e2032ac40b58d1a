"""Checks of a downloaded swarm state before it replaces anything: its form, its round, and (when
defended) that it is what most peers hold (agreement.py)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import torch

from atomtrain.peer.agreement import RoundDigest, disagreement, members_only, read_records
from atomtrain.peer.status import PeerStatus
from atomtrain.peer.sync import lower_median

if TYPE_CHECKING:
    from atomtrain.peer.runtime import PeerRuntime


class StateCheck:
    def __init__(self, peer: PeerRuntime) -> None:
        self.peer = peer
        self.numel = peer.numel
        self.defend = peer.cfg.defend

    @staticmethod
    def swarm_round(statuses: list[PeerStatus]) -> int:
        """The round most live peers are at (the median: one peer cannot claim a false one)."""
        return int(lower_median([s.round for s in statuses]))

    def records(self) -> dict[str, list[RoundDigest]]:
        """What the other peers published they hold (a DHT read)."""
        peer = self.peer
        assert peer.dht is not None
        records = read_records(peer.dht, peer.cfg.swarm, exclude=peer.presence.subkey)
        return members_only(records, peer.presence.roster(fresh=True))

    def problem(
        self,
        state: Any,
        min_round: int = 0,
        records: dict[str, list[RoundDigest]] | None = None,
    ) -> str | None:
        """Why a downloaded state must not be used, or None when it passes every check.
        `records`: the other peers' published digests (read now when not given)."""
        if state is None:
            return "no peer shared it"
        try:
            meta, tensors = state
            tensors = list(tensors)
        except (TypeError, ValueError):
            return "malformed state"
        if not isinstance(meta, dict) or not isinstance(meta.get("round"), int):
            return "malformed metadata"
        if not isinstance(meta.get("step", 0), int):
            return "malformed metadata"
        if len(tensors) != 2:
            return f"{len(tensors)} tensors instead of 2"
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                return "malformed state"
            if t.dtype != torch.float32 or t.shape != (self.numel,):
                return f"a tensor of {t.dtype} {tuple(t.shape)}, expected float32 ({self.numel},)"
            if not bool(torch.isfinite(t).all()):
                return "non-finite values"
        if not self.defend:
            return None
        if meta["round"] < min_round:
            return f"the serving peer is behind (round {meta['round']})"
        records = self.records() if records is None else records
        return disagreement(meta["round"], tensors[0], tensors[1], records)


def resync_floor(claimed_rounds: list[Any], swarm_round: int | None = None) -> int:
    """The oldest round a re-synchronizing member accepts a download at: the largest round its
    group's members claimed (its own included), capped at `swarm_round` (the round most live
    peers' signed statuses give, StateCheck.swarm_round), and never below the lower median of
    the claims (a status claiming round 0 does not lower it). The largest claim alone would let
    one member, claiming a huge round, make every download look behind, so that its victim never
    re-synchronizes."""
    rounds = []
    for r in claimed_rounds:
        try:
            rounds.append(max(int(r), 0))
        except (TypeError, ValueError, OverflowError):
            continue  # malformed: no claim
    if not rounds:
        return 0
    floor = int(lower_median(rounds))
    if swarm_round is None:
        return floor
    return max(floor, min(max(rounds), swarm_round))


def swarm_schedule_step(
    served: Any, served_round: Any, statuses: list[PeerStatus], total_steps: int, own: int
) -> int:
    """Where a peer that took a downloaded state continues its learning-rate schedule: the lower
    median of the schedule steps published by the live members that hold the swarm's progress
    (at the served state's round or one short of it: not joiners still catching up), signed
    records, one a member, so that with two or more honest ones among them no single member
    moves it past theirs; the serving peer's own figure where none qualifies; this peer's own
    where neither; within [0, total_steps]. The served figure alone would let one serving peer
    set a joiner's learning rate (a step of 10^9: the schedule's floor; a negative one: warmup
    again)."""
    floor = served_round - 1 if isinstance(served_round, int) else 0
    published = [s.schedule_step for s in statuses if s.round >= floor]
    if published:
        step = int(lower_median([float(x) for x in published]))
    elif isinstance(served, int) and not isinstance(served, bool):
        step = served
    else:
        step = own
    return min(max(step, 0), max(total_steps, 0))


def download_sources(statuses: list[PeerStatus], own_peer_id: str = "") -> list[str]:
    """Whom to download the swarm's state from, best first: the most advanced peers, each one's
    claimed round capped at the round most live peers are at (so one member claiming a huge
    round is no better a source than an honest peer), ties in random order."""
    others = [s for s in statuses if s.peer_id and s.peer_id != own_peer_id]
    if not others:
        return []
    cap = StateCheck.swarm_round(others)
    ranked = sorted(others, key=lambda s: (min(s.round, cap), random.random()), reverse=True)
    return [s.peer_id for s in ranked]
