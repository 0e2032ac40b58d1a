"""redo.py: the group a member runs at once after a try ended early over some of its members."""

from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID

from atomtrain.peer.redo import is_redo, redo, redoes


def peer(i: int) -> PeerID:
    return PeerID(bytes([i]) * 34)


GROUP = GroupInfo(b"g" * 20, tuple(peer(i) for i in range(4)), tuple(b"m%d" % i for i in range(4)))


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
