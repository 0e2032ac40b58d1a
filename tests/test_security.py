"""Swarm keys close the DHT, averaging and state-download gates; bad updates are refused."""

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import queue
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hivemind import DHT
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from atomtrain.errors import AtomError
from atomtrain.peer.auth import (
    MemberGate,
    Membership,
    SwarmAuthorizer,
    SwarmKey,
    declare_member,
    load_swarm_key,
    parse_key,
    read_roster,
    write_new_key,
)
from atomtrain.peer.averaging import ProbedAverager
from atomtrain.peer.bounds import Defence, equal_weights
from atomtrain.peer.exact import (
    FIRST_PARTS_KEPT,
    LAG_CAP,
    NOT_IN_GROUP,
    START_FLOOR_S,
    START_LAGS,
    ExactAverageRunner,
    first_part_timeouts,
    silent_members,
    start_timeouts,
)
from atomtrain.peer.exclusion import (
    FOLLOW_COSINE,
    FOLLOW_FLOOR,
    FOLLOW_RATIO,
    FOLLOW_REFERENCE_ROUNDS,
    FOLLOW_WHY,
    FOLLOW_WITHIN,
    FORGIVE_ROUNDS,
    LEAN,
    LEAN_MEMBERS,
    LEAN_WHY,
    OPPOSED_COSINE,
    OPPOSED_EXCLUSION_ROUNDS,
    OPPOSED_ROUNDS,
    OPPOSED_SPAN_ROUNDS,
    OPPOSED_WITHIN,
    STALL_ROUNDS,
    LeftOut,
    exclusion_rounds,
    stalls_remembered,
)
from atomtrain.peer.guarded import GRACE_S, OPENED_KEPT, GuardedAverager, Ran
from atomtrain.peer.layout import cut_pieces
from atomtrain.peer.protocol import averaging_prefix, protocol_tag
from atomtrain.peer.records import swarm_validators
from atomtrain.peer.traffic import Traffic

from .peer_attack_harness import honest_mean

HERE = Path(__file__).parent
NUMEL = 4000
SWARM = "sec"


def keyed_peer(key: SwarmKey | None) -> tuple[DHT, ProbedAverager]:
    """A peer of a keyed swarm that serves a known state (round 7)."""
    dht = DHT(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        start=True,
        authorizer=SwarmAuthorizer(key) if key else None,
        record_validators=swarm_validators(SWARM, RSAPrivateKey.process_wide()),
    )
    declare_member(dht, SWARM, key, dht.peer_id, wait=True)
    state = ({"round": 7}, [torch.ones(NUMEL), torch.zeros(NUMEL)])
    avg = ProbedAverager(
        dht,
        f"{SWARM}_avg",
        cut_pieces({"w": NUMEL}),
        "none",
        1.0,
        10.0,
        4,
        lambda: state,
        MemberGate(key, SWARM),
    )
    return dht, avg


async def within(awaitable, what: str, seconds: float = 60.0):
    """`awaitable`, failing with what hung (a hang once took pytest's whole 300 s, in CI on a
    slow machine, with no sign of which call it was)."""
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except TimeoutError:
        raise AssertionError(f"no answer to the {what} within {seconds:.0f} s") from None


async def collect(stream) -> list:
    return [m async for m in stream]


async def knock(victim: DHT, prefix: str) -> dict[str, object]:
    """Call the victim's three averaging RPCs directly over libp2p, as a peer without the key
    that skipped the DHT would, and report what came back."""
    p2p = await within(
        P2P.create(initial_peers=[str(a) for a in victim.get_visible_maddrs()]), "p2p"
    )
    try:
        stub = GuardedAverager.get_stub(p2p, victim.peer_id, namespace=prefix)
        join = await stub.rpc_join_group(
            averaging_pb2.JoinRequest(
                schema_hash=b"x", expiration=get_dht_time() + 10, group_key=f"{prefix}.0b"
            )
        )
        try:
            join_code = (await within(join.__anext__(), "join")).code
        except StopAsyncIteration:
            # the refusal lost as the gate hung up at once (CI, 2026-12-05, 1 run): nothing was
            # granted either; a gate that let the outsider in answers with the group
            join_code = averaging_pb2.PROTOCOL_VIOLATION

        async def no_parts():
            # nothing is sent: the gate refuses before it reads a part (guarded.py), then hangs
            # up, and a part reaching its daemon after that reset the stream with the refusal
            # still in it (here, on 2 loaded cores, a broken pipe in 1 run of 10; likely too
            # the CI runs whose read never ended: 60 s, once pytest's 300 s). A gate that let
            # the outsider in waits for its part, and this read for an answer, until `within`
            # gives up.
            await asyncio.Event().wait()
            yield

        part = await stub.rpc_aggregate_part(no_parts())
        part_code = (await within(part.__anext__(), "part", 30.0)).code
        download = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        state_messages = await within(collect(download), "download")
        return {"join": join_code, "part": part_code, "state_messages": len(state_messages)}
    finally:
        await p2p.shutdown()


def test_a_peer_without_the_key_is_refused_at_every_gate():
    key = SwarmKey(secrets.token_bytes(32))
    dht, avg = keyed_peer(key)
    try:
        addr = [str(a) for a in dht.get_visible_maddrs()]
        # gate 1, the DHT: neither no key nor a wrong key bootstraps, reads or writes
        for other in (None, SwarmKey(secrets.token_bytes(32))):
            with pytest.raises(RuntimeError, match="bootstrap failed"):
                DHT(
                    initial_peers=addr,
                    start=True,
                    authorizer=SwarmAuthorizer(other) if other else None,
                )
        loose = DHT(initial_peers=addr, start=True, ensure_bootstrap_success=False)
        try:
            assert loose.get(f"{SWARM}_members", latest=True) is None
            loose.store("planted", 1, get_dht_time() + 60)
            assert dht.get("planted", latest=True) is None
        finally:
            loose.shutdown()
        # gates 2 and 3: averaging RPCs and state download, called directly over libp2p
        outsider = asyncio.run(knock(dht, f"{SWARM}_avg"))
        assert outsider == {
            "join": averaging_pb2.PROTOCOL_VIOLATION,
            "part": averaging_pb2.PROTOCOL_VIOLATION,
            "state_messages": 0,
        }
        # the same calls from a key holder get through (so the refusals above are the gates')
        member = DHT(
            initial_peers=addr,
            start=True,
            authorizer=SwarmAuthorizer(key),
            record_validators=swarm_validators(SWARM, RSAPrivateKey.process_wide()),
        )
        try:
            declare_member(member, SWARM, key, member.peer_id, wait=True)
            roster = read_roster(member, SWARM, key.owner())
            assert roster.of_peer(member.peer_id.to_base58()) is not None
            insider_avg = ProbedAverager(
                member,
                f"{SWARM}_avg",
                cut_pieces({"w": NUMEL}),
                "none",
                1.0,
                10.0,
                4,
                lambda: ({}, []),
                MemberGate(key, SWARM),
            )
            state = insider_avg.download_state(20, [dht.peer_id.to_base58()])
            assert state is not None and state[0]["round"] == 7
            insider_avg.shutdown()
        finally:
            member.shutdown()
    finally:
        avg.shutdown()
        dht.shutdown()


def story(logs: list[str], limit: int = 2000) -> str:
    """What each peer said of its rounds (atomtrain's lines and hivemind's warnings, its last
    `limit` characters): a failed assertion's message, so a failure in CI can be read."""
    told = []
    for i, log in enumerate(logs):
        lines = [
            line
            for line in log.splitlines()
            if any(word in line for word in (" atomtrain.", "[WARN]", "[ERROR]"))
            or line.startswith("peer ")
        ]
        told.append(f"--- peer {i} ---\n" + "\n".join(lines)[-limit:])
    return "\n".join(told)


def run_round(
    tmp_path: Path, attack: str, defend: bool, honest: int = 2, rounds: int = 3
) -> dict[int, dict]:
    """Three averager processes (two honest, peer 2 poisoned), `rounds` rounds each (the
    harness's own count for some attacks); or `honest` honest ones and peer `honest` poisoned.
    The honest peers' outputs."""
    tmp_path = tmp_path / f"{attack}-{'defended' if defend else 'undefended'}"
    tmp_path.mkdir()
    logs, procs = [], []
    # start-up may take the barrier's 120 s on a loaded machine, then 3 rounds; the deadline is
    # under pytest's own timeout (300 s), so a hung peer's log still reaches the report. Each
    # peer's exit is waited for, not the end of its output: a pipe stayed open about 3 s more
    # per run after every peer had shut down, held by what its helpers had started
    deadline = time.monotonic() + 240
    try:
        for i in range(honest + 1):
            logs.append(open(tmp_path / f"log{i}.txt", "w"))  # noqa: SIM115 (closed below)
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(HERE / "peer_attack_harness.py"),
                        str(i),
                        attack,
                        "1" if defend else "0",
                        str(tmp_path),
                    ],
                    stdout=logs[i],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**os.environ, "ATTACK_HONEST": str(honest), "ATTACK_ROUNDS": str(rounds)},
                )
            )
        for i, p in enumerate(procs):
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                logs[i].write("\n[killed: past the test's 240 s deadline]")
        for log in logs:
            log.close()
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        tails = {i: (tmp_path / f"log{i}.txt").read_text()[-3000:] for i in failed}
        assert not failed, "\n".join(f"--- peer {i} ---\n{tails[i]}" for i in failed)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    return {i: torch.load(tmp_path / f"out{i}.pt") for i in range(honest)}


@pytest.mark.parametrize("attack", ["nan", "scale"])
def test_a_poisoned_contribution_never_reaches_the_averaged_parameters(tmp_path: Path, attack: str):
    outs = run_round(tmp_path, attack, defend=True)
    want_delta = honest_mean()
    for out in outs.values():
        for rnd in out["rounds"]:
            if rnd["failed"]:  # a round the attacker spoiled is discarded: nothing applied
                continue
            # only the honest peers' updates: a round lands with the attacker in its group only
            # when every reducer dropped its parts (each span's probe sits before its chunk)
            assert torch.allclose(rnd["delta"], want_delta, atol=1e-6), rnd["group"]
        assert any(not r["failed"] for r in out["rounds"])  # the honest peers went on together
    # non-finite parts and parts beyond any honest one (x 1e6) ban their sender
    assert any(out["rejected"] for out in outs.values()), "no honest peer banned the attacker"
    # without the defences the poison does arrive (so the test above can fail): in one of two
    # rounds (the first may find no group on a loaded machine)
    undefended = run_round(tmp_path, attack, defend=False, rounds=2)
    deltas = [r["delta"] for out in undefended.values() for r in out["rounds"] if not r["failed"]]
    assert deltas and any(
        not torch.isfinite(d).all() or d.abs().max() > 1e3 * want_delta.abs().max() for d in deltas
    )


def test_members_wait_past_their_matchmaking_time_for_the_quorum_rather_than_pair(
    tmp_path: Path,
):
    """assembly.least_group: three live members of a keyed swarm, one of them starting each round
    after the other two's matchmaking time. A pair could not be applied (sync.quorum: three in
    sync), so the two do not form one when their matchmaking time ends: they look on, within
    the round's time, and the late one joins them. (hivemind's rule formed the pair.)

    One round of an honest peer's three may be lost otherwise: in a CI run (2026-12-06) peer 0's
    exchange with peer 1 failed within the group of three on a loaded machine, about 0.1 s into
    the all-reduce (cause not traced); the other two landed that round, and peer 0's retry found
    no group. (The peers' logs now say why an exchange failed.) With hivemind's rule every round
    of every honest peer ran as a pair (least_group patched to 2, 2026-12-06)."""
    outs = run_round(tmp_path, "late_joiner", defend=True)
    for i, out in outs.items():
        got = [(r["failed"], r.get("group"), r.get("why")) for r in out["rounds"]]
        landed = [r for r in out["rounds"] if not r["failed"]]
        assert all(r["group"] == 3 for r in landed), (i, got)
        assert len(out["rounds"]) == 3 and len(landed) >= 2, (i, got)
        assert not out["rejected"] and not out["stalled"], (i, out)


def test_a_directed_push_with_inflated_claims_moves_the_average_by_about_a_third(tmp_path: Path):
    """One member of three sends the honest mean pushed 10 honest update sizes in one direction
    (inside the bound beyond which it would be dropped), claims a million times the tokens and a
    thousand times the update size. Whatever it claims, it moves the average by about 1/3 of an
    honest update (the median of three is moved too: 0.5 measured offline); with weights and
    clip radii that followed its claims it moved it 6.7 updates."""
    from atomtrain.peer.attack import poison

    from .peer_attack_harness import vectors

    outs = run_round(tmp_path, "push", defend=True)
    honest = honest_mean()
    size = float(vectors(0).norm())  # an honest update's size
    direction = poison("push", honest) - honest
    direction /= direction.norm()
    landed = [r for out in outs.values() for r in out["rounds"] if not r["failed"]]
    assert any(r["group"] == 3 for r in landed), "the attacker never took part in a round"
    for r in landed:
        shift = r["delta"] - honest
        assert float(shift @ direction) <= 0.75 * size, (float(shift @ direction) / size, r)
        assert float(shift.norm()) <= 1.0 * size, (float(shift.norm()) / size, r)


def test_a_member_sending_a_little_is_enough_is_left_out_after_one_round_with_it(tmp_path: Path):
    """ALIE (every coordinate moved one honest spread down, inside the honest range: its cosine
    with an honest update reads like an honest member's) is left out by every honest peer, for
    the way its update leans, after at most one landed round with it; no honest peer is named,
    and the honest pair's last round lands without it."""
    outs = run_round(tmp_path, "alie", defend=True)
    for out in outs.values():
        assert not out["rejected"], out["rejected"]  # left out for a while, not banned
        assert [name for name, _ in out["stalled"]] == ["h2"], out["stalled"]
        assert out["stalled"][0][1].startswith("sent an update that leans one way"), out["stalled"]
        landed = [r for r in out["rounds"] if not r["failed"]]
        assert sum(r["group"] == 3 for r in landed) <= 1, out["rounds"]
        assert landed and landed[-1]["group"] == 2, out["rounds"]


def caught_alone(tmp_path: Path, attack: str) -> tuple[list[tuple[str, str]], dict]:
    """Three rounds of two honest peers and peer 2 attacking, defended: only rounds of the
    honest pair land (nothing of a round with peer 2 is applied), only peer 2 is banned, and
    only peer 2 is left out for a while, but for the open race below. (who, why) of every
    blame, and the peers' outputs."""
    outs = run_round(tmp_path, attack, defend=True)
    landed = [r for out in outs.values() for r in out["rounds"] if not r["failed"]]
    assert landed, "the honest peers never averaged together"
    for r in landed:
        assert r["group"] == 2 and torch.allclose(r["delta"], honest_mean(), atol=1e-6)
    banned = [(name, why) for out in outs.values() for name, why in out["rejected"]]
    assert all(name == "h2" for name, _ in banned), banned  # never an honest peer
    left_out = [(name, why) for out in outs.values() for name, why in out["stalled"]]
    blamed = banned + left_out
    assert any(name == "h2" for name, _ in blamed), blamed
    # Open (issue 12): an honest auditor is sometimes left out a while for a verdict its
    # asker did not get (CI, 2026-12-05: peer 1 left peer 0 out after the forging reducer's
    # round, and their last two rounds found no group; 0 of 16 runs on a quiet machine). Any
    # other blame of an honest peer fails here
    assert all(name == "h2" or why.startswith("gave no audit verdict") for name, why in left_out)
    return blamed, outs


def test_a_member_banned_by_one_peer_but_taken_in_by_another_costs_it_no_round(tmp_path: Path):
    """Peer 0 banned peer 2 (honest here) before the first round; peer 1, which did not, leads
    every round and takes both in. Peer 0 takes part and, the round audited, applies it like the
    others: the same bits, nothing discarded. (Discarding it left peer 0 a round behind the
    others, out of sync, re-synchronizing for the next rounds.)"""
    outs = run_round(tmp_path, "banned_by_0", defend=True)
    together = [
        (a, b)
        for a, b in zip(outs[0]["rounds"], outs[1]["rounds"], strict=True)
        if not b["failed"] and b["group"] == 3
    ]
    assert together, outs[1]["rounds"]  # peer 1 took both in
    for a, b in together:
        # never discarded for the ban. (Its request can still time out on a loaded machine as
        # the leader assembles: a CI run, 2026-12-04, had peer 0 find no group once while the
        # other two counted it in theirs. That is matchmaking, not this rule.)
        assert not a["failed"] or "could not find a group" in a["why"], a
        if not a["failed"]:
            assert a["group"] == 3 and torch.equal(a["delta"], b["delta"])
    assert sum(not a["failed"] for a, _ in together) >= len(together) - 1, together
    assert not outs[0]["rejected"] and not outs[1]["rejected"]


