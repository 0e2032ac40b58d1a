"""The peer's state saved with a checkpoint, and taken in: from a checkpoint as the peer resumes,
or downloaded (resync.py serves it), the model replaced by it or moved to it with its local
progress kept."""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import torch

from atomtrain.errors import AtomError
from atomtrain.peer.layout import assign
from atomtrain.peer.rounds import move_to, own_share_step, shift_by
from atomtrain.peer.state import swarm_schedule_step

if TYPE_CHECKING:
    from atomtrain.peer.runtime import PeerRuntime

log = logging.getLogger(__name__)


def take_state(peer: PeerRuntime, meta: dict, tensors: list[torch.Tensor], mode: str) -> None:
    """Take a state. `resume`: a checkpoint's (the model is already loaded); `replace`: a
    download the model moves to (joining, or the last round's result); `resync`: a download
    the model moves to keeping the local progress it made since its own last sync."""
    if len(tensors) != 2 or any(t.numel() != peer.numel for t in tensors):
        raise AtomError("peer state does not match this model's parameters")
    params = peer.runner.host_parameters()
    with peer.lock:
        new = tensors[0].float().reshape(-1)
        if mode == "resync":
            peer.on_moved(partial(shift_by, pieces=peer.pieces, theta=peer.theta_sync, new=new))
            move_to(params, peer.pieces, peer.theta_sync, new)
        else:
            peer.theta_sync.copy_(new)
        if mode == "replace":
            assign(params, peer.pieces, peer.theta_sync)
        peer.outer.buf.copy_(tensors[1].float().reshape(-1))
        peer.round = int(meta["round"])
        peer.presence.round_changed.set()
        peer._sketch = peer.sketcher.of(peer.theta_sync)
    if mode == "resync":
        peer.runner.parameters_written()
    elif mode != "resume":
        peer._weights_replaced()
    if mode != "resume" and peer.train_state is not None:
        # the learning-rate schedule follows the swarm's progress, not this peer's steps:
        # where the live members' schedules stand, not where the serving peer says
        step = swarm_schedule_step(
            meta.get("step"),
            meta.get("round"),
            peer.presence.known_others,
            peer.total_steps,
            peer._schedule_step,
        )
        peer.train_state.schedule_offset = step - peer.train_state.step
        peer._schedule_step = step


def checkpoint_state(peer: PeerRuntime) -> tuple[dict, dict[str, torch.Tensor]]:
    """For checkpoints: round counter, synchronized parameters, outer momentum. Taken while
    an overlapped round runs, the model holds that round's shift (rounds.py); the saved
    synchronized parameters carry it too, so theta - x is still all the progress no landed
    round holds, and a resumed peer sends it all."""
    with peer.lock:
        theta = peer.theta_sync.clone()
        if peer._share > 0 and peer.averager is not None:
            owns = peer.averager.contributions()
            for piece, own in zip(peer.pieces, owns, strict=True):
                sl = slice(piece.offset, piece.offset + piece.numel)
                m = peer.outer.buf[sl]
                e = own_share_step(own, m, peer.cfg.outer_lr, peer.cfg.outer_momentum, peer._share)
                theta[sl].add_(own.float() - e)
        return (
            {"peer_round": peer.round},
            {"peer/theta_sync": theta, "peer/momentum": peer.outer.buf.clone()},
        )
