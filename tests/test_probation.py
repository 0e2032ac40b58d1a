"""A member on probation at two others of its group is read, not averaged in (probation.py)."""

import asyncio

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
from atomtrain.peer.robust import RobustReducer


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


def test_a_member_is_read_only_where_two_others_declare_it():
    """Two other members' word: one member alone (or its own) silences no one; malformed
    declarations count for nothing, and no declaration beyond MOST_DECLARED peer IDs."""
    ids = ["a", "b", "c", "x"]

    def users(*declarations: object) -> list[object]:
        return [{PROBATION_KEY: d} if d is not None else {} for d in declarations]

    assert DECLARERS == 2
    assert read_only(users(["x"], ["x"], None, None), ids) == [False, False, False, True]
    assert read_only(users(["x"], None, None, ["x"]), ids) == [False] * 4  # its own: no
    assert read_only(users(["x"], None, None, None), ids) == [False] * 4  # one: no
    assert read_only(users(["x", "y"], ["x", "a"], ["a"], None), ids) == [True, False, False, True]
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


def test_a_read_only_round_does_not_count_as_averaging_its_member_in():
    """bench attack's count of rounds that averaged the attacker in leaves out a round that
    read it only (`round_read_only`, runtime.py)."""
    held = {"round": 5, "round_s": 1.0, "round_members": [["h0", True], ["a", True]]}
    read = {**held, "round": 6, "round_read_only": ["a"]}
    assert counted_with([held, read], {"a"}) == 1
    assert counted_with([held, read], {"h0"}) == 2
