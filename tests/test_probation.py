"""A member most of its group holds on probation is read, not averaged in (probation.py)."""

import asyncio
import math

import torch
from hivemind.utils.serializer import MSGPackSerializer

from atomtrain.bench.attack_report import counted_with
from atomtrain.peer.bounds import Defence
from atomtrain.peer.exclusion import LeftOut
from atomtrain.peer.probation import (
    DECLARERS,
    MOST_DECLARED,
    PROBATION_KEY,
    declare,
    declared,
    read_only,
)
from atomtrain.peer.robust import RobustReducer, RobustRunner


def test_a_member_let_back_in_is_declared_on_probation_until_read():
    """What a peer tells its group: the members let back in after they were left out for their
    updates, from the round they are back until the round that reads them; none while they are
    still left out (the group then holds none of them)."""
    ledger = LeftOut(lambda *_: None, lambda peer: False)
    ledger.next_round()
    ledger.readings({"flip": -0.6, "h": 0.6})  # one reading far below: left out
    ledger.next_round()
    assert "flip" in ledger and ledger.on_probation == frozenset()
    while "flip" in ledger:
        ledger.next_round()
    assert ledger.on_probation == {"flip"}
    ledger.next_round()  # a round that met it not: still on probation
    assert ledger.on_probation == {"flip"}
    ledger.readings({"flip": 0.5, "h": 0.6})  # read, and passed
    ledger.next_round()
    assert ledger.on_probation == frozenset()


def test_a_member_is_read_only_where_most_of_its_group_declares_it():
    """More than half of the group's members, two at least: one member alone (or its own
    word) silences no one, nor do two colluders in a group of five (they would leave only their
    own updates to average); a member out of sync is not read (its update was made from other
    parameters); none is read only where fewer than two members would be left to average;
    malformed declarations count for nothing, and none beyond MOST_DECLARED peer IDs."""
    ids = ["a", "b", "c", "x"]

    def users(*declarations: object) -> list[object]:
        return [{PROBATION_KEY: d} if d is not None else {} for d in declarations]

    assert DECLARERS == 2
    assert read_only(users(["x"], ["x"], ["x"], None), ids) == [False, False, False, True]
    assert read_only(users(["x"], ["x"], None, None), ids) == [False] * 4  # 2 of 4: no majority
    assert read_only(users(["x"], ["x"], None), ids[1:]) == [False, False, True]  # 2 of 3
    assert read_only(users(["x"], None, None, ["x"]), ids) == [False] * 4  # its own: no
    assert read_only(users(["x"], None, None, None), ids) == [False] * 4  # one: no
    assert read_only(users(["x"], ["x"]), ["a", "x"]) == [False, False]  # a pair: one declarer
    both = users(["x", "c"], ["x", "c"], ["x"], ["c", "x"])
    assert read_only(both, ids) == [False, False, True, True]  # two left to average
    trio = users(["b", "x"], ["a", "x"], ["a", "b"])  # each declared by both others
    assert read_only(trio, ["a", "b", "x"]) == [False] * 3  # none left to average: none
    # two colluders (m, n) declaring the three honest members of a group of five: no one
    five = ["h1", "h2", "h3", "m", "n"]
    assert read_only(users(None, None, None, five[:3], five[:3]), five) == [False] * 5
    # out of sync: neither averaged nor read
    out = [True, True, True, False]
    assert read_only(users(["x"], ["x"], ["x"], None), ids, out) == [False] * 4
    malformed = [{PROBATION_KEY: "x"}, {PROBATION_KEY: [1, None]}, "junk", {PROBATION_KEY: ["x"]}]
    assert read_only(malformed, ids) == [False] * 4
    many = [f"p{i}" for i in range(MOST_DECLARED)] + ["x"]
    assert "x" not in declared({PROBATION_KEY: many})  # (beyond the cap)
    assert read_only([{}, {}], ["a", "b"]) == [False, False]


def test_declare_adds_the_probation_list_to_the_sealed_metadata():
    """hivemind's [bandwidth, mode, metadata] blob, with this peer's probation list added to
    the metadata (sorted, capped), the rest as it was."""
    s = MSGPackSerializer
    blob = s.dumps([1.0, 0, s.dumps({"round": 3, "weight": 1.0})])
    bandwidth, mode, user = s.loads(declare(blob, {"x", "b"}, s))
    assert (bandwidth, mode) == (1.0, 0)
    assert s.loads(user) == {"round": 3, "weight": 1.0, PROBATION_KEY: ["b", "x"]}
    many = {f"p{i:02d}" for i in range(40)}
    assert len(s.loads(s.loads(declare(blob, many, s))[2])[PROBATION_KEY]) == MOST_DECLARED


