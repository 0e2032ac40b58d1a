"""redo.py: the group a member runs at once after a try ended early over some of its members."""

from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID

from atomtrain.peer.redo import is_redo, redo, redoes


def peer(i: int) -> PeerID:
    return PeerID(bytes([i]) * 34)


GROUP = GroupInfo(b"g" * 20, tuple(peer(i) for i in range(4)), tuple(b"m%d" % i for i in range(4)))
GROUP3 = GroupInfo(b"t" * 20, GROUP.peer_ids[:3], GROUP.gathered[:3])
GROUP5 = GroupInfo(b"f" * 20, tuple(peer(i) for i in range(5)), tuple(b"m%d" % i for i in range(5)))


def test_a_redo_keeps_the_group_order_and_sealed_metadata_of_the_members_not_ended_over():
    again = redo(GROUP, {peer(2)}, peer(0), quorum=3)
    assert again is not None and is_redo(again.group_id) and redoes(again.group_id, b"g" * 20)
    assert again.peer_ids == (peer(0), peer(1), peer(3))
    assert again.gathered == (b"m0", b"m1", b"m3")
    # every member that ended over the same members forms the same group, whoever it is
    assert redo(GROUP, {peer(2)}, peer(3), quorum=3) == again
    # ended over others, or a redo of another group: another ID (its parts are refused)
    assert redo(GROUP, {peer(1)}, peer(0), quorum=3).group_id != again.group_id
    other = GroupInfo(b"h" * 20, GROUP.peer_ids, GROUP.gathered)
    assert redo(other, {peer(2)}, peer(0), quorum=3).group_id != again.group_id
    assert not redoes(again.group_id, b"h" * 20) and not is_redo(GROUP.group_id)


def test_no_redo_without_a_member_ended_over_a_quorum_left_or_of_a_redo():
    assert redo(GROUP, set(), peer(0), quorum=2) is None  # lost for another reason
    assert redo(GROUP, {peer(9)}, peer(0), quorum=2) is None  # no member of the group
    assert redo(GROUP, {peer(2), peer(3)}, peer(0), quorum=3) is None  # a pair of a quorum of 3
    assert redo(GROUP, {peer(2), peer(3)}, peer(0), quorum=2) is not None
    assert redo(GROUP, {peer(1), peer(2), peer(3)}, peer(0), quorum=1) is None  # alone
    assert redo(GROUP, {peer(0)}, peer(0), quorum=2) is None  # (never itself)
    again = redo(GROUP, {peer(3)}, peer(0), quorum=2)
    assert again is not None and redo(again, {peer(2)}, peer(0), quorum=2) is None  # one a group


def test_the_order_of_the_members_kept_is_part_of_a_redos_id():
    turned = GroupInfo(GROUP.group_id, GROUP.peer_ids[::-1], GROUP.gathered[::-1])
    assert (
        redo(turned, {peer(2)}, peer(0), 3).group_id != redo(GROUP, {peer(2)}, peer(0), 3).group_id
    )


def test_a_member_holds_a_redo_of_the_group_it_runs_until_it_runs_it_or_its_floor_passes():
    """guarded._group_runner: parts of a redo of the group this member runs wait for it (a
    sender that ended the lost try sooner), and are served once this member runs that redo;
    refused once the start timeout's floor passed, or at once for a redo of another group, or
    when this member runs no group (it will not run it)."""
    import asyncio
    import time

    from atomtrain.peer.guarded import GuardedAverager

    again = redo(GROUP, {peer(2)}, peer(0), 3)
    elsewhere = redo(GroupInfo(b"h" * 20, GROUP.peer_ids, GROUP.gathered), {peer(2)}, peer(0), 3)

    def member(running: bytes | None) -> GuardedAverager:
        avg = GuardedAverager.__new__(GuardedAverager)
        avg._parent_pid = None  # (never started: hivemind's __del__ reads it)
        avg._running_groups, avg._ran, avg._assembled = {}, {}, set()
        avg._missed, avg._gave_up_on, avg._asking = {}, {}, 0
        avg._running, avg._start_timeout_s, avg._matchmaking = running, 0.5, None
        return avg

    async def served_once_it_runs_it() -> object:
        avg = member(GROUP.group_id)
        runner = object()

        async def its_try_ends_and_its_redo_starts() -> None:
            await asyncio.sleep(0.2)
            avg._assembled.add(again.group_id)  # as the lost try ends (guarded.py)
            avg._running = None
            await asyncio.sleep(0.1)
            avg._running_groups[again.group_id] = asyncio.get_running_loop().create_future()
            avg._running_groups[again.group_id].set_result(runner)

        ending = asyncio.ensure_future(its_try_ends_and_its_redo_starts())
        served = (await avg._group_runner(again.group_id)) is runner
        await ending
        return served

    async def waited(running: bytes | None, group_id: bytes) -> tuple[object, float]:
        began = time.monotonic()
        got = await member(running)._group_runner(group_id)
        return got, time.monotonic() - began

    assert asyncio.run(served_once_it_runs_it())
    got, took = asyncio.run(waited(GROUP.group_id, again.group_id))  # its try never ends
    assert got is None and 0.5 <= took < 1.5
    for running, group_id in ((GROUP.group_id, elsewhere.group_id), (None, again.group_id)):
        got, took = asyncio.run(waited(running, group_id))
        assert got is None and took < 0.2


