"""Catching up with the swarm's state: a joiner downloads it as it starts, unless it holds it
already, and a member whose synchronized parameters differ from its group's downloads it in the
background and moves to it, keeping its local progress (training goes on meanwhile). And this
peer's state served to those that download it, after its round in flight lands."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from hivemind.utils import get_dht_time

from atomtrain.peer.agreement import agreement_key, members_only, parse_records
from atomtrain.peer.download import ZERO_MOMENTUM
from atomtrain.peer.layout import digest
from atomtrain.peer.state import StateCheck, download_sources, resync_floor
from atomtrain.peer.state_io import take_state

if TYPE_CHECKING:
    from atomtrain.peer.averaging import RoundResult
    from atomtrain.peer.runtime import PeerRuntime

log = logging.getLogger(__name__)

SERVE_WAIT_S = 10.0
"""A state asked for while this peer's round runs with its group is served once the training
thread has taken that round's result in, waiting at most this long, a third of this peer's
state_timeout_s, and the whole time of this peer's last landed round (none before one)."""


def serve_after_round(peer: PeerRuntime) -> None:
    """Hold a state download while this peer's round is under way with its group (matchmaking
    over), until the training thread has taken its result in (`rounds_ended`: applied, lost, or
    this peer out of sync), SERVE_WAIT_S and its last round's time at most, once per round (a
    round that outlasts the wait holds no later asker again). The asker is in no group of this
    round, so the state from before it was one round behind by the time it came back. (bench
    attack, run E, sign flip seeds 1 and 2: the flipper, left out by one honest peer, found
    itself out of sync, downloaded, and came back one round behind 14 and 10 times, as the three
    honest peers' round landed while it downloaded; each time it spoiled the next round of the
    two others, which the quorum refused.) Called from hivemind's one thread that serves states,
    in this process (an asker queued behind a held one waits for it too). A round still
    matchmaking is not waited for: it may find no group for a while, or none."""
    av = peer.averager
    if av is None or not (av.running and av.group_found()):
        return
    before = peer.rounds_ended
    if peer.serve_gave_up_at == before:
        return
    # at most this peer's last landed round's whole time: a round held by a staller lasts to the
    # timeouts, and a download waiting on it kept its asker out of rounds (bench attack: 9 s)
    most = min(SERVE_WAIT_S, peer.cfg.state_timeout_s / 3, peer.last_round_s)
    deadline = time.monotonic() + most
    while peer.rounds_ended == before:
        if time.monotonic() >= deadline:
            peer.serve_gave_up_at = before
            return
        time.sleep(0.02)


def served_state(peer: PeerRuntime) -> tuple[dict, list[torch.Tensor]]:
    """What a joiner downloads: synchronized parameters, outer momentum, round, schedule.
    A momentum of zeros (outer momentum 0: plain averaging) is named, not sent, which
    halves the download (download.py puts it back). Served after this peer's round under
    way, if any (serve_after_round)."""
    serve_after_round(peer)
    with peer.lock:
        theta, momentum = peer.theta_sync.clone(), peer.outer.buf.clone()
        meta = {"round": peer.round, "numel": peer.numel, "step": peer._schedule_step}
    log.info("served the state of round %d (parameters %s)", meta["round"], digest(theta))
    if not bool(momentum.view(torch.int32).any()):  # every bit zero (no -0.0 either)
        return {**meta, "momentum": ZERO_MOMENTUM}, [theta]
    return meta, [theta, momentum]


class Resync:
    def __init__(self, peer: PeerRuntime) -> None:
        self.peer = peer
        self.pending: Any = None
        """The re-synchronization's download under way (a future); None when none runs."""
        self._records: Any = None  # the others' published digests, read once it is here
        self._min_round = 0

    def catch_up(self) -> None:
        """A joiner takes the swarm's state unless it already holds it: a fresh swarm (every peer
        at round 0 with the parameters this peer built from the same seed) needs no download."""
        peer = self.peer
        assert peer.dht is not None and peer.averager is not None
        statuses = peer.presence.statuses_of_others(wait_s=10.0)
        peer.presence.known_others = statuses  # whom a download asks, and whose schedule it follows
        if not statuses:
            log.warning(
                "no live peer of this swarm averages with this one's protocol (%s); starting "
                "from this peer's own parameters",
                peer.protocol,
            )
            return
        swarm_round = peer.checker.swarm_round(statuses)
        if peer.round > 0 and peer.round >= swarm_round:
            return
        fresh = [s for s in statuses if s.round == 0 and s.init_digest == peer.init_digest]
        if peer.round == 0 and swarm_round == 0 and fresh:
            log.info(
                "fresh swarm: %s holds the same initial parameters (%s); no download",
                fresh[0].name,
                peer.init_digest,
            )
            return
        for _ in range(6):  # a fresh swarm may not have declared its state yet
            sources = download_sources(statuses, peer.peer_id)
            state = peer.averager.download_state(peer.cfg.state_timeout_s, sources)
            problem = peer.checker.problem(state, min_round=swarm_round - 1)
            if problem is None:
                take_state(peer, state[0], list(state[1]), mode="replace")
                log.info(
                    "joined at round %d with the swarm's parameters (parameters %s)",
                    peer.round,
                    digest(peer.theta_sync),
                )
                return
            if state is not None:
                log.warning("refused a downloaded state: %s", problem)
            time.sleep(1.0)
        log.warning("no peer shared a valid state; starting from this peer's own parameters")

    def start(self, result: RoundResult) -> None:
        peer = self.peer
        assert peer.averager is not None
        log.warning(
            "round %d: this peer's synchronized parameters differ from its group's; "
            "downloading the swarm's state (training goes on)",
            peer.round,
        )
        live = peer.presence.known_others  # as the status thread last read them
        self._min_round = resync_floor(
            [g.get("round", 0) for g in result.peers],
            StateCheck.swarm_round(live) if live else None,
        )
        # whom the status thread knows, or, before its first reading, the group's members that
        # hold its synchronized parameters (no DHT read here: this is the training thread)
        sources = peer.presence.state_sources() or [
            pid
            for pid, ok in zip(result.peer_ids, result.in_sync, strict=True)
            if ok and pid != peer.peer_id
        ]
        self.pending = peer.averager.download_state(peer.cfg.state_timeout_s, sources, wait=False)
        self._records = None

    def poll(self, record: dict[str, Any]) -> None:
        peer = self.peer
        if self.pending is None or not self.pending.done():
            return
        if self._records is None and peer.cfg.defend and peer.dht is not None:
            # what the others hold, read once the state is here: a download takes about a
            # round on a slow link, and digests read when it began held only older rounds (4
            # peers at 10 Mbit/s: "match 1 of 3 peers' published digests", every other try)
            key = agreement_key(peer.cfg.swarm)
            self._records = peer.dht.get(key, latest=True, return_future=True)
            return
        records_future = self._records
        if records_future is not None and not records_future.done():
            return
        future, self.pending, self._records = self.pending, None, None
        problem: str | None
        try:
            state = future.result()
            records = (
                members_only(
                    parse_records(records_future.result(), peer.presence.subkey, get_dht_time()),
                    peer.presence.roster(),
                )
                if records_future is not None
                else None
            )
        except Exception as e:
            state, problem = None, f"{type(e).__name__}: {e}"
        else:
            problem = peer.checker.problem(state, self._min_round, records)
        if problem is not None:
            log.warning("re-synchronization failed (%s); trying again after a round", problem)
            return
        take_state(peer, state[0], list(state[1]), mode="resync")
        record["resynchronized"] = True
        log.info("re-synchronized at round %d (parameters %s)", peer.round, digest(peer.theta_sync))