def test_a_lying_reducer_is_caught_by_its_auditor_and_its_lie_never_lands(tmp_path: Path):
    """Peer 2 sends its update honestly and moves the average of the span it reduces in one
    direction, within what members' bounds accept (6 typical updates). The span's auditor
    replays the reduction from the parts peer 2 forwards and finds the averages false: the round
    is discarded before anything is applied, and the auditor, holding proof, bans peer 2.
    (Without the audit the same lie landed, unseen: a group of three applied it.)"""

    blamed, outs = caught_alone(tmp_path, "lying_reducer")
    # its auditor holds proof (the reducer's own forwarded parts): banned, not left out a while
    assert any(
        "differ from the audit's replay" in why
        for out in outs.values()
        for _, why in out["rejected"]
    ), blamed


def test_a_reducer_that_forwards_its_auditor_other_parts_is_caught_by_it(tmp_path: Path):
    """Peer 2 reduces honestly but forwards its own part in place of every other member's (as
    a reducer fitting a lie would): the auditor finds its own part replaced and bans peer 2;
    every other member finds its part replaced and discards the round."""
    blamed, _ = caught_alone(tmp_path, "forging_reducer")
    assert any("another part as this member's" in why for _, why in blamed), blamed


def test_an_auditor_that_slanders_an_honest_reducer_is_banned_by_it(tmp_path: Path):
    """Peer 2 trains, sends and reduces honestly, and as an auditor reports projections 10% off
    the true ones. The reducer it slanders knows its averages are honest and bans peer 2;
    a third member cannot tell which of the two lies, discards the round and blames neither.
    No honest peer is ever banned (nor left out, but for caught_alone's open race), and nothing
    a slandered round carried is applied."""
    blamed, _ = caught_alone(tmp_path, "lying_auditor")
    assert any("reports other averages" in why for _, why in blamed), blamed


def test_a_reducers_averages_are_checked_as_tightly_as_its_rule_allows():
    """Three or more members in sync: 4 (typical + own), the typical update the upper median of
    their reports (a member reporting nonsense moves it no further than the others' values). At
    that bound, for a member whose update is of typical size, an average 7 typical updates away
    passes and 9 does not. Fewer in sync: no larger than the member's own part (with the codec's
    slack), whatever anyone reported."""
    from atomtrain.peer.bounds import (
        PAIR_SLACK,
        Defence,
        reducer_bounds,
        returned_lie,
        returned_pair_lie,
    )

    d = Defence()  # reduced = 4: the tight check
    assert reducer_bounds([1.0, 2.0, 3.0, 9.0], d).rms == 3.0
    assert reducer_bounds([1.0, 2.0, 3.0], d).rms == 2.0
    assert reducer_bounds([], Defence(min_scale=0.5)).rms == 0.5
    assert reducer_bounds([1.0, 1.0, float("nan")], d).rms == 1.0
    assert reducer_bounds([1.0, 1.0, 1.0, 1e6], d).rms == 1.0  # one liar moves nothing
    n = 400
    own = torch.randn(n, generator=torch.Generator().manual_seed(5))
    own *= 0.1 / float(own.pow(2).mean().sqrt())  # rms 0.1: a typical update
    typical = reducer_bounds([0.1, 0.1, 0.1], d)
    away = torch.randn(n, generator=torch.Generator().manual_seed(6))
    away *= float(own.norm()) / float(away.norm())  # one typical update's size
    assert returned_lie("delta", own, own + 7 * away, typical, d.reduced) is None
    assert "delta averages" in str(returned_lie("delta", own, own + 9 * away, typical, d.reduced))
    assert returned_lie("probe", own, own + 9 * away, typical, d.reduced) is None  # probe check
    bad = own.clone()
    bad[0] = float("nan")
    assert returned_lie("probe", own, bad, typical, d.reduced) == "non-finite averages"
    # of two
    assert returned_pair_lie("delta", own, own) is None
    assert returned_pair_lie("delta", own, -own) is None  # the size alone: the audit sees more
    assert returned_pair_lie("delta", own, (1 + PAIR_SLACK) / 2 * away) is None
    assert "of two" in str(returned_pair_lie("delta", own, 2 * away))
    assert returned_pair_lie("probe", own, 9 * away) is None
    assert returned_pair_lie("probe", own, bad) == "non-finite averages"


def test_stall_exclusions_double_at_each_repeat_and_quiet_rounds_forgive_them():
    assert [exclusion_rounds(k) for k in (1, 2, 3, 4)] == [2, 4, 8, 16]
    assert [exclusion_rounds(k, first=16) for k in (1, 2)] == [16, 32]
    assert exclusion_rounds(10**6) == exclusion_rounds(32)  # a long run's count stays bounded
    assert stalls_remembered(3, FORGIVE_ROUNDS - 1) == 3
    assert stalls_remembered(3, FORGIVE_ROUNDS) == 2
    assert stalls_remembered(3, 10 * FORGIVE_ROUNDS) == 0

    # the averager's own bookkeeping: a member stalling again soon is left out twice as long;
    # one stalling again after many quiet rounds (counted from the end of its exclusion) as
    # long as the first time; one stalling whenever it is let back in, ever longer
    events: list = []

    def ledger() -> LeftOut:
        return LeftOut(lambda peer, why, kind: events.append((peer, why, kind)), lambda _: False)

    def stall_at(left_out: LeftOut, round_: int, first: int = STALL_ROUNDS) -> int:
        while left_out.rounds < round_:
            left_out.next_round()
        assert "peer" not in left_out, "named again while still left out"
        left_out.stall("peer", "silent", first=first)
        return left_out.rounds_left("peer")  # the rounds it is left out of after this one

    a = ledger()
    assert [stall_at(a, 1), stall_at(a, 5), stall_at(a, 12)] == [2, 4, 8]
    back = 12 + 8  # its exclusion over; three quiet spans from then forgive all three stalls
    assert stall_at(a, back + 3 * FORGIVE_ROUNDS) == 2
    assert stall_at(a, back + 3 * FORGIVE_ROUNDS + 3) == 4  # and soon again: twice as long
    b, at, left_out = ledger(), 1, []
    for _ in range(8):  # let back in, it stalls at once, every time
        left_out.append(stall_at(b, at))
        at += left_out[-1] + 1
    assert left_out == [2, 4, 8, 16, 32, 64, 128, 256]
    assert len(events) == 13 and all(e[2] == "stall" for e in events)
    # left out for exactly that many rounds: in during them, out of them after
    c = ledger()
    assert stall_at(c, 1) == 2
    c.next_round()
    c.next_round()
    assert "peer" in c
    c.next_round()
    assert "peer" not in c
    # one left out longer the first time (opposing updates): its quiet rounds count from the
    # end of that longer exclusion, and a repeat doubles that length
    d = ledger()
    assert stall_at(d, 1, first=OPPOSED_EXCLUSION_ROUNDS) == OPPOSED_EXCLUSION_ROUNDS
    again = 1 + OPPOSED_EXCLUSION_ROUNDS + FORGIVE_ROUNDS - 1  # not quite forgiven
    assert stall_at(d, again, first=OPPOSED_EXCLUSION_ROUNDS) == 2 * OPPOSED_EXCLUSION_ROUNDS


def test_a_member_that_stalls_rounds_costs_one_round_and_is_left_out(tmp_path: Path):
    """Peer 2 joins each round's group it gets into and then goes silent (its averager frozen,
    and none of its parts sent even once it wakes: peer_attack_harness.silent_member_patches).
    The try it stalls is lost (its span is never averaged), and the honest pair run their group
    again at once without it (redo.py; the round lost where they ended that try far apart); both
    name it from the all-reduce's timeouts and leave it out, so the later rounds land between
    them. (One of
    them may instead find no group, hivemind's matchmaking race between the honest pair: CI,
    2026-12-05, the last round. It counts against the one round a peer may lose.)"""
    outs = run_round(tmp_path, "stall", defend=True)
    logs = [(tmp_path / "stall-defended" / f"log{i}.txt").read_text() for i in range(3)]
    for i, out in outs.items():
        told = f"peer {i}: {out['rounds']}\n{story(logs)}"
        failed = [r["failed"] for r in out["rounds"]]
        assert sum(failed) <= 1, told  # a stall costs at most one round
        later = [r for r in out["rounds"][1:] if not r["failed"]]
        assert later and all(r["group"] == 2 for r in later), told
        assert all(torch.allclose(r["delta"], honest_mean(), atol=1e-6) for r in later)
        assert [name for name, _ in out["stalled"]] == ["staller"], out["stalled"]
        assert not out["rejected"]  # left out for a while, not banned for good


def test_a_stalled_try_is_run_again_at_once_by_its_group_without_the_staller(tmp_path: Path):
    """Three honest peers and a staller (peer 3, as above) in one group: each honest peer ends
    the try early over the staller and runs the same group again at once without it (redo.py),
    with no matchmaking, and says so in its log; the round lands with the three of them, on
    their average. The staller is named and left out; no honest peer is named a staller (one
    late with an audit verdict on a loaded machine may be left out by a peer that discarded
    that round for it: open in issue 12).

    Where the honest peers started the try further apart than the start timeout (5 s here: 3 s
    apart each under a CPU burner, and once in CI, 2026-12-07), the first to start ended it over
    the staller and another honest member, so their redos differ and the round is lost, as the
    README says (issue 12: honest members starting a try apart): that round fails at every
    honest peer, one round, and the two after land with the three of them."""
    outs = run_round(tmp_path, "stall", defend=True, honest=3)
    logs = [(tmp_path / "stall-defended" / f"log{i}.txt").read_text() for i in range(4)]
    want, with_staller = honest_mean(3), honest_mean(4)  # (the staller's update is vectors(3))
    honest_ids = [re.search(r"^peer \d+ is (\S+)", logs[i], re.M).group(1)[-8:] for i in range(3)]
    apart = any(  # an honest member ended a try over another, late to open its stream
        "opened no stream" in line and any(h in line for h in honest_ids)
        for log in logs[:3]
        for line in log.splitlines()
        if "a round ended early" in line
    )

    def off(delta: torch.Tensor, mean: torch.Tensor) -> float:
        return float((delta - mean).norm() / mean.norm())

    landed = [r for r in outs[0]["rounds"] if not r["failed"]]
    assert landed, story(logs)
    for i, out in outs.items():
        told = f"peer {i}: {out['rounds']}\n{story(logs)}"
        redone = [line for line in logs[i].splitlines() if "trying the lost group again" in line]
        assert len(redone) == 1, told  # the stalled round's; one redo a group
        first = out["rounds"][0]
        if apart and first["failed"]:  # (above: one round lost, the rest land with the three)
            assert all(not r["failed"] and r["group"] == 3 for r in out["rounds"][1:]), told
            first = out["rounds"][1]
        else:
            assert not first["failed"] and first["group"] == 3, told
            assert first["attempts"] == 2, told  # the lost try, then its redo
        # the three's parts clipped around their median (robust.py), not their plain mean: 3%
        # off it here; the staller's update would move it 60%
        assert off(first["delta"], want) < 0.1 and off(first["delta"], with_staller) > 0.3
        # the same bits as a round of the three without it, and on every honest peer
        later = [r for r in out["rounds"][1:] if not r["failed"] and r["group"] == 3]
        assert all(torch.equal(r["delta"], first["delta"]) for r in later)
        assert torch.equal(first["delta"], landed[0]["delta"])
        # an honest member named only for an audit verdict that came too late, and only by a
        # peer that then discarded that round: hivemind's timing on a loaded machine, open in
        # issue 12 (README, "no honest peer banned"; CI, 2026-12-06); never for stalling
        honest = [(name, why) for name, why in out["stalled"] if name != "staller"]
        assert [name for name, _ in out["stalled"]].count("staller") == 1, out["stalled"]
        assert all(why.startswith("gave no audit verdict") for _, why in honest), out["stalled"]
        assert not honest or any(r["failed"] for r in out["rounds"]), out["stalled"]
        assert not out["rejected"]


def test_a_member_that_withholds_its_spans_averages_ends_rounds_early_and_is_left_out(
    tmp_path: Path,
):
    """Peer 2 sends its parts as an honest member does, then answers no stream for the span it
    reduces, nor the ask after (peer_attack_harness.withheld_span_patches: bench attack's staller
    when its freeze lands after its parts went out). Each honest peer ends such a round once
    every other span's averages came and peer 2's did not for its start timeout, not at the
    reducer timeout (exact._silent_reducer: its log says so), names it at the reducer timeout
    (and after asking it: about 8 s after its first round began, as its second may be ending,
    so three rounds), and leaves it out: the later rounds land between the honest pair."""
    outs = run_round(tmp_path, "withhold", defend=True)
    logs = [(tmp_path / "withhold-defended" / f"log{i}.txt").read_text() for i in range(3)]
    ids = [line for log in logs for line in log.splitlines() if line.startswith("peer ")]
    for i, out in outs.items():
        ended = [line for line in logs[i].splitlines() if "after the others'" in line]
        assert ended and all("sent no averages" in line for line in ended), (logs[i][-3000:], ids)
        assert "sent no averages in time" not in logs[i], logs[i][-3000:]  # (the reducer timeout)
        assert [name for name, _ in out["stalled"]] == ["h2"], out["stalled"]
        # named for its span's averages; or, on a loaded machine, for its parts of a later round
        # (its averager, its streams hanging, sent them past the sender timeout there) where
        # that verdict came first (CI, 2026-12-06): either is the withholder, named once
        assert {why for _, why in out["stalled"]} <= {
            "sent no averages of its span",
            "sent none of its parts",
        }, out["stalled"]
        later = [r for r in out["rounds"][1:] if not r["failed"]]
        assert later and all(r["group"] == 2 for r in later), (out["rounds"], ids)
        assert all(torch.allclose(r["delta"], honest_mean(), atol=1e-6) for r in later)
        assert not out["rejected"]  # left out for a while, not banned for good


def test_a_member_bringing_its_weight_average_reads_no_one_but_is_itself_still_read():
    from atomtrain.peer.guarded import reads_members

    ids = ["me", "other"]
    honest = {"name": "x", "weight_average": False}
    assert reads_members([honest, honest], ids, "me", trusted=True)
    # its own last round with train.ema: what it brings is its average, not an update
    assert not reads_members([{"weight_average": True}, honest], ids, "me", trusted=True)
    # another member's word spares that member nothing: this one still reads it
    assert reads_members([honest, {"weight_average": True}], ids, "me", trusted=True)
    # only a real True counts; metadata missing or malformed reads as before
    assert reads_members([{"weight_average": 1}, honest], ids, "me", trusted=True)
    assert reads_members([{}, honest], ids, "me", trusted=True)
    assert reads_members([honest], ids, "me", trusted=True) and reads_members([], ids, "me", True)
    # a round whose metadata a leader forged reads no one
    assert not reads_members([honest, honest], ids, "me", trusted=False)


def test_a_silent_leader_is_named_alone_for_its_groups_silence():
    """Members that sent nothing are named, unless the group's leader is among them: it may
    never have told them of the group, so only it is named."""
    assert silent_members(["b", "c"], leader="a") == ["b", "c"]
    assert silent_members(["leader", "b"], leader="leader") == ["leader"]
    assert silent_members([], leader="a") == []
    assert silent_members(["b"], leader=None) == ["b"]


def ended_early(
    leader: str, heard: str, wait_s: float, answers: str = ""
) -> tuple[list[str], list[str], str]:
    """A runner of members me, a, b, c (b already sent its parts) that ends its round early;
    `heard` sends its parts after the end; asked for its span, the member `answers` names says
    it is not in the group (members of a longer `answers` give another answer), the others
    never answer. (Names before the reducer timeout, names after, why
    the round failed.)"""

    class Stub:
        def __init__(self, peer_id: str):
            self.peer_id = peer_id

        async def rpc_aggregate_part(self, asked):
            assert (await anext(asked)).group_id == b"g"
            if self.peer_id not in answers:
                await asyncio.Event().wait()  # frozen: never answers
            not_in_group = answers == self.peer_id
            code = averaging_pb2.BAD_GROUP_ID if not_in_group else averaging_pb2.INTERNAL_ERROR

            async def answer():
                yield averaging_pb2.AveragingData(code=code)

            return answer()

    async def scenario() -> tuple[list[str], list[str], str]:
        runner = ExactAverageRunner.__new__(ExactAverageRunner)
        named: list[str] = []
        runner.peer_id, runner._leader, runner.group_id = "me", leader, b"g"
        runner.sender_peer_ids = ["me", "a", "b", "c"]
        runner.active_senders, runner.banned_senders = {"me", "b"}, set()
        runner._delivered, runner._not_in_group = set(), set()
        runner._unheard, runner._heard_late = set(), set()
        runner.sender_timeout, runner.reducer_timeout = 0.1, 0.3
        runner._started = time.monotonic()
        runner._on_stall = lambda peer_id, why: named.append(peer_id)
        runner._get_peer_stub = Stub
        runner._future = asyncio.get_running_loop().create_future()
        runner.finalize = lambda exception: runner._future.set_exception(exception)
        runner.end_early("c sent nothing within the sender timeout")
        await asyncio.sleep(0.05)
        before = list(named)
        if heard:
            runner.heard(heard)
        await asyncio.sleep(wait_s)
        return before, named, str(runner._future.exception())

    return asyncio.run(scenario())


