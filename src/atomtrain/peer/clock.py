"""When a peer's next round is due: every H local steps, or with H auto at the slots of a clock
every peer shares (whole multiples of a period, unix time, on a ladder of 0.5 s times a power of
two, so that groups holding different periods still meet at the longer one's slots)."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from atomtrain.peer.averaging import RoundResult
    from atomtrain.peer.runtime import PeerRuntime

FIRST_SYNC_EVERY = 10
"""With H auto, the first period is this many steps' time (nothing measured yet), rounded up to
the period ladder so peers of about the same speed propose the same."""
AUTO_MARGIN = 1.25
"""With H auto, the period is this many times the typical round time and a step, plus the time a
round looks for its group before its slot."""
PERIOD_GRAIN_S = 0.5
"""Periods are this times a power of two (the period ladder): proposals of peers alike are
equal, and of two periods the longer's slots are all slots of the shorter, so groups that hold
different periods still meet (at every slot of the longer)."""
SLOT_MARGIN_S = 0.25
"""A round that could look for its group only this long before its slot takes the next slot."""
MAX_PERIOD_S = 3600.0
RECENT_STEPS = 1000
"""Steps whose wall time start_lag_s looks at: evaluations and checkpoints at their default
intervals (100 and 200 steps) among them."""


class RoundClock:
    def __init__(self, peer: PeerRuntime) -> None:
        self.peer = peer
        self.sync_every = peer.cfg.fixed_sync_every or FIRST_SYNC_EVERY
        self.proposal = self.sync_every
        self.period_s = 0.0
        """With H auto: seconds between round slots (0 until the first steps are timed)."""
        self.proposal_s = 0.0
        self.next_round_at = 0.0
        self.round_slot = 0.0
        """The slot (unix seconds) the last round started at."""
        self.step_s = 0.0
        self._last_step_at = 0.0
        self._round_times: deque[float] = deque(maxlen=5)
        self._recent_steps: deque[float] = deque(maxlen=RECENT_STEPS)
        self._steps_timed = 0

    def step_ended(self) -> None:
        """A local step ended: wall time per step, evaluation and rounds included."""
        now = time.perf_counter()
        if self._last_step_at:
            dt = now - self._last_step_at
            self.step_s = dt if not self.step_s else 0.8 * self.step_s + 0.2 * dt
            self._steps_timed += 1
            if self._steps_timed > 2:  # (the first steps warm up: compiled kernels, caches)
                self._recent_steps.append(dt)
        self._last_step_at = now

    def start_lag_s(self) -> float:
        """How late after its slot this peer may start a round's all-reduce: a prepared round
        writes its contribution at the first step boundary past the slot, so its longest recent
        step (an evaluation's included); 0 where the contribution is written before matchmaking.
        The group waits about this long for it (exact.start_timeouts) before ending the round."""
        return max(self._recent_steps, default=0.0) if self.prematched() else 0.0

    def slot_due(self) -> bool:
        """With H auto: the shared clock reached this peer's next round slot."""
        now = time.time()
        if not self.period_s:
            if self.peer.steps_since_round < FIRST_SYNC_EVERY or not self.step_s:
                return False
            swarm = [s.period_s for s in self.peer.presence.known_others]
            self.period_s = self.proposal_s = first_period(self.step_s, swarm)
        if not self.next_round_at:
            self.next_round_at = next_slot(now + self.lead(), self.period_s)
        if now + self.lead() < self.next_round_at:
            return False
        if self.prematched() and now + SLOT_MARGIN_S > self.next_round_at:
            # too late to find a group for this slot: the next one
            self.next_round_at = next_slot(now + self.lead(), self.period_s)
            return False
        return True

    def prematched(self) -> bool:
        """Rounds on the shared clock find their group before their slot and write their
        contribution at it (H auto, overlapped rounds)."""
        cfg = self.peer.cfg
        return not cfg.fixed_sync_every and cfg.sync_mode == "async" and not self.peer._final

    def lead(self) -> float:
        """How long before its slot a round looks for its group."""
        return self.peer.cfg.matchmaking_s if self.prematched() else 0.0

    def choose_sync_every(self, result: RoundResult, round_s: float) -> None:
        """With H auto: the period is the rung of the ladder (on_ladder) of the largest period the
        round's members proposed (what each sent, so every member computes the same); this
        peer's next proposal follows its round time."""
        cfg = self.peer.cfg
        if cfg.fixed_sync_every:
            return
        lo = cfg.min_sync_every * self.step_s
        hi = cfg.max_sync_every * self.step_s or math.inf
        proposals = []
        for g in result.peers:
            try:
                p = float(g.get("period_s", 0.0))
            except (TypeError, ValueError):
                continue
            if math.isfinite(p) and p > 0:
                proposals.append(min(p, MAX_PERIOD_S))  # no member can stall the swarm
        period = on_ladder(max(proposals)) if proposals else self.period_s
        if period != self.period_s:
            self.period_s = period
            self.next_round_at = next_slot(time.time() + self.lead(), period)
        self._round_times.append(round_s)
        typical = statistics.median(self._round_times)  # one slow round does not stretch H
        # a period holds the round, the step its slot waits for, and the next round's matchmaking
        need = AUTO_MARGIN * (typical + self.step_s) + self.lead()
        self.proposal_s = on_ladder(max(need, lo), below=min(hi, MAX_PERIOD_S))
        if self.proposal_s < lo:  # no rung within [lo, hi]: the shortest H allowed wins
            self.proposal_s = on_ladder(lo)
        if self.step_s:  # H, for the status table: local steps a period holds
            self.proposal = self.sync_every = max(1, round(period / self.step_s))


def on_ladder(seconds: float, below: float = MAX_PERIOD_S) -> float:
    """`seconds` rounded up to the period ladder (PERIOD_GRAIN_S times a power of two), or
    the longest rung at most `below` when that is shorter (never less than PERIOD_GRAIN_S).
    With the rungs 0.5 s apart instead, two pairs of a 4-peer swarm that had split held 3.5
    and 4 s, whose slots met every 28 s: they trained as two swarms whose synchronized
    parameters differed, and each meeting sent one pair to download the other's state."""
    if not seconds <= below:  # NaN, inf, or beyond the cap
        seconds = below
    rung = max(math.ceil(math.log2(max(seconds, PERIOD_GRAIN_S) / PERIOD_GRAIN_S) - 1e-9), 0)
    while rung > 0 and PERIOD_GRAIN_S * 2**rung > below:
        rung -= 1
    return PERIOD_GRAIN_S * 2**rung


def first_period(step_s: float, swarm: list[float]) -> float:
    """A starting peer's period: the swarm's (the median of the periods the live peers last
    published), or, in a swarm starting at once, FIRST_SYNC_EVERY steps' time on the ladder.
    Peers whose step times differ a little then mostly start on the same period, and where
    one's is twice another's, each of its slots is also a slot of the other's: they meet there
    and take the group's period. (Rounded to PERIOD_GRAIN_S only, 4 peers started at once
    first met in two groups of 2, one pair on a period of about 12 steps and the other of
    about 23, whose synchronized parameters then differed.)"""
    published = [p for p in swarm if 0 < p <= MAX_PERIOD_S]
    if published:
        return on_ladder(statistics.median_low(published))
    return on_ladder(FIRST_SYNC_EVERY * step_s)


def next_slot(now: float, period: float) -> float:
    """The first multiple of `period` (unix seconds) after `now`: the same on every peer."""
    return (math.floor(now / period) + 1) * period
