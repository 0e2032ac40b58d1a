"""One peer of the poisoned-round test, run as its own process:

    python peer_attack_harness.py INDEX ATTACK DEFEND WORKDIR

Three peers share a swarm key; peer 2 poisons its update with ATTACK (with ATTACK_HONEST=N in
the environment, N honest peers and peer N attacking: "peer 2" below is that one). All start
each of three rounds (ATTACK_ROUNDS) together (file barriers; peer 2 stops looking for a group
once the honest peers' round has ended) and save what each round gave them to
WORKDIR/out{INDEX}.pt. With
`inflate`, peer 2 sends the honest peers' mean pushed far in one direction (peer/attack.py), and
claims a million times the others' tokens and a thousand times their update size. With `stall`,
peer 2 freezes its averager process (SIGSTOP) as soon as its group is found, every round, for
longer than the round's timeout unless every honest peer has named it (stalled_round), and never
sends that group its parts (silent_member_patches). With `late`, peer 2 is honest but slow: its
averager's process freezes as its group is found for longer than the sender timeout, not the
reducer's, every round but the last (there, only until the honest peers have ended it).
With `forge_gather`, peer 2 trains honestly, starts each round
first (so it leads) and sends its followers another member's metadata rewritten. With
`lying_reducer` (or `lying_reducer_far`: 20 typical updates, past what members accept), peer 2
sends honestly and moves the average of the span it reduces. With `forging_reducer`, peer 2
reduces honestly and forwards its auditor its own part in place of every other member's. With
`banned_by_0`, peer 2 is honest but peer 0 banned it before the first round, and peer 1 leads
every round (the others start theirs a second later), so peer 0 finds in its groups a member it
banned, taken in by a third party. With `stall_leader`, peer 2 starts each round first (so it
leads), tells only the first follower of its group, never runs its all-reduce, and is frozen as
`stall` is soon after: the member told waits for the other honest one, which, never told, sent
nothing either (stall_leader_patches). With `withhold`, peer 2 sends its parts as an honest member
does, and its averager then answers no stream of parts, nor any later ask, for its span: it sends
no averages (withheld_span_patches). With `late_joiner`, peer 2 is honest, and every peer knows
the others are live (as a peer's presence tells it): peer 2 starts each round LATE_S after the
others, past their matchmaking time. With `dht_overwrite`, peer 2 sends and reduces honestly, and
before the first round writes over every other member's certificate in the DHT.
"""

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import AsyncIterator  # noqa: UP035 (hivemind reads stream handlers from typing's)

import torch
from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey

from atomtrain.peer import audit, guarded
from atomtrain.peer.attack import claimed_tokens, overwrite_records, poison
from atomtrain.peer.auth import MemberGate, Membership, SwarmAuthorizer, SwarmKey, declare_member
from atomtrain.peer.averaging import ProbedAverager, RoundFailed
from atomtrain.peer.bounds import Defence
from atomtrain.peer.forgers import read_forgers
from atomtrain.peer.layout import cut_pieces
from atomtrain.peer.records import own_subkey, swarm_validators

sys.path.insert(0, str(Path(__file__).parent))
from peer_round_harness import START_TIMEOUT_S, averaged_round, live_others

NUMEL = 5000
HONEST = int(os.environ.get("ATTACK_HONEST", "2"))
ATTACKER = HONEST
"""The attacker's index (the honest peers' come before it)."""
PEERS = HONEST + 1
ROUNDS = int(os.environ.get("ATTACK_ROUNDS", "3"))
"""The first with the attacker; by the last every honest peer has caught it and they average
together (one that missed it in the first round catches it in the second). Fewer (ATTACK_ROUNDS)
where a test only shows that an undefended swarm takes the poison in."""
KEY = SwarmKey(bytes(range(32)))