def test_a_round_ended_early_names_only_members_still_silent_at_the_reducer_timeout():
    """A lost round ends at once (exact.end_early); a member that had sent nothing by then is
    named a staller only if, until the reducer timeout counted from this member's start, its
    parts never come and it answers nothing when asked for its span: one that started late
    sends them, one still looking for its group says it is not in it, and neither is named. The
    leader rule holds as at the timeout (silent_members)."""
    before, after, why = ended_early(leader="b", heard="a", wait_s=0.5)
    assert before == [] and after == ["c"], (before, after)
    assert why == "c sent nothing within the sender timeout"
    assert ended_early(leader="b", heard="", wait_s=0.5)[1] == ["a", "c"]
    assert ended_early(leader="b", heard="", wait_s=0.5, answers="a")[1] == ["c"]
    # a staller whose averager answers anything else, yet sends nothing, is named
    assert ended_early(leader="b", heard="", wait_s=0.5, answers="a,c")[1] == ["a", "c"]
    assert ended_early(leader="c", heard="", wait_s=0.5)[1] == ["c"]  # silent leader alone
    assert ended_early(leader="b", heard="", wait_s=0.05)[1] == []  # not before the timeout


def test_a_reducer_that_answers_it_is_not_in_the_group_is_recorded_so():
    """What the audit's and the stall rule's exemptions read (`_not_in_group`): a reducer that
    answers this member's parts BAD_GROUP_ID, as hivemind's sender reports it (its error's
    words, matched by exact.NOT_IN_GROUP), fails its span and is recorded as not in the group,
    not as heard from."""
    from hivemind.averaging.partition import AllreduceException
    from hivemind.p2p import PeerID

    def peer_id(name: str) -> PeerID:  # an identity multihash of a made-up key
        return PeerID(b"\x00\x24\x08\x01\x12\x20" + hashlib.sha256(name.encode()).digest())

    class Stub:
        async def rpc_aggregate_part(self, parts):
            async def answer():
                yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)

            return answer()

    async def scenario() -> tuple[str, bool, bool]:
        me, other = peer_id("me"), peer_id("other")
        runner = ExactAverageRunner(
            p2p=SimpleNamespace(peer_id=me), servicer_type=GuardedAverager, prefix="t",
            group_id=b"g", tensors=[torch.zeros(64)], ordered_peer_ids=[me, other],
            peer_fractions=(0.5, 0.5), sender_timeout=1.0, reducer_timeout=2.0,
            traffic=Traffic(), part_size_bytes=64,
        )  # fmt: skip
        assert runner.tensor_part_container.num_parts_by_peer[1] > 0  # `other` reduces a span
        runner._get_peer_stub = lambda peer: Stub()
        with pytest.raises(AllreduceException) as failed:
            await runner._communicate_with_peer(other)
        return str(failed.value), other in runner._not_in_group, runner._heard_from(other)

    why, not_in_group, heard = asyncio.run(scenario())
    # (hivemind fills the failed span with this member's own parts through the same call that
    # registers averages: those stand-ins counted as averages `other` delivered, so one that
    # missed its group was heard from, and doubted for the audit verdict it could not give)
    assert why.endswith(NOT_IN_GROUP) and not_in_group and not heard


def test_a_try_every_other_member_left_ends_at_once_and_says_what_it_waited_for(caplog):
    """A try whose other members all left it (answered it is not in the group, or their
    exchange with it failed: their try ended) can land nothing: it ends at once rather than at
    its timeout (a clean swarm's leader held its try 15 s so), while one member still runs it,
    it goes on. It ends over those never heard from: members that sent their parts and left may
    run the group's redo without a crashed one, which this member then joins. A try cut off at
    its timeout logs, per member, what it still waited for."""
    from hivemind.averaging.partition import AllreduceException
    from hivemind.p2p import PeerID

    def peer_id(name: str) -> PeerID:  # an identity multihash of a made-up key
        return PeerID(b"\x00\x24\x08\x01\x12\x20" + hashlib.sha256(name.encode()).digest())

    me, refuser, ender, crashed = (peer_id(n) for n in ("me", "refuser", "ender", "crashed"))

    class Stub:  # (INTERNAL_ERROR: a stream already open when its member's try ended)
        def __init__(self, code: int | None):
            self.code = code

        async def rpc_aggregate_part(self, parts):
            if self.code is None:
                raise ConnectionRefusedError("crashed")

            async def answer():
                yield averaging_pb2.AveragingData(code=self.code)

            return answer()

    stubs = {
        refuser: Stub(averaging_pb2.BAD_GROUP_ID),
        ender: Stub(averaging_pb2.INTERNAL_ERROR),
        crashed: Stub(None),
    }

    def runner(others: list) -> ExactAverageRunner:
        r = ExactAverageRunner(
            p2p=SimpleNamespace(peer_id=me), servicer_type=GuardedAverager, prefix="t",
            group_id=b"g", tensors=[torch.zeros(96)], ordered_peer_ids=[me, *others],
            peer_fractions=(1 / (len(others) + 1),) * (len(others) + 1), sender_timeout=1.0,
            reducer_timeout=2.0, traffic=Traffic(), part_size_bytes=64,
        )  # fmt: skip
        r._get_peer_stub = stubs.__getitem__
        return r

    async def left(others: list, heard: list) -> tuple[list[bool], str, set]:
        r = runner(others)
        for p in heard:
            r.heard(p)  # (its parts reached this member)
        still_on = []
        for p in others:
            still_on.append(not r._future.done())
            with pytest.raises((AllreduceException, ConnectionRefusedError)):
                await r._communicate_with_peer(p)
        assert r._future.done()
        return still_on, str(r._future.exception()), r.ended_over

    still_on, why, over = asyncio.run(left([refuser, ender], heard=[ender]))
    assert still_on == [True, True]  # (on while the ender still ran it)
    assert why.startswith("every other member left the try"), why
    assert f"{str(refuser)[-8:]} not in the group" in why and "its span failed" in why, why
    assert over == {refuser}  # never heard from: the redo, if any, is without it
    # a crash and two that sent their parts, then ran the redo without it: over the crash alone
    still_on, why, over = asyncio.run(left([crashed, ender, refuser], heard=[ender, refuser]))
    assert still_on == [True, True, True] and over == {crashed}, (still_on, over)

    async def cut() -> str:  # (hivemind cancels a try at its timeout)
        r = runner([refuser, ender])
        r._not_in_group.add(refuser)
        r.finalize(exception=asyncio.CancelledError())
        return r.waiting_on()

    with caplog.at_level(logging.INFO, logger="atomtrain.peer.exact"):
        waiting = asyncio.run(cut())
    assert "a try cut off at its timeout" in caplog.text, caplog.text
    # its own span's parts, and per member its parts and its span's averages
    assert re.search(r"\d+\.\d s in; own span 0/\d+ parts", waiting), waiting
    assert f"{str(ender)[-8:]}: parts 0/" in waiting and "averages 0/" in waiting, waiting
    assert f"{str(refuser)[-8:]}: parts 0/" in waiting and "not in the group" in waiting, waiting


def test_a_member_not_in_the_group_spares_no_reducer_its_late_averages():
    """A reducer's late averages name no one while another member sent this one nothing: it may
    have waited out that member's parts from its own, later start. Not where that member
    answered it is not in the group: it is named by no one, and a pair (one answering so, one
    withholding its averages) would cost every round a reducer timeout with neither named."""
    runner = ExactAverageRunner.__new__(ExactAverageRunner)
    runner.peer_id, runner.sender_peer_ids = "me", ["me", "a", "r"]
    runner.banned_senders, runner.active_senders = {"a"}, {"me", "r"}
    runner._delivered, runner._not_in_group = set(), set()
    assert runner._waiting_for_a_staller("r")  # a sent nothing: r may be waiting for it
    runner._not_in_group.add("a")
    assert not runner._waiting_for_a_staller("r")


def verdict_asked(auditor_said: str) -> tuple[list[str], str]:
    """An audited runner of members me, a, b whose span a audits and whose verdict a does not
    give (its averager answers the request as for a group it is not in). `auditor_said`: what
    a answered this member's parts: "not in the group", the same after sending this member its
    own parts, or nothing. (Members doubted, why this member discards the round.)"""
    from atomtrain.peer.audit import AuditedRunner

    class Stub:
        def __init__(self, peer_id: str):
            assert peer_id == "a"

        async def rpc_audit_verdict(self, request):
            assert request.group_id == b"g" and request.weight == 0.0
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)

    async def scenario() -> tuple[list[str], str]:
        runner = AuditedRunner.__new__(AuditedRunner)
        doubted: list[str] = []
        runner.peer_id, runner.group_id = "me", b"g"
        runner.ordered_peer_ids = runner.sender_peer_ids = ["me", "a", "b"]
        runner._auditor, runner._own_index = {0: 1, 1: 2, 2: 0}, 0
        runner._seeds, runner._sent = {0: 7, 1: 8, 2: 9}, {0: [], 1: [], 2: []}
        runner.active_senders, runner._delivered, runner._heard_late = {"me", "b"}, {"b"}, set()
        runner._not_in_group, runner._fell_back = set(), set()
        if auditor_said != "nothing":
            runner._not_in_group.add("a")  # its span failed: this member's own part stands in
            runner._fell_back.add(1)
        if auditor_said.startswith("after sending"):
            runner.active_senders.add("a")
        runner.traffic, runner._timeout = Traffic(), 0.2
        runner._get_peer_stub = Stub
        runner._on_doubt = lambda peer_id, why: doubted.append(peer_id)
        runner._on_reject = lambda peer_id, why: doubted.append(f"banned {peer_id}")
        why = await asyncio.wait_for(runner._ask(0), 5)
        return doubted, why

    return asyncio.run(scenario())


def test_an_auditor_that_missed_its_leaders_word_is_not_left_out_for_its_missing_verdict():
    """A leader formed its group as a follower's matchmaking gave up on it: the follower never
    ran the group, answered the others' parts that it is not in it, and had no verdict to give
    on the span it was to audit. Doubted for that, it was left out of the others' next rounds
    (bench attack, a clean swarm: both others short of the quorum for four rounds; the quick
    bench: a pair that stopped averaging until its budget ran out). The round is discarded, and
    no one is doubted; an auditor that sent its parts, or did not say so, still is."""
    doubted, why = verdict_asked("not in the group")
    assert doubted == [] and why == "a, the auditor, says it is not in the group"
    assert verdict_asked("after sending its parts, not in the group")[0] == ["a"]
    doubted, why = verdict_asked("nothing")
    assert doubted == ["a"] and why.startswith("a gave no audit verdict")


def start_waited(
    opened: str,
    since: float = -1.0,
    start: float = 0.1,
    first: float | None = None,
    opens_at: float | None = None,
    gate: float = 0.0,
    delivered: bool = False,
    delays: dict | None = None,
    measured_at: float | None = None,
) -> tuple[float, str]:
    """A runner of members me, a, b (a reduces no span; b does, and sends nothing): how long
    its wait for the senders ran, and how the round ended. The members `opened` names opened
    their stream of parts to it (`since`: when its previous group ended, relative to its start);
    `start`: b's start timeout (the others': 0.1 s); `first`: b's first-part timeout (None:
    none measured); `opens_at`: when b opens its stream, relative to the start, where it opens
    one during the wait; `gate`: how long this member's gate takes to let a stream in;
    `delivered`: b's stream has brought a part (of another group) already; `delays`: the
    first-part delays measured (a floor of 0.1 s), from `measured_at` s on (None: from the
    start)."""

    async def scenario() -> tuple[float, str]:
        runner = ExactAverageRunner.__new__(ExactAverageRunner)
        runner.peer_id, runner._leader, runner.group_id = "me", None, b"g"
        runner.ordered_peer_ids = runner.sender_peer_ids = ["me", "a", "b"]
        runner.tensor_part_container = SimpleNamespace(num_parts_by_peer=[1, 0, 1])
        runner.active_senders, runner.banned_senders = {"me"}, set()
        runner.all_senders_started = asyncio.Event()
        runner._delivered, runner._not_in_group = set(), set()
        runner._unheard, runner._heard_late = set(), set()
        runner.sender_timeout, runner.reducer_timeout = 0.6, 1.2
        runner._start_timeout = {"me": 0.1, "a": 0.1, "b": start}
        runner._started = time.monotonic()
        runner._since = runner._started + since
        runner._opened = {p: runner._started for p in opened}
        runner._admitted = {p: runner._started + gate for p in opened if not delivered}
        runner._first_part_timeout = {} if first is None else {"b": first}
        runner._first_part_delays, runner._first_part_floor = {}, 0.1
        if delays is not None and measured_at is None:
            runner._first_part_delays.update(delays)
        elif delays is not None:
            loop = asyncio.get_running_loop()
            loop.call_later(measured_at, runner._first_part_delays.update, delays)
        runner._on_stall = lambda peer_id, why: None
        runner._awaited = {}  # (no part of b's came: nothing for _watch_next_parts)
        runner.tensor_part_reducer = SimpleNamespace(finished=asyncio.Event())

        def stamp(stamps: dict) -> None:
            stamps["b"] = time.monotonic()

        if opens_at is not None:
            asyncio.get_running_loop().call_later(opens_at, stamp, runner._opened)
            asyncio.get_running_loop().call_later(opens_at + gate, stamp, runner._admitted)
        runner._future = asyncio.get_running_loop().create_future()
        runner.finalize = lambda exception=None: runner._future.set_exception(exception)

        async def ban(peer_id):
            runner.banned_senders.add(peer_id)

        runner._ban_sender = ban
        await runner._handle_missing_senders()
        waited = time.monotonic() - runner._started
        why = str(runner._future.exception()) if runner._future.done() else ""
        if runner._verdict is not None:
            runner._verdict.cancel()
        return waited, why

    return asyncio.run(scenario())


def test_a_round_ends_at_the_start_timeout_where_a_reducer_never_opened_its_stream():
    """A member that reduces a span and has not even opened its stream of parts by the group's
    start timeout ends the round there (its span will have no average), not at the sender
    timeout; one that opened it (its parts still on their way over a slow link) is waited for
    until the sender timeout, and a stream opened before this member's previous group ended is
    not this round's. A member that reduces nothing never ends the round early."""
    waited, why = start_waited(opened="")
    assert waited < 0.4 and why == "b opened no stream in 0.1 s", (waited, why)
    waited, why = start_waited(opened="", start=0.3)  # its own, longer: not at the others'
    assert 0.3 <= waited < 0.55 and why == "b opened no stream in 0.3 s", (waited, why)
    waited, why = start_waited(opened="b")
    assert waited >= 0.6 and why == "b sent nothing within the sender timeout", (waited, why)
    waited, why = start_waited(opened="b", since=0.05)  # a stream from the group before
    assert waited < 0.4 and why.startswith("b opened no stream"), (waited, why)


def test_a_member_that_opened_its_stream_and_froze_ends_the_round_at_its_first_part_timeout():
    """A member frozen just after opening its stream of parts (bench attack's staller, caught
    between the two) ended the round only at the sender timeout: 5 s in bench attack, two rounds
    where a round takes 2.5 s. Where its first parts were measured in earlier rounds (so its
    link's own speed is known), it is waited for its first-part timeout after this member's gate
    let the stream in, whenever this member started (members that started apart end together);
    where no first part was measured here at all (a new swarm), or its stream already brought a
    part of another group, it is still waited for until the sender timeout."""
    waited, why = start_waited(opened="b", first=0.2)
    assert 0.2 <= waited < 0.45 and why == "b opened a stream, no part in 0.2 s", (waited, why)
    waited, why = start_waited(opened="b", first=0.05)  # timed from the stream, not the start
    assert waited < 0.1 and why == "b opened a stream, no part in 0.1 s", (waited, why)
    # its stream brought a part of another group (late parts of an earlier one): not timed
    waited, why = start_waited(opened="b", first=0.05, delivered=True)
    assert waited >= 0.6 and why == "b sent nothing within the sender timeout", (waited, why)
    waited, why = start_waited(opened="b")  # none measured: the sender timeout, as before
    assert waited >= 0.6 and why == "b sent nothing within the sender timeout", (waited, why)
    # none of its own, another's measured (a new swarm's first round: as that part comes)
    waited, why = start_waited(opened="b", delays={"a": [0.1], "c": [0.2]})
    assert 0.4 <= waited < 0.55 and why == "b opened a stream, no part in 0.4 s", (waited, why)
    waited, why = start_waited(opened="b", delays={"a": [0.04], "c": [0.04]}, measured_at=0.3)
    assert 0.3 <= waited < 0.45 and why == "b opened a stream, no part in 0.2 s", (waited, why)
    # one peer's alone (its fast parts would set it for every member not measured yet): none,
    # but a member's own, measured in this round, are its own (its stream of another group)
    waited, why = start_waited(opened="b", delays={"a": [0.01]})
    assert waited >= 0.6 and why == "b sent nothing within the sender timeout", (waited, why)
    waited, why = start_waited(opened="b", delays={"b": [0.1]})
    assert 0.4 <= waited < 0.55 and why == "b opened a stream, no part in 0.4 s", (waited, why)
    # opened during the wait, before its start timeout: timed from its opening
    waited, why = start_waited(opened="", start=0.3, first=0.3, opens_at=0.2)
    assert 0.5 <= waited < 0.75 and why == "b opened a stream, no part in 0.3 s", (waited, why)
    # this member's own gate (a read of the roster) is no delay of b's: timed from the gate
    waited, why = start_waited(opened="b", first=0.2, gate=0.3)
    assert 0.5 <= waited < 0.75 and why == "b opened a stream, no part in 0.2 s", (waited, why)


