"""Poisoned contributions, for `atomtrain bench attack` only: what a malicious peer might send.

A peer run with `--peer.attack=KIND` trains normally but replaces what it contributes to each
round. The defences (peer/robust.py) must keep these from reaching the honest peers' parameters.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import replace
from typing import Any

import torch

from atomtrain.errors import AtomError

ATTACKS = (
    "nan",
    "scale",
    "noise",
    "stale",
    "sign_flip",
    "alie",
    "ipm",
    "label_flip",
    "push",
    "inflate",
    "sybil",
    "dht_overwrite",
    "stall",
    "forge_gather",
    "lying_reducer",
    "lying_auditor",
)
"""`push`: the update pushed far in one fixed direction, inside the radius a reducer drops
beyond; `inflate`: the same push, claiming a million times the tokens trained on; `sybil`: a
process that takes part under a new peer ID with its member's certificate (and signing key),
sending sign-flipped updates; `dht_overwrite`: a member that trains honestly and writes over
every other peer's status and certificate in the DHT; `stall`: a member that joins each round's
group and then goes silent (its averager frozen past the round's timeout); `forge_gather`: a
member that trains honestly and, whenever it leads a group, sends its followers another member's
metadata rewritten (a thousand times the rms and weight it claimed), under that member's
signature; `lying_reducer`: a member that trains and sends honestly and, reducing its span of
each round, moves the average it returns in one fixed direction by about as much as members
accept (lie_sizes; of fewer than three in sync, returns an average in that direction as large as
the pair check accepts), the same average to every member (no member's copy differs from
another's);
`lying_auditor`: a member that trains, sends and reduces honestly and, auditing a span
(audit.py), tells every member that asks for its verdict projections 10% off the true ones, so
that an honest reducer's round is discarded."""
SLANDER = 1.1
"""`lying_auditor` multiplies the projections it reports by this."""
LIE_FRACTION = 0.75
"""A lying reducer moves its span's average by this share of what members accept from a reducer
(bounds.reducer_bounds, three or more members in sync: `factor` times a typical update and
their own part, about 2 * factor typical updates for a member whose update is typical), as a
reducer that knows the check would."""


def lie_sizes(factor: float) -> float:
    """`lying_reducer`: how far, in typical updates, it moves its span's average when members
    check it at `factor`."""
    return LIE_FRACTION * 2 * factor


ALIE_Z = 1.0
"""How many honest standard deviations "a little is enough" (Baruch et al., 2019) moves each
coordinate: z = 1, as in its evaluations, where the rule max over (n - s)/n gives z <= 0 for a
swarm this small."""
IPM_EPSILON = 0.1
"""Inner-product manipulation (Xie et al., 2020) sends -epsilon times the honest mean."""
PUSH_SIZES = 15.0
"""A directed push moves the update this many of its own sizes in one fixed direction: inside
the bound beyond which a reducer drops a part (bounds.Defence.reject), so it is clipped, never
dropped."""
INFLATED_TOKENS = 1e6
"""An inflating peer claims this many times the tokens it trained on (more weight, if weights
followed claims)."""


def check_attack(kind: str) -> None:
    if kind and kind not in ATTACKS:
        raise AtomError(f"--peer.attack must be one of {', '.join(ATTACKS)}, got {kind!r}")


def poison(kind: str, delta: torch.Tensor) -> torch.Tensor:
    """A piece of the pseudo-gradient as the attacker sends it. (`stale` changes what the
    update is made from instead: the runtime computes it against the initial parameters.)"""
    if kind == "nan":  # not-a-number everywhere in the update
        return torch.full_like(delta, float("nan"))
    if kind == "scale":  # the honest update, a million times larger
        return delta * 1e6
    if kind == "noise":  # random noise a hundred times the size of an honest update
        rms = float(delta.pow(2).mean().sqrt()) or 1e-3
        return torch.randn_like(delta) * (100 * rms)
    if kind in ("push", "inflate"):  # the same direction every round (seeded by the piece's size)
        direction = torch.randn(delta.shape, generator=torch.Generator().manual_seed(delta.numel()))
        size = float(delta.float().norm()) or 1e-3
        return delta + direction.to(delta) * (PUSH_SIZES * size / float(direction.norm()))
    if kind in ("sign_flip", "sybil"):  # the honest update, reversed
        return -delta
    if kind == "alie":
        # the attacker's own update estimates the honest mean and |update| each coordinate's
        # spread; every coordinate moved z spreads down: inside the honest range, all one way
        return delta - ALIE_Z * delta.abs()
    if kind == "ipm":
        return delta * -IPM_EPSILON
    return delta  # label_flip poisons the data (LabelFlippedLoader), not the update


class LabelFlippedLoader:
    """A training loader whose every target token t is trained on as vocab - 1 - t (the classic
    label flip, token by token): the attacker's update is then honestly computed from poisoned
    data. Everything else (state, echo statistics) is the wrapped loader's."""

    def __init__(self, loader: Any, vocab_size: int) -> None:
        self._loader, self._vocab_size = loader, vocab_size

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self._loader.next_batch()
        return x, (self._vocab_size - 1) - y

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def overwrite_records(dht: Any, swarm: str, own_certificate: str, own_subkey: bytes) -> None:
    """`dht_overwrite`: every other member's status and certificate record written over, under
    its writer's subkey with a later expiry: statuses that say their peer is far ahead and done,
    this member's certificate in place of theirs. (This peer's own DHT node signs nothing that
    is not its own; the nodes that store the records decide.)"""
    from hivemind.utils.timed_storage import get_dht_time

    from atomtrain.peer.auth import members_key
    from atomtrain.peer.status import status_key

    later = get_dht_time() + 600

    def forged_status(value: Any) -> Any:
        return (
            {**value, "round": 10**6, "done": True, "finishing": True}
            if isinstance(value, dict)
            else value
        )

    for key, forge in (
        (status_key(swarm), forged_status),
        (members_key(swarm), lambda _: own_certificate),
    ):
        found = dht.get(key, latest=True)
        if found is None or not isinstance(found.value, dict):
            continue
        for subkey, item in found.value.items():
            if subkey == own_subkey:
                continue
            dht.store(
                key, forge(getattr(item, "value", None)), later, subkey=subkey, return_future=True
            )


def claimed_tokens(kind: str, tokens: float) -> float:
    """What a peer tells its group it trained on."""
    return tokens * INFLATED_TOKENS if kind == "inflate" else tokens


def stall_rounds(peer: Any, stop: threading.Event) -> None:
    """`stall`, run in a thread of the attacker: whenever its averager has found a group, freeze
    the averager's process (SIGSTOP) for longer than the round's timeout, then let it go on."""
    while not stop.wait(0.01):
        averager = peer.averager
        if (
            averager is None
            or not averager.running
            or not averager.group_found()
            or averager.done()
        ):
            continue
        pid = averager.averager.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            stop.wait(peer.cfg.averaging_timeout_s + 2.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        while averager.running and not averager.done() and not stop.wait(0.05):
            pass  # the spoiled round ends before the next one is stalled


FORGED_FACTOR = 1e3
"""`forge_gather` multiplies the victim's claimed rms and weight by this."""


def forge_gathered(message: Any, leader: Any) -> None:
    """`forge_gather`, in the leader's averager: rewrite, in the group's metadata it sends a
    follower (hivemind's BEGIN_ALLREDUCE message), the first other member's claimed rms and
    weight, keeping that member's signature (a leader cannot make a new one)."""
    from hivemind.p2p import PeerID
    from hivemind.utils.serializer import MSGPackSerializer as Serializer

    from atomtrain.peer.gather import unseal

    for i, peer in enumerate(message.ordered_peer_ids):
        if PeerID(peer) == leader:
            continue
        sealed = unseal(message.gathered[i])
        data = sealed.data if sealed is not None else message.gathered[i]
        bandwidth, mode, user = Serializer.loads(data)
        info = Serializer.loads(user)
        for field in ("rms", "weight"):
            info[field] = float(info.get(field, 1.0)) * FORGED_FACTOR
        data = Serializer.dumps([bandwidth, mode, Serializer.dumps(info)])
        message.gathered[i] = replace(sealed, data=data).pack() if sealed is not None else data
        return