def vectors(index: int) -> torch.Tensor:
    """A member's update: one vector with the signs of its elements drawn per member, so that
    any two members' parts of any span are of the same size and a pair of them averages as it
    is (of two, a reducer scales the larger part down to the smaller, robust.py)."""
    base = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)) * 1e-2
    signs = torch.randint(0, 2, (NUMEL,), generator=torch.Generator().manual_seed(100 + index))
    return base * (2 * signs - 1)


def honest_mean(honest: int = HONEST) -> torch.Tensor:
    return sum((vectors(i) for i in range(honest)), torch.zeros(NUMEL)) / honest


BARRIER_S = 120.0
"""How long a peer waits for the others at a barrier: three processes importing torch and
starting hivemind on 2 loaded cores took past 60 s once (CI)."""


def barrier(
    work: Path, name: str, index: int, meanwhile: Callable[[], None] = lambda: None
) -> None:
    (work / f"{name}{index}").touch()
    deadline = time.time() + BARRIER_S
    while missing := [i for i in range(PEERS) if not (work / f"{name}{i}").exists()]:
        assert time.time() < deadline, f"barrier {name}: peers {missing} never came"
        meanwhile()
        time.sleep(0.05)


def honest_done(work: Path, r: int) -> bool:
    """Every honest peer has ended round `r`."""
    return all((work / f"done{r}_{i}").exists() for i in range(HONEST))


def done_and_named(work: Path, r: int, least: int) -> bool:
    """Every honest peer has ended round `r`, and at least `least` of them have named the
    staller for it (a peer names a silent member at its reducer timeout, which may come after
    its round ended: read_verdicts in main)."""
    named = sum((work / f"named{r}_{i}").exists() for i in range(HONEST))
    return honest_done(work, r) and named >= least


TIMEOUT_S = 8.0
"""The averagers' round timeout; hivemind's sender timeout is a third of it, the reducer's two
thirds. `late` runs with twice as long, so that its margins hold on a loaded machine; `stall`
and `forge_gather` with 1.5 times (STALL_TIMEOUT_S, FORGE_TIMEOUT_S)."""
STALL_TIMEOUT_S = 12.0 if HONEST == 2 else 16.0
"""`stall`'s round timeout. The all-reduce's timeout counts from the group's assembly, its
sender and reducer timeouts from the all-reduce's start: at 8 s, on a loaded machine the first
round's setup (certificates fetched into a cold cache) took 3-5 s, the round's timeout cut the
all-reduce before the staller's sender timeout passed, and the staller, unnamed, stalled the
next round too (CI, 2026-12-03). With three honest peers, 16 s: at 12 s the one that started
last ended the lost try at its round's deadline, with no time left for the redo, and refused
the others' (CI, 2026-12-06)."""
FORGE_TIMEOUT_S = STALL_TIMEOUT_S
"""`forge_gather`'s round timeout: its first round, the forger leading with cold certificate
caches on 2 loaded cores, once found no group within 8 s (CI). Its rounds end early (the honest
peers take part for the others), so the longer timeout costs nothing when nothing is slow."""
STALL_FROZEN_S = STALL_TIMEOUT_S + 2.0
"""How long `stall_leader`'s averager is frozen once in a group: past the round's timeout (at
most: stalled_round wakes it once the honest peers have ended the round and the member it told
has named it, and in its last round once they have ended it)."""
SILENT_FROZEN_S = STALL_TIMEOUT_S * 5 / 3 + 2.0
"""How long `stall`'s averager is frozen once in a group, and silent (silent_member_patches), at
most (stalled_round wakes it once every honest peer has ended the round and named it, and in its
last round once they have ended it):
past the round's timeout plus the reducer timeout (2/3 of it), a bound on when the last honest
member stops waiting for it. A member names a silent one at its reducer timeout counted from its
own start of the all-reduce, which on a loaded machine came 3-6 s after the group formed (a
cold certificate cache). Frozen for the round's timeout only, the staller woke as that member's
wait ended and answered it was not in the group (its round over), as an honest member that
missed its leader's word does, and that member spared it (CI, 2026-12-05)."""
LATE_S = 3.5
"""How late `late_joiner` starts each round: past the others' matchmaking time (2 s), and well
inside their round's timeout (STALL_TIMEOUT_S)."""
SLOW_START_S = 7.0
"""How late `late` starts its all-reduce: 1.7 s past its sender timeout (16 s / 3), 3.7 s short
of its reducer timeout (twice that)."""