def next_parts_waited(
    first: float | None, sent: int, gap: float = 0.0, reduces: bool = True
) -> tuple[float, str, list[float], set, dict]:
    """A member's span of 3 parts, reduced by its runner's own code and hivemind's reducer, from
    three senders: itself, a (every part at once) and s, which sends `sent` parts `gap` s apart
    and then keeps its stream open, frozen, and reduces a span of its own if `reduces`. s's
    first-part timeout is `first` (None: none measured); its stream ends at a sender timeout of
    0.8 s, as hivemind's handler ends it. How long until the span had its averages or the round
    ended, why it ended ("": it did not), the span's averages, the senders banned, and the
    longest gap between parts of each sender that sent them all (`on_part_gap`)."""
    from hivemind.averaging.partition import TensorPartReducer
    from hivemind.compression import serialize_torch_tensor
    from hivemind.utils.asyncio import aiter_with_timeout

    async def scenario() -> tuple[float, str, list[float], set, dict]:
        runner = ExactAverageRunner.__new__(ExactAverageRunner)
        runner.peer_id, runner._leader, runner.group_id = "me", None, b"g"
        runner.ordered_peer_ids = runner.sender_peer_ids = ["me", "a", "s"]
        runner.tensor_part_reducer = reducer = TensorPartReducer([torch.Size([4])] * 3, 3)
        runner.tensor_part_container = SimpleNamespace(
            prefetch=1, num_parts_by_peer=[3, 0, 3 if reduces else 0]
        )
        runner._weighs_nothing = [[False] * 3] * 3
        runner.banned_senders, runner.banlock, runner._awaited = set(), asyncio.Lock(), {}
        runner.active_senders = {"me", "a", "s"}
        runner._delivered, runner._not_in_group, runner._heard_late = set(), set(), set()
        runner.sender_timeout, runner.reducer_timeout = 0.8, 1.6
        runner._first_part_timeout = {} if first is None else {"s": first}
        runner._first_part_delays, runner._first_part_floor = {}, 0.1
        gaps: dict = {}
        runner._on_part_gap = gaps.__setitem__
        runner._on_stall, runner._verdict = lambda peer_id, why: None, None
        runner._future = asyncio.get_running_loop().create_future()
        runner.finalize = lambda exception=None: runner._future.set_exception(exception)
        runner._started = time.monotonic()

        async def stream(value: float, count: int, every: float):
            for _ in range(count):
                await asyncio.sleep(every)
                part = serialize_torch_tensor(torch.full((4,), value))
                yield averaging_pb2.AveragingData(tensor_part=part, weight=1.0)
            await asyncio.sleep(60)  # frozen, its stream still open

        async def serve(sender_index: int, parts_in) -> None:
            with contextlib.suppress(asyncio.TimeoutError):
                async for _ in runner._accumulate_parts_streaming(parts_in, sender_index):
                    pass

        async def own() -> list[float]:
            return [
                float((await reducer.accumulate_part(0, index, torch.zeros(4), weight=1.0))[0])
                for index in range(3)
            ]

        handlers = [
            asyncio.ensure_future(serve(1, aiter_with_timeout(stream(3.0, 3, 0.0), 0.8))),
            asyncio.ensure_future(serve(2, aiter_with_timeout(stream(6.0, sent, gap), 0.8))),
        ]
        watch = asyncio.ensure_future(runner._watch_next_parts())
        averages = asyncio.ensure_future(own())
        await asyncio.wait((averages, runner._future), return_when=asyncio.FIRST_COMPLETED)
        took = time.monotonic() - runner._started
        why = str(runner._future.exception()) if runner._future.done() else ""
        for task in (watch, averages, *handlers, runner._verdict):
            if task is not None:
                task.cancel()
        done = averages.result() if averages.done() and not averages.cancelled() else []
        await asyncio.sleep(0.05)  # (the cancelled handlers' ends)
        return took, why, done, runner.banned_senders, gaps

    return asyncio.run(scenario())


def test_a_sender_that_stopped_partway_through_a_span_is_not_waited_for_past_its_timeout():
    """bench attack's staller, frozen after sending some of its parts, held every span it had
    not finished until the sender timeout (5 s: rounds of 8.6-8.9 s where 2.6 s is typical, run
    FP5). A member that reduces a span, whose next part this member's span waits for, now ends
    the round at its first-part timeout (its own span will have no average), as the members it
    froze before sending any part end it. One that reduces none is waited for until the sender
    timeout, as before, and then left out of the span's rest (its parts before stay in,
    hivemind's partial average); so is one with none measured. One merely slow within its
    timeout is not cut, nor is one that sent every part of this span."""
    took, why, averages, banned, _ = next_parts_waited(first=0.2, sent=1)
    assert 0.2 <= took < 0.5 and why == "s sent 1 of its 3 parts, then none in 0.2 s", (took, why)
    # one that reduces no span: until the sender timeout, then out of the rest of the span
    took, why, averages, banned, _ = next_parts_waited(first=0.2, sent=1, reduces=False)
    assert took >= 0.8 and not why and banned == {"s"}, (took, why, banned)
    assert averages == [3.0, 1.5, 1.5]  # (0 + 3 + 6) / 3, then (0 + 3) / 2
    took, why, averages, banned, _ = next_parts_waited(first=None, sent=1)  # none measured
    assert took >= 0.8 and not why and averages == [3.0, 1.5, 1.5], (took, why, averages)
    # slow, in time: not cut, and its longest gap kept (a slow link's next timeouts are its own)
    took, why, averages, banned, gaps = next_parts_waited(first=0.2, sent=3, gap=0.1)
    assert averages == [3.0, 3.0, 3.0] and not why and not banned, (took, why, banned)
    assert 0.05 <= gaps["s"] < 0.2 and gaps["a"] < 0.05, gaps
    took, why, averages, banned, _ = next_parts_waited(first=0.2, sent=3)  # all sent, then frozen
    assert took < 0.2 and averages == [3.0, 3.0, 3.0] and not banned, (took, banned)


def test_a_first_part_timeout_is_the_floor_plus_three_times_the_members_slowest_first_part():
    """Each member's first-part timeout comes from its own latest delays, as this member
    measured them: a slow link's are long, so it is never held to a fast one's. A member with
    none measured (new, or a staller that never sent a part) is held to the lower median of
    the measured peers' slowest (one slow peer does not set it for all), once two peers are
    measured; else none (the sender timeout)."""
    delays = {"fast": [0.01, 0.03, 0.02], "slow": [1.5, 2.0], "none": []}
    assert first_part_timeouts(delays, ["fast", "slow", "none", "new"], floor=1.0) == {
        "fast": pytest.approx(1.09),
        "slow": pytest.approx(7.0),
        "none": pytest.approx(1.09),
        "new": pytest.approx(1.09),
    }
    three = {"a": [0.1], "b": [0.2], "c": [4.0]}
    assert first_part_timeouts(three, ["new"], floor=1.0) == {"new": pytest.approx(1.6)}
    # one peer measured alone does not set it (its fast parts would cut every member new here)
    assert first_part_timeouts({"fast": [0.02]}, ["new"], floor=0.5) == {}
    two = {"fast": [0.02], "slow": [1.0]}  # of two, the faster: a new member slower than it loses
    assert first_part_timeouts(two, ["new"], floor=0.5) == {"new": pytest.approx(0.56)}
    assert first_part_timeouts({"none": []}, ["none", "new"]) == {}


async def reducer_waited(
    delays: dict[str, float | str | None], robust: bool = False
) -> tuple[float, str, list[str], list[str], set[str]]:
    """A real runner of members me, o and r, each reducing a span, whose averager heard both
    others' parts (as guarded.py tells it): o and r send their span's averages after `delays`
    seconds (None: never, and they answer nothing after, frozen after sending their parts;
    "left": never, and asked later for their span they answer that they are not in the group).
    `robust`: the defended runner (robust.py), which checks each average as it comes. Start
    timeouts 0.3 s, sender timeout 0.75 s, reducer timeout 2.5 s. (When both exchanges ended,
    relative to the start; how the round ended; who was named by then, and by 4.3 s: a frozen
    one is named at about 3.25 s; whom it ended over, the round's retry waits for none of them.)
    """
    from hivemind.compression import serialize_torch_tensor
    from hivemind.p2p import PeerID

    from atomtrain.peer.bounds import DELTA
    from atomtrain.peer.robust import RobustRunner

    def peer_id(name: str) -> PeerID:
        return PeerID(b"\x00\x24\x08\x01\x12\x20" + hashlib.sha256(name.encode()).digest())

    ids = {name: peer_id(name) for name in ("me", "o", "r")}
    names = {v: k for k, v in ids.items()}

    async def scenario() -> tuple[float, str, list[str], list[str], set[str]]:
        named: list[str] = []
        common = dict(
            p2p=SimpleNamespace(peer_id=ids["me"]), servicer_type=GuardedAverager, prefix="t",
            group_id=b"g", tensors=[torch.arange(96.0)], ordered_peer_ids=list(ids.values()),
            peer_fractions=(1 / 3, 1 / 3, 1 / 3), sender_timeout=0.75, reducer_timeout=2.5,
            traffic=Traffic(), part_size_bytes=64, start_timeouts=[0.3, 0.3, 0.3],
            on_stall=lambda p, why: named.append(names[p]), heard={ids["o"], ids["r"]},
        )  # fmt: skip
        defended = dict(
            kinds=[DELTA], weights={}, reported_rms={}, banned=set(), in_sync=None,
            defence=Defence(audit=False), on_reject=lambda p, why: named.append(f"banned {p}"),
        )  # fmt: skip
        runner = RobustRunner(**common, **defended) if robust else ExactAverageRunner(**common)
        container = runner.tensor_part_container
        parts = [[t for t, _ in container._input_parts_by_peer[i]] for i in range(3)]
        assert all(len(p) > 1 for p in parts)
        asked: set[str] = set()

        class Stub:
            def __init__(self, peer: PeerID):
                self.name = names[peer]

            async def rpc_aggregate_part(self, sent):
                index, delay = list(ids).index(self.name), delays[self.name]
                again, _ = self.name in asked, asked.add(self.name)

                async def answer():
                    if again and delay == "left":  # asked for its span after the round
                        yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
                    if again or not isinstance(delay, float):
                        await asyncio.Event().wait()
                    await asyncio.sleep(delay)
                    for part in parts[index]:  # (this member's own parts: within every bound)
                        code = averaging_pb2.AVERAGED_PART
                        yield averaging_pb2.AveragingData(
                            code=code, tensor_part=serialize_torch_tensor(part)
                        )

                return answer()

        runner._get_peer_stub = Stub
        runner.active_senders.update(ids.values())  # both others sent this member their parts
        for index, part in enumerate(parts[0]):  # its own span, reduced
            container.register_processed_part(0, index, part)
        exchanges = [runner._communicate_with_peer(ids[p]) for p in ("o", "r")]
        await asyncio.gather(*exchanges, return_exceptions=True)
        ended = time.monotonic() - runner._started
        done = runner._future.done() and runner._future.exception() is not None
        why = str(runner._future.exception()) if done else ""
        named_then, suspects = list(named), {names[p] for p in runner.suspects}
        await asyncio.sleep(max(runner._started + 4.3 - time.monotonic(), 0.0))
        return ended, why, named_then, named, suspects

    return await scenario()


def test_a_reducer_that_alone_sends_no_averages_ends_the_round_at_its_start_timeout():
    """A member frozen after sending its parts (bench attack's staller) sends no averages of
    its span: once every other span's averages came, the round ends at that reducer's start
    timeout, not at the reducer timeout (13.6 s rounds where 3 s is typical). It is named only
    if its averages have not come by the reducer timeout and, asked then for its span, it does
    not say it is not in the group: a merely slow honest reducer (its averages, come after the
    round ended, counted though the robust runner can no longer check them), or one that woke
    into a round the others had left, costs a round and is not left out. Where another span's
    averages are missing too, nothing ends early, and a reducer that answers in time ends
    nothing. Both the plain runner and the defended one (robust.py)."""
    cases = [{"o": 0.0, "r": r} for r in (None, 1.5, "left", 0.0)] + [{"o": None, "r": None}]

    async def all_cases() -> list[tuple[float, str, list[str], list[str], set[str]]]:
        runs = [reducer_waited(c, robust) for robust in (False, True) for c in cases]
        return await asyncio.gather(*runs)  # all at once: 4.3 s, not 43

    results = asyncio.run(all_cases())
    for robust, (frozen, slow, left, in_time, both) in enumerate((results[:5], results[5:])):
        ended, why, then, later, suspects = frozen
        assert ended < 1.2 and why.endswith("sent no averages 0.3 s after the others'"), (
            robust, ended, why)  # fmt: skip
        assert then == [] and later == ["r"], (robust, then, later)
        assert suspects == {"r"}, (robust, suspects)  # its retry's leader does not wait for r
        for ended, why, _, later, suspects in (slow, left):
            assert ended < 1.2 and "sent no averages" in why and later == [], (
                robust, ended, why, later)  # fmt: skip
            assert suspects == {"r"}, (robust, suspects)
        assert in_time[1] == "" and in_time[3] == [] and in_time[4] == set(), (robust, in_time)
        ended, why, _, later, _ = both  # the reducer timeout's
        assert ended >= 2.5 and "sent no averages in time" in why and later, (
            robust, ended, why, later)  # fmt: skip


def test_each_members_start_timeout_follows_its_declared_lag_within_the_groups_cap():
    """Every member computes the same start timeouts from what the group declared: the floor
    plus START_LAGS times each member's own lag, no lag counting for more than LAG_CAP times
    the group's lower median. A member that declares an absurd lag, or nonsense, or none, gets
    the cap: it cannot keep its own silence from ending the round early."""
    lags = [{"start_lag_s": 0.2}, {"start_lag_s": 0.4}, {"start_lag_s": 0.3}]
    assert start_timeouts(lags) == pytest.approx(
        [START_FLOOR_S + START_LAGS * x for x in (0.2, 0.4, 0.3)]
    )
    cap = START_FLOOR_S + START_LAGS * LAG_CAP * 0.3  # the lower median, the liar's counted or not
    for junk in (1e300, "x", None, float("nan"), -5.0, [1]):
        out = start_timeouts([*lags, {"start_lag_s": junk}])
        assert out[-1] == pytest.approx(cap), junk
    assert start_timeouts([*lags, {}])[-1] == pytest.approx(cap)
    # rounds written before matchmaking declare 0: the floor for everyone, and for a liar too
    assert (
        start_timeouts([{"start_lag_s": 0.0}] * 2 + [{"start_lag_s": 99.0}]) == [START_FLOOR_S] * 3
    )
    waited, why = start_waited(opened="", start=math.inf)  # none: the sender timeout, as before
    assert 0.6 <= waited < 1.0 and why == "b sent nothing within the sender timeout", (waited, why)


def test_a_staller_that_leads_and_tells_one_member_is_the_only_one_named(tmp_path: Path):
    """Peer 2 leads its groups, tells only one follower that the round begins, and sends
    nothing. The member told waits in vain for both others: the leader and the member never
    told. No honest peer is named, and the two average together: every round that lands is the
    pair's. (The member never told answers, once its wait for the leader ends, that it is not in
    the group, so here it was not named even before exact.silent_members; a CI run, the staller
    frozen as it led, named it.) Each round lands here, its retry within the round finding the
    pair, but in a CI run on a loaded machine the last one ran out of time (2026-12-04): so one of
    the two rounds after the first stall must land, not the last."""
    outs = run_round(tmp_path, "stall_leader", defend=True)
    logs = [(tmp_path / "stall_leader-defended" / f"log{i}.txt").read_text() for i in range(3)]
    ids = [line for log in logs for line in log.splitlines() if line.startswith("peer ")]
    assert (tmp_path / "stall_leader-defended" / "froze0").exists(), logs[2][-2000:]
    for out in outs.values():
        assert {name for name, _ in out["stalled"]} <= {"staller"}, (out["stalled"], ids)
        assert not out["rejected"]
        seen = [(r["failed"], r.get("group"), r.get("why")) for r in out["rounds"]]
        landed = [r for r in out["rounds"] if not r["failed"]]
        assert any(not r["failed"] for r in out["rounds"][1:]), (seen, ids)  # they recovered
        assert all(r["group"] == 2 for r in landed), (seen, ids)
        for r in landed:
            assert torch.allclose(r["delta"], honest_mean(), atol=1e-6), seen
    named = [name for out in outs.values() for name, _ in out["stalled"]]
    assert "staller" in named, (outs, ids)  # the member it told named it


def test_a_member_that_starts_its_rounds_late_is_not_named_a_staller(tmp_path: Path):
    """Peer 2 is honest but slow: in its first round, its averager starts the all-reduce past
    the others' sender timeout, though well within the round. Its parts come too late to count
    (a round with it lands, or fails its probe check), but it is no staller: no honest peer names
    it or leaves it out. (Named as soon as the sender timeout passed, it was left out for two
    rounds: on a loaded machine, an honest peer slow to start once lost the next rounds with
    it, and its partner one of them.) Its second round is the harness's last: the honest peers
    read no verdict after they have ended it, and one at the reducer timeout would come later,
    so it is woken as they end it (peer_attack_harness.stalled_round); it is there for a first
    round that found no group."""
    outs = run_round(tmp_path, "late", defend=True)
    assert list((tmp_path / "late-defended").glob("froze*")), "peer 2 was never late in a group"
    for out in outs.values():
        assert not out["stalled"] and not out["rejected"], (out["stalled"], out["rejected"])


