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

import logging
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from hivemind import DHT

from atomtrain.config import PeerSection
from atomtrain.peer.attack import check_attack, claimed_tokens, poison, stall_rounds
from atomtrain.peer.auth import MemberGate, Membership, declare_member, load_membership
from atomtrain.peer.averaging import ProbedAverager, RoundFailed, RoundResult
from atomtrain.peer.bounds import Defence
from atomtrain.peer.clock import RoundClock, next_slot
from atomtrain.peer.figures import note_rejections, record_landed
from atomtrain.peer.finish import Finisher
from atomtrain.peer.guarded import NO_ONE
from atomtrain.peer.hygiene import start_watchdog
from atomtrain.peer.layout import Sketcher, cut_pieces, digest, flatten
from atomtrain.peer.outer import OuterNesterov
from atomtrain.peer.presence import Presence
from atomtrain.peer.protocol import averaging_prefix, protocol_tag
from atomtrain.peer.resync import Resync, served_state
from atomtrain.peer.rounds import (
    Contribution,
    apply_outer_step,
    shift_to_own_share,
    write_contribution,
)
from atomtrain.peer.state import StateCheck
from atomtrain.peer.state_io import checkpoint_state, take_state
from atomtrain.peer.sync import group_live, needed_in_sync, why_not_applied
from atomtrain.peer.wire import WireMeter, daemon_meter
from atomtrain.train.metrics import MetricsLog
from atomtrain.train.runner import StepRunner
from atomtrain.train.trainer import TrainState

