"""Audited reduction: a second member recomputes each span, so no reducer can lie unseen.

In a butterfly all-reduce one member reduces each span: it receives every member's part of the
span and returns their robust average (robust.py). Members could only check what came back
against loose bounds, so a reducer that knew them moved its span's average by a few typical
updates every round, unseen. Here each span has an *auditor*, the next reducer in the group's
order:

1. The reducer reduces the parts as they came over the wire, its own part through the same
   codec, and streams every part it combined to the auditor as it combines it
   (`rpc_audit_parts`): one model's worth of the wire codec per member and round.
2. The auditor replays the reduction from those parts with the same robust reducer and the
   group's shared settings (the reducer's part the one centered on), and compares the replay
   with the averages the reducer sent it.
3. Every member then asks each span's auditor for its verdict (`rpc_audit_verdict`), revealing
   a seed it drew in secret when the round began. The auditor answers with random projections
   (by that seed) of each replayed part, and a hash of the parts the reducer forwarded as this
   member's. The member compares them with the same projections of the averages it received and
   a hash of the parts it sent. Anything amiss and the round is discarded before anything is
   applied. The seed is revealed only after the averages arrived, so a reducer cannot hide a lie
   where the projections do not look; they tolerate the codec's rounding of a replay whose sums
   ran in another order (`TOLERANCE`).

Blame falls only where it is certain, and proof bans (guarded.py): the auditor bans a reducer
whose averages differ from the replay of the very parts it forwarded, or that forwarded a part
other than the auditor's own as the auditor's; the reducer, which knows its averages are honest,
bans an auditor that reports otherwise. A reducer that forwarded nothing (in time), or an
auditor that gives no verdict, may only have a slow link: it is left out of the next rounds for
a while, as a member that stalls (not one that answered this member's parts that it is not in
the group, and sent nothing: it missed its leader's word, and has no verdict to give). A member
that is neither sees only that the two disagree, and discards the round without blaming
either. So a reducer that lies loses the round the first time (nothing of it is applied) and is
banned by its auditor; a member that lies as an auditor is banned by the reducer it slandered.
The replay's settings are the group's: every member declares its defence's smallest typical
update (`min_scale`, from its learning rate) and every reducer and auditor uses the lower median
of the declarations.

The auditor also checks the parts forwarded as its own, so a reducer cannot make up the
auditor's part to fit a lie (it is left out for it). Not closed:
- a reducer that makes up the parts of members other than its auditor, consistent with its
  lie (with three members it then controls two of three parts): each member so replaced sees
  it (the hash) and discards the round without knowing whom to blame, while the auditor applies
  the lie;
- a reducer that lies to every member but its auditor: they discard the round without blame,
  the auditor and the reducer apply it, and the others then re-synchronize.
Averages and parts signed by their senders would close both. Members must also share
`peer.audit` (one without the audit forwards nothing and answers no verdict: it is left out).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

import torch
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.asyncio import aiter_with_timeout

from atomtrain.peer.robust import RobustReducer, RobustRunner
from atomtrain.peer.traffic import RECEIVED, SENT

log = logging.getLogger(__name__)

PROJECTIONS = 4
"""Random projections of each part an auditor reports: a lie larger than the tolerance shows in
any one of them but with a chance of about the tolerance; in all four, never."""
TOLERANCE = 1e-3
"""Largest difference, relative to the part, between projections of an honest replay and of the
averages received: the codec rounds a replay's last bit the other way in a few elements at most
(its sums in another order)."""
OK, MISMATCH, SILENT, FAILED = "ok", "mismatch", "silent", "failed"
"""Verdicts: the auditor replayed the span; the reducer forwarded malformed parts; it forwarded
not all the parts it combined (in time); the request was not for this auditor's span."""


def part_hash(wire: Any) -> bytes:
    """The hash of a part as it travels (a runtime_pb2.Tensor)."""
    return hashlib.sha256(wire.SerializeToString(deterministic=True)).digest()


