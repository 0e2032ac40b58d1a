"""One peer of a swarm: local steps as usual, and every H steps a background averaging round.

A round averages the pseudo-gradient (parameters at the last sync minus parameters now) with
whoever is present, weighted by the tokens each processed since its last applied round, and
applies DiLoCo's outer Nesterov step (rounds.py). The round runs in hivemind's processes while
local training goes on; when it lands, the peer moves to the new synchronized parameters *plus*
the local progress it made meanwhile. Local steps never wait for the network: a round is only
polled between steps, and nothing on the training thread asks the DHT.

A round that finds no group, breaks, or comes back partly averaged changes nothing: the progress
stays in the model and the next round's pseudo-gradient carries it (never applied alone and then
averaged in by others too). A peer whose synchronized parameters differ from its group's
(sync.py: it missed a round, or resumed from an old checkpoint) downloads the swarm's state in the
background and moves to it, keeping its local progress.

H is `peer.sync_every`, or with `auto`, rounds start on a clock every peer shares: round slots
at whole multiples of a period (unix time), the period chosen from the measured round time so a
round finishes within the next one, and rounded up to 0.5 s times a power of two; members of a
round all take the group's largest proposal, so every peer looks for its group at the same
moment, and groups that split hold periods whose slots nest, so they meet again. Such a round
looks for its group `matchmaking_s` before its slot (telling the group the contribution it will
have by then) and writes its contribution at the slot, so matchmaking is not part of the round's
latency: the all-reduce begins as the contribution is written.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from atomtrain.config import PeerSection
from atomtrain.errors import AtomError
from atomtrain.peer.agreement import (
    AgreementRecord,
    RoundDigest,
    agreement_key,
    members_only,
    parse_records,
)
from atomtrain.peer.attack import (
    check_attack,
    claimed_tokens,
    overwrite_records,
    poison,
    stall_rounds,
)
from atomtrain.peer.auth import (
    MemberGate,
    Membership,
    Roster,
    declare_member,
    load_membership,
    note_revoked,
    read_roster,
)
from atomtrain.peer.averaging import ProbedAverager, RoundFailed, RoundResult
from atomtrain.peer.bounds import Defence
from atomtrain.peer.download import ZERO_MOMENTUM
from atomtrain.peer.finish import Finisher
from atomtrain.peer.hygiene import start_watchdog
from atomtrain.peer.layout import Sketcher, assign, cut_pieces, digest, flatten, param_slice
from atomtrain.peer.outer import OuterNesterov
from atomtrain.peer.protocol import averaging_prefix, describe, protocol_tag
from atomtrain.peer.records import own_subkey, swarm_validators
from atomtrain.peer.rounds import (
    Contribution,
    apply_outer_step,
    move_to,
    own_share_step,
    shift_to_own_share,
    write_contribution,
)
from atomtrain.peer.state import StateCheck, download_sources, resync_floor, swarm_schedule_step
from atomtrain.peer.status import PeerStatus, publish, read_statuses
from atomtrain.peer.sync import group_live, needed_in_sync
from atomtrain.peer.traffic import RateMeter
from atomtrain.peer.wire import WireMeter, daemon_meter
from atomtrain.train.metrics import MetricsLog
from atomtrain.train.runner import StepRunner
from atomtrain.train.trainer import TrainState
from atomtrain.values import atomic_write_text

log = logging.getLogger(__name__)
# hivemind logs a failed round as an error with a traceback; the runtime reports it in one line.
logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)
# ...and its DHT requests that time out on a slow link surface as unretrieved asyncio errors.
logging.getLogger("asyncio").setLevel(logging.CRITICAL)

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
FIRST_SYNC_EVERY = 10
"""With H auto, the first period is this many steps' time (nothing measured yet), rounded up to
the period ladder so peers of about the same speed propose the same."""
AUTO_MARGIN = 1.25
"""With H auto, the period is this many times the typical round time and a step, plus the time a
round looks for its group before its slot."""
PERIOD_GRAIN_S = 0.5
"""Periods are this times a power of two (the period ladder): proposals of peers alike are
equal, and of two periods the longer's slots are all slots of the shorter, so groups that hold
different periods still meet (at every slot of the longer)."""
SLOT_MARGIN_S = 0.25
"""A round that could look for its group only this long before its slot takes the next slot."""
MAX_PERIOD_S = 3600.0
OWN_SHARE = 0.5
"""While an overlapped round runs, a member trains on from this share of its own contribution
(rounds.py). Simulated (4 workers, a round every 10 steps landing 9 steps later), validation
loss after 200 steps: 2.79 keeping all of it, 2.74 keeping a quarter (1 / group size), 2.62
keeping half; blocking rounds 2.54, one worker alone 2.74."""
MIN_SCALE_STEPS = 1.0
"""A typical update moves an element (RMS) at least as far as this many AdamW steps at the peak
learning rate (each moves an element by up to about lr), so a peer whose own update is tiny still
tells honest updates from absurd ones."""


def _reap(process: Any) -> None:
    """A hivemind helper that ignored its shutdown request is killed, not waited for."""
    process.join(timeout=2.0)
    if process.is_alive():
        log.debug("%s ignored its shutdown; killing it", type(process).__name__)
        process.kill()
        process.join(timeout=2.0)


class PeerRuntime:
    def __init__(
        self,
        cfg: PeerSection,
        runner: StepRunner,
        name: str,
        total_steps: int,
        run_dir: Path,
        lr: float = 1e-3,
    ) -> None:
        self.cfg = cfg
        self.lr = lr
        self.runner = runner
        self.name = name
        self.total_steps = total_steps
        self.run_dir = run_dir
        params = runner.host_parameters()
        self.pieces = cut_pieces({n: p.numel() for n, p in params.items()})
        self.numel = sum(p.numel for p in self.pieces)
        self.theta_sync = flatten(params, self.pieces)
        self.sketcher = Sketcher(self.numel)
        self._sketch = self.sketcher.of(self.theta_sync)
        self.init_digest = digest(self.theta_sync)
        check_attack(cfg.attack)
        self._initial = self.theta_sync.clone() if cfg.attack == "stale" else None
        self.membership: Membership | None = load_membership(
            cfg.swarm_key, cfg.swarm_cert, cfg.identity, name
        )
        self.owner = self.membership.owner if self.membership else None
        self._signing_key = self.membership.private_key if self.membership else None
        self._revocations: Any = None
        self._known_others: list[PeerStatus] = []
        self.protocol = protocol_tag(cfg.defend, cfg.audit)
        self._foreign: set[str] = set()  # peers of another protocol, warned about once
        self._roster: Roster | None = None
        self.rejected: dict[str, str] = {}  # peers whose contributions were rejected: why
        self.outer = OuterNesterov(self.numel, cfg.outer_lr, cfg.outer_momentum)
        self.lock = threading.Lock()  # theta_sync, momentum, round: training vs state serving
        self.on_replaced: Callable[[], None] = lambda: None
        """Called when the model's weights were replaced rather than moved by a round (a state
        downloaded, the swarm's last round, the end on the synchronized state): the trainer
        restarts its weight average from them."""
        self.on_final: Callable[[], None] = lambda: None
        """Called just before the last round: the trainer writes its weight average into the
        weights, so the last round averages the peers' averages."""
        self.round = 0
        self.failed_rounds = 0
        self.round_tokens = 0
        self.steps_since_round = 0
        self.sync_every = cfg.fixed_sync_every or FIRST_SYNC_EVERY
        self._proposal = self.sync_every
        self.period_s = 0.0
        """With H auto: seconds between round slots (0 until the first steps are timed)."""
        self._proposal_s = 0.0
        self._next_round_at = 0.0
        self.round_slot = 0.0
        """The slot (unix seconds) the last round started at."""
        self._step_s = 0.0
        self._last_step_at = 0.0
        self._round_started = 0.0
        self.last_round_s = 0.0
        self.last_round_bytes = 0.0
        self.last_matchmaking_s = 0.0
        self.outcomes: deque[bool] = deque(maxlen=20)  # applied or not, of the last rounds
        self._round_times: deque[float] = deque(maxlen=5)
        self._rates = RateMeter()
        self._looking_since = 0.0
        self._group_found_at = 0.0
        self._traffic_at_start = (0.0, 0.0)
        self.wire: WireMeter | None = None
        """What the peer's p2p daemon put on the network and took from it (wire.py)."""
        self._wire_at_last_round = 0.0
        self._final = False
        self._share = 0.0
        """This member's share of the running round it trains on from (rounds.py); 0: none."""
        self._resync: Any = None
        self._resync_records: Any = None
        self.agreement = AgreementRecord()
        """Digests of this peer's state at its last rounds, published (agreement.py)."""
        self._digested_round = -1
        self._agreement_at = -math.inf  # monotonic time the digests were last stored
        self._declared_at = -math.inf  # ...and the certificate
        self._round_changed = threading.Event()  # the status thread publishes the new digests
        self.last_group_ids: list[str] = []
        self.last_sync = 0.0
        self.first_contribution_s: float | None = None
        import psutil

        self.started_at = psutil.Process().create_time()  # joining time counts from launch
        self._step = 0
        self._schedule_step = 0
        self._last_loss = float("nan")
        self._tokens_per_s = 0.0
        self.dht: DHT | None = None
        self.averager: ProbedAverager | None = None
        self.watchdog: subprocess.Popen | None = None
        self.finisher = Finisher(self)

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self, resumed: dict[str, Any] | None, state: TrainState | None = None) -> None:
        """Join the swarm: start the DHT and averager, then take the swarm's state if needed."""
        self.joined_at = time.time()  # joining begins: the DHT starts
        self.train_state = state or TrainState()
        self._schedule_step = self.train_state.step + self.train_state.schedule_offset
        self.watchdog = start_watchdog()
        initial = [a.strip() for a in self.cfg.join.split(",") if a.strip()]
        if self.membership is None:
            log.warning(
                "swarm %s is open: any peer that reaches this one can join it "
                "(make a key with `atomtrain keygen` and pass --swarm-key)",
                self.cfg.swarm,
            )
        else:
            log.info(
                "swarm of owner %s: only members it admitted take part (this one: %s)",
                self.membership.owner[:8],
                self.membership.member,
            )
        self.dht = self._start_dht(initial)
        self.wire = daemon_meter(self.dht.pid)
        declare_member(self.dht, self.cfg.swarm, self.membership, self._declared_id(), wait=True)
        self.peer_id = self.dht.peer_id.to_base58()
        self.averager = ProbedAverager(
            self.dht,
            averaging_prefix(self.cfg.swarm, self.protocol),
            self.pieces,
            self.cfg.compression,
            self.cfg.matchmaking_s,
            self.cfg.averaging_timeout_s,
            self.cfg.target_group_size,
            self._shared_state,
            MemberGate(self.membership, self.cfg.swarm),
            Defence(min_scale=self.lr * MIN_SCALE_STEPS, audit=self.cfg.audit)
            if self.cfg.defend
            else None,
            attack=self.cfg.attack,
        )
        self.checker = StateCheck(self)
        if resumed is not None:
            self._load(resumed["meta"], resumed["tensors"], mode="resume")
            log.info("resumed at round %d from the checkpoint", self.round)
        if initial:
            self._catch_up()
        self._publish(self.train_state.step)
        self._publish_agreement()
        self._write_addrs()
        self._stop_publishing = threading.Event()
        self._publisher = threading.Thread(
            target=self._publish_loop, daemon=True, name="atom-status"
        )
        self._publisher.start()
        if self.cfg.attack == "stall":  # bench attack only
            threading.Thread(
                target=stall_rounds, args=(self, self._stop_publishing), daemon=True
            ).start()
        self._wait_for_peers()
        log.info(
            "averaging holds %.2fx the float32 model in host memory",
            self.averaging_memory_ratio(),
        )

    def _start_dht(self, initial: list[str]) -> DHT:
        """The DHT, joined to `initial` (retried while those peers may still be starting)."""
        deadline = time.time() + self.cfg.join_timeout_s
        # a sybil (bench attack) takes part under a new peer ID, its member's certificate in hand
        own_identity = self.cfg.identity and self.cfg.attack != "sybil"
        identity = {"identity_path": self.cfg.identity} if own_identity else {}
        from hivemind.utils.crypto import RSAPrivateKey

        # open swarms sign too, each peer with its own key (peers sharing a process, as in
        # tests, would otherwise write each other's records)
        signing = self._signing_key or RSAPrivateKey()
        self._subkey = own_subkey(signing)
        warned = False
        while True:
            try:
                return DHT(
                    initial_peers=initial,
                    host_maddrs=[f"/ip4/{self.cfg.host}/tcp/{self.cfg.port}"],
                    start=True,
                    authorizer=self.membership.authorizer() if self.membership else None,
                    record_validators=swarm_validators(self.cfg.swarm, signing),
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
                            self.cfg.join_timeout_s,
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

    def averaging_memory_ratio(self) -> float:
        """Host memory held for averaging, as a multiple of the float32 model: synchronized
        parameters, outer momentum, and the averager's tensors (averaging.py)."""
        assert self.averager is not None
        held = self.theta_sync.numel() * 4 + self.outer.buf.numel() * 4
        held += self.averager.held_bytes()
        return held / (4 * self.numel)

    def _publish_loop(self) -> None:
        """Publishes from its own thread, so a peer stays visibly alive while its main thread
        waits (for a round, or for the others at the end)."""
        last_read = -math.inf
        settled = time.monotonic() + SETTLE_S
        while not self._stop_publishing.is_set():
            self._round_changed.wait(PUBLISH_EVERY_S)  # at once when the round changes
            self._round_changed.clear()
            if self._stop_publishing.is_set():
                break
            try:
                self._publish(self._step)
                self._publish_agreement()
                now = time.monotonic()
                read = now - last_read >= READ_EVERY_S
                every = REPUBLISH_EVERY_S if now >= settled else 0.0
                self._refresh_membership(read, now - self._declared_at >= every)
                last_read = now if read else last_read
            except Exception as e:  # the DHT going away at shutdown
                log.debug("status not published: %s", e)

    def _refresh_membership(self, read: bool = True, declare: bool = True) -> None:
        """With `declare`, republish this peer's certificate and the newest revocation list;
        with `read`, hand the newest list to the DHT's gate and note who is live (whom a
        download asks: state_sources). A newer revocation list is republished at once."""
        if self.dht is None:
            return
        if read:
            self._known_others = self.live_others()
        if self.membership is None:
            return
        if read:
            self._roster = read_roster(self.dht, self.cfg.swarm, self.membership.owner)
            newest = self._roster.revocations
            known = self._revocations
            if newest is not None and (known is None or newest.issued > known.issued):
                self._revocations = newest
                declare = True  # the list outlives whoever published it (declare_member)
                note_revoked(self.dht, newest.members)
                if self.membership.member in newest.members:
                    log.warning("the owner revoked this member (%s)", self.membership.member)
        if declare:
            self._declared_at = time.monotonic()
            try:
                futures = declare_member(
                    self.dht,
                    self.cfg.swarm,
                    self.membership,
                    self._declared_id(),
                    False,
                    self._revocations,
                )
            except Exception:
                self._declared_at = -math.inf  # again at the next tick
                raise
            for future in futures:
                future.add_done_callback(self._declared)
        if self.cfg.attack == "dht_overwrite":  # bench attack only
            overwrite_records(self.dht, self.cfg.swarm, self.membership.certificate().to_text())

    def _declared(self, future: Any) -> None:
        """A store of the certificate (or revocation list) ended: if it failed, the next status
        tick stores it again rather than REPUBLISH_EVERY_S later."""
        if future.cancelled() or future.exception() is not None or not future.result():
            self._declared_at = -math.inf

    def _digests_stored(self, future: Any) -> None:
        if future.cancelled() or future.exception() is not None or not future.result():
            self._agreement_at = -math.inf  # stored again at the next status tick

    def roster(self, fresh: bool = False) -> Roster | None:
        """The swarm's certified members (None: an open swarm), as the status thread last read
        them, or with `fresh` read now (a blocking DHT read: not on the training thread)."""
        if self.membership is None or self.dht is None:
            return None
        if fresh:
            self._roster = read_roster(self.dht, self.cfg.swarm, self.membership.owner)
        return self._roster if self._roster is not None else Roster()  # not read yet: no one

    def _declared_id(self) -> PeerID:
        """The peer ID this peer's certificate is published for: its own (a sybil, in bench
        attack, publishes its member's certificate as it is, for the member's peer ID)."""
        assert self.dht is not None
        if self.cfg.attack == "sybil" and self.membership is not None:
            return PeerID.from_base58(self.membership.certificate().peer_id)
        return self.dht.peer_id

    def state_sources(self, first: str = "", fresh: bool = False) -> list[str]:
        """Whom a state download asks, best first (state.py); `first` before all others. From
        the status thread's last reading (a DHT read would block the training thread), or with
        `fresh` (the finish, where nothing trains any more) read now."""
        others = self.live_others() if fresh or not self._known_others else self._known_others
        if fresh:
            self._known_others = others
        sources = download_sources(others, self.peer_id)
        return [first, *[s for s in sources if s != first]] if first else sources

    def _publish_agreement(self) -> None:
        """Digests of the synchronized state at this peer's last rounds, for joiners to check a
        downloaded state against (defended swarms only: hashing costs a pass over the state)."""
        if not self.cfg.defend or self.dht is None:
            return
        now = time.monotonic()
        if self.round != self._digested_round:
            with self.lock:
                r, theta, momentum = self.round, self.theta_sync.clone(), self.outer.buf.clone()
            self.agreement.add(RoundDigest.of(r, theta, momentum))
            self._digested_round = r
        elif now - self._agreement_at < REPUBLISH_EVERY_S:
            return  # published, unchanged, and far from expiring
        self._agreement_at = now
        try:
            future = self.agreement.publish(self.dht, self.cfg.swarm, self._subkey)
        except Exception:
            self._agreement_at = -math.inf  # again at the next tick
            raise
        future.add_done_callback(self._digests_stored)

    def _wait_for_peers(self) -> None:
        assert self.dht is not None
        deadline = time.time() + 60.0
        while self.cfg.wait_for > 1 and time.time() < deadline:
            present = 1 + len(self.live_others())  # this one, and the others it averages with
            if present >= self.cfg.wait_for:
                return
            time.sleep(0.5)
        if self.cfg.wait_for > 1:
            log.warning("only some of %d peers arrived; training anyway", self.cfg.wait_for)

    def _write_addrs(self) -> None:
        assert self.dht is not None
        addrs = [str(a) for a in self.dht.get_visible_maddrs()]
        self.addrs = addrs
        atomic_write_text(  # others read it while this peer starts
            self.run_dir / "peer.json",
            json.dumps({"name": self.name, "addrs": addrs, "peer_id": self.peer_id}),
        )
        log.info("peer %s listening; others join with --join %s", self.name, addrs[0])

    def _catch_up(self) -> None:
        """A joiner takes the swarm's state unless it already holds it: a fresh swarm (every peer
        at round 0 with the parameters this peer built from the same seed) needs no download."""
        assert self.dht is not None and self.averager is not None
        statuses = self._statuses_of_others(wait_s=10.0)
        self._known_others = statuses  # whom a download asks, and whose schedule it follows
        if not statuses:
            log.warning(
                "no live peer of this swarm averages with this one's protocol (%s); starting "
                "from this peer's own parameters",
                self.protocol,
            )
            return
        swarm_round = self.checker.swarm_round(statuses)
        if self.round > 0 and self.round >= swarm_round:
            return
        fresh = [s for s in statuses if s.round == 0 and s.init_digest == self.init_digest]
        if self.round == 0 and swarm_round == 0 and fresh:
            log.info(
                "fresh swarm: %s holds the same initial parameters (%s); no download",
                fresh[0].name,
                self.init_digest,
            )
            return
        for _ in range(6):  # a fresh swarm may not have declared its state yet
            sources = download_sources(statuses, self.peer_id)
            state = self.averager.download_state(self.cfg.state_timeout_s, sources)
            problem = self.checker.problem(state, min_round=swarm_round - 1)
            if problem is None:
                self._load(state[0], list(state[1]), mode="replace")
                log.info(
                    "joined at round %d with the swarm's parameters (parameters %s)",
                    self.round,
                    digest(self.theta_sync),
                )
                return
            if state is not None:
                log.warning("refused a downloaded state: %s", problem)
            time.sleep(1.0)
        log.warning("no peer shared a valid state; starting from this peer's own parameters")

    def _statuses_of_others(self, wait_s: float) -> list[PeerStatus]:
        assert self.dht is not None
        deadline = time.time() + wait_s
        while True:
            others = [  # a dead peer's record lingers until it expires: this one's own too,
                # after a restart under a new peer ID
                s
                for s in self.live_others()
                if s.name != self.name
            ]
            # peers of another protocol seen and none of this one's: the swarm's records are
            # here, and waiting would not bring one
            if others or self._foreign or time.time() > deadline:
                return others
            time.sleep(0.25)

    def _shared_state(self) -> tuple[dict, list[torch.Tensor]]:
        """What a joiner downloads: synchronized parameters, outer momentum, round, schedule.
        A momentum of zeros (outer momentum 0: plain averaging) is named, not sent, which
        halves the download (download.py puts it back)."""
        with self.lock:
            theta, momentum = self.theta_sync.clone(), self.outer.buf.clone()
            meta = {"round": self.round, "numel": self.numel, "step": self._schedule_step}
        log.info("served the state of round %d (parameters %s)", meta["round"], digest(theta))
        if not bool(momentum.view(torch.int32).any()):  # every bit zero (no -0.0 either)
            return {**meta, "momentum": ZERO_MOMENTUM}, [theta]
        return meta, [theta, momentum]

    def _load(self, meta: dict, tensors: list[torch.Tensor], mode: str) -> None:
        """Take a state. `resume`: a checkpoint's (the model is already loaded); `replace`: a
        download the model moves to (joining, or the last round's result); `resync`: a download
        the model moves to keeping the local progress it made since its own last sync."""
        if len(tensors) != 2 or any(t.numel() != self.numel for t in tensors):
            raise AtomError("peer state does not match this model's parameters")
        params = self.runner.host_parameters()
        with self.lock:
            new = tensors[0].float().reshape(-1)
            if mode == "resync":
                move_to(params, self.pieces, self.theta_sync, new)
            else:
                self.theta_sync.copy_(new)
            if mode == "replace":
                assign(params, self.pieces, self.theta_sync)
            self.outer.buf.copy_(tensors[1].float().reshape(-1))
            self.round = int(meta["round"])
            self._round_changed.set()
            self._sketch = self.sketcher.of(self.theta_sync)
        if mode != "resume":
            self._weights_replaced()
        if mode != "resume" and self.train_state is not None:
            # the learning-rate schedule follows the swarm's progress, not this peer's steps:
            # where the live members' schedules stand, not where the serving peer says
            step = swarm_schedule_step(
                meta.get("step"),
                meta.get("round"),
                self._known_others,
                self.total_steps,
                self._schedule_step,
            )
            self.train_state.schedule_offset = step - self.train_state.step
            self._schedule_step = step

    def extra_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """For checkpoints: round counter, synchronized parameters, outer momentum. Taken while
        an overlapped round runs, the model holds that round's shift (rounds.py); the saved
        synchronized parameters carry it too, so theta - x is still all the progress no landed
        round holds, and a resumed peer sends it all."""
        with self.lock:
            theta = self.theta_sync.clone()
            if self._share > 0 and self.averager is not None:
                owns = self.averager.contributions()
                for piece, own in zip(self.pieces, owns, strict=True):
                    sl = slice(piece.offset, piece.offset + piece.numel)
                    m = self.outer.buf[sl]
                    e = own_share_step(
                        own, m, self.cfg.outer_lr, self.cfg.outer_momentum, self._share
                    )
                    theta[sl].add_(own.float() - e)
            return (
                {"peer_round": self.round},
                {"peer/theta_sync": theta, "peer/momentum": self.outer.buf.clone()},
            )

    # --- rounds ---------------------------------------------------------------------------------

    def after_step(self, state: TrainState, record: dict[str, Any]) -> None:
        now = time.perf_counter()
        if self._last_step_at:  # wall time per step, evaluation and rounds included
            dt = now - self._last_step_at
            self._step_s = dt if not self._step_s else 0.8 * self._step_s + 0.2 * dt
        self._last_step_at = now
        self.train_state = state
        self.steps_since_round += 1
        self.round_tokens += int(record.get("tokens_step", 0))
        self._last_loss = float(record["loss"])
        self._tokens_per_s = float(record.get("tokens_per_s", 0.0))
        self._step = state.step
        self._schedule_step = state.step + state.schedule_offset
        self._poll_resync(record)
        self._poll(record, wait=self.cfg.sync_mode == "blocking")
        if state.step >= self.total_steps and self.cfg.final_sync:
            self.finisher.final_round(record)
        elif self._prematched() and self.averager is not None and self.averager.awaiting_trigger:
            if time.time() >= self.round_slot:
                self._trigger_round()
        elif self._may_start_round():
            if self._prematched():
                self._prepare_round()
            else:
                self._start_round()
            if self.cfg.sync_mode == "blocking":  # synchronous DiLoCo: wait for the round
                self._poll(record, wait=True)
        self._note_rejections(record)
        record["round"] = self.round
        record["sync_every"] = self.sync_every

    def _may_start_round(self) -> bool:
        if self.averager is None or self.averager.running or self._resync is not None:
            return False
        if self.cfg.fixed_sync_every:
            return self.steps_since_round >= self.sync_every
        return self.steps_since_round >= 1 and self._slot_due()

    def _slot_due(self) -> bool:
        """With H auto: the shared clock reached this peer's next round slot."""
        now = time.time()
        if not self.period_s:
            if self.steps_since_round < FIRST_SYNC_EVERY or not self._step_s:
                return False
            swarm = [s.period_s for s in self._known_others]
            self.period_s = self._proposal_s = first_period(self._step_s, swarm)
        if not self._next_round_at:
            self._next_round_at = _next_slot(now + self._lead(), self.period_s)
        if now + self._lead() < self._next_round_at:
            return False
        if self._prematched() and now + SLOT_MARGIN_S > self._next_round_at:
            # too late to find a group for this slot: the next one
            self._next_round_at = _next_slot(now + self._lead(), self.period_s)
            return False
        return True

    def _prematched(self) -> bool:
        """Rounds on the shared clock find their group before their slot and write their
        contribution at it (H auto, overlapped rounds)."""
        return not self.cfg.fixed_sync_every and self.cfg.sync_mode == "async" and not self._final

    def _lead(self) -> float:
        """How long before its slot a round looks for its group."""
        return self.cfg.matchmaking_s if self._prematched() else 0.0

    def _contribution(self, stats: Contribution) -> Any:
        """write(piece, out): this member's contribution, its statistics gathered in `stats`."""
        params = self.runner.host_parameters()
        theta = self._initial if self._initial is not None else self.theta_sync
        attack = self.cfg.attack
        transform = (lambda d: poison(attack, d)) if attack else None

        def write(piece, out):
            write_contribution(params, theta, piece, out, self.sketcher, stats, transform)

        return write

    def _round_info(self, stats: Contribution, scale: float = 1.0) -> dict[str, Any]:
        """What the group is told about this member's contribution (`scale`: of the statistics,
        for a contribution predicted ahead of its slot)."""
        sketch = self._sketch if self._initial is None else self.sketcher.of(self._initial)
        return {
            "name": self.name,
            "round": self.round,
            "tokens": claimed_tokens(self.cfg.attack, self.round_tokens * scale),
            "rms": stats.rms(self.numel) * scale,
            "sketch": sketch,
            "update_size": stats.size() * scale,
            "sync_every": self._proposal,
            "period_s": self._proposal_s,
            "live": self._live_members(),  # the group's quorum: sync.group_live
        }

    def _start_round(self) -> None:
        """A round that looks for its group now, with the contribution as it stands."""
        assert self.averager is not None
        stats = Contribution()
        self._looking_since, self._group_found_at = time.perf_counter(), 0.0
        self.averager.start(
            self._contribution(stats),
            claimed_tokens(self.cfg.attack, float(self.round_tokens)),
            lambda: self._round_info(stats),
        )
        self.round_slot = self._next_round_at
        self._round_began()

    def _prepare_round(self) -> None:
        """A round on the shared clock: it looks for its group now, telling it the contribution
        this member will have at the slot (the statistics of the one it has now, scaled by the
        tokens it will have processed by then), and writes that contribution at the slot."""
        assert self.averager is not None
        stats = Contribution()
        write = self._contribution(stats)
        for piece, own in zip(self.pieces, self.averager.contributions(), strict=True):
            write(piece, own)  # a dry run: the previous round's input is no longer needed
        tokens_per_step = self.round_tokens / max(self.steps_since_round, 1)
        steps_left = max(self._next_round_at - time.time(), 0.0) / max(self._step_s, 1e-3)
        scale = 1.0 + steps_left * tokens_per_step / max(self.round_tokens, 1)
        self.round_slot = self._next_round_at
        self.averager.prepare(
            claimed_tokens(self.cfg.attack, float(self.round_tokens) * scale),
            self._round_info(stats, scale),
            self.round_slot,
        )
        self._looking_since, self._group_found_at = time.perf_counter(), 0.0

    def _trigger_round(self) -> None:
        """The slot has come: write the prepared round's contribution; the all-reduce begins."""
        assert self.averager is not None
        self.averager.trigger(self._contribution(Contribution()))
        self._round_began()

    def _round_began(self) -> None:
        """Bookkeeping of a round whose contribution is written."""
        assert self.averager is not None
        self._round_started = time.perf_counter()
        self._traffic_at_start = self.averager.traffic.totals()
        self._round_steps = self.steps_since_round
        self._round_tokens = self.round_tokens
        if self.period_s:  # the next slot on the shared clock, after this round's
            self._next_round_at = _next_slot(max(self.round_slot, time.time()), self.period_s)
        if self.cfg.sync_mode == "async" and not self._final:
            self._shift(OWN_SHARE)

    def _shift(self, share: float) -> None:
        """Overlapped rounds: train on from this member's share of the round (rounds.py); a
        share of 0 undoes the shift of a round that will not land."""
        assert self.averager is not None
        undo = share == 0.0
        if undo and self._share == 0.0:
            return
        with self.lock:
            shift_to_own_share(
                self.runner.host_parameters(),
                self.pieces,
                self.averager.contributions(),
                self.outer.buf,
                self.cfg.outer_lr,
                self.cfg.outer_momentum,
                self._share if undo else share,
                undo=undo,
            )
        self.runner.parameters_written()
        self._share = share

    def _poll(self, record: dict[str, Any], wait: bool) -> None:
        av = self.averager
        if av is None or not av.running:
            return
        if wait and av.awaiting_trigger and not av.done():
            self._trigger_round()  # waiting for it (the run's end): its slot is now
        while True:
            if not self._group_found_at and av.group_found():
                self._group_found_at = time.perf_counter()  # matchmaking is over
            if not wait or av.done():
                break
            time.sleep(0.01)
        if not av.done():
            return
        try:
            result = av.result()
        except RoundFailed as e:
            self._lose_round(str(e), record)
            return
        self._apply(result, record)

    def _lose_round(self, why: str, record: dict[str, Any]) -> None:
        """Nothing applied: the progress stays in the model and goes with the next round."""
        record["failed_round_s"] = time.perf_counter() - self._round_started
        self.failed_rounds += 1
        self.outcomes.append(False)
        self._shift(0.0)
        log.info("round %d: %s; its progress goes with the next round", self.round, why)

    def _apply(self, result: RoundResult, record: dict[str, Any]) -> None:
        assert self.averager is not None
        round_s = time.perf_counter() - self._round_started
        if result.in_sync:  # kept, whatever comes of the round: whom a failed round held
            record["round_members"] = [
                [str(g.get("name", ""))[:64] if isinstance(g, dict) else "", bool(ok)]
                for g, ok in zip(result.peers, result.in_sync, strict=False)
            ]
        if not result.self_in_sync:
            self._shift(0.0)
            self._start_resync(result)
            return
        need = needed_in_sync(
            group_live(result.peers),
            self.cfg.defend and self.membership is not None,
            self.cfg.target_group_size,
        )
        if result.in_sync and sum(result.in_sync) < 2 and not self._final:
            # no other member held our synchronized parameters, so the reducers left their
            # updates out and the "average" is our own update alone. Applied, it made a round
            # only this peer held: the partner that went to download the swarm's state found no
            # other peer to vouch for it (agreement.py), and this peer raced ahead on rounds of
            # one (churn: a joiner at round 20 while the rest sat at 11, to the end of the run).
            # Not a round: the progress goes with the next. (Undefended rounds leave such
            # updates out too, exact.py: the same holds there.)
            self._lose_round("no other member in sync", record)
            return
        if result.in_sync and need > 2 and sum(result.in_sync) < need:
            # a state only a pair holds, one of them possibly a liar, no third peer could take;
            # the last round's too: every finisher takes the result of the group holding the
            # smallest peer ID (finish.py), and of {an honest member, a sign-flipping one} that
            # was the honest member's last 50 steps cancelled, for all (bench attack's sybil
            # run: 3.49 against 2.86 clean). Lost, the finishers take its synchronized state.
            self._lose_round(
                f"{sum(result.in_sync)} members in sync while {need} could take part (sync.quorum)",
                record,
            )
            return
        params = self.runner.host_parameters()
        with self.lock, self.averager.averaged() as pairs:
            apply_outer_step(
                params,
                self.pieces,
                pairs,
                self.theta_sync,
                self.outer.buf,
                self.cfg.outer_lr,
                self.cfg.outer_momentum,
                self._final,
                self._share,
            )
            self._share = 0.0
            self.round += 1
            self._round_changed.set()
            self._sketch = self.sketcher.of(self.theta_sync)
        if self._final:  # the model every finisher ends with: not to be averaged with the last
            self._weights_replaced()
        else:
            self.runner.parameters_written()
        self.steps_since_round -= self._round_steps  # steps made meanwhile count for the next
        self.round_tokens -= self._round_tokens
        self.last_sync = time.time()
        self.last_round_s = round_s
        self.outcomes.append(True)
        sent0, received0 = self._traffic_at_start
        sent, received = self.averager.traffic.totals()
        if self.wire is not None:  # everything since the last round: its share of the link
            # as the status thread last read it (every PUBLISH_EVERY_S, and as a round lands):
            # a netlink dump here would cost the training thread. So a round's figure may miss
            # its last moments, which the next round's then holds: the mean over rounds holds
            moved = sum(self.wire.last_totals())
            self.last_round_bytes = moved - self._wire_at_last_round
            self._wire_at_last_round = moved
            record["wire_bytes"] = moved
        else:  # the averager's messages only
            self.last_round_bytes = (sent - sent0) + (received - received0)
        found = self._group_found_at or time.perf_counter()
        self.last_matchmaking_s = found - self._looking_since
        record["averager_bytes"] = sent + received  # all rounds so far, failed ones too
        record["round_sent_bytes"] = sent - sent0
        record["round_received_bytes"] = received - received0
        record["matchmaking_s"] = self.last_matchmaking_s
        self._choose_sync_every(result, round_s)
        if result.group_size > 1 and self.first_contribution_s is None:
            self.first_contribution_s = self.last_sync - self.started_at
            record["first_contribution_s"] = self.first_contribution_s
            record["first_contribution_since_join_s"] = self.last_sync - self.joined_at
        record["group_size"] = result.group_size
        record["group"] = sorted(str(g.get("name", ""))[:64] for g in result.peers)
        self.last_group_ids = result.peer_ids
        self.averager.left_out_ids -= set(result.peer_ids)  # back in a round that landed
        record["round_s"] = round_s
        record["round_bytes"] = self.last_round_bytes
        record["averaging_memory_ratio"] = self.averaging_memory_ratio()
        log.debug("round %d applied with %d peers", self.round, result.group_size)

    def _choose_sync_every(self, result: RoundResult, round_s: float) -> None:
        """With H auto: the period is the rung of the ladder (on_ladder) of the largest period the
        round's members proposed (what each sent, so every member computes the same); this
        peer's next proposal follows its round time."""
        if self.cfg.fixed_sync_every:
            return
        lo = self.cfg.min_sync_every * self._step_s
        hi = self.cfg.max_sync_every * self._step_s or math.inf
        proposals = []
        for g in result.peers:
            try:
                p = float(g.get("period_s", 0.0))
            except (TypeError, ValueError):
                continue
            if math.isfinite(p) and p > 0:
                proposals.append(min(p, MAX_PERIOD_S))  # no member can stall the swarm
        period = on_ladder(max(proposals)) if proposals else self.period_s
        if period != self.period_s:
            self.period_s = period
            self._next_round_at = _next_slot(time.time() + self._lead(), period)
        self._round_times.append(round_s)
        typical = statistics.median(self._round_times)  # one slow round does not stretch H
        # a period holds the round, the step its slot waits for, and the next round's matchmaking
        need = AUTO_MARGIN * (typical + self._step_s) + self._lead()
        self._proposal_s = on_ladder(max(need, lo), below=min(hi, MAX_PERIOD_S))
        if self._proposal_s < lo:  # no rung within [lo, hi]: the shortest H allowed wins
            self._proposal_s = on_ladder(lo)
        if self._step_s:  # H, for the status table: local steps a period holds
            self._proposal = self.sync_every = max(1, round(period / self._step_s))

    # --- re-synchronization ----------------------------------------------------------------------

    def _start_resync(self, result: RoundResult) -> None:
        assert self.averager is not None
        log.warning(
            "round %d: this peer's synchronized parameters differ from its group's; "
            "downloading the swarm's state (training goes on)",
            self.round,
        )
        live = self._known_others  # as the status thread last read them
        self._resync_round = resync_floor(
            [g.get("round", 0) for g in result.peers],
            StateCheck.swarm_round(live) if live else None,
        )
        self._resync = self.averager.download_state(
            self.cfg.state_timeout_s, self.state_sources(), wait=False
        )
        self._resync_records = None

    def _poll_resync(self, record: dict[str, Any]) -> None:
        if self._resync is None or not self._resync.done():
            return
        if self._resync_records is None and self.cfg.defend and self.dht is not None:
            # what the others hold, read once the state is here: a download takes about a
            # round on a slow link, and digests read when it began held only older rounds (4
            # peers at 10 Mbit/s: "match 1 of 3 peers' published digests", every other try)
            key = agreement_key(self.cfg.swarm)
            self._resync_records = self.dht.get(key, latest=True, return_future=True)
            return
        records_future = self._resync_records
        if records_future is not None and not records_future.done():
            return
        future, self._resync, self._resync_records = self._resync, None, None
        problem: str | None
        try:
            state = future.result()
            records = (
                members_only(
                    parse_records(records_future.result(), self._subkey, get_dht_time()),
                    self.roster(),
                )
                if records_future is not None
                else None
            )
        except Exception as e:
            state, problem = None, f"{type(e).__name__}: {e}"
        else:
            problem = self.checker.problem(state, self._resync_round, records)
        if problem is not None:
            log.warning("re-synchronization failed (%s); trying again after a round", problem)
            return
        self._load(state[0], list(state[1]), mode="resync")
        record["resynchronized"] = True
        log.info("re-synchronized at round %d (parameters %s)", self.round, digest(self.theta_sync))

    # --- bookkeeping ------------------------------------------------------------------------------

    def _note_rejections(self, record: dict[str, Any]) -> None:
        if self.averager is None:
            return
        for peer, why in self.averager.rejections():  # names from rounds' metadata, no DHT call
            if peer not in self.rejected:
                self.rejected[peer] = why
                log.warning(
                    "rejected the contributions of %s (%s); ignoring it from now", peer, why
                )
        if self.rejected:
            record["rejected_peers"] = sorted(self.rejected)
        for peer, why in self.averager.stalls():  # excluded for a while, not banned
            log.warning("left %s out of rounds for a while: it %s", peer, why)
            record.setdefault("stalled_peers", []).append(peer)
        for name, peer_id, cosine in self.averager.agreements():  # the opposing-update rule's
            log.debug("%s's update against this peer's: cosine %.3f", name, cosine)
            record.setdefault("agreement", []).append([name, peer_id, round(cosine, 4)])

    def end_on_sync(self) -> None:
        """The model takes the synchronized parameters, its local progress left behind: the end
        of a run whose last round did not land, where the other finishers take this peer's
        synchronized state (finish.py)."""
        params = self.runner.host_parameters()
        with self.lock:
            for piece in self.pieces:
                x = param_slice(params, piece)
                x.copy_(self.theta_sync[piece.offset : piece.offset + piece.numel].to(x))
        self._weights_replaced()

    def _weights_replaced(self) -> None:
        """The model's weights were replaced, not moved by a round: the runner derives again
        what it copies from them, and the trainer restarts its weight average from them."""
        self.runner.parameters_written()
        self.on_replaced()

    def _live_members(self) -> int:
        """This peer and the live others that could take part in its rounds (as the status
        thread last read them): not past their last round, not rejected, not left out as a
        staller until a round with it lands again (by peer ID: a status names itself as it
        likes, its peer ID is what its certificate binds). Finishing peers count: they take
        part in the last round, and a member claiming to finish would go uncounted while it
        took part in pairs."""
        av = self.averager
        gone = (av.rejected_ids | av.left_out_ids) if av is not None else set()
        return 1 + sum(1 for s in self._known_others if not s.done and s.peer_id not in gone)

    def live_others(self) -> list[PeerStatus]:
        """The other peers whose status is fresh."""
        assert self.dht is not None
        now = time.time()
        live = [
            s
            for s in read_statuses(self.dht, self.cfg.swarm, self.owner)
            if s.peer_id != self.peer_id and s.fresh(now, 3 * PUBLISH_EVERY_S)
        ]
        for s in live:
            if s.protocol != self.protocol and s.peer_id not in self._foreign:
                self._foreign.add(s.peer_id)
                log.warning(
                    "peer %s averages with protocol %s, this one with %s: the two never join "
                    "one round (run every peer of a swarm with the same version and the same "
                    "--peer.defend and --peer.audit)",
                    s.name,
                    describe(s.protocol),
                    self.protocol,
                )
        return [s for s in live if s.protocol == self.protocol]

    def network_totals(self) -> tuple[float, float]:
        """Bytes sent and received so far: on the wire if the kernel tells, else the averager's."""
        if self.wire is not None:
            return self.wire.totals()
        assert self.averager is not None
        return self.averager.traffic.totals()

    def _publish(self, step: int) -> None:
        if self.dht is None:
            return
        sent_bps, received_bps = (
            self._rates.update(*self.network_totals()) if self.averager else (0.0, 0.0)
        )
        outcomes = list(self.outcomes)
        publish(
            self.dht,
            self.cfg.swarm,
            self._subkey,
            PeerStatus(
                name=self.name,
                round=self.round,
                step=step,
                loss=self._last_loss,
                tokens_per_s=self._tokens_per_s,
                last_sync=self.last_sync,
                failed_rounds=self.failed_rounds,
                addrs=tuple(getattr(self, "addrs", ())[:2]),
                updated=time.time(),
                finishing=self.finisher.finishing,
                done=self.finisher.done,
                rejected=tuple(sorted(self.rejected))[:16],
                peer_id=self.peer_id,
                sync_every=self.sync_every,
                round_s=self.last_round_s,
                period_s=self.period_s,
                init_digest=self.init_digest if self.round == 0 else "",
                sent_bps=sent_bps,
                received_bps=received_bps,
                round_bytes=self.last_round_bytes,
                matchmaking_s=self.last_matchmaking_s,
                success_share=sum(outcomes) / len(outcomes) if outcomes else 0.0,
                schedule_step=max(self._schedule_step, 0),
                protocol=self.protocol,
            ),
        )

    def shutdown(self) -> None:
        if getattr(self, "_publisher", None) is not None:
            self._stop_publishing.set()
            self._round_changed.set()
            self._publisher.join(timeout=5)
        if self.averager is not None:
            self.averager.shutdown()
            _reap(self.averager.averager)
            # what the peer moved after its last step's record too, read once its averager is
            # gone: a round with other peers could still be running until then
            sent, received = self.averager.traffic.totals()
            last: dict[str, Any] = {"step": self._step, "averager_bytes": sent + received}
            if self.wire is not None:
                last["wire_bytes"] = sum(self.wire.totals())
            MetricsLog(self.run_dir / "metrics.jsonl").write(last)
            self.averager = None
        if self.wire is not None:
            self.wire.close()  # its reading thread and netlink sockets
        if self.dht is not None:
            self.dht.shutdown()
            _reap(self.dht)
            self.dht = None
        # The watchdog stays: once this process exits it kills whatever helper is left (p2pd).


def on_ladder(seconds: float, below: float = MAX_PERIOD_S) -> float:
    """`seconds` rounded up to the period ladder (PERIOD_GRAIN_S times a power of two), or
    the longest rung at most `below` when that is shorter (never less than PERIOD_GRAIN_S).
    With the rungs 0.5 s apart instead, two pairs of a 4-peer swarm that had split held 3.5
    and 4 s, whose slots met every 28 s: they trained as two swarms whose synchronized
    parameters differed, and each meeting sent one pair to download the other's state."""
    if not seconds <= below:  # NaN, inf, or beyond the cap
        seconds = below
    rung = max(math.ceil(math.log2(max(seconds, PERIOD_GRAIN_S) / PERIOD_GRAIN_S) - 1e-9), 0)
    while rung > 0 and PERIOD_GRAIN_S * 2**rung > below:
        rung -= 1
    return PERIOD_GRAIN_S * 2**rung


def first_period(step_s: float, swarm: list[float]) -> float:
    """A starting peer's period: the swarm's (the median of the periods the live peers last
    published), or, in a swarm starting at once, FIRST_SYNC_EVERY steps' time on the ladder.
    Peers whose step times differ a little then mostly start on the same period, and where
    one's is twice another's, each of its slots is also a slot of the other's: they meet there
    and take the group's period. (Rounded to PERIOD_GRAIN_S only, 4 peers started at once
    first met in two groups of 2, one pair on a period of about 12 steps and the other of
    about 23, whose synchronized parameters then differed.)"""
    published = [p for p in swarm if 0 < p <= MAX_PERIOD_S]
    if published:
        return on_ladder(statistics.median_low(published))
    return on_ladder(FIRST_SYNC_EVERY * step_s)


def _next_slot(now: float, period: float) -> float:
    """The first multiple of `period` (unix seconds) after `now`: the same on every peer."""
    return (math.floor(now / period) + 1) * period