def stalled_round(
    avg: ProbedAverager,
    delta: torch.Tensor,
    frozen_s: float,
    honest_done: Callable[[], bool],
    after_s: float = 0.0,
    woken: Callable[[], bool] = lambda: False,
) -> bool:
    """Join a group, then go silent: the averager's process frozen for `frozen_s`, `after_s`
    after the group was found. False: it found no group (left out by both honest peers, it stops
    looking once they have ended their round), and so froze nothing.

    The freeze, and the wait for its own round, end early once `woken()` (the honest peers have
    ended the round and named it, done_and_named; in its last round, once they have ended it, for
    they read no verdict after that): nothing it does after that changes what they took from it
    or named it for, and the next round's barrier waited for it otherwise (13-24 s a
    round, idle, in each stall test). Its round is then cancelled; the averager's task for it
    may run on until the round's timeout. Woken before it is named, it would answer a member's
    ask that it is not in the group, and be spared (silent_member_patches)."""
    avg.start(
        lambda piece, out: out.copy_(delta[piece.offset : piece.offset + piece.numel]),
        1.0,
        lambda: {
            "name": "staller",
            "round": 0,
            "sketch": [0.0] * 64,
            "update_size": 1.0,
            "rms": float(delta.pow(2).mean().sqrt()),
        },
    )
    deadline = time.time() + 20
    while not avg.group_found() and not avg.done() and time.time() < deadline:
        if honest_done():
            avg.cancel()
            return False
        time.sleep(0.01)
    froze = avg.group_found() and not avg.done()
    if froze:
        time.sleep(after_s)
        os.kill(avg.averager.pid, signal.SIGSTOP)
        wake = time.monotonic() + frozen_s
        while time.monotonic() < wake and not woken():
            time.sleep(0.05)
        os.kill(avg.averager.pid, signal.SIGCONT)
    while not avg.done():
        if woken():
            avg.cancel()
            return froze
        time.sleep(0.05)
    with contextlib.suppress(RoundFailed):
        avg.result()
    return froze


ANNOUNCED_S = 0.5
"""How long `stall_leader` runs once its group is found before it is frozen: time to tell its
first follower."""


def stall_leader_patches() -> None:
    """`stall_leader`'s averager (forked from this process): as a leader, it tells only the first
    follower it answers that the group begins, and holds the others' answers; it never runs its
    all-reduce (so sends no part), as a staller frozen the moment its group formed."""
    from hivemind.averaging.allreduce import AllreduceException
    from hivemind.p2p import P2PContext
    from hivemind.proto import averaging_pb2

    averager = guarded.GuardedAverager
    join, told = averager.rpc_join_group, set()

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        async for message in join(self, request, context):
            if message.code == averaging_pb2.BEGIN_ALLREDUCE:
                if message.group_id in told:
                    await asyncio.sleep(3 * STALL_FROZEN_S)  # the follower gives up first
                    return
                told.add(message.group_id)
            yield message

    async def _aggregate_with_group(self, group_info, min_vector_size, **kwargs):
        await asyncio.sleep(STALL_FROZEN_S)
        raise AllreduceException("stall_leader runs no all-reduce")

    averager.rpc_join_group = rpc_join_group
    averager._aggregate_with_group = _aggregate_with_group