def project(seed: int, part_index: int, x: torch.Tensor) -> torch.Tensor:
    """PROJECTIONS random projections of a part, drawn from `seed` and the part's index."""
    flat = x.detach().reshape(-1).float()
    generator = torch.Generator().manual_seed((seed + 7919 * part_index) % (1 << 62))
    return torch.randn(PROJECTIONS, flat.numel(), generator=generator) @ flat


def forwarded_as_sent(forwarded: list[bytes], sent: list[bytes]) -> bool | None:
    """Whether the parts a reducer forwarded as a member's are those the member sent (per-part
    hashes): True; False: others; None: the first of them only (the member stopped sending, and
    the reducer combined what came: no one's fault that shows)."""
    if forwarded == sent:
        return True
    return None if sent[: len(forwarded)] == forwarded else False


def agree(seen: list[torch.Tensor], told: list[torch.Tensor]) -> bool:
    """Projections of the same parts, within TOLERANCE of each other, part by part."""
    if len(seen) != len(told):
        return False
    for a, b in zip(seen, told, strict=True):
        size = max(float(a.norm()), float(b.norm()))
        if not float((a - b).norm()) <= TOLERANCE * size + 1e-30:
            return False
    return True


class AuditedRunner(RobustRunner):
    """The robust all-reduce with every span audited (module docstring). `on_doubt` blames."""

    def __init__(self, *, slander: float = 1.0, **kwargs: Any) -> None:
        """`slander`: bench attack's lying auditor scales the projections it reports."""
        self._slander = slander
        kwargs["banned"] = set()  # reducers of audited rounds combine by what they can measure
        super().__init__(**kwargs)
        container = self.tensor_part_container
        self._own_index = self.ordered_peer_ids.index(self.peer_id)
        reducers = [i for i, n in enumerate(container.num_parts_by_peer) if n]
        self._auditor = {s: reducers[(k + 1) % len(reducers)] for k, s in enumerate(reducers)}
        self._audited = next((s for s, a in self._auditor.items() if a == self._own_index), None)
        self._seeds = {s: secrets.randbits(62) for s in reducers}
        # projections of the averages received, computed off the event loop, per span and part
        self._seen: dict[int, dict[int, asyncio.Future]] = {s: {} for s in reducers}
        self._fell_back: set[int] = set()  # spans whose reducer failed: our own part stands in
        self._sent: dict[int, list[bytes]] = {s: [] for s in reducers}  # per-part hashes
        self._timeout = float(self.sender_timeout or 10.0)
        # as a reducer: the parts it holds until it combined them, then streams to its auditor
        self._held: dict[tuple[int, int], Any] = {}
        self._forward: asyncio.Queue = asyncio.Queue()
        self.tensor_part_reducer.on_combined = self._combined
        # as an auditor: the replayed averages (on the wire) and the forwarded parts' hashes
        self._loop = asyncio.get_event_loop()
        self._replay: asyncio.Future = self._loop.create_future()
        self._answered: set[PeerID] = set()
        register = container.register_processed_part
        fall_back = container.register_failed_reducer

        def sketched(peer_index: int, part_index: int, average: torch.Tensor) -> None:
            register(peer_index, part_index, average)  # checked first (robust.py)
            if self._future.done():  # came after the round ended: nothing to audit
                return
            seed = self._seeds[peer_index]
            self._seen[peer_index][part_index] = self._loop.run_in_executor(
                None, project, seed, part_index, average
            )

        def failed(peer_index: int) -> None:
            self._fell_back.add(peer_index)
            fall_back(peer_index)

        container.register_processed_part = sketched
        container.register_failed_reducer = failed

    # --- as a sender --------------------------------------------------------------------------

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[Any]:
        async for message in super()._generate_input_for_peer(peer_index):
            self._sent[peer_index].append(part_hash(message.tensor_part))
            yield message

    # --- as a reducer -------------------------------------------------------------------------

    def _own_input(self, part_index: int, part: Any, info: Any) -> Any:
        wire = self.tensor_part_container.compression.compress(part, info)
        self._sent[self._own_index].append(part_hash(wire))
        self._held[(self._own_sender, part_index)] = wire
        return deserialize_torch_tensor(wire)

    def _received(self, sender_index: int, part_index: int, wire: Any) -> None:
        self._held[(sender_index, part_index)] = wire

    def _combined(self, part_index: int, senders: list[int]) -> None:
        for i in senders:
            self._forward.put_nowait((part_index, i, self._held.pop((i, part_index), None)))
        for key in [k for k in self._held if k[1] <= part_index]:
            del self._held[key]  # parts of senders that failed before: never combined
        if part_index == self.tensor_part_reducer.num_parts - 1:
            self._forward.put_nowait(None)

    async def _push_to_auditor(self) -> None:
        auditor = self.ordered_peer_ids[self._auditor[self._own_index]]

        async def messages() -> AsyncIterator[Any]:
            while (item := await self._forward.get()) is not None:
                part_index, sender, wire = item
                message = averaging_pb2.AveragingData(
                    code=averaging_pb2.PART_FOR_AVERAGING,
                    group_id=self.group_id,
                    peer_id=self.sender_peer_ids[sender].to_bytes(),
                    tensor_part=wire,
                    weight=float(part_index),
                )
                self.traffic.add(SENT, message)
                yield message

        try:
            stream = await self._get_peer_stub(auditor).rpc_audit_parts(messages())
            async for _ in stream:
                pass
        except Exception as e:  # the auditor's verdict says what it got
            log.debug(f"forwarding to the auditor {auditor} failed: {e!r}")
        finally:
            self._held.clear()
            while not self._forward.empty():
                self._forward.get_nowait()

    # --- as the auditor -----------------------------------------------------------------------

    def _settle(self, *replay: Any) -> None:
        if not self._replay.done():
            self._replay.set_result(replay)
            # kept for the members that ask; let go in any case well after the round
            self._loop.call_later(4 * self._timeout, self._forget)

    def _forget(self) -> None:
        if len(self._replay.result()) > 2:
            self._replay.result()[2].clear()

    async def take_forwarded(self, reducer: PeerID, stream: AsyncIterator[Any]) -> bool:
        """Replays the span this member audits from the parts its reducer streams; False: the
        caller is not that reducer."""
        span = self._audited
        if span is None or reducer != self.ordered_peer_ids[span] or self._replay.done():
            return False
        replayer = self.replay_reducer(span)
        hashes: list[list[bytes]] = [[] for _ in self.sender_peer_ids]
        outputs: list[Any] = []
        parts: dict[int, torch.Tensor] = {}
        current = 0
        try:
            # a reducer combines a part once every sender's came or its sender timeout dropped
            # the rest: a gap of up to that timeout is honest (the same gap here named it a
            # staller whenever one of its senders was late)
            async for message in aiter_with_timeout(stream, 2 * self._timeout):
                self.traffic.add(RECEIVED, message)
                part_index = int(message.weight)
                sender = self.sender_peer_ids.index(PeerID(message.peer_id))
                if part_index == current + 1 and parts:
                    outputs.append(await self._replayed(replayer, current, parts))
                    parts, current = {}, part_index
                if part_index != current or sender in parts:
                    raise ValueError(f"part {part_index} of sender {sender} out of order")
                part = await self._loop.run_in_executor(
                    None, deserialize_torch_tensor, message.tensor_part
                )
                if part.shape != replayer.part_shapes[current] or not part.is_floating_point():
                    raise ValueError(f"a part of {part.dtype} {tuple(part.shape)}")
                hashes[sender].append(part_hash(message.tensor_part))
                parts[sender] = part.detach().float().clone()  # as the reducer holds it
            if parts:
                outputs.append(await self._replayed(replayer, current, parts))
        except asyncio.TimeoutError:
            self._settle(SILENT, "stopped forwarding the parts it combined", [])
            return True
        except Exception as e:  # anything the reducer forwarded that an honest one cannot
            self._settle(MISMATCH, f"forwarded malformed parts ({e})", [])
            return True
        finally:
            replayer.finished.set()  # fed directly, never through its accumulators
        if len(outputs) != replayer.num_parts:
            why = f"forwarded the parts of {len(outputs)} of {replayer.num_parts} averages"
            self._settle(SILENT, why, [])
        else:
            self._settle(OK, "", outputs, hashes)
        return True

    async def _replayed(
        self, replayer: RobustReducer, part_index: int, parts: dict[int, torch.Tensor]
    ) -> Any:
        """The average an honest reducer sends for one part, on the wire (kept so until every
        member has asked: a quarter of the float32 span's size with the 8-bit codec)."""
        assert self._audited is not None  # only a member that audits a span replays one
        info = self.span_parts[self._audited][part_index][1]

        def replay() -> Any:
            replayer.current_part_index = part_index
            replayer.parts = parts
            return self.tensor_part_container.compression.compress(replayer._combine(), info)

        return await self._loop.run_in_executor(None, replay)

    def _projections(self, seed: int, outputs: list[Any]) -> list[torch.Tensor]:
        return [project(seed, k, deserialize_torch_tensor(x)) for k, x in enumerate(outputs)]

    async def _replayed_or_silent(self) -> tuple:
        try:
            return await asyncio.wait_for(asyncio.shield(self._replay), self._timeout)
        except asyncio.TimeoutError:
            self._settle(SILENT, "forwarded none of the parts it combined", [])
            return self._replay.result()

    async def _audit(self) -> str:
        """This member's verdict on the span it audits: its replay against the averages it
        received and the parts it sent ("" when they agree)."""
        span = self._audited
        assert span is not None  # only a member that audits a span gives a verdict
        reducer = self.ordered_peer_ids[span]
        if span in self._fell_back:  # the reducer failed on us: the probes discard the round
            return f"{reducer} sent not all its averages"
        replay = await self._replayed_or_silent()
        status, why, outputs = replay[:3]
        certain = status == MISMATCH  # it forwarded what no honest reducer does
        if status == OK:
            certain = True  # from here on, the reducer's own parts and averages convict it
            mine = forwarded_as_sent(replay[3][self._own_sender], self._sent[span])
            if mine is None:
                return f"{reducer} combined only the first of this member's parts"
            if not mine:
                status, why = MISMATCH, "forwarded another part as this member's"
            else:
                told = await self._loop.run_in_executor(
                    None, self._projections, self._seeds[span], outputs
                )
                self._release(outputs, self.peer_id)
                if agree(await self._seen_of(span), told):
                    return ""
                status, why = MISMATCH, "sent averages that differ from the audit's replay"
        convict = self._on_reject if certain else self._on_doubt
        convict(reducer, f"{why} (audit; its round discarded)")
        return f"{reducer} {why}"

    async def _seen_of(self, span: int) -> list[torch.Tensor]:
        seen = self._seen[span]
        return list(await asyncio.gather(*(seen[k] for k in sorted(seen))))

    def _release(self, outputs: list[Any], user: PeerID) -> None:
        """Let the replay go once every member (this one too) has used it."""
        self._answered.add(user)
        if self._answered >= set(self.sender_peer_ids):
            outputs.clear()

    async def answer(self, requester: PeerID, span: int, seed: int) -> dict[str, Any]:
        """The verdict on span `span` for a member that drew `seed`: from the replay alone, so
        a member whose own round broke still answers."""
        if span != self._audited or requester not in self.sender_peer_ids:
            return {"status": FAILED}
        replay = await self._replayed_or_silent()
        if replay[0] != OK:
            return {"status": replay[0]}
        _, _, outputs, hashes = replay
        if not outputs:
            return {"status": FAILED}  # asked twice, or long after: let go
        projections = await self._loop.run_in_executor(None, self._projections, seed, outputs)
        self._release(outputs, requester)
        return {
            "status": OK,
            "projections": [(p * self._slander).tolist() for p in projections],
            "parts": hashes[self.sender_peer_ids.index(requester)],
        }

    # --- every member -------------------------------------------------------------------------

    async def run(self) -> AsyncIterator[torch.Tensor]:
        push = None
        if self._own_index in self._auditor:
            push = asyncio.create_task(self._push_to_auditor())
        try:
            async for tensor in super().run():
                yield tensor
            failures = await self._conclude()
        finally:
            if push is not None and not push.done():  # it may still finish: the auditor asks
                self._loop.call_later(2 * self._timeout, push.cancel)
        if failures:
            raise AllreduceException(f"audit: {'; '.join(failures)}")

    async def _conclude(self) -> list[str]:
        """Every span's verdict, checked against what this member received (and sent)."""
        spans = [s for s in self._auditor if s != self._audited]
        checks = [self._ask(s) for s in spans]
        if self._audited is not None:
            checks.append(self._audit())
        answers = await asyncio.gather(*checks)
        return [why for why in answers if why]

    def _missed_the_group(self, peer_id: PeerID) -> bool:
        """`peer_id` answered this member's parts that it is not in the group and sent it
        nothing of the round: an honest member that missed its leader's word (guarded.py,
        _group_runner) says so, and has no verdict to give (nor, often, one whose own round of
        the group ended early). Doubted for the verdict it could not give, it was left out of
        the next rounds (bench attack, clean swarms too: an honest peer left out mid-run by
        both others, whose rounds then fell short of the quorum). Its span failed, so this
        member discards the round either way; exact.py names no staller for that answer, and
        one that sent its parts gives no such excuse."""
        return peer_id in self._not_in_group and not self._heard_from(peer_id)

    async def _ask(self, span: int) -> str:
        """Why this member's view of `span` fails its auditor's verdict ("" when it holds)."""
        auditor = self.ordered_peer_ids[self._auditor[span]]
        reducer = self.ordered_peer_ids[span]
        mine = span == self._own_index  # this member reduced it, and knows it did so honestly

        def blame(why: str, certain: bool = True) -> None:
            if mine:  # a false verdict on honest work convicts; one of no parts may be the link
                convict = self._on_reject if certain else self._on_doubt
                convict(auditor, f"{why} (audit; its round discarded)")

        if span in self._fell_back:  # the reducer failed on us: the probes discard the round
            return f"{reducer} sent not all its averages"
        if self._missed_the_group(auditor):
            return f"{auditor}, the auditor, says it is not in the group"
        request = averaging_pb2.AveragingData(
            group_id=self.group_id,
            weight=float(span),
            peer_id=self._seeds[span].to_bytes(8, "big"),
        )
        try:
            self.traffic.add(SENT, request)
            reply = await asyncio.wait_for(
                self._get_peer_stub(auditor).rpc_audit_verdict(request), 1.5 * self._timeout
            )
            self.traffic.add(RECEIVED, reply)
            told = MSGPackSerializer.loads(reply.peer_id) if reply.peer_id else {}
            status = told.get("status", FAILED) if isinstance(told, dict) else FAILED
        except Exception as e:
            status, told = f"{type(e).__name__}", {}
        if status not in (OK, SILENT, MISMATCH):  # an honest auditor always answers
            self._on_doubt(auditor, "gave no audit verdict (its round discarded)")
            return f"{auditor} gave no audit verdict ({status})"
        if status == SILENT:  # this member, its reducer, forwarded all it combined
            blame("claims this member did not forward the parts it combined", certain=False)
            return f"{auditor} says {reducer} forwarded not all the parts it combined"
        if status == MISMATCH:
            blame("took the parts this member forwarded for malformed")
            return f"{auditor} found the parts {reducer} forwarded malformed"
        try:
            projections = [torch.tensor(p, dtype=torch.float32) for p in told["projections"]]
            same_parts = forwarded_as_sent(list(told["parts"]), self._sent[span])
            same_averages = agree(await self._seen_of(span), projections)
        except Exception:
            blame("sent a malformed verdict")
            return f"{auditor} sent a malformed verdict"
        if same_parts is None:
            return f"{reducer} combined only the first of this member's parts"
        if not same_parts:
            blame("reports other parts than this member forwarded")
            return f"{reducer} forwarded other parts as this member's, or {auditor} says so"
        if not same_averages:
            blame("reports other averages than this member sent")
            return f"{reducer}'s averages to this member differ from {auditor}'s replay"
        return ""
