"""Poisoned contributions, for `atomtrain bench attack` only: what a malicious peer might send.

A peer run with `--peer.attack=KIND` trains normally but replaces what it contributes to each
round. The defences (peer/robust.py) must keep these from reaching the honest peers' parameters.
"""

from __future__ import annotations

import torch

from atomtrain.errors import AtomError

ATTACKS = ("nan", "scale", "noise", "stale")


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
    return delta