def test_a_read_only_member_is_read_against_the_reducers_update_not_averaged():
    """Its update parts weigh nothing in the reducer's average (as an out-of-sync member's),
    yet the reducer reads it (cosine, lean): the reading that ends its probation. An audit's
    replay (no reads, the same members out) combines the same average."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(4000, generator=g)
    honest = [shared + 0.6 * torch.randn(4000, generator=g) for _ in range(3)]
    flipped = -3.0 * honest[0]

    async def reduce(reads: bool, measure: bool = True) -> RobustReducer:
        reducer = RobustReducer(
            [torch.Size([4000])], ["delta"], [1.0] * 4, 0, Defence(), [False] * 4,
            lambda i, why: None, [True, True, True, False], measure=measure,
            reads=[False, False, False, reads],
        )  # fmt: skip
        reducer.parts = {0: honest[0], 1: honest[1], 2: honest[2], 3: flipped}
        reducer.average = reducer._combine()
        return reducer

    read = asyncio.run(reduce(True))
    unread = asyncio.run(reduce(False))
    replay = asyncio.run(reduce(False, measure=False))
    assert torch.equal(read.average, unread.average) and torch.equal(read.average, replay.average)
    assert read.cosines()[3] < -0.5 and set(read.cosines()) == {1, 2, 3}
    assert 3 in read.leans()
    assert set(unread.cosines()) == {1, 2}  # out of sync: not read, as before

    async def poisoned() -> tuple[list, torch.Tensor]:  # a read-only member's NaN: rejected
        named: list = []
        reducer = RobustReducer(
            [torch.Size([4000])], ["delta"], [1.0] * 4, 0, Defence(), [False] * 4,
            lambda i, why: named.append((i, why)), [True, True, True, False],
            reads=[False, False, False, True],
        )  # fmt: skip
        reducer.parts = {0: honest[0], 1: honest[1], 2: honest[2], 3: flipped * math.nan}
        return named, reducer._combine()

    named, average = asyncio.run(poisoned())
    assert named == [(3, "non-finite values")] and torch.equal(average, read.average)


def test_a_read_only_round_does_not_count_as_averaging_its_member_in():
    """bench attack's count of rounds that averaged the attacker in leaves out a round that
    read it only (`round_read_only`, runtime.py)."""
    held = {"round": 5, "round_s": 1.0, "round_members": [["h0", True], ["a", True]]}
    read = {**held, "round": 6, "round_read_only": ["a"]}
    assert counted_with([held, read], {"a"}) == 1
    assert counted_with([held, read], {"h0"}) == 2


def test_the_runner_leaves_a_read_only_member_out_of_every_average_and_keeps_its_bounds():
    """A robust runner told a member is read only: out of the reducer's average and of an
    audit's replay of any span (the same for every member), read against the reducer's own,
    while the bounds on what this member receives still count it in sync (three members: a
    typical update's bounds, not a pair's), so a read-only member checks what it applies."""
    import hashlib
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    from atomtrain.peer.bounds import DELTA
    from atomtrain.peer.guarded import GuardedAverager
    from atomtrain.peer.traffic import Traffic

    def peer_id(name: str) -> PeerID:
        return PeerID(b"\x00\x24\x08\x01\x12\x20" + hashlib.sha256(name.encode()).digest())

    me, other, x = peer_id("me"), peer_id("other"), peer_id("x")

    async def built(own: PeerID) -> RobustRunner:
        return RobustRunner(
            p2p=SimpleNamespace(peer_id=own), servicer_type=GuardedAverager, prefix="t",
            group_id=b"g", tensors=[torch.arange(96.0)], ordered_peer_ids=[me, other, x],
            peer_fractions=(1 / 3,) * 3, sender_timeout=1.0, reducer_timeout=2.0,
            traffic=Traffic(), part_size_bytes=64, kinds=[DELTA], weights={},
            reported_rms={me: 1.0, other: 1.0, x: 1.0}, banned=set(), in_sync=None,
            defence=Defence(audit=False), on_reject=lambda p, why: None,
            on_agreement=lambda cosines, leans: None, read_only={x},
        )  # fmt: skip

    async def looked(own: PeerID) -> tuple[RobustRunner, list]:  # (reducers need a loop)
        runner = await built(own)
        return runner, [runner.replay_reducer(i).in_sync for i in range(3)]

    for own in (me, x):  # (the read-only member's own runner decides alike)
        runner, replays = asyncio.run(looked(own))
        assert runner._in_sync == [True, True, False]
        assert runner.tensor_part_reducer.reads == [False, False, True]
        assert replays == [[True, True, False]] * 3
        assert runner._typical is not None and runner._counted
