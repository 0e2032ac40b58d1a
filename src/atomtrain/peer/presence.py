"""A peer's presence in the swarm's DHT: the DHT it starts, the status record that says it is alive
(published from a thread of its own), its certificate and the newest revocation list stored again,
the digests of the state it held at its last rounds, and who else is live (as that thread last
read them, so that the training thread need not ask the DHT)."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any

from hivemind import DHT
from hivemind.p2p import PeerID

from atomtrain.errors import AtomError
from atomtrain.peer.agreement import AgreementRecord, RoundDigest
from atomtrain.peer.attack import overwrite_records
from atomtrain.peer.auth import (
    Roster,
    declare_member,
    note_revoked,
    read_roster,
    share_evidence,
)
from atomtrain.peer.protocol import describe
from atomtrain.peer.records import own_subkey, swarm_validators
from atomtrain.peer.state import download_sources
from atomtrain.peer.status import PeerStatus, publish, read_statuses
from atomtrain.peer.traffic import RateMeter
from atomtrain.values import atomic_write_text

if TYPE_CHECKING:
    from atomtrain.peer.runtime import PeerRuntime

log = logging.getLogger(__name__)

PUBLISH_EVERY_S = 2.0
"""How often a peer publishes its status: the record that says it is alive (fresh for three
periods)."""
REPUBLISH_EVERY_S = 10.0
"""How often a record that did not change (a certificate, the digests of rounds already
published) is stored again, well within its time to live (30 s). Storing every record at every
status tick cost the DHT process and the status thread a few percent of a 0.45-core quota."""
SETTLE_S = 30.0
"""For this long after start a peer re-stores its certificate at every status tick, as a joiner
whose first store reached few DHT nodes must be found soon by every peer's gate (at every 10 s
from the start, a churn test's joiner missed its first rounds)."""
READ_EVERY_S = 10.0
"""How often a peer reads the swarm's records (who is live, certificates, revocations): each
read brings every peer's record, so the swarm's reads grow as N^2 over this period."""
P2PD_STARTUP_S = 60.0
"""hivemind gives its p2p daemon 15 s to start; a loaded machine (or a small CPU quota) needs
more."""


