"""One peer of a swarm: local steps as usual, and every H steps a background averaging round.

A round averages the pseudo-gradient (parameters at the last sync minus parameters now) with
whoever is present, weighted by the tokens each processed since its last round, and applies
DiLoCo's outer Nesterov step. The round runs in hivemind's processes while local training goes
on; when it lands, the peer moves to the new synchronized parameters *plus* the local progress it
made meanwhile, so no local step ever waits for the network and none is lost. A round that finds
no group, breaks, or comes back partly averaged is applied as a round of one (own pseudo-gradient
only, never a half-averaged vector).
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import torch
from hivemind import DHT

from atomtrain.config import PeerSection
from atomtrain.errors import AtomError
from atomtrain.peer.attack import check_attack, poison
from atomtrain.peer.auth import MemberGate, SwarmAuthorizer, declare_member, load_swarm_key
from atomtrain.peer.averaging import ProbedAverager, RoundFailed, RoundResult
from atomtrain.peer.hygiene import start_watchdog
from atomtrain.peer.outer import OuterNesterov
from atomtrain.peer.robust import Defence, lower_median
from atomtrain.peer.status import PeerStatus, publish, read_statuses
from atomtrain.train.runner import StepRunner
from atomtrain.train.trainer import TrainState

log = logging.getLogger(__name__)
# hivemind logs a failed round as an error with a traceback; the runtime reports it in one line.
logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)
# ...and its DHT requests that time out on a slow link surface as unretrieved asyncio errors.
logging.getLogger("asyncio").setLevel(logging.CRITICAL)

PUBLISH_EVERY_S = 1.0
LINGER_S = 10.0
FIRST_ROUND_AFTER_STEPS = 3
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


def digest(flat: torch.Tensor) -> str:
    """Short fingerprint of a flat parameter vector, for logs that tests compare."""
    import hashlib

    return hashlib.sha256(flat.contiguous().numpy().tobytes()).hexdigest()[:16]


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
        self.names = sorted(params)
        self.numel = sum(params[n].numel() for n in self.names)
        self.theta_sync = self._flat()
        check_attack(cfg.attack)
        self._initial = self.theta_sync.clone() if cfg.attack == "stale" else None
        self.key = load_swarm_key(cfg.swarm_key)
        self.rejected: dict[str, str] = {}  # peers whose contributions were rejected: why
        self.outer = OuterNesterov(self.numel, cfg.outer_lr, cfg.outer_momentum)
        self.round = 0
        self.failed_rounds = 0
        self.round_tokens = 0
        self.steps_since_round = 0
        self.snapshot: torch.Tensor | None = None
        self._final = False
        self._finishing = False
        self._done = False
        self.last_sync = 0.0
        self.first_contribution_s: float | None = None
        import psutil

        self.started_at = psutil.Process().create_time()  # joining time counts from launch
        self._step = 0
        self._last_loss = float("nan")
        self._tokens_per_s = 0.0
        self.dht: DHT | None = None
        self.averager: ProbedAverager | None = None
        self.watchdog: subprocess.Popen | None = None

    # --- flat views of the host parameters ------------------------------------------------------

    def _flat(self) -> torch.Tensor:
        params = self.runner.host_parameters()
        return torch.cat([params[n].detach().reshape(-1).float().cpu() for n in self.names])

    @torch.no_grad()
    def _assign(self, flat: torch.Tensor) -> None:
        params = self.runner.host_parameters()
        pos = 0
        for n in self.names:
            p = params[n]
            p.copy_(flat[pos : pos + p.numel()].view_as(p).to(p))
            pos += p.numel()

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self, resumed: dict[str, Any] | None) -> None:
        """Join the swarm: start the DHT and averager, then take the swarm's state if needed."""
        self.joined_at = time.time()  # joining begins: the DHT starts
        self.watchdog = start_watchdog()
        initial = [a.strip() for a in self.cfg.join.split(",") if a.strip()]
        if self.key is None:
            log.warning(
                "swarm %s is open: any peer that reaches this one can join it "
                "(make a key with `atomtrain keygen` and pass --swarm-key)",
                self.cfg.swarm,
            )
        else:
            log.info("swarm key %s: only peers holding it take part", self.key.fingerprint())
        try:
            self.dht = DHT(
                initial_peers=initial,
                host_maddrs=[f"/ip4/{self.cfg.host}/tcp/{self.cfg.port}"],
                start=True,
                authorizer=SwarmAuthorizer(self.key) if self.key else None,
            )
        except Exception as e:
            if initial and "bootstrap failed" in str(e):
                raise AtomError(
                    "cannot join the swarm: no peer accepted this one (does the swarm use "
                    "another key, or none? is a peer running at --join?)"
                ) from None
            raise AtomError(f"cannot start the swarm ({type(e).__name__}: {e})") from None
        declare_member(self.dht, self.cfg.swarm, self.key, self.dht.peer_id, wait=True)
        self.averager = ProbedAverager(
            self.dht,
            f"{self.cfg.swarm}_avg",
            self.numel,
            self.cfg.compression,
            self.cfg.matchmaking_s,
            self.cfg.averaging_timeout_s,
            self.cfg.target_group_size,
            self._shared_state,
            MemberGate(self.key, self.cfg.swarm),
            Defence(min_scale=self.lr * MIN_SCALE_STEPS) if self.cfg.defend else None,
        )
        if resumed is not None:
            self._load(resumed["meta"], resumed["tensors"])
            log.info("resumed at round %d from the checkpoint", self.round)
        if initial:
            self._catch_up()
        self._write_addrs()
        self._stop_publishing = threading.Event()
        self._publisher = threading.Thread(
            target=self._publish_loop, daemon=True, name="atom-status"
        )
        self._publisher.start()
        self._wait_for_peers()

    def _publish_loop(self) -> None:
        """Publishes every second from its own thread, so a peer stays visibly alive while its
        main thread waits (for a round, or for the others at the end)."""
        while not self._stop_publishing.wait(PUBLISH_EVERY_S):
            try:
                self._publish(self._step)
                if self.dht is not None:
                    declare_member(self.dht, self.cfg.swarm, self.key, self.dht.peer_id)
            except Exception as e:  # the DHT going away at shutdown
                log.debug("status not published: %s", e)

    def _wait_for_peers(self) -> None:
        assert self.dht is not None
        deadline = time.time() + 60.0
        while self.cfg.wait_for > 1 and time.time() < deadline:
            present = len(read_statuses(self.dht, self.cfg.swarm))
            if present >= self.cfg.wait_for:
                return
            time.sleep(0.5)
        if self.cfg.wait_for > 1:
            log.warning("only some of %d peers arrived; training anyway", self.cfg.wait_for)

    def _write_addrs(self) -> None:
        assert self.dht is not None
        addrs = [str(a) for a in self.dht.get_visible_maddrs()]
        self.addrs = addrs
        (self.run_dir / "peer.json").write_text(
            __import__("json").dumps({"name": self.name, "addrs": addrs})
        )
        log.info("peer %s listening; others join with --join %s", self.name, addrs[0])

    def _catch_up(self) -> None:
        """Download the swarm's state when this peer is new or behind."""
        assert self.dht is not None and self.averager is not None
        swarm_round = self._swarm_round()
        if self.round > 0 and self.round >= swarm_round:
            return
        for _ in range(6):  # a fresh swarm may not have declared its state yet
            state = self.averager.download_state(timeout_s=self.cfg.state_timeout_s)
            problem = "no peer shared it" if state is None else self._state_problem(*state)
            if problem is None:
                assert state is not None
                self._load(*state)
                log.info(
                    "joined at round %d with the swarm's parameters (parameters %s)",
                    self.round,
                    digest(self._flat()),
                )
                return
            if state is not None:
                log.warning("refused a downloaded state: %s", problem)
            time.sleep(1.0)
        log.warning("no peer shared a valid state; starting from this peer's own parameters")

    def _swarm_round(self) -> int:
        """The round most live peers are at (the median: one peer cannot claim a false one)."""
        assert self.dht is not None
        return int(lower_median([s.round for s in read_statuses(self.dht, self.cfg.swarm)]))

    def _state_problem(self, meta: Any, tensors: list[torch.Tensor]) -> str | None:
        """Why a downloaded state must not be used, or None when it passes every check."""
        if not isinstance(meta, dict) or not isinstance(meta.get("round"), int):
            return "malformed metadata"
        if len(tensors) != 2:
            return f"{len(tensors)} tensors instead of 2"
        for t in tensors:
            if t.dtype != torch.float32 or t.shape != (self.numel,):
                return f"a tensor of {t.dtype} {tuple(t.shape)}, expected float32 ({self.numel},)"
            if not bool(torch.isfinite(t).all()):
                return "non-finite values"
        if self.cfg.defend and meta["round"] < self._swarm_round() - 1:
            return f"the serving peer is behind (round {meta['round']})"
        return None

    def _shared_state(self) -> tuple[dict, list[torch.Tensor]]:
        """What a joiner downloads: the synchronized parameters, outer momentum and round."""
        theta, momentum = self.theta_sync.clone(), self.outer.buf.clone()
        log.info("served the state of round %d (parameters %s)", self.round, digest(theta))
        return {"round": self.round, "numel": self.numel}, [theta, momentum]

    def _load(self, meta: dict, tensors: list[torch.Tensor]) -> None:
        if len(tensors) != 2 or any(t.numel() != self.numel for t in tensors):
            raise AtomError("peer state does not match this model's parameters")
        self.theta_sync = tensors[0].float().clone()
        self.outer.buf = tensors[1].float().clone()
        self.round = int(meta["round"])
        self._assign(self.theta_sync)

    def extra_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """For checkpoints: round counter, synchronized parameters, outer momentum."""
        return (
            {"peer_round": self.round},
            {"peer/theta_sync": self.theta_sync.clone(), "peer/momentum": self.outer.buf},
        )

    # --- rounds ---------------------------------------------------------------------------------

    def after_step(self, state: TrainState, record: dict[str, Any]) -> None:
        self.steps_since_round += 1
        self.round_tokens += int(record.get("tokens_step", 0))
        self._last_loss = float(record["loss"])
        self._tokens_per_s = float(record.get("tokens_per_s", 0.0))
        self._poll(record, wait=False)
        last = state.step >= self.total_steps
        if last and self.cfg.final_sync:
            self._final_round(record)
        elif (
            self.averager is not None
            and not self.averager.running
            and self.steps_since_round >= self._next_round_after()
        ):
            self._start_round()
        record["round"] = self.round
        self._step = state.step

    def _next_round_after(self) -> int:
        """Local steps before the next round: a newcomer contributes after a few steps rather
        than a whole period, so joining pays off sooner."""
        if self.first_contribution_s is None:
            return min(self.cfg.sync_every, FIRST_ROUND_AFTER_STEPS)
        return self.cfg.sync_every

    def _start_round(self) -> None:
        assert self.averager is not None
        theta = self._flat()
        self.snapshot = theta
        delta = self.theta_sync - theta
        delta, sync = poison(self.cfg.attack, delta, self.theta_sync, self._initial)
        self.averager.start(
            delta,
            sync,
            float(self.round_tokens),
            {"name": self.name, "round": self.round, "tokens": self.round_tokens},
        )
        self._round_started = time.time()
        self.steps_since_round = 0
        self.round_tokens = 0

    def _poll(self, record: dict[str, Any], wait: bool) -> None:
        av = self.averager
        if av is None or not av.running:
            return
        try:
            self._poll_round(av, record, wait)
        finally:
            self._note_rejections(record)

    def _note_rejections(self, record: dict[str, Any]) -> None:
        if self.averager is None:
            return
        events = self.averager.rejections()
        if events and self.dht is not None:
            names = {s.peer_id: s.name for s in read_statuses(self.dht, self.cfg.swarm)}
            events = [(names.get(peer, peer), why) for peer, why in events]
        for peer, why in events:
            if peer not in self.rejected:
                self.rejected[peer] = why
                log.warning(
                    "rejected the contributions of %s (%s); ignoring it from now", peer, why
                )
        if self.rejected:
            record["rejected_peers"] = sorted(self.rejected)

    def _poll_round(self, av: ProbedAverager, record: dict[str, Any], wait: bool) -> None:
        deadline = self._round_started + self.cfg.averaging_timeout_s + 5.0
        while wait and not av.done() and time.time() < deadline:
            time.sleep(0.05)
        if not av.done():
            if time.time() < deadline:
                return
            av.cancel()
            self._apply_solo("round timed out", record)
            return
        try:
            result = av.result()
        except RoundFailed as e:
            self._apply_solo(str(e), record)
            return
        self._apply(result, record)

    def _apply_solo(self, why: str, record: dict[str, Any]) -> None:
        assert self.snapshot is not None
        self.failed_rounds += 1
        log.info("round %d: %s; applying this peer's own update", self.round, why)
        delta = self.theta_sync - self.snapshot
        self._apply(RoundResult(delta, self.theta_sync, 1, []), record)

    @torch.no_grad()
    def _apply(self, result: RoundResult, record: dict[str, Any]) -> None:
        assert self.snapshot is not None
        if self._final:  # the last round averages the parameters themselves, no extrapolation
            new_sync = result.theta_sync - result.delta
        else:
            new_sync = self.outer.step(result.theta_sync, result.delta)
        drift = self._flat() - self.snapshot  # local progress made while the round ran
        self.theta_sync = new_sync
        self._assign(new_sync + drift)
        self.snapshot = None
        self.round += 1
        self.last_sync = time.time()
        if self.averager is not None:  # joiners ask the most advanced peer first
            self.averager.averager.state_sharing_priority = float(self.round)
        if result.group_size > 1 and self.first_contribution_s is None:
            self.first_contribution_s = self.last_sync - self.started_at
            record["first_contribution_s"] = self.first_contribution_s
            record["first_contribution_since_join_s"] = self.last_sync - self.joined_at
        record["group_size"] = result.group_size
        log.debug("round %d applied with %d peers", self.round, result.group_size)

    def _final_round(self, record: dict[str, Any]) -> None:
        """Finish the running round; wait (bounded) until every live peer is finishing too, then
        all average their parameters in one last round and end up with the same ones."""
        av = self.averager
        if av is not None and av.running:
            # Let the open round end on its own (bounded by its timeout). Cancelling it is not
            # enough: an all-reduce already under way goes on in hivemind's process, and the
            # others would average this peer's round while it applied only its own update.
            self._poll(record, wait=True)
        if self.averager is None or self.dht is None:
            return
        self._finishing = True
        deadline = time.time() + self.cfg.final_wait_s
        others: list[PeerStatus] = []
        while time.time() < deadline:
            others = self._live_others()
            if all(s.finishing for s in others):
                break
            time.sleep(0.25)
        if not others:
            log.info("no other live peer at the end; keeping this peer's parameters")
            return
        self._final = True
        self._start_round()
        self._poll(record, wait=True)
        if record.get("group_size", 1) > 1:
            self._linger(others)
        else:  # left out of the others' last group: take its result from one of them
            self._adopt_final_state(record)

    def _linger(self, others: list[PeerStatus]) -> None:
        """Stay a few seconds after the last round, serving its result to any peer that the
        group left out, until every other live peer is done."""
        assert self.dht is not None
        self._done = True
        # long enough for a left-out peer's own last round to time out and ask for the result
        deadline = time.time() + self.cfg.averaging_timeout_s + LINGER_S
        while time.time() < deadline:
            if all(s.done for s in self._live_others()):
                return
            time.sleep(0.25)

    def _live_others(self) -> list[PeerStatus]:
        """The other peers whose status is fresh."""
        assert self.dht is not None
        now = time.time()
        return [
            s
            for s in read_statuses(self.dht, self.cfg.swarm)
            if s.name != self.name and s.fresh(now)
        ]

    def _adopt_final_state(self, record: dict[str, Any]) -> None:
        assert self.averager is not None
        state = self.averager.download_state(timeout_s=self.cfg.state_timeout_s)
        problem = "no peer shared it" if state is None else self._state_problem(*state)
        if problem is not None or state is None:
            log.warning("left out of the last round and took no result: %s", problem)
            return
        self._load(*state)
        record["adopted_final_state"] = True
        log.info(
            "left out of the last round; took its result (parameters %s)", digest(self._flat())
        )
        self._done = True

    def _publish(self, step: int) -> None:
        now = time.time()
        if self.dht is None:
            return
        publish(
            self.dht,
            self.cfg.swarm,
            self.name,
            PeerStatus(
                name=self.name,
                round=self.round,
                step=step,
                loss=self._last_loss,
                tokens_per_s=self._tokens_per_s,
                last_sync=self.last_sync,
                failed_rounds=self.failed_rounds,
                addrs=tuple(getattr(self, "addrs", ())[:2]),
                updated=now,
                finishing=self._finishing,
                done=self._done,
                rejected=tuple(sorted(self.rejected))[:16],
                peer_id=self.dht.peer_id.to_base58(),
            ),
        )

    def shutdown(self) -> None:
        if getattr(self, "_publisher", None) is not None:
            self._stop_publishing.set()
            self._publisher.join(timeout=5)
        if self.averager is not None:
            self.averager.shutdown()
            _reap(self.averager.averager)
            self.averager = None
        if self.dht is not None:
            self.dht.shutdown()
            _reap(self.dht)
            self.dht = None
        # The watchdog stays: once this process exits it kills whatever helper is left (p2pd).