def silent_member_patches() -> None:
    """`stall`'s averager (forked from this process): in a group, it checks the group as any
    member does and then sends none of its parts, not even late, until SILENT_FROZEN_S have
    passed or it is woken (stalled_round); only then does it say, when asked, that it is not in
    the group. Frozen (SIGSTOP) alone, it sent its parts or said so as it woke, and a member
    whose all-reduce had started late still waited then and spared it: that evasion is open
    (issue 12; so is a staller that wakes as soon as the honest peers' round has ended, before
    they named it, and says so: woken so, it was named by no one in three rounds, each landing
    by its redo about a second late), and this test is the staller that stays silent."""
    from hivemind.averaging.allreduce import AllreduceException

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        await asyncio.sleep(SILENT_FROZEN_S)
        raise AllreduceException("stall sends none of its parts")

    guarded.GuardedAverager._run_allreduce_inplace_ = _run_allreduce_inplace_


def withheld_span_patches() -> None:
    """`withhold`'s averager (forked from this process): every stream of parts another member
    opens to it, or asks it with, hangs unanswered (as a member frozen after sending its own
    parts: bench attack's staller, when SIGSTOP lands there); its own parts go out as usual."""

    from hivemind.p2p import P2PContext
    from hivemind.proto import averaging_pb2

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        await asyncio.Event().wait()
        yield averaging_pb2.AveragingData()  # (never: an async generator, as hivemind's is)

    guarded.GuardedAverager.rpc_aggregate_part = rpc_aggregate_part