def test_a_leader_that_forges_a_members_metadata_loses_its_round_and_is_named(tmp_path: Path):
    """Peer 2 trains honestly and leads the first round (it starts first); as leader it sends
    its followers another member's claimed rms and weight rewritten under that member's
    signature. Both honest peers find a blob its member did not seal: they apply nothing of that
    round and reject the leader (not its victim); the next rounds land between them.

    A round that found no group at all (on 2 loaded cores, the first round's matchmaking with cold
    certificate caches once outlasted its timeout: CI, 2026-12-04) is no part of the attack: the
    forger, not yet named, leads the next one. Such rounds are skipped, never counted as landed."""
    outs = run_round(tmp_path, "forge_gather", defend=True)
    for out in outs.values():
        formed = [r for r in out["rounds"] if not no_group(r)]
        assert formed, out["rounds"]
        forged, *later = formed
        assert forged["failed"] and "did not sign" in forged["why"], out["rounds"]
        # named as its own signed metadata names it (the harness names peer i "h{i}")
        assert [who for who, _ in out["rejected"]] == ["h2"], out["rejected"]
        assert "forged metadata" in out["rejected"][0][1]
        assert later and all(not r["failed"] and r["group"] == 2 for r in later), out["rounds"]
        for r in later:
            assert torch.allclose(r["delta"], honest_mean(), atol=1e-6)


def test_a_member_that_writes_over_others_dht_records_is_banned_before_its_first_round(
    tmp_path: Path,
):
    """Peer 2 sends and reduces honestly, and before the first round writes over the honest
    peers' certificates in the DHT (bench attack's dht_overwrite). Their DHT nodes refuse the
    records and name it (forgers.py); their averagers read the name as the first round begins
    and ban it, so no round of theirs takes it in, and every round lands between the two."""
    outs = run_round(tmp_path, "dht_overwrite", defend=True)
    for out in outs.values():
        assert len(out["rejected"]) == 1, out["rejected"]
        assert "could not have signed" in out["rejected"][0][1]
        assert out["rounds"] and not any(r["failed"] for r in out["rounds"]), out["rounds"]
        for r in out["rounds"]:
            assert r["group"] == 2 and torch.allclose(r["delta"], honest_mean(), atol=1e-6)


def no_group(rnd: dict) -> bool:
    """A round that failed before any group formed: nothing was sent or received in it."""
    return rnd["failed"] and "could not find a group" in rnd["why"]


class AnsweringRunner:
    """What a group's all-reduce answers a part with."""

    over = False
    sender_peer_ids: tuple = ()
    ended_at, ended_over = 0.0, frozenset()

    async def rpc_aggregate_part(self, stream, context):
        async for part in stream:
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, weight=part.weight)


def handlers_alone() -> GuardedAverager:
    """An averager's handlers alone, no process, behind a gate that lets everyone in."""

    class Gate:
        async def allows(self, dht, peer_id):
            return True

    avg = GuardedAverager.__new__(GuardedAverager)
    avg._gate, avg._traffic, avg.dht, avg._parent_pid = Gate(), Traffic(), None, -1
    avg._defence = None
    avg._heard, avg._opened, avg._ran, avg._admitted, avg._first_parts = {}, {}, {}, {}, {}
    avg._streams, avg._redo_senders = {}, {}
    avg.allreduce_kwargs = {}
    avg._gave_up_on, avg._missed, avg._assembled, avg._requests = {}, {}, set(), 0
    avg._left_out = LeftOut(lambda peer_id, why, kind: None, lambda peer_id: False)
    return avg


def test_a_leader_forms_a_retrys_group_early_but_not_a_first_trys_nor_one_prepared_for_a_slot():
    """assembly.py: once every live member it expects has joined, a leader forms its group at
    once only in a retry (the round ran a group already); a first try waits out its
    matchmaking time as before, and with `always` (the tests' harness) a round prepared for a
    slot (H auto) forms its group at its time."""
    from atomtrain.peer.assembly import ALWAYS, Suspects

    def formed(attempts: int, mode: str = "retries", prepared: bool = False) -> bool:
        avg = handlers_alone()
        avg._gate.banned, avg._gate.owner = set(), None
        avg._assemble_early, avg._attempts = mode, SimpleNamespace(value=attempts)
        avg._expected, avg._suspects = ["a", "b"], Suspects()
        avg.dht = SimpleNamespace(peer_id="me")
        assembled: list[bool] = []

        async def assemble() -> None:
            assembled.append(True)

        avg._matchmaking = SimpleNamespace(
            assembled_group=SimpleNamespace(done=lambda: False),
            is_looking_for_group=True, current_leader=None, client_mode=False,
            current_followers={"a": None, "b": None},
            step_control=SimpleNamespace(allow_retries=not prepared, triggered=False),
            leader_assemble_group=assemble,
        )  # fmt: skip
        asyncio.run(avg._assemble_if_all_joined())
        return bool(assembled)

    assert not formed(attempts=0)  # a first try: the matchmaking time, as before
    assert formed(attempts=1)  # a retry, every expected member in: at once
    assert formed(attempts=0, mode=ALWAYS)
    assert not formed(attempts=0, mode=ALWAYS, prepared=True)  # its slot decides


def test_a_stream_of_parts_counts_as_opened_before_its_first_part_comes():
    """What the start timeout reads (exact.py, _contacted): a member's stream of parts is
    stamped as it opens, before its first part arrives (over a slow link that part may take
    seconds), so a member that started on time is never taken for one that did not."""

    async def scenario() -> tuple[bool, bool]:
        avg = handlers_alone()
        never = asyncio.Event()

        async def parts():
            await never.wait()  # its first part is still on the wire
            yield averaging_pb2.AveragingData(group_id=b"g", weight=1.0)

        before = "member" in avg._opened
        served = avg.rpc_aggregate_part(parts(), SimpleNamespace(remote_id="member"))
        task = asyncio.create_task(anext(served))
        await asyncio.sleep(0.1)
        stamped = avg._opened.get("member", 0.0) > 0.0 and not task.done()
        task.cancel()
        return before, stamped

    assert asyncio.run(scenario()) == (False, True)


def test_only_the_latest_callers_streams_are_remembered():
    """Every caller's stream of parts is stamped before the gate (its parts may take a while):
    callers the gate refuses, a new peer ID each, must not grow the stamps without bound, and
    a member that opened a stream lately keeps its stamp however many came before."""

    async def scenario() -> tuple[int, bool, bool]:
        avg = handlers_alone()
        avg._running_groups, avg._assembled, avg._ran = {}, set(), {}
        avg._matchmaking = SimpleNamespace(is_looking_for_group=False)

        from hivemind.compression import serialize_torch_tensor

        tensor = serialize_torch_tensor(torch.zeros(1))

        async def served(caller: str) -> None:
            async def part():  # (a part: an ask, with none, puts its caller's stamp back)
                yield averaging_pb2.AveragingData(group_id=b"none", weight=1.0, tensor_part=tensor)

            [m async for m in avg.rpc_aggregate_part(part(), SimpleNamespace(remote_id=caller))]

        await served("member")
        for i in range(OPENED_KEPT):
            await served(f"intruder{i}")
            if i == OPENED_KEPT // 2:
                await served("member")  # it opens another stream meanwhile
        return len(avg._opened), "member" in avg._opened, "intruder0" in avg._opened

    assert asyncio.run(scenario()) == (OPENED_KEPT, True, False)


def test_a_member_that_hangs_up_its_parts_cannot_cancel_the_others_all_reduce():
    """A member's part arrives while this one still checks the group's metadata; the member
    hangs up (its round failed, or on purpose). hivemind's handler awaits the group's start
    itself, so the hang-up cancelled it: this member could not run its all-reduce and the honest
    members it kept waiting excluded it as a staller (seen under load in the poisoned-round
    test). The group must still start, and a part sent after it be served."""

    async def scenario() -> list[int]:
        avg = handlers_alone()
        avg._running_groups = {b"g": asyncio.Future()}
        avg._assembled = set()

        async def part(weight: float, group: bytes):
            yield averaging_pb2.AveragingData(group_id=group, weight=weight)

        async def served(weight: float, group: bytes = b"g") -> list[int]:
            sender = SimpleNamespace(remote_id="member")
            return [m.code async for m in avg.rpc_aggregate_part(part(weight, group), sender)]

        early = asyncio.create_task(served(1.0))
        await asyncio.sleep(0.05)
        early.cancel()  # the sender hung up before this member started the group
        with pytest.raises(asyncio.CancelledError):
            await early
        avg._running_groups[b"g"].set_result(AnsweringRunner())  # InvalidStateError when cancelled
        codes = await asyncio.wait_for(served(2.0), 5)
        assert avg._traffic.totals()[1] > 0  # the part read before the wait is counted
        # a group this member will not run (its metadata check failed): a part waiting for it
        # is answered at once (_aggregate_with_group cancels the group's start)
        avg._running_groups[b"h"] = asyncio.Future()
        waiting = asyncio.create_task(served(3.0, b"h"))
        await asyncio.sleep(0.05)
        avg._running_groups[b"h"].cancel()
        return codes + await asyncio.wait_for(waiting, 5)

    assert asyncio.run(scenario()) == [averaging_pb2.AVERAGED_PART, averaging_pb2.BAD_GROUP_ID]


def test_every_member_weighs_the_same_whatever_it_claims():
    assert equal_weights([100.0, 110.0, 1e9]) == [1.0, 1.0, 1.0]
    assert equal_weights([float("nan"), 5.0, 0.0, -3.0])[::2] == [pytest.approx(1e-6)] * 2
    assert equal_weights([]) == []