def test_a_member_still_in_the_lost_try_runs_the_redo_once_every_other_member_kept_sent_it():
    """guarded._follow_redo, through _group_runner as parts of a redo are held: a member that
    started the lost try later than the others ends it later (its timeouts count from its own
    start). Once every other member a redo of that group keeps has sent it parts of the redo
    (each ended the try: it is lost), it ends the try over the one member the redo leaves out,
    and so forms and runs the same redo, not at its own timeouts (past the floor it holds their
    parts for, the redo ended without it: bench attack, run NP4), whether or not the left-out
    member's parts of the try reached it (one that had all it needed landed the try while the
    others landed their redo: run FR3). The left-out member's own parts of the redo count for
    nothing; one member's parts alone end nothing, nor asks, nor a redo leaving out more than
    one member, or all but a pair."""
    import asyncio
    import time
    from types import SimpleNamespace

    from atomtrain.peer.guarded import GuardedAverager

    REDO_RUNNER = object()

    class Runner:
        """The lost try's runner: ending it early does what the averager does then
        (guarded._aggregate_with_group): its redo formed and run."""

        def __init__(self, avg: GuardedAverager, quorum: int) -> None:
            self.avg, self.quorum = avg, quorum
            self.ended: list[tuple[str, set]] = []

        def end_early(self, why: str, over) -> None:
            self.ended.append((why, set(over)))
            avg = self.avg
            again = redo(avg._running_sealed, set(over), avg.peer_id, self.quorum)
            avg._assembled.add(again.group_id)
            avg._running = avg._running_sealed = None
            avg._running_groups[again.group_id] = asyncio.get_running_loop().create_future()
            avg._running_groups[again.group_id].set_result(REDO_RUNNER)

    FLOOR = 1.0  # how long a redo's parts are held (the start timeout's floor)

    async def held(
        group, quorum, redo_id, sent, apart=0.1, may_redo=True
    ) -> tuple[list, list, float]:
        """Parts (or asks: parts False) of `redo_id` from each of `sent` in turn, `apart` s
        apart, reach peer 1 as it still runs `group`: what each got, how the try ended, how
        long it took."""
        avg = GuardedAverager.__new__(GuardedAverager)
        avg._parent_pid = None  # (never started: hivemind's __del__ reads it)
        avg.dht = SimpleNamespace(peer_id=peer(1))
        avg._ran, avg._assembled, avg._missed, avg._gave_up_on = {}, set(), {}, {}
        avg._asking, avg._matchmaking, avg._start_timeout_s = 0, None, FLOOR
        avg._running, avg._running_sealed, avg._redos_of = group.group_id, group, None
        avg._redo_senders = {}
        avg._quorum, avg._may_redo = (lambda: quorum), may_redo
        runner = Runner(avg, quorum)
        avg._running_groups = {group.group_id: asyncio.get_running_loop().create_future()}
        avg._running_groups[group.group_id].set_result(runner)
        for fake in range(100):  # redo IDs of the left-out member's making crowd out nothing
            avg._follow_redo(redo_id[:-2] + fake.to_bytes(2, "big"), peer(2))
        began, tasks = time.monotonic(), []
        for sender, parts in sent:
            tasks.append(asyncio.ensure_future(avg._group_runner(redo_id, sender, parts)))
            await asyncio.sleep(apart)
        got = await asyncio.gather(*tasks)
        return got, runner.ended, time.monotonic() - began

    again = redo(GROUP, {peer(2)}, peer(0), 3)  # peers 0, 1 and 3, run by 0 and 3
    # the left-out member's parts first, then the two others kept: it follows at the last
    sent = [(peer(2), True), (peer(0), True), (peer(3), True)]
    got, ended, took = asyncio.run(held(GROUP, 3, again.group_id, sent))
    assert got == [REDO_RUNNER] * 3 and took < FLOOR - 0.2
    assert len(ended) == 1 and ended[0][1] == {peer(2)}
    assert ended[0][0].endswith("ran the group again without " + str(peer(2))[-8:])
    # none of these end the try: their parts are refused at the floor, as before
    for group, quorum, redo_id, sent, apart, may_redo in (
        # peer 3 may still be in the try: nothing lost yet here
        (GROUP, 3, again.group_id, [(peer(0), True), (peer(0), True)], 0.1, True),
        # asks for this member's span, not parts
        (GROUP, 3, again.group_id, [(peer(0), False), (peer(3), False)], 0.1, True),
        # peer 0's parts held past the floor, refused (its redo has ended over this member)
        (GROUP, 3, again.group_id, [(peer(0), True), (peer(3), True)], FLOOR + 0.3, True),
        # a round prepared for a slot, which runs no redo
        (GROUP, 3, again.group_id, [(peer(0), True), (peer(3), True)], 0.1, False),
        # two members left out (two colluders would keep it in a group of three with them)
        (
            GROUP5,
            3,
            redo(GROUP5, {peer(3), peer(4)}, peer(0), 3).group_id,
            [(peer(0), True), (peer(2), True)],
            0.1,
            True,
        ),
        # a pair: one other member's word alone
        (GROUP3, 2, redo(GROUP3, {peer(2)}, peer(0), 2).group_id, [(peer(0), True)], 0.1, True),
    ):
        got, ended, took = asyncio.run(held(group, quorum, redo_id, sent, apart, may_redo))
        assert got == [None] * len(sent) and ended == [] and took >= FLOOR


