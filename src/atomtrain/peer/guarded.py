"""hivemind's averager behind the swarm's gates, reducing robustly when defended.

GuardedAverager runs behind the swarm's gates (auth.py) and, when defended, reduces robustly
(robust.py), has a second member replay each span's reduction (audit.py: the round is discarded
before anything is applied when a replay and the averages received differ), and excludes from
its next rounds (exclusion.py: `STALL_ROUNDS`, doubled at each repeat, one repeat forgiven every
`FORGIVE_ROUNDS` quiet rounds) any member that stalled a round: one that joined the group and
then sent nothing, or reduced nothing (exact.py tells which), or reduced its span to averages
beyond what an honest reducer returns (bounds.reducer_bounds, bounds.PAIR_SLACK), or that an
audit showed lying as a reducer or an auditor, or whose update opposed this member's own in
`OPPOSED_ROUNDS` of this member's last `OPPOSED_WITHIN` readings of it (`OPPOSED_COSINE`) or
in one (`STRONGLY_OPPOSED_COSINE`; left out `OPPOSED_EXCLUSION_ROUNDS` the first time, an
attack's sign rather than a failure's; no readings where this member brings its weight average,
reads_members). Counted in rounds rather than banned for good, since an honest peer frozen for a
while (or cut off), or an honest reducer whose own update is tens of times the others', can look
the same. A group that
holds a member this one excludes or banned does not make it abort (that would spoil the round
for the others too): it takes part. An audited round it then applies like any other when every
check passes: every reducer combined that member's parts by what it measures (robust.py:
non-finite and far too large parts dropped, the rest clipped, so the member weighs what any other
member does), and every reducer's averages were audited, its own span's too. Discarding it
instead left this member a round behind the others that applied it, out of sync, and it spent
the next rounds re-synchronizing: in bench attack's 4-peer swarms an honest peer that had banned
the attacker before the others did applied 1 round of 7 where a third party's group still took
the attacker in. An unaudited round it discards for itself only (and where it reduces it drops
that member's parts): there a banned reducer's averages are only bounded, not checked.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime

# hivemind reads RPC signatures and recognizes streams by typing's AsyncIterator only
from typing import Any, AsyncIterator  # noqa: UP035

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.proto.averaging_pb2 import BEGIN_ALLREDUCE
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import achain, as_aiter
from hivemind.utils.timed_storage import get_dht_time

from atomtrain.peer.assembly import (
    RETRIES,
    ExpectedMembers,
    Suspects,
    all_expected_joined,
    least_group,
)
from atomtrain.peer.attack import SLANDER, forge_gathered, lie_sizes
from atomtrain.peer.audit import AuditedRunner
from atomtrain.peer.auth import MemberGate
from atomtrain.peer.bounds import DELTA, MIN_WEIGHT, NO_DEFENCE, Defence, equal_weights
from atomtrain.peer.download import download_from
from atomtrain.peer.exact import (
    FIRST_PART_TIMES,
    FIRST_PARTS_KEPT,
    START_FLOOR_S,
    ExactAverageRunner,
    first_part_timeouts,
    start_timeouts,
)
from atomtrain.peer.exclusion import LeftOut
from atomtrain.peer.forgers import FORGERS_READ_S, read_forgers
from atomtrain.peer.gather import NO_KEY, check, seal, unseal
from atomtrain.peer.layout import round_layout
from atomtrain.peer.probation import declare, read_only
from atomtrain.peer.redo import is_redo, redo, redoes
from atomtrain.peer.robust import RobustRunner
from atomtrain.peer.sync import lower_median, membership, quorum
from atomtrain.peer.traffic import RECEIVED, SENT, Traffic, counting_state_stubs

log = logging.getLogger(__name__)

BANNED, FORGED, MALFORMED, UNVERIFIED = 1, 2, 3, 4
"""Why a round is discarded (set by hivemind's process): it held a peer this one banned or
excludes; the leader sent a member's metadata that member did not sign; a member signed
malformed metadata; no certificate this peer could read names a member."""
HEARD_KEPT = 64
"""Groups whose senders a member remembers (exact.py, end_early: parts that came before it
started a group, or after its round ended early, name no staller)."""
OPENED_KEPT = 1024
"""Peers whose latest stream of parts a member remembers (exact.py, _contacted: for the start
timeout), most recent first: every caller is stamped before the gate, and a stream of new peer
IDs the gate refuses grew it without bound."""
GRACE_S = 1.0
"""How long parts from a leader this member gave up on wait for another leader's word while a
join request is out (_group_runner): that leader's word reaches its members at once."""
SLOW_START_S = 0.5
"""A try whose all-reduce this member began this long or more after hivemind handed it the
group (its members' metadata checked, load balancing, the averaged tensors' lock) is logged with
where the time went, and how long before that its matchmaking found the group (`_log_start`;
every try at DEBUG): members that begin a try apart end it over each other at the start timeout
(exact.py), and the logs kept of bench attack's runs could not say why honest members had (FR2,
FR5; 49 early ends by an honest peer over an honest member for opening no stream in the runs
FR1-FR5 and LN1-LN5 kept)."""
NO_ONE = "no member to average with: every other live member is left out or banned"
"""Why a round ends at once (`looked`): its rounds pass, and with them the exclusions."""
AUDITS_KEPT = 8
"""Audited all-reduces a member keeps for the members that ask after it ends (each lets its
replay go once every member asked, or some seconds after the round)."""


@dataclass
class Ran:
    """A group this member ran: when its round of it ended (monotonic), over whom it ended
    early (exact.py, `ended_over`), and whose late first part was measured since."""

    ended: float
    ended_over: frozenset
    measured: set = field(default_factory=set)


def finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


class GuardedAverager(DecentralizedAverager):
    """hivemind's averager behind the swarm's gates, with robust aggregation when defended.

    Runs in its own process. Serves the peer's state (metadata, tensors) to joiners that pass the
    gate; refuses group requests, tensor parts and state downloads from callers that do not; never
    asks a leader that does not; seals the metadata it tells its group and checks its group's
    (gather.py); and reports each member it rejects through `events`.
    """

    def __init__(
        self,
        provider: Any,
        gate: MemberGate,
        defence: Defence | None,
        kinds: list[str],
        events: Any,
        inputs: list[torch.Tensor],
        traffic: Traffic,
        discard: Any,
        attempts: Any,
        *args: Any,
        window_s: float = 60.0,
        start_timeout_s: float = START_FLOOR_S,
        attack: str = "",
        expected: ExpectedMembers | None = None,
        unfinished: ExpectedMembers | None = None,
        assemble_early: str = RETRIES,
        **kwargs: Any,
    ) -> None:
        self._provider, self._gate, self._defence = provider, gate, defence
        self._expected_members, self._assemble_early = expected, assemble_early
        self._expected: list[PeerID] = []  # this round's live others (assembly.py)
        self._unfinished_members = unfinished
        self._unfinished: list[PeerID] = []  # and those it left out or rejected
        self._suspects = Suspects()  # whom this round's tries ended early unheard (assembly.py)
        self._traffic, self._discard, self._attempts = traffic, discard, attempts
        self._window_s, self._attack = window_s, attack
        self._start_timeout_s = start_timeout_s
        self._round_at = 0.0  # this round's scheduled time, which the sealed metadata names
        self._sealed = b""  # what this member sent its group this round
        self._leaders: dict[bytes, PeerID] = {}  # group ID -> the leader that formed it
        self._led_by: dict[bytes, PeerID] = {}  # this round's groups' leaders, this one's too
        self._assembled: set[bytes] = set()  # groups this step joined (a trigger may await them)
        self._asking = 0  # join requests this member has out to leaders (_guard_leaders)
        self._requests = 0  # join requests this member made (a redirect nests one in another)
        # leaders this step whose word did not come in time (each may have put this member in
        # its group all the same), and the groups that came from them (_group_runner)
        self._gave_up_on: dict[PeerID, None] = {}
        self._missed: dict[bytes, None] = {}
        self._trusted = True  # the round's metadata is its members' (robust bans count)
        self._left_out = LeftOut(
            lambda peer_id, why, kind: events.put((peer_id.to_base58(), why, kind)),
            lambda peer_id: peer_id in self._gate.banned,
            follow=defence.follow if defence is not None else 0.0,
            lean=defence.lean if defence is not None else 0.0,
        )
        self._audits: dict[bytes, AuditedRunner] = {}  # group ID -> its runner, latest last
        self._heard: dict[bytes, set[PeerID]] = {}  # group ID -> members whose parts came
        self._streams: dict[bytes, set[PeerID]] = {}  # group ID -> members that streamed parts
        self._opened: dict[PeerID, float] = {}  # peer -> when it last opened a stream of parts
        self._admitted: dict[PeerID, float] = {}  # peer -> its stream let in, no first part yet
        self._first_parts: dict[PeerID, deque[float]] = {}  # peer -> its first parts' delays
        self._group_ended = 0.0  # when this member's last group ended (monotonic seconds)
        self._ran: dict[bytes, Ran] = {}  # groups this member ran, the latest HEARD_KEPT
        self._running: bytes | None = None  # the group this member runs now (its ID)
        self._running_sealed: Any = None  # that group as it formed (_follow_redo reads it)
        self._may_redo = True  # this round runs redos (not one prepared for a slot)
        # the group whose redos _follow_redo notes, each that leaves out one member (redo ID ->
        # that member), and the members whose parts of each this member holds now
        self._redos_of: bytes | None = None
        self._redo_leaves: dict[bytes, PeerID] = {}
        self._redo_senders: dict[bytes, set[PeerID]] = {}
        self._ended_over: set[PeerID] = set()  # whom its last try ended early over (exact.py)
        self._redo: Any = None  # the group to run at once in this round's next try (redo.py)
        self._forgers: asyncio.Future | None = None  # this round's read of them (forgers.py)
        self._forgers_banned: set[str] = set()  # their public keys, once their peers were found
        self._warming: asyncio.Future | None = None  # this round's checks of its live members
        # when this member's matchmaking found its latest group, hivemind handed it the group
        # (monotonic, wall: after the round's trigger), its members' metadata was checked, and
        # the averaged tensors' lock was asked for and taken (_log_start)
        self._found, self._handed, self._checked_at = 0.0, (0.0, 0.0), 0.0
        self._tensors_asked = self._tensors_held = 0.0
        self._kinds, self._events, self._inputs = kinds, events, inputs
        self.get_stub = counting_state_stubs(self, traffic)
        super().__init__(*args, **kwargs)

    async def _shutdown(self, timeout: float | None) -> None:
        """As hivemind's, which calls `finalize` on each running group's future rather than on
        its runner (hivemind 1.1.12: an AttributeError and a traceback at exit whenever a round
        was in flight, as when a peer stops at its target): a started round's runner is
        cancelled, a group not yet started loses its future. Nothing is waited for: `finalize`
        cancels in place."""
        if not self.client_mode:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        for started in list(self._running_groups.values()):
            if started.done() and not started.cancelled() and started.exception() is None:
                started.result().finalize(cancel=True)
            else:
                started.cancel()

    def get_current_state(self):
        metadata, tensors = self._provider()
        return metadata, tensors, None

    async def _declare_for_download_periodically(self):
        """hivemind's unsigned priority record is not written (download.py)."""

    async def _download_from(self, sources: list[str], timeout_s: float, future: MPFuture):
        try:
            # a state: the parameters and the outer momentum, float32, and some framing
            numel = sum(t.numel() for t in self._averaged_tensors)
            most = int(8 * numel * 1.25) + (1 << 20)
            future.set_result(await download_from(self, sources, timeout_s, most))
        except BaseException as e:
            future.set_exception(e)

    def _reject(self, peer_id: PeerID, why: str) -> None:
        if peer_id not in self._gate.banned:
            self._gate.ban(peer_id)
            self._events.put((peer_id.to_base58(), why, "reject"))

    @property
    def _audited(self) -> bool:
        """Its rounds are audited (audit.py): a banned member a third party took in is safe to
        average with."""
        return self._defence is not None and self._defence.audit

    def _excluded(self, peer_id: PeerID) -> bool:
        """Stalled a round lately (local, for some rounds; a ban is the gate's and lasts)."""
        return peer_id in self._left_out

    # --- gates ------------------------------------------------------------------------------

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if (
            self._excluded(context.remote_id)
            or not await self._gate.allows(self.dht, context.remote_id)
            or (await self._unsealed(request.gather, context.remote_id))[0] is None
        ):  # an honest leader never forwards metadata its sender did not seal
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async with aclosing(super().rpc_join_group(request, context)) as messages:
            async for message in messages:
                if self._attack == "forge_gather" and message.code == BEGIN_ALLREDUCE:
                    forge_gathered(message, self.peer_id)  # bench attack only
                yield message
                if message.code == averaging_pb2.ACCEPTED:  # (sent: the lock is still held)
                    await self._assemble_if_all_joined()

    async def _assemble_if_all_joined(self) -> None:
        """In a retry (or any try, with `always`), form the group now when every member this leader
        expects has joined (assembly.py): live, not left out or banned, and not one an earlier try
        of the round ended early unheard from (assembly.SUSPECT_ROUNDS; exact.py names it only
        later), in a group that holds the round's quorum. Called just after hivemind's matchmaking
        accepted a follower and sent it word, before it checks its own `target_group_size`: its
        request lock is still held by that call, suspended where it sent the word."""
        matchmaking = self._matchmaking
        step = matchmaking.step_control
        if (
            matchmaking.assembled_group.done()
            or not matchmaking.is_looking_for_group
            or matchmaking.current_leader is not None
            or matchmaking.client_mode
            or step is None
            or not (step.allow_retries or step.triggered)  # prepared for a slot, not yet at it
            or (self._assemble_early == RETRIES and not self._attempts.value)  # a first try
        ):
            return
        if all_expected_joined(
            self.peer_id,
            matchmaking.current_followers,
            self._expected,
            self._waited_for,
            least=self._quorum(),
        ):
            await matchmaking.leader_assemble_group()

    def _takes_in(self, peer_id: PeerID) -> bool:
        """Neither left out nor banned: this member would average with it."""
        return not (self._excluded(peer_id) or peer_id in self._gate.banned)

    def _waited_for(self, peer_id: PeerID) -> bool:
        """An expected member this leader waits for: not left out, banned, or a suspect."""
        return self._takes_in(peer_id) and peer_id not in self._suspects

    def _quorum(self) -> int:
        """Members in sync this round needs (sync.quorum), counting the live others."""
        keyed = self._defence is not None and self._gate.owner is not None
        return quorum(1 + len(self._expected), keyed)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        # (before the gate, which may read the roster: its parts may take a while to come too;
        # the latest OPENED_KEPT callers kept, so callers the gate refuses cannot grow it)
        caller = context.remote_id
        was_opened = _stamp(self._opened, caller)
        opened = self._opened[caller]
        refused = not await self._gate.allows(self.dht, caller)
        if refused and not self._audited:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        # its first part is timed from here: this member's own gate (a read of the roster for a
        # caller not verified lately) is no delay of the caller's. Stamped until it comes
        was_admitted = _stamp(self._admitted, caller)
        admitted = self._admitted[caller]
        try:
            first = await anext(stream)
        finally:
            came = time.monotonic()
            if self._admitted.get(caller) == admitted:  # (no later stream of its own since)
                _unstamp(self._admitted, caller, None)
        if not first.HasField("tensor_part"):  # an ask for this member's span: no stream of parts
            if self._opened.get(caller) == opened:  # (no stream of parts opened meanwhile)
                _unstamp(self._opened, caller, was_opened)
            if caller not in self._admitted:  # a stream of parts it had let in before still waits
                _unstamp(self._admitted, caller, was_admitted)
        running = first.group_id in self._running_groups  # (as the request came)
        # parts that came before this member started the group, or after its round ended early,
        # name no staller (exact.py, end_early)
        self._heard_of(first.group_id).add(context.remote_id)
        # (parts its gate let in: a redo's may end the try this member still runs)
        parts = first.HasField("tensor_part") and not refused
        group = await self._group_runner(first.group_id, context.remote_id, parts)
        # an ask for this member's span (no part: exact.py, _answers) that came before it ran
        # the group is answered that it was not in it: held until it ran it (late to its group,
        # or to a redo), the ask reached its runner, which answers no ask, and the asker named
        # it unless its parts had reached the asker, which a redo ended at once may not send
        asked_before = not running and not first.HasField("tensor_part")
        over = group is None or group.over  # not in it, or its round is over
        if over and first.HasField("tensor_part") and not refused:
            ran = self._ran_record(first.group_id, group)
            if ran is not None:
                self._late_first_part(ran, caller, admitted, came)
        if over or asked_before:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        runner = self._audits.get(first.group_id) if refused else None
        if refused and (runner is None or context.remote_id not in runner.sender_peer_ids):
            # a member this one banned, in a group a third party took it into: its parts are
            # combined by what they measure and the round audited (_aggregate_with_group);
            # anyone else this one refuses stays refused
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        if first.HasField("tensor_part"):
            # one stream of parts per member and group: hivemind's reducer counts parts, not
            # senders, so a second stream's part 0 completed part 0 before an honest sender's
            # came (whose stream then failed, and was left out of the span); its first part,
            # sent at leisure, set its sender's first-part timeout at no cost
            streams = self._streams.setdefault(first.group_id, set())
            keep_latest(self._streams, HEARD_KEPT)
            if caller in streams:
                yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
            streams.add(caller)
            if not refused and caller in group.sender_peer_ids:
                self._first_part_took(caller, came - admitted)  # (a member's, of a group it runs)
        # the reducer's side of this member's traffic: parts in, averages out. (To the group's
        # runner itself: hivemind's handler looks the group up again, and where its round had
        # ended meanwhile it waited for this member's next group to answer. A member that asked
        # as its own round ended early waited past the reducer timeout, and named this one.)
        async for message in group.rpc_aggregate_part(
            self._traffic.count(RECEIVED, achain(as_aiter(first), stream)), context
        ):
            self._traffic.add(SENT, message)
            yield message

    def _first_part_took(self, peer_id: PeerID, seconds: float) -> None:
        """Keep how long `peer_id`'s first part took to come after the gate let its stream in, or
        the longest its parts of a span it completed came apart (exact.py, `on_part_gap`; its
        latest FIRST_PARTS_KEPT, for the latest OPENED_KEPT peers): its first-part timeout
        (exact.first_part_timeouts). Only a member's first stream of parts of a group this
        member runs counts (or one late for a round ended over it: _late_first_part): a part for
        a made-up group, or one sent at leisure on a second stream or for a round over, would let
        anyone set its own delays at no cost. One that took the sender timeout or more is no
        measure of its link: no round would have waited for it, and its sender was stopped, not
        slow (bench attack's staller, frozen after opening its streams, sends its first parts as
        it wakes, 17 s later; kept, that gave it the sender timeout in every later round)."""
        timeout = self.allreduce_kwargs.get("sender_timeout")
        if timeout is not None and seconds >= timeout:
            return
        delays = self._first_parts.pop(peer_id, None) or deque(maxlen=FIRST_PARTS_KEPT)
        delays.append(seconds)
        self._first_parts[peer_id] = delays
        keep_latest(self._first_parts, OPENED_KEPT)

    def _ran_record(self, group_id: bytes, group: Any) -> Ran | None:
        """What this member keeps of a group it ran (None: it did not, or has forgotten): kept
        from its runner as soon as the round is over (`group`), before this member's clean-up
        of the round ends (a part that came meanwhile is judged as any late one)."""
        ran = self._ran.get(group_id)
        if ran is None and group is not None and group.over:
            ran = self._ran[group_id] = Ran(group.ended_at, frozenset(group.ended_over))
            keep_latest(self._ran, HEARD_KEPT)
        return ran

    def _late_first_part(self, ran: Ran, caller: PeerID, admitted: float, came: float) -> None:
        """Keep the delay of a first part that came after this member's round of its group ended
        early over its sender (`ran`), from a stream let in before that end: the measure the
        sender's next rounds need. Not kept, a member slower than the others' typical (new here,
        timed by it) lost every round, never measured. Once per member and group, and no more
        than would raise its first-part timeout to the sender timeout: a staller that freezes
        for less than the sender timeout, its part coming after the round ended over it, is
        waited for no longer than hivemind waited before first-part timeouts."""
        if caller not in ran.ended_over or caller in ran.measured or admitted > ran.ended:
            return
        ran.measured.add(caller)
        timeout = self.allreduce_kwargs.get("sender_timeout")
        most = math.inf if timeout is None else (timeout - self._start_timeout_s) / FIRST_PART_TIMES
        if timeout is None or came - admitted < timeout:  # (past it: stopped, not slow)
            self._first_part_took(caller, min(came - admitted, max(most, 0.0)))

    def _heard_of(self, group_id: bytes) -> set[PeerID]:
        """The members whose parts for `group_id` reached this member (the latest groups'
        kept)."""
        heard = self._heard.setdefault(group_id, set())
        keep_latest(self._heard, HEARD_KEPT)
        return self._heard.get(group_id, heard)

    async def _group_runner(
        self, group_id: bytes, sender: PeerID | None = None, parts: bool = False
    ) -> Any:
        """The group's all-reduce (exact.ExactAverageRunner), once this member runs it; None:
        it will not. Waits until this member starts it (or never will:
        _aggregate_with_group cancels it), shielded: hivemind's handler awaits the group's
        future itself, and a sender that gives up its request (a member whose round failed, or
        one that hangs up on purpose) cancelled the task and with it that future. This member
        then could not start its all-reduce at all, and the honest members it left waiting
        excluded it as a staller.

        A group this member is not in, and can no longer join, is refused at once: it did not
        assemble this group, and it has no join request out to a leader (one it has out may be
        answered with this group: the leader's word can come after the other members' parts).
        hivemind's handler waits until this member registers its next group, or forever: a
        leader that formed its group as this member's matchmaking ran out of time (a retry's
        group is formed at the round's deadline, where the follower stops waiting for it) held
        the round for the reducer timeout and named this member a staller; so did one whose
        word came after this member, still looking for a group, had given up on it (bench
        attack, 4 peers on 2 cores: an honest peer left out, its partners' next rounds short of
        the quorum). A group this member already ran is refused at once too: a member whose
        round ended early asks whether this one is in it before naming it a staller
        (exact.py, _answers), and an answer held while this one looks for its next group named
        it.

        A group whose member `sender` is a leader this member gave up on in this step (its
        word did not come in time, _guard_leaders) is refused as well, with every other
        member's parts for that group: the leader formed it with this member in it after this
        member stopped waiting for it (a loaded leader whose event loop lagged past the
        follower's request timeout). Held until this member's matchmaking ended, it named
        this honest member a staller, and one that gave no audit verdict (bench attack, clean
        swarms: left out by both others, its partners' next rounds short of the quorum).
        Its span fails and the round with it; the answer names no one. While this member still
        has a join request out, such a sender's parts wait a second first: the leader given up
        on may have joined another leader's group with this member in it, whose word is on its
        way (a group refused so is lost all the same where that word takes longer).

        A redo (redo.py) of the group this member runs now may be its own once that group
        ends: its parts wait for that, as long as the start timeout's floor (the start timeout
        its sender gives it: redos run only in rounds that declare no start lag). Any other
        redo it refuses at once: it will not run it, and held while it looks for a group, the
        ask after would have gone unanswered past the asker's reducer timeout. Parts of such a
        redo (`parts`: parts its gate let in, not an ask) may end the try this member still runs
        (_follow_redo)."""
        began = time.monotonic()
        try:
            while group_id not in self._running_groups:
                if group_id in self._ran:  # over (its round ended early, say): not looking for it
                    return None
                if is_redo(group_id) and group_id not in self._assembled:
                    # a redo of the group this member runs may be its own once that ends, for as
                    # long as its sender gives it to start (redo.py); any other it will not run
                    running = self._running is not None and redoes(group_id, self._running)
                    if not running or time.monotonic() - began > self._start_timeout_s:
                        return None
                    if parts and sender is not None:
                        self._follow_redo(group_id, sender)
                    await asyncio.sleep(0.05)
                    continue
                matchmaking = getattr(self, "_matchmaking", None)
                looking = matchmaking is not None and matchmaking.is_looking_for_group
                asking = looking and self._asking
                if group_id not in self._assembled:  # not (yet) one this member joined
                    graced = asking and time.monotonic() < began + GRACE_S
                    if group_id in self._missed or (sender in self._gave_up_on and not graced):
                        if group_id not in self._missed:
                            log.info(
                                "refusing %s's group: a leader this member gave up on formed it",
                                str(sender)[-8:],
                            )
                        self._missed[group_id] = None  # a given-up leader's: it will not come
                        keep_latest(self._missed, HEARD_KEPT)
                        return None
                    if not asking:
                        return None
                await asyncio.sleep(0.05)
        finally:  # (its parts held no longer: it counts no more towards a follow)
            if parts and sender is not None:
                self._redo_senders.get(group_id, set()).discard(sender)
        started = self._running_groups[group_id]
        try:
            return await asyncio.shield(started)
        except asyncio.CancelledError:
            if not started.cancelled():
                raise  # this request itself was cancelled: its sender hung up
            return None

    def _follow_redo(self, redo_id: bytes, sender: PeerID) -> None:
        """`sender` sent parts of a redo of the group this member still runs. Once every other
        member kept by that redo has, and this member holds their parts (at most the floor,
        _group_runner; a member joins a redo only once it ended the try: an honest one,
        redo.py), and it leaves out one member only, this member ends its try now, while it
        still runs, over that one, so that its own redo is theirs, rather than holding their
        parts until its own timeouts end the try. Members that started the try apart end it
        apart: one later than the others by more than that floor refused their redo, which then
        ended, and ran its own alone after (bench attack, run NP4); one that had all it needed
        of the try may land it while the others land their redo, and come out of sync (run
        FR3, as its log reads). Bounded so that one member cannot steer it: two others kept at
        least (one other's word alone would pull it out of a try into a pair with that one),
        so one of them at least is honest and ended the try over that member; one member left
        out only (two colluders could otherwise keep it in a group of three with them, out of
        a larger one); only the redos that leave out one member of this group, and their kept
        members' parts, are noted (the left-out member's count for nothing, nor can it crowd
        theirs out with redo IDs of its own making); not in a round prepared for a slot, which
        runs no redo."""
        group, started = self._running_sealed, self._running_groups.get(self._running or b"")
        if group is None or not self._may_redo:
            return
        if self._redos_of != group.group_id:  # a new try: the redos that leave out one member
            self._redos_of, self._redo_senders = group.group_id, {}
            self._redo_leaves = {}
            for peer_id in group.peer_ids:
                again = redo(group, {peer_id}, self.peer_id, self._quorum())
                if again is not None and len(again.peer_ids) >= 3:  # (two others kept at least)
                    self._redo_leaves[again.group_id] = peer_id
        left_out = self._redo_leaves.get(redo_id)
        if left_out is None or sender in (left_out, self.peer_id) or sender not in group.peer_ids:
            return
        senders = self._redo_senders.setdefault(redo_id, set())
        senders.add(sender)  # (until its parts are held no longer: _group_runner)
        if started is None or not started.done() or started.cancelled():
            return  # (its runner not started yet: looked at again as the parts wait)
        kept = [p for p in group.peer_ids if p not in (left_out, self.peer_id)]
        if senders.issuperset(kept):
            names = ", ".join(str(p)[-8:] for p in kept)
            started.result().end_early(
                f"{names} ran the group again without {str(left_out)[-8:]}", [left_out]
            )

    async def rpc_audit_parts(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """The reducer of the span this member audits streams the parts it combined (audit.py)."""
        try:
            first = await asyncio.wait_for(anext(stream), self._window_s)
        except (asyncio.TimeoutError, StopAsyncIteration):
            return
        runner = await self._audited_runner(first.group_id, context.remote_id)
        if runner is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        taken = await runner.take_forwarded(context.remote_id, achain(as_aiter(first), stream))
        code = averaging_pb2.AVERAGED_PART if taken else averaging_pb2.PROTOCOL_VIOLATION
        yield averaging_pb2.AveragingData(code=code)

    async def rpc_audit_verdict(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        """A member of a group asks for the verdict on the span this member audited, revealing
        the seed of its projections in `peer_id` and naming the span in `weight` (audit.py)."""
        runner = await self._audited_runner(request.group_id, context.remote_id)
        if runner is None or len(request.peer_id) != 8 or not finite(request.weight):
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        seed = int.from_bytes(request.peer_id, "big")
        told = await runner.answer(context.remote_id, int(request.weight), seed)
        reply = averaging_pb2.AveragingData(
            code=averaging_pb2.AVERAGED_PART, peer_id=self.serializer.dumps(told)
        )
        self._traffic.add(SENT, reply)
        return reply

    async def _audited_runner(self, group_id: bytes, caller: PeerID) -> AuditedRunner | None:
        """The audited all-reduce of group `group_id` when `caller` is one of its members
        (waiting for this member to start it, as the parts' handler does)."""
        runner = self._audits.get(group_id)
        if runner is None:
            try:
                if await asyncio.wait_for(self._group_runner(group_id, caller), self._window_s):
                    runner = self._audits.get(group_id)
            except asyncio.TimeoutError:
                return None
        if runner is None or caller not in runner.sender_peer_ids:
            return None
        return runner

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._gate.allows(self.dht, context.remote_id):
            return  # the caller sees no state and moves on
        async for message in super().rpc_download_state(request, context):
            self._traffic.add(SENT, message)
            yield message

    async def _step(self, *, step, future_for_init):
        self._guard_leaders()
        self._left_out.next_round()
        self._leaders.clear()
        self._led_by.clear()
        self._assembled.clear()
        self._gave_up_on.clear()
        self._redo = None
        self._may_redo = step.allow_retries  # (looked: a redo is a retry)
        self._round_at = step.scheduled_time
        self._expected = read_ids(self._expected_members)
        self._unfinished = read_ids(self._unfinished_members)
        self._suspects.next_round(self._left_out.rounds)
        if self._gate.owner is not None and (self._forgers is None or self._forgers.done()):
            self._forgers = asyncio.ensure_future(self._ban_forgers())
        if self._warming is None or self._warming.done():
            self._warming = asyncio.ensure_future(self._warm([self.peer_id, *self._expected]))
        if self._defence is not None:  # read, not averaged, where others declare it too
            step._data_for_gather = declare(
                step.data_for_gather, self._left_out.on_probation, self.serializer
            )
        if self._gate.signing_key is not None:  # this step's copy, in this process
            step._data_for_gather = seal(
                self._gate.signing_key,
                self.prefix,
                self.peer_id.to_base58(),
                self._round_at,
                step.data_for_gather,
            )
        self._sealed = step.data_for_gather
        try:
            return await super()._step(step=step, future_for_init=future_for_init)
        finally:
            self._assembled.clear()  # its groups ran, or never will

    async def _warm(self, peer_ids: list[PeerID]) -> None:
        """The round's members' certificates checked as it begins (auth.MemberGate.warm)."""
        try:
            await self._gate.warm(self.dht, peer_ids)
        except Exception as e:  # (a check on the path reads again)
            log.debug("could not check the round's members ahead: %r", e)

    async def _ban_forgers(self) -> None:
        """Ban the peers this peer's DHT node caught sending records they could not have
        signed, or saw shown to have sent one (forgers.py: the status thread shares the
        evidence, presence.py), and their members, in the background of a round's matchmaking
        (a peer whose certificate the roster does not show yet is looked for again next
        round)."""
        try:
            named = await asyncio.wait_for(read_forgers(self.dht), FORGERS_READ_S)
        except Exception as e:  # (the DHT's process busy or gone: the next round reads again)
            log.debug("could not read the peers the DHT named: %r", e)
            return
        for public_key, (member, why) in named.items():
            if public_key in self._forgers_banned:
                continue
            self._gate.banned_members.add(member)  # (its certificate's: a ban follows it)
            for peer_id in await self._gate.peers_of(self.dht, public_key):
                self._reject(peer_id, why)
                self._forgers_banned.add(public_key)

    def _guard_leaders(self) -> None:
        """hivemind picks leaders from the DHT with no hook to refuse one: wrap the request so a
        banned or unproven leader is skipped like one that said no."""
        matchmaking = getattr(self, "_matchmaking", None)
        if matchmaking is None or getattr(matchmaking, "_atom_guarded", False):
            return
        ask = matchmaking._request_join_group
        timeout = matchmaking.request_timeout
        assemble = matchmaking.follower_assemble_group
        lead = matchmaking.leader_assemble_group
        look = matchmaking.look_for_group

        async def guarded(leader: PeerID):
            if self._excluded(leader) or not await self._gate.allows(self.dht, leader):
                return None
            if matchmaking.assembled_group.done():  # it led a group meanwhile (assembly.py)
                return None
            self._asking += 1  # from the request until the leader's group, or its end
            self._requests += 1
            self._gave_up_on.pop(leader, None)  # asked again: its next group may be ours
            began, request, group = time.monotonic(), self._requests, None
            try:
                group = await ask(leader)
                return group
            finally:
                self._asking -= 1
                # no group after the request timeout: its word did not come in time (a leader
                # that refuses says so within it), or its group did not after it accepted this
                # member. It may yet form that group with this member in it. (One that sent
                # this member on to another leader, a nested request, did not.)
                nested = self._requests != request
                if group is None and not nested and time.monotonic() - began >= timeout:
                    self._gave_up_on[leader] = None
                    log.debug(
                        "gave up on leader %s: no group %.2f s after asking to join it",
                        str(leader)[-8:],
                        time.monotonic() - began,
                    )

        async def followed(leader: PeerID, message: Any):
            if is_redo(message.group_id):  # only members name a redo (redo.py), never a leader
                self._reject(leader, "formed a group under a redo's ID")
                return None  # (a refusal: this member looks on)
            group_info = await assemble(leader, message)
            self._leaders[group_info.group_id] = leader  # whom to blame for forged metadata
            self._assembled.add(group_info.group_id)
            return group_info

        async def led():
            group_info = await lead()
            self._assembled.add(group_info.group_id)
            return group_info

        async def looked(step: Any):
            again, self._redo = self._redo, None
            if again is not None and not step.allow_retries:
                log.debug("a redo formed, but this round allows no retries: none run")
            elif again is not None:  # the lost try's group, less those
                ended_over = ", ".join(sorted(p.to_base58()[-8:] for p in self._ended_over))
                log.info("trying the lost group again at once without %s", ended_over)
                self._found = time.monotonic()
                return again
            if self._unfinished and not any(map(self._takes_in, self._unfinished)):
                # the round ends at its trigger, not at its timeout, so the rounds a member is
                # left out of pass at this peer's pace (a pair, one member frozen for a while)
                await step.wait_for_trigger()
                step.set_exception(AllreduceException(NO_ONE))
                return None
            # each try: no group the quorum would refuse where the members it waits for make it
            # up; a round prepared for a slot (H auto) keeps hivemind's rule (not measured)
            least = least_group(self.peer_id, self._expected, self._waited_for, self._quorum())
            matchmaking.min_group_size = least if step.allow_retries else 2
            group_info = await look(step)
            self._found = time.monotonic()  # (for _log_start)
            return group_info

        matchmaking._request_join_group = guarded
        matchmaking.look_for_group = looked
        matchmaking.follower_assemble_group = followed
        matchmaking.leader_assemble_group = led
        matchmaking._atom_guarded = True

    # --- signed metadata (gather.py) --------------------------------------------------------

    async def _unsealed(self, blob: bytes, peer_id: PeerID) -> tuple[bytes | None, str]:
        """(hivemind's blob, "") when `peer_id` sealed `blob` for this round (open swarms seal
        nothing: as it is); else (None, why)."""
        if self._gate.signing_key is None:
            return blob, ""
        key = await self._gate.public_key(self.dht, peer_id)
        return check(blob, self.prefix, peer_id.to_base58(), key, self._round_at, self._window_s)

    async def _checked(self, group_info: Any) -> Any:
        """The group with its members' metadata unsealed. Metadata a member did not seal can
        only come from the leader, who forged or forwarded it: the round is discarded and the
        leader rejected. Metadata its member sealed but no honest member sends (H1) rejects
        that member. Either way this member still takes part, for the others."""
        leader = self._leaders.pop(group_info.group_id, self.peer_id)
        self._led_by[group_info.group_id] = leader
        blobs: list[bytes] = []
        forged: list[str] = []
        unknown: list[str] = []
        for peer_id, blob in zip(group_info.peer_ids, group_info.gathered, strict=True):
            data, why = await self._unsealed(blob, peer_id)
            if peer_id == self.peer_id and blob != self._sealed:
                data, why = None, "not what it sent"
            if data is None:
                (unknown if why == NO_KEY else forged).append(
                    f"{peer_id.to_base58()[-8:]}'s ({why})"
                )
                opened = unseal(blob)
                data = opened.data if opened is not None else blob
            else:  # named before anything this round reports about it
                self._events.put((peer_id.to_base58(), self._name_in(data), "name"))
            blobs.append(data)
        group_info = replace(group_info, gathered=tuple(blobs))
        self._trusted = not (forged or unknown)
        if forged:
            self._discard.value = FORGED
            if leader != self.peer_id:
                self._reject(leader, f"led a round with forged metadata: {', '.join(forged)}")
        elif unknown:  # no certificate in this peer's view (a DHT that did not answer): no blame
            self._discard.value = UNVERIFIED
        elif self._gate.signing_key is not None:  # open swarms: a leader could have made it up
            for peer_id, data in zip(group_info.peer_ids, blobs, strict=True):
                if not self._well_formed(data):
                    self._discard.value = MALFORMED
                    self._reject(peer_id, "signed malformed round metadata")
        return group_info

    def _name_in(self, data: bytes) -> str:
        try:
            info = self.serializer.loads(self.serializer.loads(data)[2])
            return str(info.get("name", ""))[:64]
        except Exception:  # malformed: named by its peer ID
            return ""

    def _well_formed(self, data: bytes) -> bool:
        """hivemind's part and the fields every round reads, as an honest member sends them."""
        defended = self._defence is not None  # the defences read the size it reports
        try:
            bandwidth, mode, user = self.serializer.loads(data)
            info = self.serializer.loads(user)
            numbers = [float(info["weight"]), float(info["probe"])]
            if defended:
                numbers.append(float(info["rms"]))
            if bandwidth is not None:  # hivemind's default: unknown
                numbers.append(float(bandwidth))
            AveragingMode(mode)
        except Exception:  # anything at all may have been signed
            return False
        return all(finite(x) and x >= 0 for x in numbers)

    # --- robust all-reduce ------------------------------------------------------------------

    @contextmanager
    def get_tensors(self) -> Iterator[Sequence[torch.Tensor]]:
        # (for _log_start; in this process a try's all-reduce is the caller: another one in
        # between would shift time between its "load balancing" and "lock" figures, not the sum)
        self._tensors_asked = time.monotonic()
        with super().get_tensors() as tensors:
            self._tensors_held = time.monotonic()
            yield tensors

    async def _aggregate_with_group(self, group_info, min_vector_size, **kwargs):
        self._handed = (time.monotonic(), time.time())  # (for _log_start)
        self._discard.value = 0  # this attempt's: a retry after a lost one may still land
        self._attempts.value += 1
        self._running, self._ended_over, sealed = group_info.group_id, set(), group_info
        self._running_sealed = sealed
        try:
            group_info = await self._checked(group_info)
            self._checked_at = time.monotonic()
            if not self._audited and any(
                p in self._gate.banned or self._excluded(p) for p in group_info.peer_ids
            ):
                # take part for the others; apply nothing (module docstring)
                self._discard.value = self._discard.value or BANNED
            return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        except BaseException:
            # the same group at once, less those it ended early over (redo.py): assembled
            # before this group ends, so that the others' parts for it wait for it
            self._redo = redo(sealed, self._ended_over, self.peer_id, self._quorum())
            if self._redo is not None:
                self._assembled.add(self._redo.group_id)
            if self._ended_over:  # (bench attack --trace: why a member ran no redo)
                log.debug(
                    "the try of %d members (%s) ended over %s; quorum %d, %s",
                    len(sealed.peer_ids),
                    "a redo" if is_redo(sealed.group_id) else "found by matchmaking",
                    ", ".join(sorted(p.to_base58()[-8:] for p in self._ended_over)),
                    self._quorum(),
                    "its redo formed" if self._redo is not None else "no redo",
                )
            raise
        finally:
            self._running = self._running_sealed = None
            self._group_ended = time.monotonic()
            # (kept from its runner already where the round ran one: _ran_record)
            self._ran.setdefault(
                group_info.group_id, Ran(time.monotonic(), frozenset(self._ended_over))
            )
            keep_latest(self._ran, HEARD_KEPT)
            self._assembled.discard(group_info.group_id)  # ran: a late request is refused
            started = self._running_groups.get(group_info.group_id)
            if started is not None and not started.done():
                started.cancel()  # this member will not run it: parts waiting for it end now

    def _log_start(self, group_info: Any) -> None:
        """Where the time went between hivemind handing this member a group (after the round's
        trigger) and the try's all-reduce beginning: at INFO where it took SLOW_START_S or more,
        else at DEBUG."""
        now = time.monotonic()
        handed, wall = self._handed
        took = now - handed
        level = logging.INFO if took >= SLOW_START_S else logging.DEBUG
        if not log.isEnabledFor(level):
            return
        found = handed - self._found if 0 < self._found <= handed else math.nan
        asked = max(self._tensors_asked, self._checked_at)
        held = max(self._tensors_held, asked)
        log.log(
            level,
            "began a try's all-reduce %.2f s after its group (%s) was handed to this member at "
            "%s (found %.2f s before): metadata checked in %.2f s, load balancing %.2f s, the "
            "averaged tensors' lock %.2f s, then %.2f s to begin",
            took,
            ", ".join(p.to_base58()[-8:] for p in group_info.peer_ids),
            datetime.fromtimestamp(wall).strftime("%H:%M:%S.%f")[:-3],
            found,
            self._checked_at - handed,
            asked - self._checked_at,
            held - asked,
            max(now - held, 0.0),
        )

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        self._log_start(group_info)
        for tensor, original in zip(tensors, self._inputs, strict=True):
            tensor.copy_(original)  # every attempt of a round starts from the round's input
        held, probes = tensors
        tensors, kwargs["tensor_infos"] = round_layout(held, probes, kwargs["peer_fractions"])
        group_id = group_info.group_id if group_id is None else group_id
        runner_type: type[ExactAverageRunner] = ExactAverageRunner
        extra: dict[str, Any]
        if self._defence is not None:
            runner_type = AuditedRunner if self._defence.audit else RobustRunner
            extra = self._robust_arguments(group_info, self._defence)
            extra["on_stall"] = self._left_out.stall
            if self._attack == "lying_auditor":  # bench attack only
                extra["slander"] = SLANDER
        elif self._attack == "lying_reducer":  # bench attack only: it lies in undefended swarms too
            runner_type, extra = RobustRunner, self._robust_arguments(group_info, NO_DEFENCE)
        else:  # an undefended round: the members' own weights
            flags = membership(self._users(group_info))
            ids = group_info.peer_ids
            extra = {
                "out_of_sync": {p for p, ok in zip(ids, flags, strict=True) if not ok},
                "delta_keys": {key for key, kind in enumerate(self._kinds) if kind == DELTA},
            }
        runner = runner_type(
            **extra,
            heard=self._heard_of(group_id),
            opened=self._opened,
            admitted=self._admitted,
            since=self._group_ended,  # (set as this attempt ends)
            start_timeouts=start_timeouts(self._users(group_info), self._start_timeout_s),
            first_part_timeouts=first_part_timeouts(
                self._first_parts, group_info.peer_ids, self._start_timeout_s
            ),
            first_part_delays=self._first_parts,
            first_part_floor=self._start_timeout_s,
            on_part_gap=self._first_part_took,
            leader=self._led_by.get(group_info.group_id),
            traffic=self._traffic,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        if isinstance(runner, AuditedRunner):  # its auditor and members ask it after it ends
            self._audits[group_id] = runner
            keep_latest(self._audits, AUDITS_KEPT)
        self._running_groups[group_id].set_result(runner)
        index = 0
        try:
            async for average in runner:  # to its end: an audited round is checked after the last
                tensors[index].copy_(average)  # the same bits on every member (exact.py)
                index += 1
        finally:
            # not waited for in a retry (SUSPECT_ROUNDS); those that took part are again
            self._suspects.tried(group_info.peer_ids, runner.suspects, self._left_out.rounds)
            self._ended_over = set(runner.ended_over)
            self._ran_record(group_id, runner)  # (its end as the runner saw it)
        self.last_updated = get_dht_time()
        self._state_updated.set()

    def _lie(self) -> float:
        """bench attack's lying reducer: as far as the swarm's check lets it (its own defences'
        bounds, which every member shares; the defaults in an undefended swarm). With fewer
        than three members in sync it returns an average of the largest size the pair check
        accepts instead (robust.RobustReducer)."""
        if self._attack != "lying_reducer":
            return 0.0
        return lie_sizes((self._defence or Defence()).reduced)

    def _users(self, group_info: Any) -> list[dict[str, Any]]:
        """What each member told the group, in group order ({} where malformed)."""
        users: list[dict[str, Any]] = []
        for blob in group_info.gathered:
            try:
                user = self.serializer.loads(self.serializer.loads(blob)[2])
                users.append(user if isinstance(user, dict) else {})
            except Exception:  # malformed metadata: the probe check discards the round
                users.append({})
        return users

    def _robust_arguments(self, group_info: Any, defence: Defence) -> dict[str, Any]:
        """The robust runner's view of the group, from the metadata its members gathered
        (NO_DEFENCE: hivemind's plain weighted mean, for a lying reducer in an undefended
        swarm)."""
        users = self._users(group_info)
        ids = group_info.peer_ids
        flags = membership(users)
        claimed = [_number(u.get("weight")) for u in users]
        weights = (
            [w if math.isfinite(w) and w > 0 else MIN_WEIGHT for w in claimed]
            if defence == NO_DEFENCE
            else equal_weights(claimed)
        )
        if defence != NO_DEFENCE:  # the group's smallest typical update: what most declare
            declared = [_number(u.get("min_scale")) for u in users]
            valid = [x for x in declared if math.isfinite(x) and x >= 0]
            if valid:
                defence = replace(defence, min_scale=lower_median(valid))
        reads = reads_members(users, ids, self.peer_id, self._trusted)
        # members on probation at most of the group: read, their updates left out (probation.py)
        only_read = {p for p, ro in zip(ids, read_only(users, ids, flags), strict=True) if ro}
        return {
            "kinds": self._kinds,
            "weights": dict(zip(ids, weights, strict=True)),
            "reported_rms": dict(zip(ids, [_number(u.get("rms")) for u in users], strict=True)),
            "banned": {p for p in ids if p in self._gate.banned or self._excluded(p)},
            "in_sync": dict(zip(ids, flags, strict=True)),
            "read_only": only_read,
            "defence": defence,
            # metadata the leader forged may make an honest member look bad: no one is judged
            "on_reject": self._reject if self._trusted else lambda peer_id, why: None,
            "on_doubt": self._left_out.stall if self._trusted else lambda peer_id, why: None,
            "on_agreement": self._left_out.readings if reads else None,
            "lie": self._lie(),  # bench attack only
        }


def reads_members(users: list[dict[str, Any]], ids: list[Any], own: Any, trusted: bool) -> bool:
    """Whether this member (`own`) reads the others' updates against its own this round (the
    opposing-update rule, exclusion.LeftOut.reading): not where a leader forged the round's
    metadata, nor where this member brings its weight average (`weight_average` in its own
    metadata: the last round with train.ema, finish.py), which is not its progress since the
    round before. There two honest peers read each other at -0.75 and -0.85 (README machines
    test), and each left the other out. Only this member's own word counts: a member that says
    it brings its average is still read by the others (an attacker would say so every round)."""
    at = ids.index(own) if own in ids else -1
    mine = users[at] if 0 <= at < len(users) else {}
    return trusted and mine.get("weight_average") is not True


def _number(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def read_ids(members: ExpectedMembers | None) -> list[PeerID]:
    """The peer IDs in a list the runtime wrote (an entry that is no peer ID is skipped: no
    such peer can join, so none is waited for)."""
    ids = []
    for peer_id in members.read() if members is not None else []:
        try:
            ids.append(PeerID.from_base58(peer_id))
        except Exception:
            continue
    return ids


def keep_latest(entries: dict[Any, Any], most: int) -> None:
    """Drop the oldest of `entries` (insertion order) until at most `most` are left."""
    while len(entries) > most:
        del entries[next(iter(entries))]


def _stamp(stamps: dict[Any, float], peer_id: Any) -> float | None:
    """Stamp `peer_id` now, the latest OPENED_KEPT peers kept; its stamp before, if any."""
    was = stamps.pop(peer_id, None)
    stamps[peer_id] = time.monotonic()
    keep_latest(stamps, OPENED_KEPT)
    return was


def _unstamp(stamps: dict[Any, float], peer_id: Any, was: float | None) -> None:
    """Put back `peer_id`'s stamp from before (_stamp): the request was no stream of parts."""
    stamps.pop(peer_id, None)
    if was is not None:
        stamps[peer_id] = was