def main() -> None:
    index, attack, defend, work = (
        int(sys.argv[1]),
        sys.argv[2],
        sys.argv[3] == "1",
        Path(sys.argv[4]),
    )
    addr_file = work / "addr"
    initial = []
    if index > 0:
        while not addr_file.exists():
            time.sleep(0.1)
        initial = [addr_file.read_text()]
    dht = DHT(
        initial_peers=initial,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        start=True,
        authorizer=SwarmAuthorizer(KEY),
        record_validators=swarm_validators("atk", RSAPrivateKey.process_wide()),
        # peer 2's DHT process (whatever peer 2 plays) often fails to read a last request from
        # its averager, gone by then, and misses the word to shut down: it was terminated after
        # hivemind's 3 s grace while the test waited; now after half a second
        shutdown_timeout=0.5 if index == ATTACKER else 3.0,
    )
    if index == 0:  # written whole before it appears: a peer that read it half-written failed
        # to bootstrap (a CI run, 2026-12-04: "failed to connect to bootstrap peers")
        (work / "addr.tmp").write_text(str(dht.get_visible_maddrs()[0]))
        (work / "addr.tmp").rename(addr_file)
    declare_member(dht, "atk", KEY, dht.peer_id, wait=True)
    print(f"peer {index} is {dht.peer_id.to_base58()}", flush=True)  # to read its log by
    if attack == "lying_reducer_far":  # the averager's process is forked from this one
        guarded.lie_sizes, attack = (lambda factor: 20.0), "lying_reducer"
    if attack == "forging_reducer" and index == ATTACKER:  # forwards its own part as everyone's
        combined = audit.AuditedRunner._combined

        def forged(self, part_index, senders):
            own = self._held.get((self._own_sender, part_index))
            for i in senders:
                self._held[(i, part_index)] = own
            combined(self, part_index, senders)

        audit.AuditedRunner._combined = forged
    if attack == "stall_leader" and index == ATTACKER:
        stall_leader_patches()
    if attack == "stall" and index == ATTACKER:
        silent_member_patches()
    if attack == "withhold" and index == ATTACKER:
        withheld_span_patches()
    if attack in ("withhold", "stall", "late_joiner"):  # how each round ended early, and was
        handler = logging.StreamHandler(sys.stdout)  # tried again, into this peer's log
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        for name in ("atomtrain.peer.exact", "atomtrain.peer.guarded"):
            logging.getLogger(name).addHandler(handler)
            logging.getLogger(name).setLevel(logging.INFO)
        # and why an exchange with a reducer failed (hivemind says so at DEBUG only)
        logging.getLogger("hivemind.averaging.allreduce").setLevel(logging.DEBUG)
    gate = MemberGate(KEY, "atk")
    if attack == "banned_by_0":
        if index == ATTACKER:
            (work / "id2.tmp").write_text(dht.peer_id.to_base58())
            (work / "id2.tmp").rename(work / "id2")
        if index == 0:  # before its averager's process starts (forked with the gate)
            while not (work / "id2").exists():
                time.sleep(0.05)
            gate.ban(PeerID.from_base58((work / "id2").read_text()))
    others = live_others(index, work, dht, PEERS) if attack == "late_joiner" else []
    avg = ProbedAverager(
        dht,
        "atk_avg",
        cut_pieces({"w": NUMEL}),
        "none",
        2.0,
        {
            "late": 2 * TIMEOUT_S,
            "stall": STALL_TIMEOUT_S,
            "stall_leader": STALL_TIMEOUT_S,
            "forge_gather": FORGE_TIMEOUT_S,
            "late_joiner": STALL_TIMEOUT_S,
        }.get(attack, TIMEOUT_S),
        8,
        lambda: ({}, []),
        gate,
        Defence() if defend else None,
        attack=attack if index == ATTACKER and attack not in ("banned_by_0", "withhold") else "",
        live_others=lambda: others,
        # late_joiner checks when groups form, not stalls: members get the round harness's time
        # to open their streams (a late opener on a loaded machine would end a try early); so
        # do the honest peers of a stall with three of them, which tell a redo (redo.py) from
        # a retry: four peers' processes on 2 loaded cores end the lost try seconds apart
        **(
            {"start_timeout_s": START_TIMEOUT_S}
            if attack == "late_joiner" or (attack == "stall" and HONEST > 2)
            else {}
        ),
    )
    delta, weight, rms_claim = vectors(index), 1.0, 0.0
    if index == ATTACKER:
        delta = poison(attack, honest_mean() if attack == "inflate" else delta)
        weight = claimed_tokens(attack, weight)
        rms_claim = 1e3 * float(delta.pow(2).mean().sqrt()) if attack == "inflate" else 0.0
    rounds: list[dict] = []
    rejected: list[tuple[str, str]] = []
    stalled: list[tuple[str, str]] = []

    def read_verdicts(r: int, since: int) -> None:
        """An honest peer's verdicts read as they come, between rounds: once it has named the
        staller for round `r` (in `stalled` past `since`), the staller may wake (done_and_named)."""
        rejected.extend(avg.rejections())
        stalled.extend(avg.stalls())
        if any(name == "staller" for name, _ in stalled[since:]):
            (work / f"named{r}_{index}").touch()

    verdicts = lambda: None  # noqa: E731 (the last round's reader, for the next barrier)
    # late: named in its first, or never; forge_gather: one round more, so that a first round that
    # finds no group on a loaded machine still leaves the forged round and two after it
    last = {"late": 2, "forge_gather": ROUNDS + 1}.get(attack, ROUNDS) - 1
    for r in range(last + 1):
        # the proof lives 30 s in the DHT (auth.PROOF_TTL_S); a peer re-stores it every 10 s: so
        # does each process here, before each round (a round after 30 s found no certificate)
        declare_member(dht, "atk", KEY, dht.peer_id, wait=True)
        barrier(work, f"round{r}_", index, verdicts)
        since = len(stalled)
        if attack == "dht_overwrite" and r == 0:  # before the first round: every record over
            if index == ATTACKER:
                own = Membership.of_owner(KEY, dht.peer_id.to_base58())
                cert = own.certificate(dht.peer_id.to_base58())
                overwrite_records(dht, "atk", cert.to_text(), own_subkey(own.private_key))
                time.sleep(1.0)  # (the stores go out in the DHT's process)
                (work / "forged").touch()
            while not (work / "forged").exists():
                time.sleep(0.05)
            # until this peer's DHT node has named it (its averager reads the name as the
            # round begins: not raced here against the stores going out)
            deadline = time.monotonic() + BARRIER_S
            while index != ATTACKER and not read_forgers(dht).result():
                assert time.monotonic() < deadline, "the forger was never named"
                time.sleep(0.05)
        if attack in ("forge_gather", "stall_leader") and index < ATTACKER:
            time.sleep(1.0)  # the forger's round is scheduled first: honest peers ask it to lead
        if attack == "banned_by_0" and index != 1:
            time.sleep(1.0)  # peer 1's round is scheduled first: the others ask it to lead
        if attack == "late_joiner" and index == ATTACKER:
            time.sleep(LATE_S)
        if index == ATTACKER and attack == "stall_leader":
            done = partial(honest_done, work, r)
            # the member it told names it; the one never told has nothing to name it for
            woken = done if r == last else partial(done_and_named, work, r, 1)
            if stalled_round(avg, delta, STALL_FROZEN_S, done, ANNOUNCED_S, woken):
                (work / f"froze{r}").touch()
            continue
        if index == ATTACKER and attack in ("stall", "late"):
            if attack == "stall":
                # an honest peer's round is scheduled first, so it leads: a staller that leads
                # and freezes while announcing its group tells one honest member and not the
                # other, which then blame each other (a CI run, 2026-12-03: peer 1 left peer 0
                # out for 2 rounds). That is open (issue 12); this test is the member that stalls
                time.sleep(1.0)
            frozen_s = SILENT_FROZEN_S if attack == "stall" else SLOW_START_S
            done = partial(honest_done, work, r)
            if r == last:  # the honest peers' outputs are written once they are done
                woken = done
            elif attack == "stall":  # named by every honest peer (each test asserts they do)
                woken = partial(done_and_named, work, r, HONEST)
            else:  # `late`, honest, named by no one, is never woken before its last round: its
                # late all-reduce, on until the round's timeout, holds the averaged tensors'
                # lock, and its next all-reduce would wait for it, later still
                woken = lambda: False  # noqa: E731
            if stalled_round(avg, delta, frozen_s, done, woken=woken):
                (work / f"froze{r}").touch()  # in a group: the round it was meant to slow
            continue
        # peer 2, refused by peers that banned or left it out, would go on asking until its
        # round's timeout while the next barrier waited: it gives up once the honest peers' ended
        give_up = partial(honest_done, work, r) if index == ATTACKER else None
        try:
            rounds.append(
                {
                    "failed": False,
                    **averaged_round(avg, delta, weight, f"h{index}", rms_claim, give_up=give_up),
                }
            )
        except RoundFailed as e:
            rounds.append({"failed": True, "why": str(e)})
        if index == ATTACKER:
            continue
        (work / f"done{r}_{index}").touch()
        read_verdicts(r, since)
        verdicts = partial(read_verdicts, r, since)
    # the last round may still need this peer after its own end: its averages on their way to the
    # others, its audit verdicts. Gone at once, it failed an honest peer's last round now and then
    # ("sent not all its averages": CI, test_a_member_that_writes_over_others_dht_records...)
    deadline = time.time() + BARRIER_S
    while not honest_done(work, r) and time.time() < deadline:
        verdicts()
        time.sleep(0.05)
    if (
        attack == "withhold" and index < ATTACKER
    ):  # named once its exchange's reducer timeout and the
        deadline = time.monotonic() + TIMEOUT_S  # ask after it passed: wait out the last ask
        while not stalled and time.monotonic() < deadline:
            time.sleep(0.1)
            verdicts()  # (stalls() is filled by rejections(): both read)
    if index < ATTACKER:
        torch.save(
            {"rounds": rounds, "rejected": rejected, "stalled": stalled}, work / f"out{index}.pt"
        )
    print(index, [(r["failed"], r.get("group"), r.get("why")) for r in rounds], rejected)
    avg.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
