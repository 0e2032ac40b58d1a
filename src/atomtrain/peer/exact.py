"""Every member of a round ends with the same bits of the average.

hivemind's reducer sends each member `average - that member's part`, compressed, and the member
adds it to its own part: each ends with its own value plus the rounding of its own difference, so
members never hold identical averages (and, applying them round after round, drift apart).
Here the reducer sends the average itself, through the codec of the part (the same bytes to every
member), and takes its own span through that codec too. Every member then applies the same
values: their synchronized parameters and outer momentum stay bit-identical on the same
hardware, so a member that holds other ones (a missed round, a stale model) stands out in every
round, not only the first (sync.py).

The runner's output is the average itself, not a difference: the averager copies it into its
tensors. A reducer that fails leaves the member's own part in its span, which the probes show
(averaging.py).

A round that is lost ends at once (end_early): a member that reduces a span and has not even opened
its stream to this member by its start timeout (`start_timeouts`: a second, plus one and a half
times the lag it declares, its longest recent step where rounds write their contribution at the
first step past their slot, capped at 4 times the group's median lag; in 60 clean rounds of bench
attack every member's first part came within 0.65 s of this member's start), or has opened it
and sent no part within its first-part timeout after this member's gate let it in
(`first_part_timeouts`: the same second, plus three times the longest its first part took in its
latest rounds here, so a slow link sets its own; a member not seen sending parts yet: the lower
median of the others' longest, this round's first parts included), or has sent some of this
member's span's parts and then none within that first-part timeout (_watch_next_parts), or has
sent nothing by the sender timeout (its span will have no average) ends it there rather than at
the reducer timeout; so does a reducer that sent its parts
yet, once every other span's averages came, has sent none of its own for its start timeout (a
member frozen after sending its parts: rounds of 13.6 s where 3 s is typical in bench attack). A
round that looked for its group when it was due then runs the same group again at once without
the members whose silence ended it (`ended_over`, redo.py), where they make the round's quorum,
and otherwise looks for another group, within the round's time; a round prepared for a slot
fails, and the next slot comes. A try every other member has left (each answered it is
not in the group, or its span failed here) ends at once too, over those never heard from
(_end_if_deserted); a try hivemind cuts off at its timeout logs what it still waited for
(`waiting_on`).

It also tells who stalled the round (`on_stall`): a member that joined the group but sent none of
its parts until the reducer timeout (hivemind leaves its parts out after its sender timeout; where
the round ended early, parts that came after it still count as sent), or a reducer that sent no
averages within the reducer timeout, counted from this member's start, whether or not the round
ended early (a slow one then costs a round, and is not named; nor is one that, asked then for its
span, says it is not in the group: _name_if_no_averages). (A member that crashed looks the same;
the averager excludes either for a while.) Where the group's leader sent nothing either, only the
leader is named: it may never have told the others (silent_members). A reducer is not named for
late averages in a round where another member sent this one nothing: it may have waited for that
member's parts, from its own, later start of the round. A member that answers it is not in the
group is not named: an honest one that missed its leader's word (guarded.py, _group_runner) says
so, and a member that refuses its span this way spoils the round as it could by sending its parts
and refusing only its span, which never names anyone either.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.partition import BannedException
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import amap_in_executor

from atomtrain.peer.redo import is_redo
from atomtrain.peer.traffic import CountedRunner

log = logging.getLogger(__name__)

NO_WEIGHT = 1e-30
"""What a part that weighs nothing adds to a reducer's denominator: far below any sender's weight
(hivemind's floor is 1e-6), so no average's bits change, yet never 0/0."""

START_FLOOR_S = 1.0
"""How long after this member's all-reduce starts every member that reduces a span must have
opened its stream of parts to it, besides START_LAGS times the lag that member declares (the
default of `peer.start_timeout_s`)."""
START_LAGS = 1.5
"""Times the start lag a member declares (`start_lag_s`: its longest recent step, where it
writes its contribution at the first step past its slot; 0 where it wrote it before
matchmaking)."""
LAG_CAP = 4.0
"""No member's lag counts for more than this many times the group's lower median lag: a member
that declares an absurd lag, or none, cannot keep its own silence from ending the round early
(only the sender timeout would end it)."""


FIRST_PART_TIMES = 3.0
"""A member that opened its stream of parts to this one is waited for this many times the longest
its first part took to come after this member's gate let its stream in, in its latest rounds
(FIRST_PARTS_KEPT),
besides the start timeout's floor, before the round ends as lost (first_part_timeouts)."""
FIRST_PARTS_KEPT = 8
"""A member's latest first-part delays kept per peer (guarded.py)."""


def first_part_timeouts(
    delays: dict[Any, Collection[float]], members: Collection[Any], floor: float = START_FLOOR_S
) -> dict[Any, float]:
    """How long after this member's gate let its stream of parts in each of `members` may take
    to send its first part before the round ends (ExactAverageRunner): the floor plus
    FIRST_PART_TIMES times the longest of its latest delays (`delays`: seconds from a stream let
    in to its first part, per peer, as this member measured them), so a slow link is held to its
    own. A member
    with none measured (new here, or one that never sent a part: bench attack's staller, frozen
    in every group it joins) is held to the lower median, over the peers measured, of each one's
    slowest (no one peer's slow parts set it for everyone), once two peers are measured (one
    peer's fast parts alone do not set it; of two, the faster does); else none (the sender
    timeout). A new member slower than that loses the round it first joins
    (not named: its parts still come), and is timed by its own from then on (its part, late for
    that round, measured: guarded.py, _late_first_part). A member can still lengthen its own
    timeout, up to the sender timeout, with a slow first part in a round it is in (that round
    waits for it), or one late for a round ended over it (a stall that cost that round): no
    worse than the sender timeout it had before."""
    longest = sorted(max(d) for d in delays.values() if d)
    typical = longest[(len(longest) - 1) // 2] if len(longest) >= 2 else None
    timeouts = {}
    for peer in members:
        own = delays.get(peer)
        slowest = max(own) if own else typical
        if slowest is not None:
            timeouts[peer] = floor + FIRST_PART_TIMES * slowest
    return timeouts


def start_timeouts(users: list[dict[str, Any]], floor: float = START_FLOOR_S) -> list[float]:
    """Each member's start timeout, in group order (ExactAverageRunner), from what the members
    declared: the same on every member that uses the same `floor`."""
    lags: list[float] = []
    for user in users:
        try:
            lag = float(user.get("start_lag_s", math.inf))
        except (TypeError, ValueError):
            lag = math.inf
        lags.append(lag if lag >= 0 else math.inf)  # (NaN too)
    valid = sorted(x for x in lags if math.isfinite(x))
    cap = LAG_CAP * valid[(len(valid) - 1) // 2] if valid else 0.0
    return [floor + START_LAGS * min(lag, cap) for lag in lags]


WATCH_S = 0.05
"""How often a member looks whether one reducer alone has sent no averages (_silent_reducer), a
sender stopped partway through its span (_watch_next_parts), or a member with no first-part
timeout got one (_overdue)."""

NOT_IN_GROUP = f" sent {averaging_pb2.MessageCode.Name(averaging_pb2.BAD_GROUP_ID)}"
"""How hivemind's error ends when a reducer answers that it is not in the group."""


class ExactAverageRunner(CountedRunner):
    def __init__(
        self,
        *,
        on_stall: Callable[[Any, str], None] | None = None,
        leader: Any = None,
        out_of_sync: Collection[Any] = (),
        delta_keys: Collection[int] = (),
        heard: set[Any] | None = None,
        opened: dict[Any, float] | None = None,
        admitted: dict[Any, float] | None = None,
        since: float = 0.0,
        start_timeouts: Collection[float] = (),
        first_part_timeouts: dict[Any, float] | None = None,
        first_part_delays: dict[Any, Collection[float]] | None = None,
        first_part_floor: float = START_FLOOR_S,
        on_part_gap: Callable[[Any, float], None] | None = None,
        **kwargs: Any,
    ):
        """`out_of_sync`: members whose synchronized parameters differ from the group's
        (sync.py), whose parts of the tensors keyed `delta_keys` weigh nothing here. Their
        update holds all their progress since the last round they applied, which the others
        averaged in already when they applied that round: averaged in again, it lands twice, and
        again each round until the member re-synchronizes. (The robust reducer leaves them out
        by itself; this is for an undefended round.) `leader`: the member that formed the group
        and told the others of it (finalize). `opened`: when each peer last opened a stream of
        parts to this member (monotonic seconds), `admitted` when this member's gate last let one
        in (its first part is timed from there), `since` when this member's previous group
        ended; `start_timeouts`, in group order: how long after this runner's start each member
        that reduces a span may take to open its stream before the round ends (end_early; none:
        only at the sender timeout); `first_part_timeouts`: how long after `admitted` each may
        take to send its first part; `first_part_delays` (kept up to date as parts come, this
        round's too) and `first_part_floor` give a member without one a timeout as the round
        goes on (first_part_timeouts: the others' typical once some first part was measured, in
        a new swarm's first round too; none: until the sender timeout); `on_part_gap` is told,
        once a sender's stream of this member's span has brought every part, the longest this
        member's span waited for one of its next parts (guarded.py keeps it with its first
        parts' delays: a slow link's gaps set its own timeout as its first parts do)."""
        super().__init__(**kwargs)
        self._leader = leader
        self.tensor_part_container.return_deltas = False  # a failed reducer: our own part
        self._on_stall = on_stall
        own = self.tensor_part_container._input_parts_by_peer[
            self.ordered_peer_ids.index(self.peer_id)
        ]
        delta_parts = [info.key in delta_keys for _, info in own]
        self._weighs_nothing = [
            [p in out_of_sync and is_delta for is_delta in delta_parts]
            for p in self.sender_peer_ids
        ]
        self._delivered: set[Any] = set()  # reducers that sent this member any average (of theirs)
        self._not_in_group: set[Any] = set()  # members that answered they are not in it
        self._ended_over: set[Any] = set()  # the members whose silence ended it early
        self._started = time.monotonic()
        self._unheard: set[Any] = set()  # members that had sent nothing as it ended early
        # members whose parts reached this member's averager for this group, whenever they came
        # (before this member started it, or after it ended: guarded.py records them)
        self._heard_late: set[Any] = set() if heard is None else heard
        self._opened: dict[Any, float] = {} if opened is None else opened
        self._admitted: dict[Any, float] = {} if admitted is None else admitted
        self._since = since
        self._start_timeout = dict(zip(self.ordered_peer_ids, start_timeouts, strict=False))
        self._first_part_timeout = dict(first_part_timeouts or {})
        self._first_part_delays = {} if first_part_delays is None else first_part_delays
        self._first_part_floor = first_part_floor
        self._on_part_gap = on_part_gap
        self.ended_at = math.inf  # when this member's round of the group ended (monotonic)
        self._verdict: asyncio.Task | None = None
        # reducers whose silence ended the round early: their verdicts (_name_if_no_averages)
        self._late: dict[Any, asyncio.Future] = {}
        # senders of this member's span whose next part is awaited now: since when (monotonic)
        self._awaited: dict[int, float] = {}
        container = self.tensor_part_container
        register, fall_back = container.register_processed_part, container.register_failed_reducer
        self._failed: set[int] = set()  # reducers whose span now holds this member's own part
        failed = self._failed

        def registered(peer_index: int, part_index: int, part: Any) -> None:
            if peer_index not in failed:  # hivemind registers the stand-ins the same way
                self._delivered.add(self.ordered_peer_ids[peer_index])
            register(peer_index, part_index, part)

        def reducer_failed(peer_index: int) -> None:
            failed.add(peer_index)
            fall_back(peer_index)

        container.register_processed_part = registered
        container.register_failed_reducer = reducer_failed

    @property
    def over(self) -> bool:
        """This member's round of the group has ended: a part that comes now is not waited for
        (guarded.py answers that this member is not in the group)."""
        return self._future.done()

    def _weighed(self, sender_index: int, part_index: int, part: Any, weight: float) -> Any:
        """(part, weight) as this reducer adds it. One that weighs nothing goes in as zeros
        with a weight too small to change any average's bits (where every other sender of the
        span failed, zeros, not 0/0; and an infinite value adds no NaN)."""
        row = self._weighs_nothing[sender_index]  # (a sender's extra parts fail in hivemind)
        if part_index < len(row) and row[part_index]:
            return torch.zeros_like(part), NO_WEIGHT
        return part, weight

    def finalize(self, **kwargs: Any) -> None:
        """A member hivemind dropped for sending nothing within its sender timeout is named a
        staller only if it sent nothing until this member's all-reduce ended. One that was merely
        late (its own process slow to start the round) has begun by then: its parts came too late
        to count, but it did not stall the round. (Named at once, an honest peer on a loaded
        machine was left out of the next two rounds as if it had.) Where the group's leader is
        silent too, only the leader is named (silent_members). A round cancelled (this peer
        shutting down: GuardedAverager._shutdown) names no one."""
        if not self._future.done() and isinstance(kwargs.get("exception"), asyncio.CancelledError):
            try:  # (hivemind cancels a try at its timeout, `averaging_timeout_s`, per try)
                log.info("a try cut off at its timeout: %s", self.waiting_on())
            except Exception as e:  # (what it logs must never keep the round from ending)
                log.info("a try cut off at its timeout (%r describing it)", e)
        if not self._future.done() and not kwargs.get("cancel"):
            self.ended_at = time.monotonic()
            silent = [p for p in self._silent() if p not in self._unheard]
            for peer_id in silent_members(silent, self._leader):
                self._stalled(peer_id, "sent none of its parts")
        super().finalize(**kwargs)

    def waiting_on(self) -> str:
        """What this member's try waits for now, per other member: its parts of this member's
        span come in (`parts` received of the span's, `banned` as a sender: its parts left out),
        the averages of its own span (`averages`, `failed`: its span holds this member's own
        part), and whether it answered it is not in the group. Logged where a try is cut off
        before it ends: hivemind cancels it at its timeout (`averaging_timeout_s`, 15 s in bench
        attack, counted from the try's start), a whole round lost for its members and the quorum
        of the others (bench attack's logs: an honest peer's try ran there in 20 of 328
        swarm-peers, in clean swarms too, with nothing logged on why)."""
        container, reducer = self.tensor_part_container, self.tensor_part_reducer
        received = getattr(reducer, "num_parts_received", None) or []
        said = [f"{time.monotonic() - self._started:.1f} s in"]
        if reducer.num_parts and received:
            said.append(f"own span {sum(received)}/{reducer.num_parts * len(received)} parts")
        for index, peer_id in enumerate(self.ordered_peer_ids):
            if peer_id == self.peer_id:
                continue
            words = []
            if peer_id in self.sender_peer_ids:
                sender = self.sender_peer_ids.index(peer_id)
                if reducer.num_parts and sender < len(received):
                    words.append(f"parts {received[sender]}/{reducer.num_parts}")
                if peer_id in self.banned_senders:
                    words.append("banned")
            spans = container.num_parts_by_peer[index]
            if spans:
                if index in self._failed:
                    words.append("failed")
                else:
                    averaged = container._outputs_registered_by_peer[index]
                    words.append(f"averages {averaged}/{spans}")
            if peer_id in self._not_in_group:
                words.append("not in the group")
            said.append(f"{_names([peer_id])}: {' '.join(words) or 'nothing'}")
        return "; ".join(said)

    def _silent(self) -> list[Any]:
        """Members hivemind dropped for sending nothing within the sender timeout that have
        sent this member nothing since."""
        return [p for p in self._unheard_now() if p in self.banned_senders]

    def _unheard_now(self) -> list[Any]:
        """Other members that have sent this member nothing of the round so far."""
        return [
            peer_id
            for peer_id in self.sender_peer_ids
            if peer_id != self.peer_id
            and not (self._heard_from(peer_id) or peer_id in self._not_in_group)
        ]

    def _heard_from(self, peer_id: Any) -> bool:
        """`peer_id` sent this member something of the round, whenever it came: its parts, or
        averages of its span (which may beat its parts here): it ran the round."""
        return (
            peer_id in self.active_senders
            or peer_id in self._delivered
            or peer_id in self._heard_late
        )

    async def _handle_missing_senders(self) -> None:
        """hivemind's, with the round ended (end_early) where it has become all but sure to be
        lost (_overdue): at a member's start timeout, where it reduces a span and has not even
        opened its stream to this member (its contribution was due within its declared lag); at
        its first-part timeout after it opened it, where it has sent no part (frozen as it began:
        its first part, measured in its earlier rounds, would have come); at the sender timeout,
        where such a member has sent nothing. Where no first part was measured here at all (a
        new swarm's first round), a member is waited for until the sender timeout, or until some
        member's first part comes and gives it a timeout: its parts may still be on their way
        over a slow link. A sender that stopped partway through this member's span is watched
        meanwhile (_watch_next_parts)."""
        tasks = {asyncio.ensure_future(self._end_if_overdue())}
        tasks.add(asyncio.ensure_future(self._watch_next_parts()))
        for task in tasks:
            task.add_done_callback(_retrieved)
        try:  # until both end, or the round does (one of them ended it, or a reducer did)
            while tasks and not self._future.done():
                await asyncio.wait((*tasks, self._future), return_when=asyncio.FIRST_COMPLETED)
                tasks = {task for task in tasks if not task.done()}
        finally:
            for task in tasks:
                task.cancel()

    async def _end_if_overdue(self) -> None:
        sender_timeout = math.inf if self.sender_timeout is None else self.sender_timeout
        while True:
            due, why, then = self._overdue(sender_timeout)
            if due:
                self.end_early(why, due)
                return
            if then >= sender_timeout or not await self._unstarted_by(then):
                break
            if time.monotonic() - self._started - then > 2 * WATCH_S:
                # woke late (this member's own process stopped or starved): parts that came
                # meanwhile may still wait in its handlers, not yet heard; let them in first
                await asyncio.sleep(WATCH_S)
        if await self._unstarted_by(sender_timeout):
            for peer_id in self.sender_peer_ids:  # hivemind's: their parts are left out
                if peer_id not in self.active_senders and peer_id not in self.banned_senders:
                    await self._ban_sender(peer_id)
        reducing = self._reducing(self._silent())
        if reducing:
            self.end_early(f"{_names(reducing)} sent nothing within the sender timeout", reducing)

    def _overdue(self, sender_timeout: float) -> tuple[list[Any], str, float]:
        """The members that reduce a span and whose silence is overdue now (end_early over
        them), why, and when to look again (seconds from this runner's start: the earliest
        timeout still to come; a stream that opens meanwhile is timed from the next look, at the
        latest its member's start timeout, so it may end the round a little late, never early). A
        member that opened no stream this round is due at its start timeout; one whose stream of
        parts this member's gate let in and that has sent no part on it, at its first-part
        timeout after that (`admitted` holds only streams still waiting for their first part:
        a stream that brought a late part of an earlier group times nothing), whenever this
        member started the round (members that started it apart end it together)."""
        now = time.monotonic() - self._started
        unopened: dict[Any, float] = {}
        unsent: dict[Any, float] = {}
        then = sender_timeout
        for peer_id in self._reducing(self._unheard_now()):
            start = self._start_timeout.get(peer_id, math.inf)
            first = self._first_part_allowed(peer_id)
            if not self._contacted(peer_id):
                due, into, waited = start, unopened, start
            elif first is None:  # until the sender timeout, or a first part measured meanwhile
                then = min(then, now + WATCH_S)
                continue
            elif self._admitted.get(peer_id, -math.inf) <= self._since:
                # the gate still checks its stream, or that stream brought a part of another
                # group: not timed (look again soon: a stream let in now is)
                then = min(then, now + WATCH_S)
                continue
            else:
                admitted = self._admitted[peer_id] - self._started
                due, into, waited = admitted + first, unsent, first
            if due <= now:
                into[peer_id] = waited
            else:
                then = min(then, due)
        whys = []
        if unopened:
            whys.append(
                f"{_names(list(unopened))} opened no stream in {max(unopened.values()):.1f} s"
            )
        if unsent:
            whys.append(
                f"{_names(list(unsent))} opened a stream, no part in {max(unsent.values()):.1f} s"
            )
        return [*unopened, *unsent], "; ".join(whys), then

    async def _watch_next_parts(self) -> None:
        """Ends the round (end_early) over a member that reduces a span and sent some of this
        member's span's parts, then none for its first-part timeout (`first_part_timeouts`:
        parts of a span are alike, and each is sent as the one before it goes, so none takes
        longer than a first one). hivemind waits for it until the sender timeout (5 s in bench
        attack, two rounds: run FP5's dearest stalls), and its span will not have its averages
        anyway while it stays frozen. The members it opened its streams to and froze before
        sending a part end the round over it at about the same time (their first-part
        timeouts), so all run the redo (run NP1, a05448e, which only left it out of the span's
        rest: this member ran on, and the others' redo ended over it). A sender idle here is
        always the one the span waits for: each part's average returns to its handler only once
        every sender's part came. A member that reduces no span is waited for until the sender
        timeout, as before (then left out of the rest of the span, hivemind's partial average):
        cut sooner, it would fail its own audit and keep other reducers waiting, and an honest
        reducer could be ended over for it. (A member that received all of the staller's parts
        for its span sees nothing amiss until the others' ends fail its round: it joins no
        redo.)"""
        reducer = self.tensor_part_reducer
        looked = time.monotonic()
        while not (self._future.done() or reducer.finished.is_set()):
            await asyncio.wait((self._future,), timeout=WATCH_S)  # (ends with the round)
            now = time.monotonic()
            late, looked = now - looked > 3 * WATCH_S, now
            if late:  # this process was stopped or starved: parts may wait in its handlers
                for sender_index in self._awaited:  # (its own pause is no sender's delay)
                    self._awaited[sender_index] = now
                continue
            for sender_index, since in list(self._awaited.items()):
                peer_id = self.sender_peer_ids[sender_index]
                allowed = self._first_part_allowed(peer_id)
                if allowed is None or now - since < allowed or not self._reducing([peer_id]):
                    continue
                received = reducer.num_parts_received[sender_index]
                self.end_early(
                    f"{_names([peer_id])} sent {received} of its {reducer.num_parts} parts, "
                    f"then none in {allowed:.1f} s",
                    [peer_id],
                )
                return

    def _first_part_allowed(self, peer_id: Any) -> float | None:
        """`peer_id`'s first-part timeout: as the round began, or where it had none then (none
        of its own measured, nor two other peers'), from the delays measured since, this round's
        first parts included (None: the sender timeout)."""
        allowed = self._first_part_timeout.get(peer_id)
        if allowed is None and self._first_part_delays:
            delays, floor = self._first_part_delays, self._first_part_floor
            allowed = first_part_timeouts(delays, [peer_id], floor).get(peer_id)
        return allowed

    async def _unstarted_by(self, seconds: float) -> bool:
        """Whether some sender has not started by `seconds` after this runner's start."""
        if self.all_senders_started.is_set():
            return False
        left = self._started + seconds - time.monotonic()
        try:
            wait = None if left == math.inf else max(left, 0.0)
            await asyncio.wait_for(self.all_senders_started.wait(), wait)
        except asyncio.TimeoutError:
            return True
        return False

    def _reducing(self, peers: list[Any]) -> list[Any]:
        """Those of `peers` that reduce a span of this round."""
        counts = self.tensor_part_container.num_parts_by_peer
        return [p for p in peers if counts[self.ordered_peer_ids.index(p)]]

    def _contacted(self, peer_id: Any) -> bool:
        """`peer_id` opened a stream of parts to this member since its previous group ended."""
        return self._opened.get(peer_id, -math.inf) > self._since

    def end_early(self, why: str, over: Collection[Any] = ()) -> None:
        """End a round that is lost (a span will have no average) now, not at the reducer
        timeout: a stall held every member of its group there, and the members outside it as
        long, short of the quorum (bench attack's staller cost its honest peers 14 s a stall);
        the group then runs again without `over` (redo.py), or hivemind looks for another group,
        within the round's time. An honest member that
        started late loses a round it might have landed late, and is not named for it: members
        that have sent nothing yet are named only if, until the reducer timeout counted from this
        member's start, their parts never reach this member's averager (`heard`) and, asked for
        their span, they do not say they are not in the group (`_answers`: an honest one still
        looking for its group says so), as when the round ran there."""
        if self._future.done():
            return
        log.info("a round ended early (%s); trying again if time allows", why)
        self._ended_over = set(over)
        unheard = self._unheard_now()
        self._unheard = set(unheard)
        deadline = self._reducer_deadline
        self._verdict = asyncio.create_task(self._name_if_unheard(unheard, deadline))
        self._verdict.add_done_callback(_retrieved)
        self.finalize(exception=AllreduceException(why))

    @property
    def _reducer_deadline(self) -> float:
        """When this member's wait for any reducer ends (monotonic): the reducer timeout from its
        start, what the verdicts on silent members wait for before they name anyone."""
        return self._started + (self.reducer_timeout or self.sender_timeout or 0.0)

    @property
    def ended_over(self) -> set[Any]:
        """The members whose silence ended this round early: its group runs again at once
        without them (redo.py). Members merely not heard from yet are not among them (they may
        have started later)."""
        return self._ended_over

    @property
    def suspects(self) -> set[Any]:
        """The members not heard from when this round ended early (every one that had sent
        nothing, not only those whose silence ended it, `ended_over`), and reducers that sent no
        averages: not named yet (that waits for the reducer timeout), but a leader does not wait
        for them in the round's next try (assembly.py)."""
        return self._unheard | set(self._late)

    def heard(self, peer_id: Any) -> None:
        """`peer_id` sent this member its parts of the round (perhaps after it ended)."""
        self._heard_late.add(peer_id)

    async def _name_if_unheard(self, unheard: list[Any], deadline: float) -> None:
        answered = await asyncio.gather(*(self._answers(p, deadline) for p in unheard))
        still = [
            p
            for p, answer in zip(unheard, answered, strict=True)
            if not answer and p not in self._heard_late
        ]
        for peer_id in silent_members(still, self._leader):
            self._stalled(peer_id, "sent none of its parts")

    async def _answers(self, peer_id: Any, deadline: float, parts_count: bool = True) -> bool:
        """Whether `peer_id` answers a request for its span of this round, before `deadline`,
        that it is not in the group (an honest member that missed its leader's word says so once
        it stops looking for a group, and one late to the group, or to a redo, as it was not in it
        when asked: guarded.py; as `_not_in_group`, such a member is not named). Its parts
        reaching this member meanwhile count too, if `parts_count` (not for a reducer whose
        parts came: _name_if_no_averages). Any other answer spares no one: a staller that keeps
        its averager answering but sends nothing is still named."""

        async def ask() -> AsyncIterator[averaging_pb2.AveragingData]:
            yield averaging_pb2.AveragingData(
                code=averaging_pb2.PART_FOR_AVERAGING, group_id=self.group_id
            )

        async def answer() -> bool:
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(ask())
            return (await anext(stream)).code == averaging_pb2.BAD_GROUP_ID

        try:
            if await asyncio.wait_for(answer(), max(deadline - time.monotonic(), 0.01)):
                return True
        except asyncio.TimeoutError:
            return parts_count and peer_id in self._heard_late
        except Exception:  # unreachable or hung up: as silent as before
            pass
        await asyncio.sleep(max(deadline - time.monotonic(), 0.0))
        return parts_count and peer_id in self._heard_late

    def _waiting_for_a_staller(self, reducer: Any) -> bool:
        """Another member sent this one none of its parts: `reducer` may be waiting out its
        own sender timeout for that member's parts, counted from its own start of the round (on
        a loaded machine, seconds after this member's), so its late averages name no one. (The
        staller is named; a colluder withholding its averages spoils only the round the staller
        spoiled anyway. A member that answered it is not in the group is named by no one, so
        it spares no reducer either: else a pair, one answering so, the other withholding its
        averages, would cost every round a reducer timeout and neither be named.)"""
        return any(
            p not in (reducer, self.peer_id)
            and p in self.banned_senders
            and p not in self.active_senders
            and p not in self._delivered
            and p not in self._not_in_group
            for p in self.sender_peer_ids
        )

    def _stalled(self, peer_id: Any, why: str) -> None:
        if self._on_stall is not None and peer_id != self.peer_id:
            self._on_stall(peer_id, why)

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        if peer_id == self.peer_id:
            return await self._reduce_own_span()
        exchange = asyncio.ensure_future(self._exchange(peer_id))
        exchange.add_done_callback(_retrieved)  # (one cancelled may end in hivemind's error)
        watch = asyncio.ensure_future(self._silent_reducer(peer_id))
        try:
            await asyncio.wait((exchange, watch), return_when=asyncio.FIRST_COMPLETED)
            waited = None if exchange.done() or not watch.done() else watch.result()
            if waited is not None and not self._future.done():  # the round is lost
                self._late[peer_id] = asyncio.ensure_future(
                    self._name_if_no_averages(peer_id, exchange)
                )
                self._late[peer_id].add_done_callback(_retrieved)
                why = f"{_names([peer_id])} sent no averages {waited:.1f} s after the others'"
                self.end_early(why, [peer_id])
                raise AllreduceException(why)
            return await exchange
        finally:
            watch.cancel()
            if peer_id not in self._late:
                exchange.cancel()  # its clean-up within the round, as hivemind's was
                await asyncio.wait((exchange,))

    async def _silent_reducer(self, reducer: Any) -> float | None:
        """Returns `reducer`'s start timeout once, for that long, it has sent this member no
        average of its span while every other span's averages had come, though it sent its own
        parts (so it runs the round) and no member is silent that it may be waiting for
        (`_waiting_for_a_staller`); None as soon as it sends one, or where it has no start
        timeout. Honest reducers combine the same senders' parts and answer within a moment of
        each other; a staller frozen after sending its parts held its group until the reducer
        timeout (bench attack: rounds of 13.6 s where 3 s is typical)."""
        allowed = self._start_timeout.get(reducer)
        if allowed is None:
            return None
        since = math.inf
        while reducer not in self._delivered:
            now = time.monotonic()
            if self._only_one_missing(reducer):
                since = min(since, now)
                if now - since >= allowed:
                    return allowed
            else:
                since = math.inf
            await asyncio.sleep(WATCH_S)
        return None

    def _only_one_missing(self, reducer: Any) -> bool:
        """Every span's averages but `reducer`'s have come, and it is the only one to blame."""
        container = self.tensor_part_container
        for index, (peer_id, parts) in enumerate(
            zip(self.ordered_peer_ids, container.num_parts_by_peer, strict=False)
        ):
            if peer_id != reducer and container._outputs_registered_by_peer[index] < parts:
                return False
        return reducer in self.active_senders and not self._waiting_for_a_staller(reducer)

    async def _name_if_no_averages(self, reducer: Any, exchange: asyncio.Future) -> None:
        """After a round ended early for `reducer`'s silence: keep the exchange with it open
        until the reducer timeout, counted from this member's start, and name it only if no
        average of its span came by then (as when the round waited there) and, asked then for
        its span, it does not answer within the sender timeout that it is not in the group. An
        honest reducer that was merely slow costs a round and is not left out for it: one
        frozen for a while (an overloaded machine: tests/peer_attack_harness.py, `late`) wakes
        into a round the others have left, gives up on it, and says so; a staller frozen
        longer says nothing. (One that withholds its averages and says so goes unnamed, as one
        that refuses its span at once does; so does a sender that delays its parts to one
        reducer past that reducer's start timeout, within its sender timeout: either costs
        each round it joins its start timeout, not the reducer timeout.)"""
        deadline = self._reducer_deadline
        try:
            await asyncio.wait((exchange,), timeout=max(deadline - time.monotonic(), 0.01))
            if reducer not in self._delivered:  # (an exchange that failed early: asked later)
                await asyncio.sleep(max(deadline - time.monotonic(), 0.0))
        finally:
            exchange.cancel()
        if reducer in self._delivered or self._waiting_for_a_staller(reducer):
            return
        asked = time.monotonic() + (self.sender_timeout or START_FLOOR_S)
        if not await self._answers(reducer, asked, parts_count=False):
            self._stalled(reducer, "sent no averages of its span")

    async def _exchange(self, peer_id: Any) -> None:
        """Send `peer_id` this member's parts of its span and take its averages (hivemind's)."""
        try:
            return await super()._communicate_with_peer(peer_id)
        except asyncio.TimeoutError:
            if peer_id not in self._late and not self._waiting_for_a_staller(peer_id):
                self._stalled(peer_id, "sent no averages of its span")
            # its span holds our own part, not an average: the probes discard the round,
            # so it ends now, not at the round's timeout (an audit waited there for the
            # staller's verdicts: a stalled round took 15 s of the bench's 15, not 10)
            self.finalize(exception=AllreduceException(f"{peer_id} sent no averages in time"))
            raise
        except Exception as e:
            if isinstance(e, AllreduceException) and str(e).endswith(NOT_IN_GROUP):
                self._not_in_group.add(peer_id)  # (hivemind's words for that answer)
                if is_redo(self.group_id):  # it ended the redo sooner, or formed another
                    self.end_early(f"{_names([peer_id])} is not in this redo")
            self._end_if_deserted()
            raise

    def _end_if_deserted(self) -> None:
        """Ends the try (end_early) once every other member has left it: each answered it is
        not in the group, or its exchange with this member ended without its averages (its try
        ended early, or it refused the group). This member's round cannot land then (a span
        holds its own part: the probes discard it), and it would wait on: a leader whose
        follower had given up on it and refused its group, while the third member ended its
        try over that follower, held its try for the try's timeout (15 s in bench attack, a
        clean swarm), and the other two, short of the quorum without it, lost those rounds too.
        (Rarely, a member's exchange breaks after it had every part of its span from this one:
        the others may still await this one's span; they end their try at its timeouts.)

        It ends over those never heard from (in a redo's ID, redo.py): a member that sent this
        one its parts and then left may be running the group's redo without a silent one (its
        exchange here failed as its try ended), which this member then joins, as it did at its
        own timeouts; one that crashed, or refused the group, sent nothing."""
        others = [p for p in self.ordered_peer_ids if p != self.peer_id]
        gone = {
            p: "not in the group" if p in self._not_in_group else "its span failed"
            for i, p in enumerate(self.ordered_peer_ids)
            if p != self.peer_id and (p in self._not_in_group or i in self._failed)
        }
        if others and len(gone) == len(others):
            why = ", ".join(f"{_names([p])} {said}" for p, said in gone.items())
            over = [p for p in gone if not self._heard_from(p)]
            self.end_early(f"every other member left the try: {why}", over)

    async def _reduce_own_span(self) -> None:
        """This member's own span: the average through the codec the others receive it in."""
        peer_id = self.peer_id
        container = self.tensor_part_container
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, (part, info) in enumerate(container._input_parts_by_peer[peer_index]):
            own, weight = self._weighed(
                sender_index, part_index, self._own_input(part_index, part, info), self.weight
            )
            average = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, own, weight=weight
            )
            wire = container.compression.compress(average, info)
            container.register_processed_part(
                peer_index, part_index, deserialize_torch_tensor(wire)
            )

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[Any]:
        """hivemind's, stopped once the round has ended: an exchange kept open past it
        (_name_if_no_averages) would read its parts from tensors a retry, or the next round,
        writes anew, and a reducer that woke late would average those in. It then drops this
        member as a sender for its span instead."""
        async for message in super()._generate_input_for_peer(peer_index):
            if self._future.done():
                return
            yield message

    def _own_input(self, part_index: int, part: Any, info: Any) -> Any:
        """What this member reduces as its own part of its span (audit.py: through the codec)."""
        return part

    def _received(self, sender_index: int, part_index: int, wire: Any) -> None:
        """A sender's part of this member's span, as it came (audit.py keeps it)."""

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's, sending the average rather than the average minus the sender's part."""
        part_index, gap = 0, 0.0
        try:
            loop = asyncio.get_event_loop()
            async for part, weight, wire in amap_in_executor(
                lambda msg: (
                    deserialize_torch_tensor(msg.tensor_part),
                    msg.weight,
                    msg.tensor_part,
                ),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                gap = max(gap, time.monotonic() - self._awaited.pop(sender_index, math.inf))
                compression = wire.compression
                self._received(sender_index, part_index, wire)
                try:
                    part, weight = self._weighed(sender_index, part_index, part, weight)
                    average = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, part, weight=weight
                    )
                    part_index += 1
                except BannedException:
                    break  # the sender was banned: its parts are no longer needed
                serialized = await loop.run_in_executor(
                    None,
                    lambda: serialize_torch_tensor(average, compression),  # noqa: B023
                )
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.AVERAGED_PART, tensor_part=serialized
                )
                self._awaited[sender_index] = time.monotonic()  # its next part (_watch_next_parts)
        finally:
            self._awaited.pop(sender_index, None)
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
            elif self._on_part_gap is not None and gap > 0:  # (a span of one part: no gap)
                self._on_part_gap(self.sender_peer_ids[sender_index], gap)


def _retrieved(task: asyncio.Future) -> None:
    """Takes a finished task's exception, so that asyncio does not report it unretrieved."""
    if not task.cancelled():
        task.exception()


def _names(peers: list[Any]) -> str:
    return ", ".join(str(p)[-8:] for p in peers)


def silent_members(silent: list[Any], leader: Any) -> list[Any]:
    """The members of `silent` (those that sent this member none of their parts) to name as
    stallers. A silent leader may never have told the others of the group: frozen as it
    announced it (bench attack's staller, when it leads), it told one member and not another,
    and the one not told, still waiting for a leader's word, sent nothing either. Naming both,
    the member told left the other honest one out (a CI run: both honest peers lost three
    rounds). So where the leader is silent, only the leader is named."""
    return [leader] if leader in silent else silent
