"""Poisoned contributions, for `atomtrain bench attack` only: what a malicious peer might send.

A peer run with `--peer.attack=KIND` trains normally but replaces what it contributes to each
round. The defences (peer/robust.py) must keep these from reaching the honest peers' parameters.
"""

from __future__ import annotations

import torch

from atomtrain.errors import AtomError

ATTACKS = ("nan", "scale", "noise", "stale", "push")
PUSH_SIZES = 15.0
"""A directed push moves the update this many of its own sizes in one fixed direction: inside
the bound beyond which a reducer drops a part (robust.Defence.reject), so it is clipped, never
dropped."""
INFLATED_TOKENS = 1e6
"""A pushing peer claims this many times the tokens it trained on (more weight, if weights
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
    if kind == "push":  # the same direction every round (seeded by the piece's size)
        direction = torch.randn(delta.shape, generator=torch.Generator().manual_seed(delta.numel()))
        size = float(delta.float().norm()) or 1e-3
        return delta + direction.to(delta) * (PUSH_SIZES * size / float(direction.norm()))
    return delta


def claimed_tokens(kind: str, tokens: float) -> float:
    """What a peer tells its group it trained on."""
    return tokens * INFLATED_TOKENS if kind == "push" else tokens