log = logging.getLogger(__name__)
# hivemind logs a failed round as an error with a traceback; the runtime reports it in one line.
logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)
# ...and its DHT requests that time out on a slow link surface as unretrieved asyncio errors.
logging.getLogger("asyncio").setLevel(logging.CRITICAL)

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
        self.protocol = protocol_tag(cfg.defend, cfg.audit)
        self.rejected: dict[str, str] = {}  # peers whose contributions were rejected: why
        self.outer = OuterNesterov(self.numel, cfg.outer_lr, cfg.outer_momentum)
        self.lock = threading.Lock()  # theta_sync, momentum, round: training vs state serving
        self.on_replaced: Callable[[], None] = lambda: None
        """Called when the model's weights were replaced rather than moved by a round (a state
        downloaded to join, the swarm's last round, the end on the synchronized state): the
        trainer restarts its weight average from them."""
        self.on_moved: Callable[[Callable[[Mapping[str, torch.Tensor]], None]], None] = (
            lambda shift: None
        )
        """Called when a re-synchronization moved the weights by the swarm's state minus this
        peer's synchronized one (its local progress kept), with that shift: the trainer moves
        its weight average by the same, so the average keeps its history."""
        self.on_final: Callable[[], bool] = lambda: False
        """Called just before the last round: the trainer writes its weight average into the
        weights, so the last round averages the peers' averages (False: it keeps none)."""
        self.round = 0
        self.failed_rounds = 0
        self.round_tokens = 0
        self.steps_since_round = 0
        self._idle_steps = 0  # after a round with nobody to average with: steps before the next
        self._round_started = 0.0
        self.last_round_s = 0.0
        self.last_round_bytes = 0.0
        self.last_matchmaking_s = 0.0
        self.outcomes: deque[bool] = deque(maxlen=20)  # applied or not, of the last rounds
        self.rounds_ended = 0  # rounds whose result the training thread has taken in
        self.serve_gave_up_at: int | None = None  # rounds_ended a state served waited out
        self._looking_since = 0.0
        self._group_found_at = 0.0
        self._traffic_at_start = (0.0, 0.0)
        self.wire: WireMeter | None = None
        """What the peer's p2p daemon put on the network and took from it (wire.py)."""
        self._wire_at_last_round = 0.0
        self._final = False
        self._brings_average = False
        """In its last round, this peer brings its weight average, not its progress since the
        round before: it reads no member's update against it (guarded.reads_members)."""
        self._share = 0.0
        """This member's share of the running round it trains on from (rounds.py); 0: none."""
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
        self.presence = Presence(self)
        self.clock = RoundClock(self)
        self.resync = Resync(self)
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
        self.dht = self.presence.start_dht(initial)
        self.wire = daemon_meter(self.dht.pid)
        declared = self.presence.declared_id()
        declare_member(self.dht, self.cfg.swarm, self.membership, declared, wait=True)
        self.peer_id = self.dht.peer_id.to_base58()
        self.averager = ProbedAverager(
            self.dht,
            averaging_prefix(self.cfg.swarm, self.protocol),
            self.pieces,
            self.cfg.compression,
            self.cfg.matchmaking_s,
            self.cfg.averaging_timeout_s,
            self.cfg.target_group_size,
            partial(served_state, self),
            MemberGate(self.membership, self.cfg.swarm),
            Defence(
                min_scale=self.lr * MIN_SCALE_STEPS,
                audit=self.cfg.audit,
                follow=self.cfg.follow_ratio,
                lean=self.cfg.lean,
            )
            if self.cfg.defend
            else None,
            attack=self.cfg.attack,
            start_timeout_s=self.cfg.start_timeout_s,
            live_others=self.presence.live_other_ids,
            unfinished_others=self.presence.unfinished_other_ids,
        )
        self.checker = StateCheck(self)
        if resumed is not None:
            take_state(self, resumed["meta"], resumed["tensors"], mode="resume")
            log.info("resumed at round %d from the checkpoint", self.round)
        if initial:
            self.resync.catch_up()
        self.presence.publish(self.train_state.step)
        self.presence.publish_agreement()
        self.presence.write_addrs()
        self.presence.start_publishing()
        if self.cfg.attack == "stall":  # bench attack only
            threading.Thread(
                target=stall_rounds, args=(self, self.presence.stopping), daemon=True
            ).start()
        self.presence.wait_for_peers()
        log.info(
            "averaging holds %.2fx the float32 model in host memory",
            self.averaging_memory_ratio(),
        )

    def averaging_memory_ratio(self) -> float:
        """Host memory held for averaging, as a multiple of the float32 model: synchronized
        parameters, outer momentum, and the averager's tensors (averaging.py)."""
        assert self.averager is not None
        held = self.theta_sync.numel() * 4 + self.outer.buf.numel() * 4
        held += self.averager.held_bytes()
        return held / (4 * self.numel)

    def extra_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """For checkpoints (state_io.checkpoint_state)."""
        return checkpoint_state(self)

    # --- rounds ---------------------------------------------------------------------------------

    def after_step(self, state: TrainState, record: dict[str, Any]) -> None:
        self.clock.step_ended()
        self.train_state = state
        self.steps_since_round += 1
        self._idle_steps = max(self._idle_steps - 1, 0)
        self.round_tokens += int(record.get("tokens_step", 0))
        self._last_loss = float(record["loss"])
        self._tokens_per_s = float(record.get("tokens_per_s", 0.0))
        self._step = state.step
        self._schedule_step = state.step + state.schedule_offset
        self.resync.poll(record)
        self._poll(record, wait=self.cfg.sync_mode == "blocking")
        if state.step >= self.total_steps and self.cfg.final_sync:
            self.finisher.final_round(record)
        elif (
            self.clock.prematched() and self.averager is not None and self.averager.awaiting_trigger
        ):
            if time.time() >= self.clock.round_slot:
                self._trigger_round()
        elif self._may_start_round():
            if self.clock.prematched():
                self._prepare_round()
            else:
                self._start_round()
            if self.cfg.sync_mode == "blocking":  # synchronous DiLoCo: wait for the round
                self._poll(record, wait=True)
        note_rejections(self, record)
        record["round"] = self.round
        record["sync_every"] = self.clock.sync_every

    def _may_start_round(self) -> bool:
        if self.averager is None or self.averager.running or self.resync.pending is not None:
            return False
        if self.cfg.fixed_sync_every:  # (a failed round's progress goes with one at once)
            return self.steps_since_round >= self.clock.sync_every and not self._idle_steps
        return self.steps_since_round >= 1 and self.clock.slot_due()

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
            "sync_every": self.clock.proposal,
            "period_s": self.clock.proposal_s,
            "start_lag_s": self.clock.start_lag_s(),
            "live": self.presence.live_members(),  # the group's quorum: sync.group_live
            "weight_average": self._brings_average,  # guarded.reads_members
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
        self.clock.round_slot = self.clock.next_round_at
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
        clock = self.clock
        steps_left = max(clock.next_round_at - time.time(), 0.0) / max(clock.step_s, 1e-3)
        scale = 1.0 + steps_left * tokens_per_step / max(self.round_tokens, 1)
        clock.round_slot = clock.next_round_at
        self.averager.prepare(
            claimed_tokens(self.cfg.attack, float(self.round_tokens) * scale),
            self._round_info(stats, scale),
            clock.round_slot,
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
        clock = self.clock
        if clock.period_s:  # the next slot on the shared clock, after this round's
            clock.next_round_at = next_slot(max(clock.round_slot, time.time()), clock.period_s)
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
        if wait and av.awaiting_trigger:  # waited for (the run's end): at its slot, as the
            while not av.done() and time.time() < self.clock.round_slot:  # others trigger it
                time.sleep(0.01)  # (before it, the group's start timeouts would run out first)
            if not av.done():
                self._trigger_round()
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
        else:
            self._apply(result, record)
        self.rounds_ended += 1  # applied, lost, or this peer out of sync: its state is final

    def _lose_round(self, why: str, record: dict[str, Any]) -> None:
        """Nothing applied: the progress stays in the model and goes with the next round."""
        record["failed_round_s"] = time.perf_counter() - self._round_started
        record["round_attempts"] = self.averager.attempts if self.averager is not None else 0
        self.failed_rounds += 1
        self.outcomes.append(False)
        if why.endswith(NO_ONE):  # the next round in H steps, as if this one landed: the rounds a
            # member is left out of are this peer's rounds, not its steps
            self._idle_steps = self.clock.sync_every
        self._shift(0.0)
        log.info("round %d: %s; its progress goes with the next round", self.round, why)

    def _apply(self, result: RoundResult, record: dict[str, Any]) -> None:
        assert self.averager is not None
        round_s = time.perf_counter() - self._round_started
        if result.in_sync:  # kept, whatever comes of the round: whom a failed round held
            record["round_members"] = [
                [_member_name(g), bool(ok)]
                for g, ok in zip(result.peers, result.in_sync, strict=False)
            ]
        if any(result.read_only):  # read, its update left out of the average (probation.py)
            record["round_read_only"] = [
                _member_name(g) for g, ro in zip(result.peers, result.read_only, strict=False) if ro
            ]
        if not result.self_in_sync:
            self._shift(0.0)
            self.resync.start(result)
            return
        need = needed_in_sync(
            group_live(result.peers),
            self.cfg.defend and self.membership is not None,
            self.cfg.target_group_size,
        )
        why = why_not_applied(result.in_sync, need, self._final)
        if why:
            self._lose_round(why, record)
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
            self.presence.round_changed.set()
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
        record_landed(self, result, record, round_s)

    # --- bookkeeping ------------------------------------------------------------------------------

    def _weights_replaced(self) -> None:
        """The model's weights were replaced, not moved by a round: the runner derives again
        what it copies from them, and the trainer restarts its weight average from them."""
        self.runner.parameters_written()
        self.on_replaced()

    def shutdown(self) -> None:
        self.presence.stop_publishing()
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


def _member_name(metadata: Any) -> str:
    """The name a member told its group (the round's record; bench attack matches on it)."""
    return str(metadata.get("name", ""))[:64] if isinstance(metadata, dict) else ""