def test_a_leader_that_names_its_group_as_a_redo_is_refused_and_rejected():
    """Only members name a redo; a leader whose group ID looks like one (which would keep its
    members from redoing its groups, and spared it the blame for forged metadata) is refused
    before its group is taken in, and rejected."""
    import asyncio
    import queue
    from types import SimpleNamespace

    from atomtrain.peer.guarded import GuardedAverager
    from atomtrain.peer.redo import TAG

    taken: list[bytes] = []

    async def assemble(leader, message):
        taken.append(message.group_id)
        return GroupInfo(message.group_id, GROUP.peer_ids, GROUP.gathered)

    async def unused(*args):
        raise AssertionError("not called here")

    banned: set = set()
    avg = GuardedAverager.__new__(GuardedAverager)
    avg._parent_pid = None  # (never started: hivemind's __del__ reads it)
    avg._matchmaking = SimpleNamespace(
        _request_join_group=unused, request_timeout=1.0, follower_assemble_group=assemble,
        leader_assemble_group=unused, look_for_group=unused,
    )  # fmt: skip
    avg._gate = SimpleNamespace(banned=banned, ban=banned.add)
    avg._events, avg._leaders, avg._assembled = queue.Queue(), {}, set()
    avg._guard_leaders()
    follow = avg._matchmaking.follower_assemble_group
    assert asyncio.run(follow(peer(7), SimpleNamespace(group_id=TAG + b"x" * 24))) is None
    assert taken == [] and banned == {peer(7)} and avg._events.get_nowait()[2] == "reject"
    assert asyncio.run(follow(peer(8), SimpleNamespace(group_id=b"g" * 20))) is not None
    assert taken == [b"g" * 20] and avg._leaders[b"g" * 20] == peer(8)