def test_keys_are_written_private_parsed_strictly_and_never_overwritten(tmp_path, monkeypatch):
    path = tmp_path / "swarm.key"
    key = write_new_key(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_swarm_key(str(path)) == key
    with pytest.raises(AtomError, match="already exists"):
        write_new_key(path)
    assert load_swarm_key(str(path)) == key  # untouched
    monkeypatch.setenv("ATOM_SWARM_KEY", key.secret.hex())
    assert load_swarm_key("") == key
    monkeypatch.delenv("ATOM_SWARM_KEY")
    assert load_swarm_key("") is None
    for bad in ("", "zz" * 32, "ab" * 31, "ab" * 33):
        with pytest.raises(AtomError, match="not a swarm key"):
            parse_key(bad, "test")
    with pytest.raises(AtomError, match="cannot read swarm key"):
        load_swarm_key(str(tmp_path / "missing.key"))
    assert key.secret.hex() not in repr(key) and key.secret.hex() not in str(key)
    assert [p.name for p in tmp_path.iterdir()] == ["swarm.key"]  # no temporary file left
    path.chmod(0o644)  # a key others may read is a leaked key
    with pytest.raises(AtomError, match="readable by others"):
        load_swarm_key(str(path))
    monkeypatch.setenv("ATOM_SWARM_KEY", key.secret.hex())
    assert load_swarm_key("", consume_env=True) == key
    assert "ATOM_SWARM_KEY" not in os.environ  # p2pd and the watchdog, started later, lack it


def test_a_joiner_refuses_a_poisoned_state_and_keeps_its_parameters(tmp_path: Path):
    """The serving peer hands out, in turn, a state with NaNs, a forged model and the swarm's
    model with an oversized momentum buffer, all of the swarm's round; the swarm's peers have
    published digests of what they hold at that round (agreement.py). The joiner refuses all
    three and keeps its parameters; the state the swarm holds passes the same check."""
    from atomtrain.config import PeerSection
    from atomtrain.models import GPT, GPTConfig
    from atomtrain.optim import AdamW, AdamWConfig
    from atomtrain.peer.agreement import AgreementRecord, RoundDigest
    from atomtrain.peer.runtime import PeerRuntime
    from atomtrain.train.runner import PlainRunner

    model = GPT(GPTConfig.from_name("tiny"))
    runner = PlainRunner(
        model, AdamW(dict(model.named_parameters()), AdamWConfig()), 2, 1.0, torch.device("cpu")
    )
    numel = sum(p.numel() for p in runner.host_parameters().values())
    key_file = tmp_path / "swarm.key"
    key = write_new_key(key_file)
    from atomtrain.peer.records import own_subkey
    from atomtrain.peer.status import PeerStatus, publish

    g = torch.Generator().manual_seed(0)
    held = (torch.randn(numel, generator=g) * 0.02, torch.randn(numel, generator=g) * 1e-3)
    forged = held[0] + torch.randn(numel, generator=g) * 0.05
    served = [
        [torch.full((numel,), float("nan")), torch.zeros(numel)],
        [forged, held[1]],  # a model of the attacker's choosing
        [held[0], held[1] * 1e4],  # the swarm's model, with a momentum that throws it off
    ]
    calls = []

    def serve():
        calls.append(1)
        return {"round": 3}, served[len(calls) % len(served)]

    signing = RSAPrivateKey()  # not the process-wide key the joiner signs with
    owner = Membership.of_owner(key, "server", signing)
    dht = DHT(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        start=True,
        authorizer=owner.authorizer(),
        record_validators=swarm_validators(SWARM, signing),
    )
    declare_member(dht, SWARM, owner, dht.peer_id, wait=True)
    # the server says it is at round 3 (signed; stamped ahead, so it stays fresh for the test):
    # the joiner asks it for the state
    server_id = dht.peer_id.to_base58()
    tag = protocol_tag(defend=True, audit=True)  # what the joiner's defaults speak
    said = PeerStatus(
        "server", 3, 30, 2.0, 1.0, 0.0, peer_id=server_id, updated=time.time() + 60, protocol=tag
    )
    assert publish(dht, SWARM, own_subkey(signing), said).result()
    record = AgreementRecord()  # what the swarm holds at round 3, as its peers publish it
    record.add(RoundDigest.of(3, *held))
    assert record.publish(dht, SWARM, own_subkey(signing)).result()
    server = ProbedAverager(
        dht,
        averaging_prefix(SWARM, tag),
        cut_pieces({"w": numel}),
        "none",
        1.0,
        10.0,
        4,
        serve,
        MemberGate(key, SWARM),
    )
    before = {n: p.detach().clone() for n, p in runner.host_parameters().items()}
    cfg = PeerSection(
        swarm=SWARM,
        join=str(dht.get_visible_maddrs()[0]),
        swarm_key=str(key_file),
        state_timeout_s=10.0,
    )
    joiner = PeerRuntime(cfg, runner, "joiner", 10, tmp_path)
    try:
        joiner.start(None)
        assert len(calls) >= len(served)  # it asked the server: every poisoned state offered
        after = runner.host_parameters()
        assert all(torch.equal(before[n], after[n]) for n in before)  # nothing was replaced
        assert joiner.round == 0
        assert joiner.checker.problem(({"round": 3}, list(held))) is None
        for state in served[1:]:
            assert "digests" in (joiner.checker.problem(({"round": 3}, state)) or "")
    finally:
        joiner.shutdown()
        if joiner.watchdog is not None:
            joiner.watchdog.kill()
        server.shutdown()
        dht.shutdown()


def test_keygen_and_bad_keys_from_the_command_line(tmp_path: Path):
    from .conftest import run_cli

    made = run_cli("keygen", "swarm.key", cwd=tmp_path)
    assert made.returncode == 0 and "wrote swarm key" in made.stdout
    text = (tmp_path / "swarm.key").read_text()
    again = run_cli("keygen", "swarm.key", cwd=tmp_path)
    assert (
        again.returncode == 2 and again.stderr.count("\n") == 1 and "already exists" in again.stderr
    )
    assert (tmp_path / "swarm.key").read_text() == text  # nothing overwritten
    (tmp_path / "bad.key").write_text("not a key\n")
    for key, message in (("bad.key", "is not a swarm key"), ("missing.key", "cannot read")):
        out = run_cli("train", "--swarm", "s", "--swarm-key", key, "--train.steps=1", cwd=tmp_path)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def reduce_one_part(
    parts: dict[int, torch.Tensor],
    kind: str = "delta",
    shape=(100,),
    in_sync=None,
    defence: Defence | None = None,
):
    """Run the robust reducer on one part: sender 0 is the reducer itself."""
    from hivemind.averaging.partition import AllreduceException

    from atomtrain.peer.robust import RobustReducer

    rejected: list[tuple[int, str]] = []

    async def go():
        n = len(parts)
        reducer = RobustReducer(
            [torch.Size(shape)],
            [kind],
            [1.0] * n,
            0,
            defence or Defence(),
            [False] * n,
            lambda i, why: rejected.append((i, why)),
            in_sync,
        )
        reducer.on_doubt = lambda i, why: rejected.append((i, f"left out: {why}"))

        async def send(i: int, x: torch.Tensor):
            try:
                return await reducer.accumulate_part(i, 0, x)
            except AllreduceException:
                reducer.on_sender_failed(i)
                return None

        return await asyncio.gather(*(send(i, x) for i, x in parts.items()))

    results = asyncio.run(go())
    return results[0], rejected


def test_the_reducer_drops_bad_parts_and_clips_outliers():
    g = torch.Generator().manual_seed(0)
    own, honest = torch.randn(100, generator=g), torch.randn(100, generator=g)
    honest *= own.norm() / honest.norm()  # of the same size: a pair of them averages as it is
    avg, rejected = reduce_one_part({0: own, 1: honest})
    assert torch.allclose(avg, (own + honest) / 2) and not rejected  # honest parts pass as they are
    avg, rejected = reduce_one_part({0: own, 1: honest, 2: torch.full((100,), float("nan"))})
    assert torch.allclose(avg, (own + honest) / 2) and [i for i, _ in rejected] == [2]
    assert not rejected[0][1].startswith("left out")  # non-finite: banned
    avg, rejected = reduce_one_part({0: own, 1: honest, 2: honest * 100})
    assert torch.allclose(avg, (own + honest) / 2) and [i for i, _ in rejected] == [2]
    assert rejected[0][1].startswith("left out")  # only far too large: left out for a while
    avg, rejected = reduce_one_part({0: own, 1: honest, 2: honest * 1e6})
    assert torch.allclose(avg, (own + honest) / 2) and [i for i, _ in rejected] == [2]
    assert not rejected[0][1].startswith("left out")  # beyond any honest part: banned
    # with two members no part is trusted more than the other, the reducer's own neither: both
    # are scaled down to the smaller norm
    far = own + 10 * own.norm() * honest / honest.norm()
    avg, rejected = reduce_one_part({0: own, 1: far})
    assert not rejected and torch.allclose(avg, (own + far * own.norm() / far.norm()) / 2)
    # with three or more, around their coordinate-wise median, to one typical size
    third = torch.randn(100, generator=g)
    avg, rejected = reduce_one_part({0: own, 1: honest, 2: third, 3: far})
    parts = [own, honest, third, far]
    center = torch.stack(parts).sort(dim=0).values[1:3].mean(0)
    tau = sorted(float(x.norm()) for x in parts)[1]
    pulled = [center + (x - center) * min(1.0, tau / float((x - center).norm())) for x in parts]
    assert not rejected and torch.allclose(avg, sum(pulled) / 4, atol=1e-5)
    assert float((avg - (own + honest + third) / 3).norm()) < 0.5 * tau  # far moved it little
    avg, rejected = reduce_one_part({0: own, 1: honest, 2: torch.zeros(7)})
    assert torch.allclose(avg, (own + honest) / 2) and [i for i, _ in rejected] == [2]


def test_the_reducer_measures_how_each_members_update_agrees_with_its_own():
    """Over the update parts of its span (in-sync, finite ones), the cosine of each other
    member's part with the reducer's own: a sign flip reads -1, whatever its size or the
    clipping; probes and members out of sync are not measured."""
    from atomtrain.peer.bounds import PROBE
    from atomtrain.peer.robust import RobustReducer

    g = torch.Generator().manual_seed(8)
    own, noise = torch.randn(2, 100, generator=g), torch.randn(2, 100, generator=g)

    async def measure() -> dict[int, float]:
        reducer = RobustReducer(
            [torch.Size([100])] * 3, ["delta", "delta", PROBE], [1.0] * 4, 0, Defence(),
            [False] * 4, lambda i, why: None, [True, True, True, False],
        )  # fmt: skip
        for part in range(3):
            x = own[min(part, 1)]
            reducer.current_part_index = part
            reducer.parts = {0: x, 1: x + 0.1 * noise[min(part, 1)], 2: -3 * x, 3: -x}
            if part == 2:  # a probe: equal everywhere but the flipper's, and not measured
                reducer.parts = {i: torch.ones(100) * (-1 if i == 2 else 1) for i in range(4)}
            reducer._combine()
        return reducer.cosines()

    cos = asyncio.run(measure())
    assert set(cos) == {1, 2}  # 3 is out of sync
    assert cos[1] > 0.99 and abs(cos[2] + 1) < 1e-9


def test_a_member_whose_updates_oppose_ours_round_after_round_is_left_out():
    """OPPOSED_ROUNDS of this peer's last OPPOSED_WITHIN readings of the member's update with
    its cosine to this peer's below OPPOSED_COSINE leave it out (as a staller, named once),
    whether or not it agreed in between, and however many rounds without a reading of it came
    between (within OPPOSED_SPAN_ROUNDS); an honest member's weak agreement (about 0) never
    counts, nor opposing readings further apart, nor a member already left out or banned."""
    named: list[tuple[str, str, int]] = []

    class Peer(str):
        def to_base58(self) -> str:
            return str(self)

    events: queue.Queue = queue.Queue()
    flipper, banned = Peer("flipper"), Peer("banned")
    ledger = LeftOut(
        lambda peer, why, kind: events.put((peer.to_base58(), why, kind)),
        lambda peer: peer == banned,
    )
    stall = ledger.stall

    def named_and_left_out(peer, why, first):
        named.append((peer, why, first))
        stall(peer, why, first)

    ledger.stall = named_and_left_out  # type: ignore[method-assign]

    def round_(**cosines: float) -> None:
        ledger.next_round()
        for name, cos in cosines.items():
            ledger.reading(Peer(name), cos)

    for cos in [-0.45, 0.5, 0.5, 0.5, -0.45, 0.0, -0.01, 0.05, -0.2]:  # opposing 4 rounds apart
        round_(flipper=cos, honest=abs(cos) - 0.2, banned=-0.9)
    assert not named
    round_(flipper=-0.4)
    round_(flipper=0.6)  # agreeing between: still counted
    round_(flipper=-0.4)
    assert [peer for peer, _, _ in named] == ["flipper"] and "opposite" in named[0][1]
    assert named[0][2] == OPPOSED_EXCLUSION_ROUNDS  # left out longer than a staller
    assert flipper in ledger and flipper not in ledger._readings  # afresh once let back in
    round_(flipper=-0.9)  # while it is left out, nothing more is counted against it
    round_(flipper=-0.9)
    assert len(named) == 1 and flipper not in ledger._readings
    # every reading, counted or not, reaches the peer (its metrics' `agreement`), by name
    avg = SimpleNamespace(
        _events=events, names={"flipper": "mallory"}, _agreements=[], _stalls=[],
        left_out_ids=set(), rejected_ids=set(),
    )  # fmt: skip
    assert ProbedAverager.rejections(avg) == []
    readings = ProbedAverager.agreements(avg)  # (name, peer ID, cosine, lean: NaN, not read)
    assert len(readings) == 9 * 3 + 5 and readings[-1][:3] == ("mallory", "flipper", -0.9)
    assert all(math.isnan(lean) for *_, lean in readings)
    assert ("honest", "honest", pytest.approx(0.25)) in [r[:3] for r in readings]
    assert ProbedAverager.agreements(avg) == []
    # failed rounds it was not in do not age a reading (bench attack: a flipper read -0.58,
    # then -0.41 four readings and more rounds later, was left out by that peer only 12 rounds
    # on); readings OPPOSED_SPAN_ROUNDS rounds apart still do not count together
    named.clear()
    spans = (
        (OPPOSED_WITHIN + 2, True),
        (OPPOSED_SPAN_ROUNDS - 1, True),
        (OPPOSED_SPAN_ROUNDS, False),
    )
    for gap, left_out in spans:
        drifter = f"drifter{gap}"
        round_(**{drifter: -0.45})
        for _ in range(gap - 1):
            round_(honest=0.5)
        round_(**{drifter: -0.4})
        assert [peer for peer, _, _ in named] == ([drifter] if left_out else []), gap
        named.clear()
    # a reading no longer counted is let go: a member read once and never again is not kept
    assert f"drifter{OPPOSED_SPAN_ROUNDS}" in ledger._readings
    for _ in range(OPPOSED_SPAN_ROUNDS):
        round_(honest=0.5)
    assert set(ledger._readings) == {"honest"}
    # the tries of one round read one update: an odd update read twice is one reading (opposed),
    # and agreeing tries push no opposed reading out of the window
    ledger.next_round()
    ledger.reading(Peer("odd"), -0.4)
    ledger.reading(Peer("odd"), -0.4)
    round_(odd=0.5)
    assert not named
    ledger.next_round()
    for _ in range(3):  # three tries of a round: one reading, not three
        ledger.reading(Peer("odd"), 0.5)
    round_(odd=-0.4)  # the 4th reading: the first still counts
    assert [peer for peer, _, _ in named] == ["odd"]
    named.clear()
    # left out for a stall meanwhile, it keeps its readings: a stall does not start it afresh
    round_(twice=-0.4)
    ledger.stall(Peer("twice"), "silent", first=1)
    named.clear()
    round_()
    round_()
    assert "twice" not in ledger
    round_(twice=-0.4)
    assert [peer for peer, _, _ in named] == ["twice"]
    named.clear()
    # a newer reading keeps the member's readings; the old one past the span still drops out
    round_(span=-0.45)
    for _ in range(OPPOSED_SPAN_ROUNDS // 2 - 1):
        round_()
    round_(span=0.5)
    for _ in range(OPPOSED_SPAN_ROUNDS // 2 - 1):
        round_()
    round_(span=-0.4)
    assert not named


def test_one_reading_far_below_leaves_a_member_out_at_once():
    """A single reading below STRONGLY_OPPOSED_COSINE leaves the member out for
    OPPOSED_EXCLUSION_ROUNDS, named with its cosine: the first readings of flippers and IPM
    members that a -0.65 threshold let through (bench attack, then near 0 and never named) are
    caught; the worst honest readings kept (-0.4501, -0.44) and one between OPPOSED_COSINE and
    the threshold are not; a NaN cosine counts as far below."""
    named: list[tuple[str, str]] = []
    ledger = LeftOut(
        lambda peer, why, kind: kind == "stall" and named.append((peer, why)), lambda peer: False
    )

    def round_(**cosines: float) -> None:
        ledger.next_round()
        for name, cos in cosines.items():
            ledger.reading(name, cos)

    round_(honest=-0.4501, honest2=-0.44, between=-0.4)
    for _ in range(OPPOSED_WITHIN):
        round_(honest=0.1, honest2=0.2, between=-0.05)
    assert not named and OPPOSED_COSINE > -0.4
    first = {"f052": -0.52, "f055": -0.55, "f061": -0.61, "f063": -0.63}
    round_(**first, honest=0.3)
    assert sorted(named) == sorted(
        (peer, f"sent an update opposite to this peer's (cosine {cos:.3f})")
        for peer, cos in first.items()
    )
    for peer in first:  # left out as long as for two opposed readings, counted afresh after
        assert ledger.rounds_left(peer) == OPPOSED_EXCLUSION_ROUNDS
        assert peer not in ledger._readings
    round_(f052=0.01, f055=-0.27)  # its drifting readings while left out count for nothing
    assert len(named) == 4 and "f055" not in ledger._readings
    round_(broken=float("nan"))
    assert [p for p, _ in named[4:]] == ["broken"]


def test_the_reducer_measures_how_far_each_members_update_leans_one_way_from_its_own():
    """Over the update parts of its span, each other member's part less its component along the
    reducer's own (summed over its absolute sum), and that less the same of the reducer's own
    against the member's, halved: the lesser where both lean the same way, else 0. Two honest
    updates share a direction that leans (most coordinates up, as early in training) and
    differ by noise: what the reducer's own noise keeps of that direction is taken out with
    its own, so what is left of the other's leans with it (0.26 between two honest peers of
    bench scaling --quick) and what is left of ours as far: about 0 in all, whatever the
    member's size against the reducer's (a tenth of the steps). "A little is enough" (the
    honest mean less z spreads: z = 1, and the bench's harsher estimate from one update), and
    the same moving every coordinate up, read far from 0; a part all along the reducer's
    (flipped, or equal) leaves nothing to read."""
    from atomtrain.peer.attack import poison
    from atomtrain.peer.robust import RobustReducer

    g = torch.Generator().manual_seed(3)
    noise = lambda scale: scale * torch.randn(2, 4000, generator=g)  # noqa: E731
    magnitude = torch.randn(2, 4000, generator=g).abs()
    shared = magnitude * torch.where(torch.rand(2, 4000, generator=g) < 0.95, 1.0, -1.0)
    own, other = shared + noise(0.6), shared + noise(0.6)  # cosine 0.74
    honest = torch.stack([own, other, shared + noise(0.6), shared + noise(0.6)])
    alie = honest.mean(0) - honest.std(0)  # z = 1, as attack.ALIE_Z
    up = honest.mean(0) + honest.std(0)  # the same, every coordinate up
    slow = 0.1 * shared + noise(0.6 * 0.1**0.5)  # a tenth of the steps: noisier for its size

    def one_way(x: torch.Tensor, y: torch.Tensor) -> float:
        apart = x - (x * y).sum(1, keepdim=True) / y.pow(2).sum(1, keepdim=True) * y
        return float(apart.sum() / apart.abs().sum())

    assert one_way(other, own) > LEAN  # what the member's side alone would read

    async def measure() -> dict[int, float]:
        reducer = RobustReducer(
            [torch.Size([4000])] * 2, ["delta", "delta"], [1.0] * 8, 0, Defence(reject=1e9),
            [False] * 8, lambda i, why: None,
        )  # fmt: skip
        for part in range(2):
            x, y = own[part], other[part]
            reducer.current_part_index = part
            reducer.parts = {
                0: x, 1: y, 2: poison("alie", y), 3: up[part], 4: -x, 5: x.clone(),
                6: slow[part], 7: alie[part],
            }  # fmt: skip
            reducer._combine()
        return reducer.leans()

    lean = asyncio.run(measure())
    assert set(lean) == {1, 2, 3, 6, 7}  # 4 and 5 lie along the reducer's own part
    assert abs(lean[1]) < 0.05 and abs(lean[6]) < 0.05, lean
    assert lean[2] < -0.5 and lean[3] > 1.5 * LEAN and lean[7] < -1.5 * LEAN, lean

    async def part_by_part() -> dict[int, float]:
        """Twice the reducer's part in one part, half in the next (an exact copy, and an honest
        member's): nothing left in either (one projection over both would leave each part's
        difference in size); where the reducer's own part is zeros, a part is not read (its
        own lean is not ours to judge)."""
        reducer = RobustReducer(
            [torch.Size([4000])] * 3, ["delta"] * 3, [1.0] * 3, 0, Defence(reject=1e9),
            [False] * 3, lambda i, why: None,
        )  # fmt: skip
        for part, (x, scale) in enumerate([(own[0], 2.0), (own[1], 0.5), (torch.zeros(4000), 1)]):
            reducer.current_part_index = part
            y, z = (x * scale, other[part] * scale) if part < 2 else (own[0], other[0])
            reducer.parts = {0: x, 1: y, 2: z}
            reducer._combine()
        return reducer.leans()

    lean = asyncio.run(part_by_part())
    assert set(lean) == {2} and abs(lean[2]) < 0.05

    async def pair() -> RobustReducer:
        """In a pair no lean is read (exclusion.LEAN_MEMBERS), though the cosine is."""
        reducer = RobustReducer(
            [torch.Size([4000])], ["delta"], [1.0] * 2, 0, Defence(reject=1e9), [False] * 2,
            lambda i, why: None,
        )  # fmt: skip
        reducer.parts = {0: own[0], 1: alie[0]}
        reducer._combine()
        return reducer

    alone = asyncio.run(pair())
    assert alone.leans() == {} and set(alone.cosines()) == {1} and LEAN_MEMBERS == 3


def test_a_lean_is_the_lesser_of_its_two_readings_where_both_lean_the_same_way_else_0():
    """(dot, theirs squared, ours squared, what is left of theirs summed, its absolute sum, what
    is left of ours summed, its absolute sum), per member, over a span: one way is the fourth
    over the fifth; against ours, that less the sixth over the seventh, halved."""
    from atomtrain.peer.robust import RobustReducer

    async def made() -> RobustReducer:  # (its futures need an event loop)
        return RobustReducer(
            [torch.Size([4])], ["delta"], [1.0] * 6, 0, Defence(), [False] * 6, lambda *_: None
        )

    reducer = asyncio.run(made())
    reducer.agreement = {
        1: [1.0, 1.0, 1.0, -0.6, 1.0, 0.2, 1.0],  # ALIE's signature: -0.6 and -0.4
        2: [1.0, 1.0, 1.0, 0.6, 2.0, 0.2, 1.0],  # a shared direction that leans: +0.3, +0.05
        3: [1.0, 1.0, 1.0, 0.3, 1.0, 0.5, 1.0],  # ours leans further: +0.3 and -0.1, no lean
        4: [1.0, 1.0, 1.0, -0.2, 1.0, 0.6, 1.0],  # -0.2 and -0.4
        5: [1.0, 1.0, 1.0, 0.0, 0.0, 0.1, 1.0],  # theirs not read (in a pair, say)
    }
    assert reducer.leans() == pytest.approx({1: -0.4, 2: 0.05, 3: 0.0, 4: -0.2})


def test_a_member_whose_update_leans_one_way_in_a_rounds_reading_is_left_out_as_it_ends():
    """A member whose update leans one way by LEAN or more, either way, in every try of a round
    that read it, is left out for OPPOSED_EXCLUSION_ROUNDS once the round is over, named with
    its lean (cosine 0.45: no other rule would); honest leans (0.022 at most, measured), a
    lean under LEAN, one try of a round that leans while another does not, and a reading
    with no lean do not; the lean goes on with the cosine to the training process (metrics'
    `agreement`); `lean` 0 turns the rule off."""
    named: list[tuple[str, str]] = []
    told: list[tuple[str, str]] = []

    def tell(peer: str, why: str, kind: str) -> None:
        (named if kind == "stall" else told).append((peer, why))

    ledger = LeftOut(tell, lambda peer: False)
    for _ in range(4):
        ledger.next_round()
        ledger.readings({"a": 0.6, "b": 0.7, "odd": 0.6}, {"a": 0.022, "b": -0.022, "odd": -0.7})
        ledger.readings(
            {"under": 0.6, "unread": 0.6, "odd": 0.6}, {"under": LEAN - 0.01, "odd": 0.01}
        )
    ledger.next_round()
    assert not named and ("unread", "0.6 nan") in told and ("a", "0.6 0.022") in told
    ledger.readings({"alie": 0.45, "up": 0.45, "a": 0.6}, {"alie": -0.7, "up": LEAN, "a": 0.01})
    ledger.readings({"alie": 0.45, "a": 0.6}, {"alie": -0.6, "a": 0.01})
    assert not named  # judged once the round is over
    ledger.next_round()
    assert named == [
        ("alie", f"{LEAN_WHY} (what its component along this peer's leaves sums to -0.60 of its "
                 "absolute sum, the lesser of two readings)"),
        ("up", f"{LEAN_WHY} (what its component along this peer's leaves sums to +0.25 of its "
               "absolute sum, the lesser of two readings)"),
    ]  # fmt: skip
    assert ledger.rounds_left("alie") == OPPOSED_EXCLUSION_ROUNDS - 1  # (this round is one)
    while "alie" in ledger:  # let back in on probation: one opposed reading leaves it out
        ledger.next_round()
    ledger.next_round()
    ledger.readings({"alie": -0.35, "a": 0.6}, {"alie": 0.0, "a": 0.01})
    assert named[-1][0] == "alie" and "since let back in" in named[-1][1]
    banned = LeftOut(tell, lambda peer: peer == "gone")  # banned mid-round: nothing to judge
    banned.next_round()
    banned.readings({"gone": 0.45, "a": 0.6}, {"gone": -0.7, "a": 0.01})
    banned.next_round()
    assert named[-1][0] == "alie"
    off = LeftOut(tell, lambda peer: False, lean=0.0)
    named.clear()
    for _ in range(3):
        off.next_round()
        off.readings({"alie": 0.45, "a": 0.6}, {"alie": -0.7, "a": 0.01})
    assert not named


def test_a_member_whose_update_follows_ours_little_is_left_out_as_the_round_ends():
    """A member whose cosine with this peer's update was below FOLLOW_COSINE, and below
    FOLLOW_RATIO of the closest other member's in the same try, in the medians of its last
    FOLLOW_WITHIN rounds (bench attack's label flipper: about 0 against honest 0.5-0.8) is left
    out as an opposing one is, once the third such round is over (a round's tries are one
    reading, the best: a later try in better company still counts), named with its figures. No
    one is named for one odd reading among three, nor where every member follows this peer's
    update weakly (members on different data: the ratio), nor where the closest member follows
    far more than any honest update does (a colluder: the cosine), nor from a try where no other
    member reaches FOLLOW_FLOOR (this peer's own update follows no one); two colluders cannot
    shield each other by pulling a median down. A member read alone (a pair) is compared with
    the closest member of this peer's latest try that had one reaching FOLLOW_FLOOR, in this
    round or FOLLOW_REFERENCE_ROUNDS before (the sybil of LN5 met in pairs), never an older one.
    `follow` 0 turns it off."""
    named: list[tuple[str, str, int]] = []
    ledger = LeftOut(lambda peer, why, kind: None, lambda peer: False)
    stall = ledger.stall

    def named_and_left_out(peer, why, first):
        named.append((peer, why, first))
        stall(peer, why, first)

    ledger.stall = named_and_left_out  # type: ignore[method-assign]

    def round_(*tries: dict[str, float]) -> None:
        ledger.next_round()  # (the round before is judged as this one begins)
        for cosines in tries:
            ledger.readings(cosines)

    round_({"a": 0.7, "b": 0.6, "flipper": 0.02, "odd": 0.05})
    round_({"a": 0.6, "b": 0.7, "flipper": -0.05, "odd": 0.6})
    round_({"a": 0.65, "b": 0.6, "flipper": 0.08, "odd": 0.55})
    assert not named  # the third round is not over yet
    round_()
    assert [(peer, first) for peer, _, first in named] == [("flipper", OPPOSED_EXCLUSION_ROUNDS)]
    assert named[0][1] == (
        "sent updates that followed this peer's little (cosine 0.02, 0.03 of the closest "
        "member's, the medians of its last 3 readings)"
    )
    assert "flipper" in ledger and ledger.rounds_left("flipper") == OPPOSED_EXCLUSION_ROUNDS - 1
    named.clear()
    # everyone follows weakly (members on data unlike this peer's): the ratio spares them
    for _ in range(5):
        round_({"a": 0.25, "b": 0.22, "c": 0.08})
    # a colluder far closer than honest updates come: the cosine spares the honest member
    for _ in range(5):
        round_({"colluder": 0.95, "honest": 0.25})
    # this peer's own update follows no one (just re-synchronized), or a member read alone
    # with no recent try to compare it with (but in the first round: one reading of three)
    for _ in range(5):
        round_({"a": 0.05, "b": 0.15, "c": -0.02}, {"alone": 0.0})
    round_()
    assert not named and FOLLOW_FLOOR > 0.15
    # read alone: against the closest member of a try in this round or the one before
    round_({"h": 0.6, "pair": 0.0, "lone": 0.0})
    round_({"h": 0.6}, {"pair": -0.05})  # (this round's)
    round_({"lone": 0.02})  # (the round before's)
    round_({"h": 0.6, "k": 0.5, "pair": 0.02, "lone": 0.01})
    round_()
    assert sorted(peer for peer, _, _ in named) == ["lone", "pair"]
    assert FOLLOW_REFERENCE_ROUNDS == 1 and OPPOSED_COSINE < -0.05
    named.clear()
    # ...with one reading alone at most among those judged (two could be this peer's own odd
    # updates), and never against an older try
    round_({"h": 0.6, "two": 0.0, "late": 0.0})
    round_({"h": 0.6}, {"two": 0.0})
    round_({"h": 0.6}, {"two": 0.0})
    round_()
    round_({"late": 0.0})
    round_({"h": 0.6, "late": 0.0})
    round_()
    assert not named
    # two colluders pulling the others' median down are still read against the honest member
    for _ in range(FOLLOW_WITHIN):
        round_({"h": 0.6, "f1": -0.25, "f2": -0.25})
    round_()
    assert sorted(peer for peer, _, _ in named) == ["f1", "f2"] and OPPOSED_COSINE < -0.25
    named.clear()
    # a round's tries: the best counts, whenever it comes in the round
    for _ in range(FOLLOW_WITHIN):
        round_({"d": 0.05, "e": 0.6}, {"d": 0.5, "e": 0.6, "f": 0.6})
    round_()
    assert not named
    for _ in range(FOLLOW_WITHIN):  # under both bars in every try
        round_({"d": 0.05, "e": 0.6}, {"d": 0.09, "e": 0.6, "f": 0.6})
    round_()
    assert [peer for peer, _, _ in named] == ["d"] and FOLLOW_COSINE > 0.09
    assert FOLLOW_RATIO > 0.09 / 0.6
    named.clear()
    # readings further apart than OPPOSED_SPAN_ROUNDS do not count together
    round_({"g": 0.0, "h": 0.6})
    round_({"g": 0.0, "h": 0.6})
    for _ in range(OPPOSED_SPAN_ROUNDS):
        round_({"h": 0.6})
    round_({"g": 0.0, "h": 0.6})
    round_()
    assert not named
    # off: never
    off = LeftOut(lambda peer, why, kind: None, lambda peer: False, follow=0.0)
    for _ in range(5):
        off.next_round()
        off.readings({"flipper": 0.0, "a": 0.7, "b": 0.7})
    assert "flipper" not in off


def test_a_member_let_back_in_after_it_was_left_out_for_its_updates_is_on_probation():
    """Once let back in, a member left out for not following is left out again on one reading
    under the follow bars in its first round back, for twice as long, and one left out for
    opposing on one opposed reading (two were needed before); the first round back that reads
    it at all ends the probation, whether it passed there (read in company, or alone against a
    recent try's closest member) or was read only where the follow rule cannot
    judge (where no other member reaches FOLLOW_FLOOR), and with the follow rule off; from then on
    it is judged as any member."""
    named: list[tuple[str, str]] = []

    def ledger_of(follow: float = FOLLOW_RATIO) -> tuple[LeftOut, Callable]:
        ledger = LeftOut(
            lambda peer, why, kind: kind == "stall" and named.append((peer, why)),
            lambda peer: False,
            follow=follow,
        )

        def round_(*tries: dict[str, float]) -> None:
            ledger.next_round()
            for cosines in tries:
                ledger.readings(cosines)

        return ledger, round_

    ledger, round_ = ledger_of()
    suspects = ("lf", "passes", "floor", "pair", "opp")
    for _ in range(FOLLOW_WITHIN):
        round_({"lf": 0.02, "passes": 0.03, "floor": 0.01, "pair": 0.0, "opp": -0.35, "h": 0.6})
    round_()
    assert sorted(peer for peer, _ in named) == sorted(suspects)
    named.clear()
    while any(peer in ledger for peer in suspects):
        round_()
    round_(
        {"lf": 0.02, "passes": 0.6, "opp": -0.35, "h": 0.6},
        {"floor": 0.02, "x": 0.1},
        {"pair": 0.5},
    )
    assert named == [
        ("opp", "sent an update opposite to this peer's in its first round since let back in")
    ]
    round_({"passes": 0.02, "floor": 0.02, "h": 0.6}, {"pair": -0.35})
    assert named[1] == (
        "lf", f"{FOLLOW_WHY} (cosine 0.02, 0.03 of the closest member's, in its first round "
        "since it was let back in)",
    )  # fmt: skip
    assert ledger.rounds_left("lf") == 2 * OPPOSED_EXCLUSION_ROUNDS - 1  # (this round is one)
    round_()
    assert len(named) == 2  # probation over: one reading is not enough any more
    for _ in range(FOLLOW_WITHIN - 1):
        round_({"passes": 0.02, "floor": 0.02, "h": 0.6}, {"pair": -0.35})
    round_()
    assert sorted(peer for peer, _ in named[2:]) == ["floor", "pair", "passes"]
    assert min(FOLLOW_WITHIN, OPPOSED_ROUNDS) > 1
    # with the follow rule off, the opposing rule's probation still ends once read
    named.clear()
    ledger, round_ = ledger_of(follow=0.0)
    round_({"opp": -0.6, "h": 0.6})
    while "opp" in ledger:
        round_()
    round_({"opp": 0.5})
    round_({"opp": -0.35})
    round_()
    assert [peer for peer, _ in named] == ["opp"]


def test_an_audit_replays_a_reduction_to_the_bit_and_its_projections_catch_a_small_lie():
    """The auditor's replay (the parts as forwarded, in any arrival order) gives the reducer's
    average bit for bit; projections by a seed tolerate the codec's rounding of a last bit in a
    few elements and catch a lie of 1% of the part's size."""
    from atomtrain.peer.audit import agree, project

    g = torch.Generator().manual_seed(3)
    parts = {i: torch.randn(100, generator=g) * (1 + i) for i in range(4)}
    parts[3] = parts[3] * 30  # one far part: clipped
    forward, _ = reduce_one_part(parts)
    backward, _ = reduce_one_part(dict(reversed(list(parts.items()))))
    assert torch.equal(forward, backward)

    x = torch.randn(200_000, generator=g) * 1e-3
    rounded = x.clone()
    rounded[:20] += x.abs().max() / 127  # an 8-bit step, the other way, in 20 elements
    seed = 123456789
    assert agree([project(seed, 0, x)], [project(seed, 0, rounded)])
    lie = x + 0.01 * x.norm() * torch.nn.functional.normalize(torch.randn(200_000), dim=0)
    assert not agree([project(seed, 0, x)], [project(seed, 0, lie)])
    assert not agree([project(seed, 0, x)], [project(seed + 1, 0, x)])  # the seed matters
    assert not agree([project(seed, 0, x)], [])  # a part missing


def test_no_honest_reducer_is_taken_for_a_liar_when_members_have_just_joined():
    """Honest updates share a descent direction (weakly to strongly); members that have just
    joined or re-synchronized bring updates 3-10x smaller than the others'. Whichever member
    reduces, every other member finds what it returns within 1.5 of the 4 (typical update + own
    part) that the check allows: honest averages sit well inside the bound. Of two, an average
    is no larger than either member's part (the check's slack left for the codec)."""
    from atomtrain.peer.bounds import (
        PAIR_SLACK,
        Defence,
        Typical,
        reducer_bounds,
        returned_lie,
        returned_pair_lie,
    )

    g = torch.Generator().manual_seed(3)
    base = torch.randn(400, generator=g)
    groups = 0
    for shared in (0.3, 1.0, 3.0):
        for small in (0.3, 0.1):
            for sizes in (
                [small, small, 1.0, 1.0],
                [small, small, 1.0],
                [small, 1.0, 1.0],
                [small, 1.0, 1.0, 1.0],
                [small, small, small, 1.0],
            ):
                parts = [s * (shared * base + torch.randn(400, generator=g)) for s in sizes]
                typical = Typical.of([float(p.pow(2).mean().sqrt()) for p in parts], 0.0)
                for reducer in range(len(parts)):
                    order = [reducer, *[i for i in range(len(parts)) if i != reducer]]
                    group = {k: parts[i] for k, i in enumerate(order)}
                    average, rejected = reduce_one_part(group, shape=(400,))
                    assert not rejected
                    for member in order[1:]:
                        why = returned_lie("delta", parts[member], average, typical, 1.5)
                        assert why is None, (shared, sizes, reducer, member, why)
                    groups += 1
                # the same members with the reducer out of sync (its update left out): it
                # clips the others' around their median, checked as tightly
                stale = torch.randn(400, generator=g)
                flags = [False] + [True] * len(parts)
                average, rejected = reduce_one_part(
                    dict(enumerate([stale, *parts])), shape=(400,), in_sync=flags
                )
                claims = [float(p.pow(2).mean().sqrt()) for p in parts]
                typical = reducer_bounds(claims, Defence(reduced=4.0))
                for own in parts:
                    assert returned_lie("delta", own, average, typical, 1.5) is None, sizes
            # two members, whichever reduces (or a third out of sync): the pair check passes
            for sizes in ([small, 1.0], [1.0, 1.0], [1.0, small]):
                parts = [s * (shared * base + torch.randn(400, generator=g)) for s in sizes]
                stale = torch.randn(400, generator=g)
                for group, flags in (
                    ({0: parts[0], 1: parts[1]}, None),
                    ({0: parts[1], 1: parts[0]}, None),
                    ({0: stale, 1: parts[0], 2: parts[1]}, [False, True, True]),
                ):
                    average, rejected = reduce_one_part(group, shape=(400,), in_sync=flags)
                    assert not rejected
                    for own in parts:
                        assert returned_pair_lie("delta", own, average / PAIR_SLACK) is None
                    groups += 1
    assert groups == 3 * 2 * (18 + 9)


def test_updates_of_members_out_of_sync_are_left_out():
    g = torch.Generator().manual_seed(1)
    own, honest = torch.randn(100, generator=g), torch.randn(100, generator=g)
    # member 2 averages from other synchronized parameters: its update is left out
    avg, rejected = reduce_one_part(
        {0: own, 1: honest, 2: torch.zeros(100)}, in_sync=[True, True, False]
    )
    scaled = honest * min(1.0, float(own.norm() / honest.norm()))  # of two: the smaller size
    assert torch.allclose(avg, (own * min(1.0, float(honest.norm() / own.norm())) + scaled) / 2)
    assert not rejected
    # the reducer's own update left out (it missed a round) and two others: no majority and no
    # reference, so neither is banned (both used to be, the honest one too, and the reducer
    # then failed on an empty stack); the far one is scaled down to the other's size
    far = honest * 50
    avg, rejected = reduce_one_part({0: own, 1: honest, 2: far}, in_sync=[False, True, True])
    assert not rejected and torch.allclose(avg, honest)


def test_of_two_a_member_that_flips_and_inflates_its_update_cancels_a_round_never_reverses_it():
    """A pair of an honest member (update u) and one that sends -k u: whichever of the two
    reduces a span, the average is no larger than u (here: nothing), and what the honest member
    receives passes its check. Centered on its own part, the attacker used to return about
    -k/2 u (-10 u here), inside the loose bound that centering needed, and the honest peer
    applied it: bench attack's sybil run went from loss 3.0 to 13 in one such round."""
    from atomtrain.peer.bounds import returned_pair_lie

    g = torch.Generator().manual_seed(7)
    u = torch.randn(100, generator=g)
    for k in (1.0, 20.0, 1e3):
        for reducer in (0, 1):  # the attacker reduces, or the honest member
            parts = {0: -k * u, 1: u} if reducer == 0 else {0: u, 1: -k * u}
            avg, rejected = reduce_one_part(parts)
            assert float(avg.norm()) < 1e-5 * float(u.norm()), (k, reducer)
            assert returned_pair_lie("delta", u, avg) is None
            # a reducer leaves the other out of the next rounds where it sits beyond 20 times
            # two sizes of its own part (still averaged now, scaled down)
            assert [i for i, _ in rejected] == ([1] if k > 39 else []), (k, reducer)


def test_of_two_a_member_just_resynchronized_takes_an_honest_average_above_its_own_part():
    """Its update is a few steps' (here 1/20 of the other's), below the group's smallest typical
    update, to which an honest reducer scales the parts: the average is about half the other's
    update, ten times its own. Checked against its own part alone, honest reducers were left out
    (bench attack's sybil run, 1.9x); against the floor too they pass, and a lie beyond fails."""
    from atomtrain.peer.bounds import bound, returned_pair_lie

    g = torch.Generator().manual_seed(8)
    u = torch.randn(100, generator=g)
    small = 0.05 * torch.randn(100, generator=g)
    floor = float(u.norm()) / bound(1.0, 100, 1.0)  # min_scale: the other's update RMS
    d = Defence(min_scale=floor)
    for reducer in (0, 1):
        parts = {0: u, 1: small} if reducer == 0 else {0: small, 1: u}
        avg, rejected = reduce_one_part(parts, defence=d)
        assert not rejected
        assert float(avg.norm()) > 5 * float(small.norm())  # far above its own part
        assert "of two" in str(returned_pair_lie("delta", small, avg))  # the old check
        assert returned_pair_lie("delta", small, avg, d.min_scale) is None
        assert "of two" in str(returned_pair_lie("delta", small, 2 * u, d.min_scale))


def test_the_sync_reference_is_the_member_most_others_agree_with():
    from atomtrain.peer.sync import in_sync_flags

    base = [0.0] * 64
    near = [1e-4] * 64  # float16 rounding apart: the same parameters
    far = [1.0] * 64  # an outer step away: a member that missed a round
    flags = in_sync_flags([base, near, far], [0.5, 0.5, 0.5], [3, 3, 2])
    assert flags == [True, True, False]
    # two against one, whatever the order
    assert in_sync_flags([far, base, near], [0.5] * 3, [2, 3, 3]) == [False, True, True]
    # two members that differ: the one with more rounds is the reference
    assert in_sync_flags([base, far], [0.5, 0.5], [4, 3]) == [True, False]
    # a stale member that claims a huge update does not widen the tolerance to pass
    assert in_sync_flags([base, near, far], [0.5, 0.5, 1e3], [3, 3, 3]) == [True, True, False]


def test_a_member_asked_to_reduce_for_a_group_it_is_not_in_answers_at_once():
    """A leader formed its group as a follower's matchmaking ran out (a retry's group is formed
    at the round's deadline): the follower never runs it. Asked for its span's averages, it must
    say so at once; hivemind's handler waited for its next group, the leader waited its reducer
    timeout and named an honest member a staller (seen in CI in the slander test). So must one
    still looking for a group that has no join request out: a leader whose word came after the
    follower gave up on it has it in its group (bench attack: an honest peer left out). A member
    with a request out, or holding a group that awaits its trigger, may be in it: it waits; one
    asked for a group it already ran, or whose round of it is over, says so at once, even while
    it looks for its next."""

    from hivemind.compression import serialize_torch_tensor

    async def scenario() -> dict[str, list[int]]:
        avg = handlers_alone()
        avg._running_groups, avg._assembled = {}, set()
        avg._matchmaking = SimpleNamespace(is_looking_for_group=False)

        async def served(group: bytes, member: str = "member") -> list[int]:
            async def part():  # (a part, not an ask: a part of no group it ran yet is waited on)
                tensor = serialize_torch_tensor(torch.zeros(1))
                yield averaging_pb2.AveragingData(group_id=group, weight=1.0, tensor_part=tensor)

            sender = SimpleNamespace(remote_id=member)
            return [m.code async for m in avg.rpc_aggregate_part(part(), sender)]

        def run(group: bytes) -> None:
            avg._running_groups[group] = asyncio.Future()
            avg._running_groups[group].set_result(AnsweringRunner())

        avg._asking = 0
        codes = {"idle": await asyncio.wait_for(served(b"a"), 5)}
        avg._matchmaking.is_looking_for_group = True
        codes["gave up"] = await asyncio.wait_for(served(b"e"), 5)  # looking, nobody asked
        avg._asking = 1  # a join request out to a leader
        joins, leaves = asyncio.create_task(served(b"b")), asyncio.create_task(served(b"c"))
        await asyncio.sleep(0.3)
        assert not joins.done() and not leaves.done()  # its leader's word may still come
        run(b"b")  # it came: the group runs
        codes["joined"] = await asyncio.wait_for(joins, 5)
        avg._matchmaking.is_looking_for_group = False  # its matchmaking ended without b"c"
        codes["missed"] = await asyncio.wait_for(leaves, 5)
        avg._assembled.add(b"d")  # found, awaiting its trigger
        triggered = asyncio.create_task(served(b"d"))
        await asyncio.sleep(0.3)
        assert not triggered.done()
        run(b"d")
        codes["triggered"] = await asyncio.wait_for(triggered, 5)
        # a group it ran (its round ended early), asked after while it looks for its next one
        # with a request out: at once (a member probing whether it stalled named it)
        avg._ran[b"f"] = Ran(0.0, frozenset())
        avg._matchmaking.is_looking_for_group = True
        codes["ran"] = await asyncio.wait_for(served(b"f"), 0.5)
        # a group whose round has just ended, still registered (hivemind drops it after its
        # cleanup): at once too, not through hivemind's handler, which looked the group up again
        # and, where it had been dropped meanwhile, waited for this member's next group
        over = AnsweringRunner()
        over.over = True
        avg._running_groups[b"g"] = asyncio.Future()
        avg._running_groups[b"g"].set_result(over)
        codes["just over"] = await asyncio.wait_for(served(b"g"), 0.5)
        # looking, a request out to another leader, having given up on "late" (its word did
        # not come in time): the group "late" formed after is refused within GRACE_S, from it
        # and from a member whose parts came first and were held
        avg._gave_up_on["late"] = None
        held = asyncio.create_task(served(b"h", "other member"))
        await asyncio.sleep(0.3)
        assert not held.done()  # its leader may be the one still asked
        codes["given up"] = await asyncio.wait_for(served(b"h", "late"), GRACE_S + 0.5)
        codes["given up, held"] = await asyncio.wait_for(held, 0.5)
        # a group of its own that the given-up leader is in (it joined the leader asked now),
        # whose word comes within the grace: it waits, and runs
        ours = asyncio.create_task(served(b"i", "late"))
        await asyncio.sleep(0.3)
        avg._assembled.add(b"i")
        await asyncio.sleep(GRACE_S)
        assert not ours.done()  # assembled, awaiting its trigger
        run(b"i")
        codes["given up, ours"] = await asyncio.wait_for(ours, 0.5)
        # with no request out, at once
        avg._asking = 0
        codes["given up, idle"] = await asyncio.wait_for(served(b"j", "late"), 0.2)
        return codes

    assert asyncio.run(scenario()) == {
        "idle": [averaging_pb2.BAD_GROUP_ID],
        "gave up": [averaging_pb2.BAD_GROUP_ID],
        "joined": [averaging_pb2.AVERAGED_PART],
        "missed": [averaging_pb2.BAD_GROUP_ID],
        "triggered": [averaging_pb2.AVERAGED_PART],
        "ran": [averaging_pb2.BAD_GROUP_ID],
        "just over": [averaging_pb2.BAD_GROUP_ID],
        "given up": [averaging_pb2.BAD_GROUP_ID],
        "given up, held": [averaging_pb2.BAD_GROUP_ID],
        "given up, ours": [averaging_pb2.AVERAGED_PART],
        "given up, idle": [averaging_pb2.BAD_GROUP_ID],
    }


def test_a_member_keeps_each_peers_latest_first_part_delays_from_parts_not_asks():
    """What a first-part timeout comes from (exact.first_part_timeouts): how long each member's
    first part of a group this member runs or ran (a part late for a round ended early over its
    sender) took to come after this member's gate let its stream in, measured as the handler
    gets it (the gate's own time not counted; one past the sender
    timeout not at all: its sender was stopped, bench attack's staller waking). A part for a
    group this member neither runs nor ran, or from a peer not in it, measures nothing (anyone
    could set its own delays at no cost), nor does a member's second stream of parts of a group
    (refused: hivemind's reducer counts parts, not senders), nor a part of a group whose round
    is over but from a member it ended over, nor an ask for this member's span (no part), which
    leaves the caller's stamps as they were; each peer's latest FIRST_PARTS_KEPT are kept."""
    from hivemind.compression import serialize_torch_tensor

    members = ("slow", "fast", "gated", "stopped", "asker")

    async def scenario() -> tuple[dict, dict]:
        avg = handlers_alone()
        avg._running_groups, avg._assembled, avg._asking = {}, set(), 0
        avg._matchmaking = SimpleNamespace(is_looking_for_group=False)
        runner = AnsweringRunner()
        runner.sender_peer_ids = members
        avg._running_groups[b"a"] = asyncio.Future()
        avg._running_groups[b"a"].set_result(runner)

        codes: dict[str, list] = {}

        async def send(member: str, part: bool, after: float = 0.0, group: bytes = b"a") -> list:
            comes = time.monotonic() + after  # (read or not: a stream's part comes by itself)

            async def messages():
                await asyncio.sleep(max(comes - time.monotonic(), 0.0))
                message = averaging_pb2.AveragingData(group_id=group, weight=1.0)
                if part:
                    message.tensor_part.CopyFrom(serialize_torch_tensor(torch.zeros(1)))
                yield message

            sender = SimpleNamespace(remote_id=member)
            return [m.code async for m in avg.rpc_aggregate_part(messages(), sender)]

        await send("slow", part=True, after=0.2)
        # one stream of parts per member and group: a second is refused, and measures nothing
        codes["second"] = await send("slow", part=True, after=0.3)
        avg._opened["asker"] = avg._admitted["asker"] = 1.0
        await send("asker", part=False, after=0.2)
        for index in range(FIRST_PARTS_KEPT + 2):  # (a group each)
            avg._running_groups[bytes([index])] = asyncio.Future()
            avg._running_groups[bytes([index])].set_result(runner)
            await send("fast", part=True, group=bytes([index]))
        await send("outsider", part=True)  # not in the group
        await send("slow", part=True, group=b"z" * 20)  # a group it runs not
        # a group still registered, its round over: a part of a member it did not end over
        # measures nothing; one of a member it ended over is a late part (below)
        over = AnsweringRunner()
        over.over, over.sender_peer_ids = True, ("quick", "overdue")
        over.ended_at, over.ended_over = time.monotonic() + 1.0, frozenset({"overdue"})
        avg._running_groups[b"o"] = asyncio.Future()
        avg._running_groups[b"o"].set_result(over)
        await send("quick", part=True, group=b"o")
        await send("overdue", part=True, after=0.1, group=b"o")
        # a group it ran, whose round ended early over the sender before its part came, from a
        # stream let in before that end: the measure its next rounds need (else a member slower
        # than the typical lost every one). Once per member and group; not from a member the
        # round did not end over, nor from a stream opened after the end (a part sent at
        # leisure for a round over would let anyone set its own timeout)
        avg._ran[b"r"] = Ran(time.monotonic() + 1.0, frozenset({"late"}))
        await send("late", part=True, after=0.2, group=b"r")
        await send("late", part=True, after=0.4, group=b"r")  # a second: not kept
        await send("outsider", part=True, group=b"r")  # the round did not end over it
        avg._ran[b"q"] = Ran(time.monotonic() - 0.1, frozenset({"again"}))
        await send("again", part=True, group=b"q")  # its stream opened after the round's end

        class SlowGate:  # a read of the roster
            async def allows(self, dht, peer_id):
                await asyncio.sleep(0.3)
                return True

        gate, avg._gate = avg._gate, SlowGate()
        await send("gated", part=True, after=0.2)  # its part came while the gate read
        avg._gate = gate
        avg.allreduce_kwargs["sender_timeout"] = 0.3
        await send("stopped", part=True, after=0.8)  # past the sender timeout: no measure
        # late for a round ended over it: kept no longer than would make its first-part timeout
        # the sender timeout (0.1 s here, with no floor): a staller frozen for less than the
        # sender timeout is waited for no longer than before first-part timeouts
        avg._start_timeout_s = 0.0
        avg._ran[b"c"] = Ran(time.monotonic() + 0.05, frozenset({"capped"}))
        await send("capped", part=True, after=0.25, group=b"c")
        # past the sender timeout, late or not: not kept (bench attack's staller, waking 17 s on)
        avg._ran[b"d"] = Ran(time.monotonic() + 0.05, frozenset({"woke"}))
        await send("woke", part=True, after=0.35, group=b"d")
        assert codes["second"] == [averaging_pb2.PROTOCOL_VIOLATION], codes
        return avg._first_parts, {
            "opened": avg._opened["asker"],
            "admitted": avg._admitted["asker"],
        }

    delays, asker = asyncio.run(scenario())
    assert set(delays) == {"slow", "fast", "gated", "late", "capped", "overdue"}, delays
    assert len(delays["overdue"]) == 1 and 0.1 <= delays["overdue"][0] < 0.3, delays
    assert len(delays["late"]) == 1 and 0.2 <= delays["late"][0] < 0.4, delays
    assert list(delays["capped"]) == [pytest.approx(0.1)], delays
    assert len(delays["slow"]) == 1 and 0.2 <= delays["slow"][0] < 0.5, delays
    assert len(delays["fast"]) == FIRST_PARTS_KEPT and max(delays["fast"]) < 0.1, delays
    assert delays["gated"][0] < 0.1, delays
    assert asker == {"opened": 1.0, "admitted": 1.0}, asker  # the ask left its stamps be


def test_join_requests_out_are_counted_through_redirects_errors_and_cancels():
    """What _group_runner trusts: a member counts a join request out from its start until the
    leader's group or the request's end, whatever ends it (a redirect nests one request in
    another, as hivemind's matchmaking calls itself through the wrapped attribute)."""
    avg = handlers_alone()
    avg._assembled, avg._leaders, avg._asking = set(), {}, 0
    counted: list[int] = []

    class Matchmaking:
        request_timeout = 0.2
        assembled_group = SimpleNamespace(done=lambda: False)  # it leads no group of its own

        async def _request_join_group(self, leader):
            counted.append(avg._asking)
            if leader == "redirects":  # GROUP_DISBANDED with a suggested leader
                return await self._request_join_group("leads")
            if leader == "sends on":  # the same, to a leader that lags
                await asyncio.sleep(0.1)
                return await self._request_join_group("lags")
            if leader == "fails":
                raise RuntimeError("the leader's daemon died")
            if leader == "hangs":
                await asyncio.sleep(10)
            if leader == "refuses":  # its word, in time: it did not take this member
                return None
            if leader == "lags":  # no word within the request timeout
                await asyncio.sleep(0.25)
                return None
            return "group"

        async def follower_assemble_group(self, leader, message):
            raise AssertionError("not reached")

        async def leader_assemble_group(self):
            raise AssertionError("not reached")

        async def look_for_group(self, step):  # wrapped too (assembly.least_group)
            raise AssertionError("not reached")

    matchmaking = Matchmaking()
    avg._matchmaking = matchmaking
    avg._guard_leaders()

    async def scenario() -> None:
        assert await matchmaking._request_join_group("redirects") == "group"
        assert counted == [1, 2] and avg._asking == 0
        with pytest.raises(RuntimeError):
            await matchmaking._request_join_group("fails")
        assert avg._asking == 0
        waiting = asyncio.create_task(matchmaking._request_join_group("hangs"))
        await asyncio.sleep(0.05)
        assert avg._asking == 1  # its leader's word may still come: a group's parts wait
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert avg._asking == 0  # given up: a group it was put in is refused at once
        # a leader whose word did not come within the request timeout is remembered for the
        # step; one that said no in time, failed, or was left before the timeout, is not
        assert await matchmaking._request_join_group("refuses") is None
        assert not avg._gave_up_on
        assert await matchmaking._request_join_group("lags") is None
        assert list(avg._gave_up_on) == ["lags"]
        asking_again = asyncio.create_task(matchmaking._request_join_group("lags"))
        await asyncio.sleep(0.05)
        assert not avg._gave_up_on  # asked again: its next group may be this member's
        assert await asking_again is None
        assert list(avg._gave_up_on) == ["lags"]
        # a leader that sent this member on in time is not; the one it sent it to is
        avg._gave_up_on.clear()
        assert await matchmaking._request_join_group("sends on") is None
        assert list(avg._gave_up_on) == ["lags"]

    asyncio.run(scenario())
