"""The end of a peer's run: one last round in which every finishing peer averages its parameters,
so they all end with the same model."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from atomtrain.peer.layout import digest, param_slice
from atomtrain.peer.presence import PUBLISH_EVERY_S
from atomtrain.peer.state_io import take_state
from atomtrain.peer.status import PeerStatus

if TYPE_CHECKING:
    from atomtrain.peer.runtime import PeerRuntime

log = logging.getLogger(__name__)

LINGER_S = 10.0
FINAL_TRIES = 3
"""Last rounds a finisher runs before it ends on the synchronized state (or takes the smallest
peer's result): a member that stalled the last round (bench attack, one seed in three) left
every honest peer with the synchronized parameters, their progress since the round before
lost (validation 3.16 against 2.75 clean)."""
STATUS_DELAY_S = 2 * PUBLISH_EVERY_S
"""How long a finisher's status (done) may take to reach the others."""


class Finisher:
    def __init__(self, peer: PeerRuntime) -> None:
        self.peer = peer
        self.finishing = False
        """Done with local steps and waiting for the last round."""
        self.done = False
        """Past the last round (and serving its result to any peer the group left out)."""

    def final_round(self, record: dict[str, Any]) -> None:
        """Finish the running round; wait (bounded) until every live peer is finishing too, then
        all average their parameters in one last round and end up with the same ones."""
        peer = self.peer
        # Let the open round end on its own (bounded by its timeouts). Cancelling it is not
        # enough: an all-reduce already under way goes on in hivemind's process. (A round still
        # looking for its group as every other peer is finishing finds none and runs to its
        # timeout, 30 s by default, at the end of most runs. Giving it up once the others'
        # statuses all said finishing was tried and taken out, 880288c: in the churn scenario a
        # read missed peers still training, and the finishers ended apart.)
        peer._poll(record, wait=True)
        deadline = time.time() + peer.cfg.state_timeout_s
        while peer.resync.pending is not None and time.time() < deadline:
            peer.resync.poll(record)
            time.sleep(0.05)
        if peer.averager is None or peer.dht is None:
            return
        self.finishing = True
        deadline = time.time() + peer.cfg.final_wait_s
        others: list[PeerStatus] = []
        while time.time() < deadline:
            others = peer.presence.live_others()
            if all(s.finishing for s in others):
                break
            time.sleep(0.25)
        if not others:
            log.info("no other live peer at the end; keeping this peer's parameters")
            return
        self._catch_up(others, record)
        # what this peer brings to the last round: its weight average, if kept (then it reads no
        # member's update against it: guarded.reads_members)
        peer._brings_average = peer.on_final()
        peer._final = True
        for tries in range(1, FINAL_TRIES + 1):
            for key in ("group_size", "failed_round_s", "round_s", "round_attempts"):
                record.pop(key, None)  # this try's, not an earlier one's
            record["final_tries"] = tries
            peer._start_round()
            peer._poll(record, wait=True)
            if "group_size" in record or tries == FINAL_TRIES or self._another_done():
                break  # (another finisher past its last round: as after a single try, below)
            log.info("the last round did not land; trying again (%d of %d)", tries + 1, FINAL_TRIES)
        group = record.get("group_size", 1)
        smallest = min([peer.peer_id] + [s.peer_id for s in others])
        if group > len(others):  # every finisher was in this group
            self._linger()
        elif smallest in (peer.last_group_ids if group > 1 else [peer.peer_id]):
            # several groups (a swarm larger than a group) or peers left out: every finisher
            # takes the result of the group holding the smallest peer ID, served from here
            # (they ask that peer first: state_sources)
            if "group_size" not in record:  # it did not land here (failed, or sync.quorum):
                self.end_on_sync()  # what the others take is the synchronized state: so here
            self._linger()
        else:
            self._adopt_final_state(record, smallest)

    def _another_done(self) -> bool:
        """Another finisher is past its last round (it landed, or ended on a state), after the
        time its status takes to reach this peer: then no try of this one's can meet it."""
        time.sleep(STATUS_DELAY_S)
        return any(s.done for s in self.peer.presence.live_others())

    def end_on_sync(self) -> None:
        """The model takes the synchronized parameters, its local progress left behind: the end
        of a run whose last round did not land, where the other finishers take this peer's
        synchronized state."""
        peer = self.peer
        params = peer.runner.host_parameters()
        with peer.lock:
            for piece in peer.pieces:
                x = param_slice(params, piece)
                x.copy_(peer.theta_sync[piece.offset : piece.offset + piece.numel].to(x))
        peer._weights_replaced()

    def _catch_up(self, others: list[PeerStatus], record: dict[str, Any]) -> None:
        """A peer that finished early waited while the others went on with rounds: it takes the
        swarm's state first (keeping its own progress), so the last round finds every finisher
        in sync instead of leaving it out with its old parameters."""
        peer = self.peer
        assert peer.averager is not None
        ahead = max(s.round for s in others)
        if ahead <= peer.round:
            return
        state = peer.averager.download_state(
            peer.cfg.state_timeout_s, peer.presence.state_sources(fresh=True)
        )
        problem = peer.checker.problem(state, min_round=ahead)
        if problem is not None:
            log.warning("could not catch up with the swarm before the last round: %s", problem)
            return
        take_state(peer, state[0], list(state[1]), mode="resync")
        record["resynchronized"] = True
        log.info("caught up at round %d before the last round", peer.round)

    def _linger(self) -> None:
        """Stay a few seconds after the last round, serving its result to any peer that the
        group left out, until every other live peer is done."""
        self.done = True
        # long enough for a left-out peer's own last rounds to time out and ask for the result
        deadline = time.time() + FINAL_TRIES * self.peer.cfg.averaging_timeout_s + LINGER_S
        while time.time() < deadline:
            if all(s.done for s in self.peer.presence.live_others()):
                return
            time.sleep(0.25)

    def _adopt_final_state(self, record: dict[str, Any], representative: str) -> None:
        peer = self.peer
        assert peer.averager is not None
        deadline = time.time() + FINAL_TRIES * peer.cfg.averaging_timeout_s + LINGER_S
        while time.time() < deadline:  # its result is ready once it says it is done
            if any(s.done for s in peer.presence.live_others() if s.peer_id == representative):
                break
            time.sleep(0.25)
        sources = peer.presence.state_sources(first=representative, fresh=True)
        state = peer.averager.download_state(peer.cfg.state_timeout_s, sources)
        problem = peer.checker.problem(state)
        if problem is not None:
            log.warning("left out of the last round and took no result: %s", problem)
            return
        take_state(peer, state[0], list(state[1]), mode="replace")
        record["adopted_final_state"] = True
        log.info(
            "left out of the last round; took its result (parameters %s)",
            digest(peer.theta_sync),
        )
        self.done = True
