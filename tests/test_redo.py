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
