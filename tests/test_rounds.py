"""Rounds driven step by step: two peer runtimes in this process (each with its real hivemind DHT
and averager processes), trained by hand so every outcome is deterministic to check."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from pathlib import Path

import pytest
import torch

from atomtrain.config import PeerSection
from atomtrain.models import GPT, GPTConfig
from atomtrain.optim import AdamW, AdamWConfig
from atomtrain.peer.layout import Sketcher, cut_pieces, flatten
from atomtrain.peer.rounds import apply_outer_step, move_to, shift_to_own_share
from atomtrain.peer.runtime import PeerRuntime
from atomtrain.peer.state_io import take_state
from atomtrain.peer.status import PeerStatus
from atomtrain.train.runner import PlainRunner
from atomtrain.train.trainer import TrainState


class Driver:
    """One peer: a tiny GPT, its runtime, and a step() that trains and calls the runtime."""

    def __init__(self, tmp: Path, name: str, join: str = "", seed: int = 0, **peer) -> None:
        torch.manual_seed(0)  # the same initial parameters on every peer
        self.model = GPT(GPTConfig.from_name("tiny"))
        params = dict(self.model.named_parameters())
        self.runner = PlainRunner(
            self.model, AdamW(params, AdamWConfig()), 4, 1.0, torch.device("cpu")
        )
        cfg = PeerSection(
            swarm=peer.pop("swarm", "rounds"),
            join=join,
            sync_every=str(peer.pop("sync_every", 3)),
            matchmaking_s=1.0,
            averaging_timeout_s=peer.pop("timeout_s", 15.0),
            state_timeout_s=15.0,
            final_sync=False,
            defend=peer.pop("defend", True),
            **peer,
        )
        run_dir = tmp / name
        run_dir.mkdir()
        self.peer = PeerRuntime(cfg, self.runner, name, 10_000, run_dir, lr=1e-2)
        self.state = TrainState()
        self.gen = torch.Generator().manual_seed(seed)
        self.peer.start(None, self.state)
        self.after_step_s: list[float] = []
        self.records: list[dict] = []

    def step(self) -> dict:
        x = torch.randint(0, 256, (4, 16), generator=self.gen)
        self.runner.train_step(x, x.roll(-1, 1), 1e-2)
        self.state.step += 1
        record = {"loss": 1.0, "tokens_step": x.numel()}
        t0 = time.perf_counter()
        self.peer.after_step(self.state, record)
        self.after_step_s.append(time.perf_counter() - t0)
        self.records.append(record)
        return record

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.runner.host_parameters().items()}

    def close(self) -> None:
        self.peer.shutdown()
        if self.peer.watchdog is not None:
            self.peer.watchdog.kill()


def addr(d: Driver) -> str:
    return d.peer.presence.addrs[0]


def steps_until(drivers: list[Driver], done, limit_s: float = 60.0) -> None:
    deadline = time.time() + limit_s
    while not done():
        assert time.time() < deadline, "timed out"
        for d in drivers:
            d.step()
        time.sleep(0.02)


def settle(drivers: list[Driver]) -> None:
    """Let the rounds in flight land, starting no new ones."""
    for d in drivers:
        d.peer._poll({}, wait=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    """Two peers shared by the tests below, in file order (each starts from where the last
    left them; starting peers costs more than the tests)."""
    tmp = tmp_path_factory.mktemp("pair")
    a = Driver(tmp, "a", seed=1)
    b = Driver(tmp, "b", join=addr(a), seed=2)
    yield a, b
    b.close()
    a.close()


def test_a_fresh_swarm_needs_no_download_and_rounds_agree(pair):
    a, b = pair
    assert a.peer.round == b.peer.round == 0  # the first test of the module: fresh peers
    assert torch.equal(a.peer.theta_sync, b.peer.theta_sync)  # the seed, not a download
    steps_until([a, b], lambda: a.peer.round >= 2 and b.peer.round >= 2)
    settle([a, b])
    # members of a round apply the same bits of the average (peer/exact.py): their synchronized
    # parameters and momentum stay identical round after round, not only after the first
    assert a.peer.round == b.peer.round
    assert torch.equal(a.peer.theta_sync, b.peer.theta_sync)
    assert torch.equal(a.peer.outer.buf, b.peer.outer.buf)
    # the group's choice: they stay in phase
    assert a.peer.clock.sync_every == b.peer.clock.sync_every


def test_a_round_without_a_group_changes_nothing_and_local_steps_never_wait(tmp_path: Path):
    lone = Driver(tmp_path, "lone", sync_every=2, timeout_s=5.0, swarm="lone")
    try:
        theta = lone.peer.theta_sync.clone()
        for _ in range(2):
            lone.step()  # the round starts here, looking for a group that never comes
        assert lone.peer.averager is not None and lone.peer.averager.running
        before = lone.params()
        failed = lone.peer.failed_rounds
        steps_until([lone], lambda: lone.peer.failed_rounds > failed, limit_s=30)
        # nothing applied alone: the synchronized parameters stay, the progress stays in the model
        assert torch.equal(lone.peer.theta_sync, theta) and lone.peer.round == 0
        assert lone.peer.round_tokens > 0  # ...and goes with the next round, weighted
        after = lone.params()
        assert any(not torch.equal(before[n], after[n]) for n in before)  # training went on
        # while the round searched for seconds, no step waited for it
        assert max(lone.after_step_s) < 1.0, max(lone.after_step_s)
        # the step that found it failed says for how long it ran (bench attack's failed_round_s)
        lost = [r["failed_round_s"] for r in lone.records if "failed_round_s" in r]
        # (the peer's clock starts a moment after hivemind's 5 s deadline does: 4.9976 s in one
        # CI run, 4.889 s in another; the bound tells the round's time from none or a step's)
        assert len(lost) == 1 and 4.0 <= lost[0] < 30, lost
    finally:
        lone.close()


def test_a_peer_stalled_mid_round_never_holds_up_the_others_steps(pair):
    import os
    import signal

    from atomtrain.peer.guarded import NO_ONE

    a, b = pair
    lost: list[tuple[int, str]] = []  # a's lost rounds: (its step, why)
    lose = a.peer._lose_round
    a.peer._lose_round = lambda why, record: (lost.append((a.state.step, why)), lose(why, record))
    left_out = False  # a left b out: it names b where b froze mid-round (5 runs of 6), not where
    # b froze in matchmaking, and then only the steps and the return are checked

    def watching(done):
        def check() -> bool:
            nonlocal left_out
            left_out |= b.peer.peer_id in a.peer.averager.left_out_ids
            return done()

        return check

    try:
        start_round = max(a.peer.round, b.peer.round)
        steps_until([a, b], lambda: min(a.peer.round, b.peer.round) >= start_round + 1)
        # freeze b's averager while a round runs: a's round waits on it, a's training must not
        steps_until([a, b], lambda: a.peer.averager.running and b.peer.averager.running)
        frozen = b.peer.averager.averager.pid
        os.kill(frozen, signal.SIGSTOP)
        try:
            a.after_step_s.clear()
            failed, rounds = a.peer.failed_rounds, a.peer.round
            start = time.time()
            stalled = watching(lambda: a.peer.failed_rounds > failed or time.time() > start + 20)
            steps_until([a], stalled)
            steps_while_stalled = len(a.after_step_s)
        finally:
            os.kill(frozen, signal.SIGCONT)
        assert a.peer.round <= rounds + 1  # the stalled round did not land (one in flight)
        assert steps_while_stalled >= 5  # a kept training through the stall
        assert max(a.after_step_s) < 1.0, max(a.after_step_s)
        # and once b is back, they average together again
        target = a.peer.round + 1
        back = watching(lambda: a.peer.round >= target and b.peer.round >= target)
        steps_until([a, b], back, 90)
    finally:
        del a.peer._lose_round
    # while a left b out, its only other member, its rounds ended at once, H steps apart,
    # rather than look for a group until their timeout (15 s each): b's exclusion passed in
    # a's rounds, and no faster
    idle = [step for step, why in lost if NO_ONE in why]
    assert bool(idle) == left_out, (left_out, lost)
    sync_every = a.peer.clock.sync_every
    assert all(y - x >= sync_every for x, y in itertools.pairwise(idle)), lost


def test_a_drifted_peer_resynchronizes_without_a_restart_and_keeps_its_progress(pair):
    a, b = pair
    for d in (a, b):  # from here on plain averaging (outer momentum 0): no momentum is kept
        d.peer.cfg = dataclasses.replace(d.peer.cfg, outer_momentum=0.0)
        with d.peer.lock:
            d.peer.outer.buf.zero_()
    start_round = max(a.peer.round, b.peer.round)
    steps_until([a, b], lambda: min(a.peer.round, b.peer.round) >= start_round + 1)
    settle([a, b])
    assert not a.peer.outer.buf.any()  # the rounds since kept none
    served, received = a.peer.averager.traffic.totals()[0], b.peer.averager.traffic.totals()[1]
    # b as if it had missed a round: one outer step fewer, its synchronized parameters elsewhere
    with b.peer.lock:
        b.peer.round -= 1
        b.peer.theta_sync.add_(0.05)
        b.peer._sketch = b.peer.sketcher.of(b.peer.theta_sync)
        b.peer.outer.buf.normal_()
    before, a_round, a_failed = b.peer.round, a.peer.round, a.peer.failed_rounds
    steps_until([a, b], lambda: b.peer.resync.pending is not None or b.peer.round > before + 1)
    assert b.peer.resync.pending is not None, "b did not find itself out of sync"
    steps_until([a, b], lambda: b.peer.resync.pending is None)
    # a, with no other member in sync, applied no round of its own update alone (a round only
    # it held, which b's download could not have been checked against): b took a's round
    assert a.peer.round == a_round and a.peer.failed_rounds > a_failed
    assert b.peer.round == a_round
    assert not b.peer.outer.buf.any()  # a's momentum, which a named rather than sent
    # the download is counted on both sides: synchronized parameters, float32, and no momentum
    # (and the round that found b out of sync: about 2 bytes a parameter each way, and as much
    # again that each reducer forwards its auditor, audit.py)
    state = 4 * b.peer.numel
    got = b.peer.averager.traffic.totals()[1] - received
    sent = a.peer.averager.traffic.totals()[0] - served
    round_bytes = 5 * b.peer.numel  # at most: 4 bytes a parameter and framing
    assert state <= got <= state + round_bytes  # momentum would add 4 bytes a parameter
    assert state <= sent <= state + round_bytes
    # from then on b takes part again: the next rounds find both in sync, at the same round
    target = a.peer.round + 2
    steps_until([a, b], lambda: a.peer.round >= target and b.peer.round >= target)
    settle([a, b])
    assert a.peer.round == b.peer.round
    assert torch.equal(a.peer.theta_sync, b.peer.theta_sync)  # the same bits again
    assert max(b.after_step_s) < 1.0  # the download ran in the background


def test_with_h_auto_peers_agree_on_a_period_and_start_rounds_in_the_same_slot(pair):

    a, b = pair
    for d in (a, b):  # the pair so far ran with H fixed; now as `auto` runs
        d.peer.cfg = dataclasses.replace(d.peer.cfg, sync_every="auto")
    start = a.peer.round
    steps_until([a, b], lambda: a.peer.round >= start + 3 and b.peer.round >= start + 3, limit_s=90)
    settle([a, b])
    assert a.peer.clock.period_s == b.peer.clock.period_s > 0  # the group's choice
    assert math.log2(a.peer.clock.period_s / 0.5).is_integer()  # on the period ladder
    # both began the last round on one slot
    assert a.peer.clock.round_slot == b.peer.clock.round_slot
    assert a.peer.clock.round_slot % 0.5 == 0  # a multiple of the period then in force


def test_a_downloaded_state_sets_the_schedule_where_the_swarm_stands_not_where_it_says(pair):
    a, b = pair

    def published() -> list[PeerStatus]:
        return [s for s in b.peer.presence.live_others() if s.schedule_step > 0]

    steps_until([a, b], lambda: bool(published()))
    settle([a, b])
    others = published()
    assert len(others) == 1
    swarm_step = others[0].schedule_step  # a's, signed: one member, one figure
    with b.peer.lock:
        held = [b.peer.theta_sync.clone(), b.peer.outer.buf.clone()]
    for served in (10**9, -5, "x", None):  # what a serving peer may claim
        b.peer.presence.known_others = others
        take_state(b.peer, {"round": b.peer.round, "step": served}, held, mode="resync")
        assert b.state.step + b.state.schedule_offset == swarm_step
        assert b.peer._schedule_step == swarm_step


def test_a_defended_pair_round_is_not_applied_while_a_third_member_could_take_part():
    """Of a pair, one may lie and then vouch for nothing: its honest partner would hold a state
    no third peer could take (bench attack's sybil run split three honest peers so). While
    three members could take part, a round needs three in sync (sync.quorum)."""
    from types import SimpleNamespace

    from atomtrain.peer.agreement import RoundDigest, disagreement
    from atomtrain.peer.averaging import RoundResult
    from atomtrain.peer.presence import Presence
    from atomtrain.peer.sync import group_live, quorum, why_not_applied

    # why: a pair round applied by honest p with a liar that publishes another digest; q and r
    # never took it. No download of p's state can be checked by the others
    params, momentum = torch.ones(8), torch.zeros(8)
    before = RoundDigest.of(4, params - 1, momentum)
    p_state = RoundDigest.of(5, params, momentum)
    junk = RoundDigest.of(5, params + 1, momentum)
    others_of_q = {"p": [before, p_state], "r": [before], "liar": [junk]}
    assert "match 1 of 3" in str(disagreement(5, params, momentum, others_of_q))

    assert [quorum(n, keyed=True) for n in (1, 2, 3, 4, 16)] == [2, 2, 3, 3, 3]
    assert [quorum(n, keyed=False) for n in (2, 3, 4)] == [2, 2, 2]  # open or undefended
    # what a member decides from its group's in-sync flags and the quorum
    pair_short = "2 members in sync while 3 could take part (sync.quorum)"
    assert why_not_applied([True, True, True], need=3, final=False) == ""
    assert why_not_applied([True, True, False], need=3, final=False) == pair_short
    assert why_not_applied([True, True, False], need=3, final=True) == pair_short  # last too
    assert why_not_applied([True, True], need=2, final=False) == ""
    assert why_not_applied([True, False], need=2, final=False) == "no other member in sync"
    assert why_not_applied([True, False], need=2, final=True) == ""  # the last: its own alone
    assert why_not_applied([], need=3, final=False) == ""  # no flags: nothing to check

    def status(name: str, **kw: object) -> PeerStatus:
        return PeerStatus(name, 3, 30, 2.0, 1.0, 0.0, **{"peer_id": f"id-{name}", **kw})

    averager = SimpleNamespace(rejected_ids={"id-banned"}, left_out_ids={"id-staller"})
    presence = Presence(SimpleNamespace(averager=averager))
    presence.known_others = [
        status("live"),
        status("finished", done=True),  # past its last round: no more rounds with it
        status("finishing", finishing=True),  # waits for the last round: counts
        status("renamed", peer_id="id-banned"),  # a banned member, under another name
        status("staller"),
    ]
    assert presence.live_members() == 3  # this one, "live" and "finishing"
    # whom a leader expects, and counts towards the quorum (assembly.py): the same others
    assert presence.live_other_ids() == ["id-live", "id-finishing"]
    averager.left_out_ids.clear()  # a round with the staller landed again: it counts
    assert presence.live_members() == 4
    assert presence.live_other_ids() == ["id-live", "id-finishing", "id-staller"]

    # the group decides from what its members told it: the largest claim, the same for all
    assert group_live([{"live": 2}, {"live": 3}]) == 3
    assert group_live([{"live": 3}, {"live": -5}, {"live": "x"}, {}, None]) == 3
    assert group_live([{"live": 10**30}]) == 1 << 20
    assert group_live([]) == 1

    class Applying(Exception):
        pass

    def apply(
        claims: list[int], in_sync: list[bool], final=False, keyed=True, group_size=64
    ) -> str:
        lost: list[str] = []
        fake = SimpleNamespace(
            averager=object(),
            cfg=SimpleNamespace(defend=True, target_group_size=group_size),
            membership=object() if keyed else None,
            _final=final,
            _round_started=0.0,
            _lose_round=lambda why, record: lost.append(why),
            runner=SimpleNamespace(host_parameters=lambda: (_ for _ in ()).throw(Applying())),
        )
        peers = [{"live": c} for c in claims]
        result = RoundResult(len(claims), peers, 0, in_sync, [""] * len(claims))
        try:
            PeerRuntime._apply(fake, result, {})
        except Applying:
            return "applied"
        return lost[0]

    assert apply([2, 2], [True, True]) == "applied"  # the whole swarm: a pair is a round
    pair_lost = "2 members in sync while 3 could take part (sync.quorum)"
    assert apply([3, 3], [True, True]) == pair_lost
    # this member counts two live (it banned the third), its partner three: both lose it
    assert apply([2, 3], [True, True]) == pair_lost
    assert apply([4, 4, 4], [True, True, False]).startswith("2 members in sync")  # one behind
    assert apply([4, 4, 4], [True, True, True]) == "applied"
    assert apply([4, 4], [True, True], final=True) == pair_lost  # the last round too
    assert apply([2, 2], [True, True], final=True) == "applied"
    assert apply([2, 2], [True, False], final=True) == "applied"  # the last: its own, as before
    assert apply([3, 3], [True, False], final=True).startswith("1 members in sync while 3")
    assert apply([4, 4], [True, True], keyed=False) == "applied"  # open: anyone brings a third
    assert apply([4, 4], [True, True], group_size=2) == "applied"  # groups of two by choice
    assert apply([4, 4], [True, False]) == "no other member in sync"
    # whom a round held and who was in sync, kept in its metrics whatever came of it
    record: dict = {}
    peers = [{"name": "a", "live": 3}, {"name": "b", "live": 3}, {"name": "c", "live": 3}]
    fake = SimpleNamespace(
        averager=object(), cfg=SimpleNamespace(defend=True, target_group_size=64),
        membership=object(), _final=False, _round_started=0.0,
        _lose_round=lambda why, record: None,
    )  # fmt: skip
    PeerRuntime._apply(fake, RoundResult(3, peers, 0, [True, True, False], [""] * 3), record)
    assert record["round_members"] == [["a", True], ["b", True], ["c", False]]


def test_the_schedule_step_is_the_members_median_then_the_servers_within_the_run():
    from atomtrain.peer.state import swarm_schedule_step

    def at(step: int, round_: int = 3) -> PeerStatus:
        return PeerStatus("p", round_, 0, 2.0, 1.0, 0.0, schedule_step=step)

    honest = [at(400), at(410), at(405)]
    assert swarm_schedule_step(10**9, 3, [*honest, at(10**9)], 1000, 0) == 405
    assert swarm_schedule_step(0, 3, [*honest, at(0)], 1000, 0) == 400
    joiners = [at(0, round_=0)] * 5  # still catching up: not the swarm's progress
    assert swarm_schedule_step(0, 3, [*honest, *joiners], 1000, 0) == 405
    assert swarm_schedule_step(300, 3, joiners, 1000, 7) == 300  # none holds the swarm's
    assert swarm_schedule_step(10**9, 3, [], 1000, 7) == 1000
    assert swarm_schedule_step(-5, 3, [], 1000, 7) == 0
    assert swarm_schedule_step(True, 3, [], 1000, 7) == 7  # not a step: this peer's own
    assert swarm_schedule_step(None, None, [], 1000, 7) == 7


def test_a_peer_of_another_protocol_is_named_and_never_averaged_with(pair, tmp_path: Path):
    a, b = pair
    c = Driver(tmp_path, "c", join=addr(a), seed=3, defend=False)
    try:
        # c found a and b but takes no state from them and never waits on them
        assert c.peer.presence.live_others() == []
        assert c.peer.presence.foreign == {a.peer.peer_id, b.peer.peer_id}
        assert c.peer.round == 0
        deadline = time.time() + 30
        while c.peer.peer_id not in a.peer.presence.foreign:
            assert time.time() < deadline, "a never read c's status"
            a.peer.presence.live_others()
            time.sleep(0.5)
        assert c.peer.peer_id not in {s.peer_id for s in a.peer.presence.live_others()}
        start = a.peer.round
        steps_until([a, b, c], lambda: a.peer.round >= start + 1 and b.peer.round >= start + 1)
        settle([a, b, c])
        assert c.peer.round == 0  # no round of a and b ever took c in
    finally:
        c.close()


def test_a_peer_declares_its_longest_recent_step_as_its_start_lag_only_for_rounds_at_slots():
    """A round prepared for a slot writes its contribution at the first step past it, so its
    members may start up to their longest step late (an evaluation's included) and declare it
    (exact.start_timeouts); the first steps (warm-up) do not count. A round written before it
    looks for its group (H fixed, or blocking) declares no lag."""
    from types import SimpleNamespace

    from atomtrain.peer.clock import RoundClock

    def lag(sync_every: str) -> float:
        cfg = PeerSection(sync_every=sync_every)
        clock = RoundClock(SimpleNamespace(cfg=cfg, _final=False))
        for pause in (0.0, 0.3, 0.3, 0.02, 0.08, 0.02):  # a long warm-up, then steps
            time.sleep(pause)
            clock.step_ended()
        return clock.start_lag_s()

    assert 0.08 <= lag("auto") < 0.25
    assert lag("5") == 0.0


def test_slots_are_whole_multiples_of_the_period_on_the_shared_clock():
    from atomtrain.peer.clock import next_slot, on_ladder

    assert [on_ladder(s) for s in (0.01, 0.5, 1.0, 1.01, 3.5, 4.0, 4.1)] == [
        0.5,
        0.5,
        1.0,
        2.0,
        4.0,
        4.0,
        8.0,
    ]
    # capped by the longest period allowed: the longest rung within it, never below 0.5 s
    assert on_ladder(10.0, below=7.0) == 4.0 and on_ladder(10.0, below=0.1) == 0.5
    # any two rungs nest: every slot of the longer period is a slot of the shorter
    assert all(on_ladder(b) % on_ladder(a) == 0 for a in (0.3, 1.7, 3.2) for b in (3.3, 9.0))
    assert next_slot(100.2, 2.5) == 102.5 and next_slot(102.5, 2.5) == 105.0


def test_a_starting_peer_takes_the_swarms_period_or_a_power_of_two_that_nests():
    from atomtrain.peer.clock import first_period

    # alone at the start: 10 steps' time, up to 0.5 s times a power of two
    assert [first_period(s, []) for s in (0.01, 0.12, 0.15, 0.2, 0.21, 1.0)] == [
        0.5,
        2.0,
        2.0,
        2.0,
        4.0,
        16.0,
    ]
    # a slower peer's slots are every faster peer's slots
    assert first_period(0.21, []) % first_period(0.12, []) == 0
    # joining a running swarm: the median of the live peers' periods (none yet: 0 is ignored;
    # one peer claiming an hour does not set it)
    assert first_period(0.12, [4.0, 0.0, 4.0, 3600.0]) == 4.0
    assert first_period(0.12, [3.5]) == 4.0  # a published period off the ladder: its rung
    assert first_period(0.12, [0.0, 0.0]) == 2.0


def test_resynchronizing_keeps_the_local_progress():
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(50, generator=g)}
    pieces = cut_pieces({"w": 50}, pieces_hint=3)
    theta = torch.randn(50, generator=g)
    new = torch.randn(50, generator=g)
    progress = params["w"] - theta
    move_to(params, pieces, theta, new)
    assert torch.equal(theta, new)
    torch.testing.assert_close(params["w"] - theta, progress)


def test_a_resync_moves_the_weight_average_with_the_weights():
    """A re-synchronization keeps the local progress and moves the weights by the swarm's
    state minus this peer's synchronized one: the trainer's weight average moves by the same
    (its history kept), where a joiner's download restarts it."""
    import threading
    from types import SimpleNamespace

    from atomtrain.train.averaged import WeightAverage

    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(50, generator=g), "b": torch.randn(7, generator=g)}
    pieces = cut_pieces({n: p.numel() for n, p in params.items()}, pieces_hint=4)
    average = WeightAverage(params, 0.9)
    for value in average.shadow.values():
        value.add_(1.0)  # an average that is not the weights
    gap = {n: params[n] - average.shadow[n] for n in params}
    told: list[str] = []
    peer = SimpleNamespace(
        numel=57,
        runner=SimpleNamespace(
            host_parameters=lambda: params, parameters_written=lambda: told.append("runner")
        ),
        lock=threading.Lock(),
        pieces=pieces,
        theta_sync=flatten(params, pieces) - 0.5,
        outer=SimpleNamespace(buf=torch.zeros(57)),
        round=0,
        presence=SimpleNamespace(round_changed=threading.Event()),
        sketcher=Sketcher(57),
        on_moved=lambda shift: shift(average.shadow),
        _weights_replaced=lambda: told.append("replaced"),
        train_state=None,
    )
    new = torch.randn(57, generator=g)
    before = flatten(params, pieces)
    take_state(peer, {"round": 3}, [new, torch.zeros(57)], mode="resync")  # type: ignore[arg-type]
    moved = flatten(params, pieces) - before
    torch.testing.assert_close(moved, new - (before - 0.5))
    for name in params:
        torch.testing.assert_close(params[name] - average.shadow[name], gap[name])
    assert told == ["runner"] and peer.round == 3  # not replaced: the average is not restarted


def test_a_resync_before_the_first_reading_of_the_swarm_asks_its_group():
    """The status thread has not read who is live yet: a re-synchronization (on the training
    thread, where nothing reads the DHT) asks the members of its group that hold the group's
    synchronized parameters, not nobody."""
    from types import SimpleNamespace

    from atomtrain.peer.averaging import RoundResult
    from atomtrain.peer.resync import Resync

    asked: list[list[str]] = []
    peer = SimpleNamespace(
        peer_id="me",
        round=4,
        cfg=SimpleNamespace(state_timeout_s=5.0),
        presence=SimpleNamespace(known_others=[], state_sources=lambda: []),
        averager=SimpleNamespace(
            download_state=lambda timeout, sources, wait: asked.append(sources)
        ),
    )
    result = RoundResult(3, [{"round": 4}] * 3, 0, [False, True, False], ["me", "a", "b"])
    Resync(peer).start(result)  # type: ignore[arg-type]
    assert asked == [["a"]]


def test_a_state_asked_for_during_a_round_with_its_group_is_served_once_it_lands():
    """A download asked for while this peer's round runs with its group gets the state that
    round leaves (the training thread took its result in: applied, lost, or out of sync), not
    the one from before it, which would leave the asker one round behind. The round's control
    is gone before its result is taken in (ProbedAverager.result): that is not the end. A round
    still matchmaking, or none, is not waited for; one that never ends, no longer than a third
    of the state timeout, and not again for a later asker."""
    from types import SimpleNamespace

    from atomtrain.peer.resync import serve_after_round

    class Peer:
        """A round under way with its group; its control gone after 2 looks at the peer, its
        result taken in after `ends` looks (never: None)."""

        def __init__(self, ends: int | None, running=True, found=True, timeout_s=30.0) -> None:
            self.looks, self.ends, self.ended = 0, ends, 0
            self.serve_gave_up_at: int | None = None
            self.last_round_s = 60.0
            self.cfg = SimpleNamespace(state_timeout_s=timeout_s)
            self.averager = SimpleNamespace(running=running, group_found=lambda: found)

        @property
        def rounds_ended(self) -> int:
            self.looks += 1
            if self.looks == 2:
                self.averager.running = False  # result() took the control first
            if self.ends is not None and self.looks >= self.ends:
                self.ended = 1
            return self.ended

    p = Peer(ends=6)
    serve_after_round(p)  # type: ignore[arg-type]
    assert p.ended == 1 and p.looks == 6
    for waiting in (Peer(6, running=True, found=False), Peer(6, running=False, found=False)):
        serve_after_round(waiting)  # type: ignore[arg-type]
        assert waiting.looks == 0  # matchmaking, or no round: served at once
    p = Peer(ends=None, timeout_s=0.3)  # never ends: waited out (0.1 s), then served
    serve_after_round(p)  # type: ignore[arg-type]
    assert p.looks > 2 and p.serve_gave_up_at == 0
    p.averager.running, looks = True, p.looks
    serve_after_round(p)  # type: ignore[arg-type]
    assert p.looks == looks + 1  # the same round: a later asker is not held again
    for last_round_s in (0.15, 0.0):  # no longer than this peer's last round; none before one
        p = Peer(ends=None)
        p.last_round_s = last_round_s
        serve_after_round(p)  # type: ignore[arg-type]
        assert p.serve_gave_up_at == 0 and p.ended == 0
        assert p.looks < 100  # (polled every 20 ms: 10 s would be 500 looks)
    serve_after_round(SimpleNamespace(averager=None))  # type: ignore[arg-type]


def test_the_outer_step_moves_model_and_sync_alike():
    """The piecewise outer step against the flat DiLoCo formula."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(50, generator=g), "b": torch.randn(7, generator=g)}
    pieces = cut_pieces({n: p.numel() for n, p in params.items()}, pieces_hint=4)
    theta = flatten(params, pieces) + 0.1
    x0 = flatten(params, pieces)
    own = [(theta - x0)[p.offset : p.offset + p.numel].half() for p in pieces]
    avg = [torch.randn(p.numel, generator=g).half() for p in pieces]
    m = torch.randn(57, generator=g)
    a_flat, q_flat = torch.cat([a.float() for a in avg]), torch.cat([q.float() for q in own])
    m_want = 0.9 * m + a_flat
    step = 0.7 * (a_flat + 0.9 * m_want)
    theta_want, x_want = theta - step, x0 + q_flat - step
    apply_outer_step(params, pieces, list(zip(avg, own, strict=True)), theta, m, 0.7, 0.9, False)
    torch.testing.assert_close(m, m_want)
    torch.testing.assert_close(theta, theta_want)
    torch.testing.assert_close(flatten(params, pieces), x_want)
    assert len(Sketcher(57).of(theta)) == 64
    # plain averaging (momentum 0): the step is the average; no momentum is kept, not even
    # one resumed from a run with momentum (every member holds the same zeros)
    theta2, x2 = theta.clone(), flatten(params, pieces)
    apply_outer_step(params, pieces, list(zip(avg, own, strict=True)), theta, m, 1.0, 0.0, False)
    torch.testing.assert_close(theta, theta2 - a_flat)
    torch.testing.assert_close(flatten(params, pieces), x2 + q_flat - a_flat)
    assert not m.view(torch.int32).any()


def test_a_finisher_whose_last_round_did_not_land_ends_on_the_state_the_others_take():
    """The others take its synchronized state (finish.py): its own model ends there too, its
    local progress left behind, so every finisher holds the same model."""
    import threading
    from types import SimpleNamespace

    from atomtrain.peer.finish import Finisher

    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(50, generator=g), "b": torch.randn(7, generator=g)}
    pieces = cut_pieces({n: p.numel() for n, p in params.items()}, pieces_hint=4)
    theta = flatten(params, pieces) - 0.3  # the local progress since the last round: 0.3
    told: list[str] = []
    peer = SimpleNamespace(
        runner=SimpleNamespace(
            host_parameters=lambda: params, parameters_written=lambda: told.append("runner")
        ),
        pieces=pieces,
        theta_sync=theta,
        lock=threading.Lock(),
        on_replaced=lambda: told.append("trainer"),
    )
    peer._weights_replaced = lambda: PeerRuntime._weights_replaced(peer)
    Finisher(peer).end_on_sync()
    assert torch.equal(flatten(params, pieces), theta)
    # the runner derives its copies again; the trainer's weight average restarts from here
    assert told == ["runner", "trainer"]


def last_rounds(outcomes: list[bool], others_done_after: int = 99) -> tuple[int, list[str]]:
    """A finisher whose last rounds land or fail as `outcomes` says, beside one other finisher
    that says it is done from round `others_done_after` on: (rounds it ran, what it did after)."""
    from types import SimpleNamespace

    from atomtrain.peer.finish import Finisher

    did: list[str] = []
    runs: list[int] = []

    def poll(record, wait):  # (first called for the round open as the peer finished: none)
        if runs and outcomes[len(runs) - 1]:
            record["group_size"] = 2

    def other():
        return SimpleNamespace(
            peer_id="b", finishing=True, round=0, done=len(runs) >= others_done_after
        )

    peer = SimpleNamespace(
        cfg=SimpleNamespace(state_timeout_s=1.0, final_wait_s=1.0),
        resync=SimpleNamespace(pending=None),
        averager=object(),
        dht=object(),
        presence=SimpleNamespace(live_others=lambda: [other()]),
        _poll=poll,
        _start_round=lambda: runs.append(1),
        on_final=lambda: None,
        peer_id="a",
        last_group_ids=["a", "b"],
        round=0,
    )
    finisher = Finisher(peer)
    finisher._catch_up = lambda others, record: None
    finisher._linger = lambda: did.append("linger")
    finisher.end_on_sync = lambda: did.append("end_on_sync")
    finisher._adopt_final_state = lambda record, smallest: did.append("adopt")
    finisher.final_round({})
    return len(runs), did


def test_a_last_round_that_did_not_land_is_tried_again_before_ending_on_the_sync_state(
    monkeypatch,
):
    """A member that stalls the last round (bench attack) cost every honest finisher its
    progress since the round before: the last round is tried again (FINAL_TRIES in all), unless
    another finisher is past its own last round meanwhile (no try could meet it: what follows is
    as after a single try, the smallest peer ID's rule)."""
    from atomtrain.peer import finish

    monkeypatch.setattr(finish, "STATUS_DELAY_S", 0.0)
    assert last_rounds([False, True]) == (2, ["linger"])  # landed at its second try
    assert last_rounds([True]) == (1, ["linger"])
    # never lands: the smallest peer ID ends on its synchronized state, which the others take
    tries = finish.FINAL_TRIES
    assert last_rounds([False] * tries) == (tries, ["end_on_sync", "linger"])
    # the other finisher is past its last round: no more tries
    assert last_rounds([False, True], others_done_after=1) == (1, ["end_on_sync", "linger"])


def test_an_overlapped_round_trains_on_from_its_share_and_lands_where_the_plain_rule_does():
    """Shifted at the start (x <- x + q - e), corrected at the landing (x <- x + e - s): the
    model ends at x + q - s with the progress made meanwhile, and a round that does not land
    is undone exactly."""
    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(40, generator=g), "b": torch.randn(9, generator=g)}
    pieces = cut_pieces({n: p.numel() for n, p in params.items()}, pieces_hint=3)
    x0 = flatten(params, pieces)
    theta = x0 + torch.randn(49, generator=g) * 0.1
    own = [(theta - x0)[p.offset : p.offset + p.numel].half() for p in pieces]
    q = torch.cat([o.float() for o in own])
    avg = [torch.randn(p.numel, generator=g).half() for p in pieces]
    m = torch.randn(49, generator=g)
    lr, mu, share = 0.7, 0.9, 0.5
    e = lr * ((1 + mu) * share * q + mu * mu * m)
    shift_to_own_share(params, pieces, own, m, lr, mu, share)
    torch.testing.assert_close(flatten(params, pieces), x0 + q - e)
    progress = torch.randn(49, generator=g) * 0.01
    for p in pieces:  # local steps while the round runs
        params[p.name].view(-1)[p.start : p.start + p.numel] += progress[
            p.offset : p.offset + p.numel
        ]
    a_flat = torch.cat([a.float() for a in avg])
    step = lr * (a_flat + mu * (mu * m + a_flat))
    t, mm = theta.clone(), m.clone()
    apply_outer_step(params, pieces, list(zip(avg, own, strict=True)), t, mm, lr, mu, False, share)
    torch.testing.assert_close(flatten(params, pieces), x0 + progress + q - step)
    torch.testing.assert_close(t, theta - step)
    # a round that does not land: undone, the model keeps exactly its own progress
    before = flatten(params, pieces)
    shift_to_own_share(params, pieces, own, mm, lr, mu, share)
    shift_to_own_share(params, pieces, own, mm, lr, mu, share, undo=True)
    torch.testing.assert_close(flatten(params, pieces), before)


@pytest.mark.parametrize("fractions", [(0.5, 0.5), (0.25, 0.25, 0.25, 0.25), (0.1, 0.6, 0.3)])
def test_round_layout_gives_each_member_its_probe_and_its_chunk(fractions):
    """hivemind's own partitioner, fed the round's layout: member i reduces exactly probe i and
    chunk i (so a member lost mid-round always leaves its probe unaveraged), and the chunks
    cover the vector once, in order."""
    from hivemind.averaging.partition import TensorPartContainer

    from atomtrain.peer.layout import round_layout

    held = torch.arange(1000, dtype=torch.float16)
    probes = torch.zeros(8)
    tensors, infos = round_layout(held, probes, fractions)
    assert len(tensors) == 2 * len(fractions)
    assert torch.equal(torch.cat(tensors[1::2]), held)
    container = TensorPartContainer(tensors, fractions, tensor_infos=infos, part_size_bytes=64)
    for i in range(len(fractions)):
        parts = list(container._input_parts_by_peer[i])
        assert parts[0][0].data_ptr() == probes[i : i + 1].data_ptr()  # its probe first
        assert [info.key for _, info in parts] == [1] + [0] * (len(parts) - 1)
        chunk = tensors[2 * i + 1]
        assert sum(p.numel() for p, _ in parts[1:]) == chunk.numel()