class Presence:
    def __init__(self, peer: PeerRuntime) -> None:
        self.peer = peer
        self.subkey = b""
        """The signed subkey this peer's records go under (records.py); set as the DHT starts."""
        self.known_others: list[PeerStatus] = []
        """The live others as the status thread last read them (whom a download asks)."""
        self.foreign: set[str] = set()  # peers of another protocol, warned about once
        self.addrs: list[str] = []
        """The addresses others join this peer at (once the DHT has started)."""
        self._roster: Roster | None = None
        self._revocations: Any = None
        self.agreement = AgreementRecord()
        """Digests of this peer's state at its last rounds, published (agreement.py)."""
        self._digested_round = -1
        self._agreement_at = -math.inf  # monotonic time the digests were last stored
        self._declared_at = -math.inf  # ...and the certificate
        self._sharing: Any = None  # evidence of forgers shown and checked (forgers.py)
        self.round_changed = threading.Event()  # the status thread publishes the new digests
        self.stopping = threading.Event()  # the status thread ends
        self._publisher: threading.Thread | None = None
        self._rates = RateMeter()

    def start_dht(self, initial: list[str]) -> DHT:
        """The DHT, joined to `initial` (retried while those peers may still be starting)."""
        cfg = self.peer.cfg
        deadline = time.time() + cfg.join_timeout_s
        # a sybil (bench attack) takes part under a new peer ID, its member's certificate in hand
        own_identity = cfg.identity and cfg.attack != "sybil"
        identity = {"identity_path": cfg.identity} if own_identity else {}
        from hivemind.utils.crypto import RSAPrivateKey

        # open swarms sign too, each peer with its own key (peers sharing a process, as in
        # tests, would otherwise write each other's records)
        signing = self.peer._signing_key or RSAPrivateKey()
        self.subkey = own_subkey(signing)
        membership = self.peer.membership
        warned = False
        while True:
            try:
                return DHT(
                    initial_peers=initial,
                    host_maddrs=[f"/ip4/{cfg.host}/tcp/{cfg.port}"],
                    start=True,
                    authorizer=membership.authorizer() if membership else None,
                    record_validators=swarm_validators(cfg.swarm, signing),
                    startup_timeout=P2PD_STARTUP_S,
                    **identity,
                )
            except Exception as e:
                # hivemind says "bootstrap failed"; p2pd itself, "failed to connect to bootstrap
                # peers" (its daemon refuses to start while no initial peer answers)
                text = str(e).lower()
                refused = bool(initial) and any(
                    m in text for m in ("bootstrap failed", "bootstrap peers")
                )
                if refused and time.time() < deadline:
                    if not warned:
                        log.warning(
                            "no peer at --join answered yet (still starting? another key?); "
                            "trying for up to %.0f s",
                            cfg.join_timeout_s,
                        )
                        warned = True
                    time.sleep(1.0)
                    continue
                if refused:
                    raise AtomError(
                        "cannot join the swarm: no peer accepted this one (does the swarm use "
                        "another key, or none? is a peer running at --join?)"
                    ) from None
                raise AtomError(f"cannot start the swarm ({type(e).__name__}: {e})") from None

    # --- the status thread ----------------------------------------------------------------------

    def start_publishing(self) -> None:
        self._publisher = threading.Thread(
            target=self._publish_loop, daemon=True, name="atom-status"
        )
        self._publisher.start()

    def stop_publishing(self) -> None:
        if self._publisher is not None:
            self.stopping.set()
            self.round_changed.set()
            self._publisher.join(timeout=5)

    def _publish_loop(self) -> None:
        """Publishes from its own thread, so a peer stays visibly alive while its main thread
        waits (for a round, or for the others at the end)."""
        last_read = -math.inf
        settled = time.monotonic() + SETTLE_S
        while not self.stopping.is_set():
            self.round_changed.wait(PUBLISH_EVERY_S)  # at once when the round changes
            self.round_changed.clear()
            if self.stopping.is_set():
                break
            try:
                self.publish(self.peer._step)
                self.publish_agreement()
                now = time.monotonic()
                read = now - last_read >= READ_EVERY_S
                every = REPUBLISH_EVERY_S if now >= settled else 0.0
                self._refresh_membership(read, now - self._declared_at >= every)
                last_read = now if read else last_read
            except Exception as e:  # the DHT going away at shutdown
                log.debug("status not published: %s", e)

    def publish(self, step: int) -> None:
        peer = self.peer
        if peer.dht is None:
            return
        sent_bps, received_bps = (
            self._rates.update(*self.network_totals()) if peer.averager else (0.0, 0.0)
        )
        outcomes = list(peer.outcomes)
        publish(
            peer.dht,
            peer.cfg.swarm,
            self.subkey,
            PeerStatus(
                name=peer.name,
                round=peer.round,
                step=step,
                loss=peer._last_loss,
                tokens_per_s=peer._tokens_per_s,
                last_sync=peer.last_sync,
                failed_rounds=peer.failed_rounds,
                addrs=tuple(self.addrs[:2]),
                updated=time.time(),
                finishing=peer.finisher.finishing,
                done=peer.finisher.done,
                rejected=tuple(sorted(peer.rejected))[:16],
                peer_id=peer.peer_id,
                sync_every=peer.clock.sync_every,
                round_s=peer.last_round_s,
                period_s=peer.clock.period_s,
                init_digest=peer.init_digest if peer.round == 0 else "",
                sent_bps=sent_bps,
                received_bps=received_bps,
                round_bytes=peer.last_round_bytes,
                matchmaking_s=peer.last_matchmaking_s,
                success_share=sum(outcomes) / len(outcomes) if outcomes else 0.0,
                schedule_step=max(peer._schedule_step, 0),
                protocol=peer.protocol,
            ),
        )

    def network_totals(self) -> tuple[float, float]:
        """Bytes sent and received so far: on the wire if the kernel tells, else the averager's."""
        if self.peer.wire is not None:
            return self.peer.wire.totals()
        assert self.peer.averager is not None
        return self.peer.averager.traffic.totals()

    def publish_agreement(self) -> None:
        """Digests of the synchronized state at this peer's last rounds, for joiners to check a
        downloaded state against (defended swarms only: hashing costs a pass over the state)."""
        peer = self.peer
        if not peer.cfg.defend or peer.dht is None:
            return
        now = time.monotonic()
        if peer.round != self._digested_round:
            with peer.lock:
                r, theta, momentum = peer.round, peer.theta_sync.clone(), peer.outer.buf.clone()
            self.agreement.add(RoundDigest.of(r, theta, momentum))
            self._digested_round = r
        elif now - self._agreement_at < REPUBLISH_EVERY_S:
            return  # published, unchanged, and far from expiring
        self._agreement_at = now
        try:
            future = self.agreement.publish(peer.dht, peer.cfg.swarm, self.subkey)
        except Exception:
            self._agreement_at = -math.inf  # again at the next tick
            raise
        future.add_done_callback(self._digests_stored)

    def _digests_stored(self, future: Any) -> None:
        if future.cancelled() or future.exception() is not None or not future.result():
            self._agreement_at = -math.inf  # stored again at the next status tick

    # --- membership -----------------------------------------------------------------------------

    def _refresh_membership(self, read: bool = True, declare: bool = True) -> None:
        """With `declare`, republish this peer's certificate and the newest revocation list;
        with `read`, hand the newest list to the DHT's gate and note who is live (whom a
        download asks: state_sources). A newer revocation list is republished at once."""
        peer = self.peer
        if peer.dht is None:
            return
        if read:
            self.known_others = self.live_others()
        if peer.membership is None:
            return
        if read and (self._sharing is None or self._sharing.done()):
            # (not as each round begins too: a DHT read at every round's start in tests of four
            # peers on 2 cores made a stalled round's redo fail in 2 CI runs of 2)
            self._sharing = share_evidence(peer.dht, peer.cfg.swarm)
        if read:
            self._roster = read_roster(peer.dht, peer.cfg.swarm, peer.membership.owner)
            newest = self._roster.revocations
            known = self._revocations
            if newest is not None and (known is None or newest.issued > known.issued):
                self._revocations = newest
                declare = True  # the list outlives whoever published it (declare_member)
                note_revoked(peer.dht, newest.members)
                if peer.membership.member in newest.members:
                    log.warning("the owner revoked this member (%s)", peer.membership.member)
        if declare:
            self._declared_at = time.monotonic()
            try:
                futures = declare_member(
                    peer.dht,
                    peer.cfg.swarm,
                    peer.membership,
                    self.declared_id(),
                    False,
                    self._revocations,
                )
            except Exception:
                self._declared_at = -math.inf  # again at the next tick
                raise
            for future in futures:
                future.add_done_callback(self._declared)
        if peer.cfg.attack == "dht_overwrite":  # bench attack only
            cert = peer.membership.certificate(self.declared_id().to_base58())
            overwrite_records(peer.dht, peer.cfg.swarm, cert.to_text(), self.subkey)

    def _declared(self, future: Any) -> None:
        """A store of the certificate (or revocation list) ended: if it failed, the next status
        tick stores it again rather than REPUBLISH_EVERY_S later."""
        if future.cancelled() or future.exception() is not None or not future.result():
            self._declared_at = -math.inf

    def roster(self, fresh: bool = False) -> Roster | None:
        """The swarm's certified members (None: an open swarm), as the status thread last read
        them, or with `fresh` read now (a blocking DHT read: not on the training thread)."""
        peer = self.peer
        if peer.membership is None or peer.dht is None:
            return None
        if fresh:
            self._roster = read_roster(peer.dht, peer.cfg.swarm, peer.membership.owner)
        return self._roster if self._roster is not None else Roster()  # not read yet: no one

    def declared_id(self) -> PeerID:
        """The peer ID this peer's certificate is published for: its own (a sybil, in bench
        attack, publishes its member's certificate as it is, for the member's peer ID)."""
        peer = self.peer
        assert peer.dht is not None
        if peer.cfg.attack == "sybil" and peer.membership is not None:
            return PeerID.from_base58(peer.membership.certificate().peer_id)
        return peer.dht.peer_id

    # --- who is live ----------------------------------------------------------------------------

    def live_others(self) -> list[PeerStatus]:
        """The other peers whose status is fresh."""
        peer = self.peer
        assert peer.dht is not None
        now = time.time()
        live = [
            s
            for s in read_statuses(peer.dht, peer.cfg.swarm, peer.owner)
            if s.peer_id != peer.peer_id and s.fresh(now, 3 * PUBLISH_EVERY_S)
        ]
        for s in live:
            if s.protocol != peer.protocol and s.peer_id not in self.foreign:
                self.foreign.add(s.peer_id)
                log.warning(
                    "peer %s averages with protocol %s, this one with %s: the two never join "
                    "one round (run every peer of a swarm with the same version and the same "
                    "--peer.defend and --peer.audit)",
                    s.name,
                    describe(s.protocol),
                    peer.protocol,
                )
        return [s for s in live if s.protocol == peer.protocol]

    def live_members(self) -> int:
        """This peer and the live others that could take part in its rounds (as the status
        thread last read them): not past their last round, not rejected, not left out as a
        staller until a round with it lands again (by peer ID: a status names itself as it
        likes, its peer ID is what its certificate binds). Finishing peers count: they take
        part in the last round, and a member claiming to finish would go uncounted while it
        took part in pairs."""
        return 1 + len(self.live_other_ids())

    def live_other_ids(self) -> list[str]:
        """The peer IDs of the live others that could take part in this peer's rounds, as
        `live_members` counts them: whom a leader waits for before it forms a retry's group
        early, and whom it counts towards the round's quorum (assembly.py; the averager also
        leaves out whom it excludes or banned)."""
        av = self.peer.averager
        gone = (av.rejected_ids | av.left_out_ids) if av is not None else set()
        return [p for p in self.unfinished_other_ids() if p not in gone]

    def unfinished_other_ids(self) -> list[str]:
        """The peer IDs of the live others not past their last round, those this peer left
        out or rejected among them: where the averager refuses every one, its round ends at
        once (guarded.py, NO_ONE)."""
        return [s.peer_id for s in self.known_others if not s.done]

    def statuses_of_others(self, wait_s: float) -> list[PeerStatus]:
        assert self.peer.dht is not None
        deadline = time.time() + wait_s
        while True:
            others = [  # a dead peer's record lingers until it expires: this one's own too,
                # after a restart under a new peer ID
                s
                for s in self.live_others()
                if s.name != self.peer.name
            ]
            # peers of another protocol seen and none of this one's: the swarm's records are
            # here, and waiting would not bring one
            if others or self.foreign or time.time() > deadline:
                return others
            time.sleep(0.25)

    def state_sources(self, first: str = "", fresh: bool = False) -> list[str]:
        """Whom a state download asks, best first (state.py); `first` before all others. From
        the status thread's last reading (a DHT read would block the training thread: with none
        yet, nobody; a re-synchronization then asks its group), or with `fresh`
        (the finish, where nothing trains any more) read now."""
        others = self.live_others() if fresh else self.known_others
        if fresh:
            self.known_others = others
        sources = download_sources(others, self.peer.peer_id)
        return [first, *[s for s in sources if s != first]] if first else sources

    def wait_for_peers(self) -> None:
        cfg = self.peer.cfg
        assert self.peer.dht is not None
        deadline = time.time() + 60.0
        while cfg.wait_for > 1 and time.time() < deadline:
            present = 1 + len(self.live_others())  # this one, and the others it averages with
            if present >= cfg.wait_for:
                return
            time.sleep(0.5)
        if cfg.wait_for > 1:
            log.warning("only some of %d peers arrived; training anyway", cfg.wait_for)

    def write_addrs(self) -> None:
        peer = self.peer
        assert peer.dht is not None
        addrs = [str(a) for a in peer.dht.get_visible_maddrs()]
        self.addrs = addrs
        atomic_write_text(  # others read it while this peer starts
            peer.run_dir / "peer.json",
            json.dumps({"name": peer.name, "addrs": addrs, "peer_id": peer.peer_id}),
        )
        log.info("peer %s listening; others join with --join %s", peer.name, addrs[0])
