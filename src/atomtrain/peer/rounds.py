"""The arithmetic of a round, piece by piece over the host parameters: what a peer contributes,
and how an averaged round moves its synchronized parameters, outer momentum and model.

With the synchronized parameters theta, the model's parameters x and the contribution
q = compress(theta - x) sent at the round's start, a round that averaged to `a` does

    m     <- mu * m + a
    s      = lr * (a + mu * m)          (DiLoCo's outer Nesterov step)
    theta <- theta - s
    x     <- x + q - s

so the model ends at the new synchronized parameters plus the local progress made while the
round ran, minus what compression did not send (error feedback: the next round's pseudo-gradient
carries it). No flat copy of the model is made: every vector is touched one piece at a time.

Overlapped rounds (the runtime's default) do not leave the model at theta - q while the round
runs: a peer that kept its whole contribution would train on, for the round's duration, from a
point that holds its own drift undiluted, and measured that way (a simulation of 2 and 4
workers, a round landing 9 steps after it started, every 10 steps) averaging gained nothing over
one worker. Instead, at the round's start the model takes the step its own share of the group
would make, e = outer step of share * q (share = 1 / expected group size), and the round's
landing corrects that estimate to the real step:

    at the start:   x <- x + q - e
    at the landing: x <- x + e - s

which ends where the plain rule ends (x + q - s), with the drift diluted while the round runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from atomtrain.peer.layout import SKETCH_SIZE, Piece, Sketcher, param_slice


@dataclass
class Contribution:
    """Statistics of what a peer sent, for the group's checks."""

    sumsq: float = 0.0
    sketch: list[float] = field(default_factory=lambda: [0.0] * SKETCH_SIZE)

    def rms(self, numel: int) -> float:
        return math.sqrt(self.sumsq / max(numel, 1))

    def size(self) -> float:
        """RMS of the contribution's sketch: the measure sync.py compares sketches in."""
        return math.sqrt(sum(x * x for x in self.sketch) / len(self.sketch))


def write_contribution(
    params: Mapping[str, torch.Tensor],
    theta: torch.Tensor,
    piece: Piece,
    out: torch.Tensor,
    sketcher: Sketcher,
    stats: Contribution,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """out <- theta - x for one piece (rounded to out's dtype), and its statistics.
    `transform` replaces the honest value (the attack benchmark's poisoned peers only)."""
    current = param_slice(params, piece).float().cpu()
    ref = theta[piece.offset : piece.offset + piece.numel]
    value = ref - current
    out.copy_(transform(value) if transform is not None else value)
    sent = out.float()
    stats.sumsq += float(sent.double().pow(2).sum())
    sketcher.accumulate(stats.sketch, piece.offset, sent)


def own_share_step(
    own: torch.Tensor, momentum: torch.Tensor, lr: float, mu: float, share: float
) -> torch.Tensor:
    """The outer step (float32) a round would make if the group averaged to `share * own`."""
    a = own.float().mul_(share)
    return a.mul_(1 + mu).add_(momentum, alpha=mu * mu).mul_(lr)


@torch.no_grad()
def shift_to_own_share(
    params: Mapping[str, torch.Tensor],
    pieces: list[Piece],
    owns: list[torch.Tensor],
    momentum: torch.Tensor,
    lr: float,
    mu: float,
    share: float,
    undo: bool = False,
) -> None:
    """At an overlapped round's start, x <- x + q - e (see the module docstring); with `undo`,
    the reverse, for a round that will not land."""
    for piece, own in zip(pieces, owns, strict=True):
        sl = slice(piece.offset, piece.offset + piece.numel)
        shift = own.float().sub_(own_share_step(own, momentum[sl], lr, mu, share))
        x = param_slice(params, piece)
        x.sub_(shift.to(x)) if undo else x.add_(shift.to(x))


@torch.no_grad()
def apply_outer_step(
    params: Mapping[str, torch.Tensor],
    pieces: list[Piece],
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    theta: torch.Tensor,
    momentum: torch.Tensor,
    lr: float,
    mu: float,
    final: bool,
    share: float = 0.0,
) -> None:
    """Apply an averaged round in place (see the module docstring). The final round of a run
    averages the parameters themselves (theta <- theta - a, x <- theta), so every finisher
    ends with the same model. `share` > 0: the round started with shift_to_own_share."""
    for piece, (avg, own) in zip(pieces, pairs, strict=True):
        sl = slice(piece.offset, piece.offset + piece.numel)
        a = avg.float()
        x = param_slice(params, piece)
        if final:
            theta[sl].sub_(a)
            x.copy_(theta[sl].to(x))
            continue
        m = momentum[sl]
        taken = own_share_step(own, m, lr, mu, share) if share > 0 else own.float()
        if mu:
            m.mul_(mu).add_(a)
            a.add_(m, alpha=mu)
        else:  # plain averaging keeps no momentum: zeros (also one resumed from a run with mu)
            m.zero_()
        step = a.mul_(lr)  # a is a fresh float32 copy: reuse it
        theta[sl].sub_(step)
        x.add_((taken - step).to(x))


@torch.no_grad()
def move_to(
    params: Mapping[str, torch.Tensor], pieces: list[Piece], theta: torch.Tensor, new: torch.Tensor
) -> None:
    """Re-synchronize: x <- x + (new - theta), theta <- new, keeping the local progress."""
    shift_by(params, pieces, theta, new)
    theta.copy_(new)


def shift_by(
    params: Mapping[str, torch.Tensor], pieces: list[Piece], theta: torch.Tensor, new: torch.Tensor
) -> None:
    """x <- x + (new - theta), piece by piece, for the pieces `params` holds (a weight average
    holds the floating-point parameters only)."""
    for piece in pieces:
        if piece.name not in params:
            continue
        sl = slice(piece.offset, piece.offset + piece.numel)
        x = param_slice(params, piece)
        x.add_((new[sl] - theta[sl]).to(x))