def test_an_ask_that_came_before_its_member_ran_the_group_is_answered_not_in_it():
    """exact.py asks a member it ended a round over for its span; one that was late to the group
    (or to a redo) got the ask held until it ran the group, and its runner, which answers no
    ask, did not say it was not in it: the asker named it unless its parts had come, which a
    redo ended at once may not send. Now it says so. An ask for a group it ran already, or
    parts, go to the group's runner as before."""
    import asyncio
    from types import SimpleNamespace

    from hivemind.proto import averaging_pb2
    from hivemind.proto.runtime_pb2 import Tensor

    from atomtrain.peer.guarded import GuardedAverager
    from atomtrain.peer.traffic import Traffic

    delivered: list[int] = []
    held_as: list[bool] = []  # what each request was to _group_runner: parts (True), or not

    class Runner:
        over = False
        sender_peer_ids = ()  # (peer 5 sends this group nothing: no first part measured)

        async def rpc_aggregate_part(self, stream, context):
            async for _ in stream:
                delivered.append(1)
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)

    allowed = [True]

    async def allows(dht, peer_id):
        return allowed[0]

    def member(running: bool) -> GuardedAverager:
        avg = GuardedAverager.__new__(GuardedAverager)
        avg._parent_pid = None  # (never started: hivemind's __del__ reads it)
        avg._opened, avg._heard, avg._audits, avg._traffic = {}, {}, {}, Traffic()
        avg._admitted, avg._first_parts, avg.allreduce_kwargs = {}, {}, {}
        avg._streams, avg._ran = {}, {}
        avg._gate, avg.dht, avg._defence = SimpleNamespace(allows=allows), None, None
        avg._running_groups = {b"g" * 20: None} if running else {}

        async def group_runner(group_id, sender=None, parts=False):
            held_as.append(parts)
            return Runner()  # (it runs the group by now)

        avg._group_runner = group_runner
        return avg

    async def answer(running: bool, message, defence=None) -> int:
        async def stream():
            yield message

        context = SimpleNamespace(remote_id=peer(5))
        avg = member(running)
        avg._defence = defence
        replies = avg.rpc_aggregate_part(stream(), context)
        return (await anext(replies)).code

    ask = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"g" * 20)
    assert asyncio.run(answer(False, ask)) == averaging_pb2.BAD_GROUP_ID and not delivered
    assert asyncio.run(answer(True, ask)) == averaging_pb2.AVERAGED_PART and delivered
    # parts, and only parts its gate let in, are parts to _group_runner (a redo's may end the
    # try this member still runs: guarded._follow_redo), not asks
    part = averaging_pb2.AveragingData(
        code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"g" * 20, tensor_part=Tensor()
    )
    assert asyncio.run(answer(True, part)) == averaging_pb2.AVERAGED_PART
    allowed[0] = False  # (a member this one banned, in an audited swarm: let on to the runner)
    defended = SimpleNamespace(audit=True)
    asyncio.run(answer(True, part, defended))
    assert held_as == [False, False, True, False]


def test_a_try_begun_late_is_logged_with_where_its_time_went(caplog, monkeypatch):
    """A member that began a try's all-reduce SLOW_START_S or more after hivemind handed it the
    group says so at INFO, with the group, the wall-clock time it was handed (to compare across
    peers' logs), how long before that its matchmaking found the group, and how long the
    metadata checks, load balancing, the averaged tensors' lock and what came after took; a
    prompt one only at DEBUG."""
    import logging
    import types

    from atomtrain.peer import guarded
    from atomtrain.peer.guarded import SLOW_START_S, GuardedAverager

    member = types.SimpleNamespace(
        _found=99.5,
        _handed=(100.0, 1_800_000_000.25),
        _checked_at=100.1,
        _tensors_asked=100.3,
        _tensors_held=100.8,
    )
    monkeypatch.setattr(guarded.time, "monotonic", lambda: 101.0)
    with caplog.at_level(logging.INFO, logger="atomtrain.peer.guarded"):
        GuardedAverager._log_start(member, GROUP3)
    (record,) = caplog.records
    assert record.levelno == logging.INFO and SLOW_START_S < 1.0
    names = ", ".join(p.to_base58()[-8:] for p in GROUP3.peer_ids)
    assert record.getMessage().startswith(
        f"began a try's all-reduce 1.00 s after its group ({names}) was handed to this member at "
    )
    assert record.getMessage().endswith(
        ".250 (found 0.50 s before): metadata checked in 0.10 s, load balancing 0.20 s, the "
        "averaged tensors' lock 0.50 s, then 0.20 s to begin"
    )
    caplog.clear()
    monkeypatch.setattr(guarded.time, "monotonic", lambda: 100.4)
    with caplog.at_level(logging.INFO, logger="atomtrain.peer.guarded"):
        GuardedAverager._log_start(member, GROUP3)
    assert not caplog.records
    with caplog.at_level(logging.DEBUG, logger="atomtrain.peer.guarded"):
        GuardedAverager._log_start(member, GROUP3)
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_a_traced_swarm_runs_its_peers_verbose(tmp_path):
    """bench attack --trace: each peer's command line asks for debug messages, as a user's
    `atomtrain --verbose train ...` does."""
    from atomtrain.cli.main import build_parser
    from atomtrain.peer.launcher import Swarm

    for verbose in (False, True):
        argv = Swarm("s", tmp_path, "b", [], verbose=verbose).peer_args(0, 2, None)
        args, _ = build_parser().parse_known_args(argv[3:])
        assert args.verbose is verbose and argv[3 + verbose] == "train"
