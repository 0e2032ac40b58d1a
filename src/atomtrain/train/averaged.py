"""An exponential moving average of the weights (`train.ema`): what the run validates, saves
beside its checkpoints and exports.

At a constant or slowly decaying learning rate the weights a run trains move around their
trend with the noise of each step's batch; their moving average follows the trend with much
of that noise averaged away (Polyak averaging), which a validation loss sees as a lower, steadier
curve. The average lives beside the master parameters, on their device, one copy of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from itertools import pairwise

import torch

from atomtrain.errors import AtomError

PREFIX = "ema/"
"""Checkpoint tensors of the average are named `ema/<parameter>`."""

WARMUP = 10
"""Early steps weigh more (decay min(decay, (1 + t) / (WARMUP + t)) at step t, raised to the
power ema_every at an update covering that many steps), so the
average tracks the first steps instead of remembering the initial weights for hundreds of steps:
the decay is 0.9 at update 80 and 0.98 at update 440."""


class WeightAverage:
    """The moving average of `params` (name -> master tensor), updated after every `every`-th
    step by decay**every (one pass over the model each time: `train.ema_every`). `updates`
    counts the steps it covers."""

    def __init__(self, params: dict[str, torch.Tensor], decay: float, every: int = 1) -> None:
        if not 0.0 < decay < 1.0:
            raise AtomError(f"train.ema must be in (0, 1), got {decay}")
        if every < 1:
            raise AtomError(f"train.ema_every must be positive, got {every}")
        self.decay, self.every = decay, every
        self.updates = 0
        check_unaliased(params)
        self.shadow = {n: p.detach().clone() for n, p in params.items() if p.is_floating_point()}
        self._spare: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        for s in self.shadow.values():  # one buffer per kind, the size of its largest tensor
            kind = (s.dtype, s.device)
            if kind not in self._spare or self._spare[kind].numel() < s.numel():
                self._spare[kind] = torch.empty(s.numel(), dtype=s.dtype, device=s.device)

    def due(self, step: int) -> bool:
        """The average is updated after step `step` (counted from 1)."""
        return step % self.every == 0

    def update(self, params: dict[str, torch.Tensor]) -> None:
        """One update, of every parameter at once."""
        self.follow(params)(list(self.shadow))

    def follow(self, params: dict[str, torch.Tensor]) -> Callable[[list[str]], None]:
        """One update, made piecewise: call what this returns with the names of the parameters
        the step wrote, as it writes them (the swap engine's optimizer thread, sub-model by
        sub-model, so the next forward need not wait for every step to end). The update's decay
        is fixed now: a later update does not change it."""
        self.updates += self.every
        ramp = (1 + self.updates) / (WARMUP + self.updates)
        weight = 1.0 - min(self.decay, ramp) ** self.every

        @torch.no_grad()
        def written(names: list[str]) -> None:
            named = [n for n in names if n in self.shadow]
            if named:  # one fused pass (torch's foreach kernel, private but stable since 1.13)
                torch._foreach_lerp_(
                    [self.shadow[n] for n in named], [params[n].detach() for n in named], weight
                )

        return written

    @torch.no_grad()
    def adopt(self, params: dict[str, torch.Tensor]) -> None:
        """The weights become the average (a swarm's last round then averages the peers'
        averages)."""
        for name, s in self.shadow.items():
            params[name].copy_(s)

    @torch.no_grad()
    def restart(self, params: dict[str, torch.Tensor]) -> None:
        """Start again from `params`: the weights were replaced (a swarm's state downloaded, the
        swarm's last round), and an average of the old and new ones is neither."""
        for name, s in self.shadow.items():
            s.copy_(params[name])
        self.updates = 0

    @contextmanager
    def swapped_in(
        self, params: dict[str, torch.Tensor], written: Callable[[], None] = lambda: None
    ) -> Iterator[None]:
        """The parameters hold the average inside the block (and their own values again after
        it): whatever reads the masters (a validation pass, the swap engine) reads the average.
        Exchanged in place, so every reference to a parameter stays valid; `written` is called
        after each exchange (the runner's `parameters_written`)."""
        self._exchange(params)
        try:
            written()
            yield
        finally:
            self._exchange(params)
            written()

    @torch.no_grad()
    def _exchange(self, params: dict[str, torch.Tensor]) -> None:
        for name, s in self.shadow.items():
            p = params[name]
            spare = self._spare[(s.dtype, s.device)][: s.numel()].view_as(s)
            spare.copy_(p)
            p.copy_(s)
            s.copy_(spare)

    def state(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensors: the average, by parameter name under `ema/`."""
        return {PREFIX + n: s for n, s in self.shadow.items()}

    @torch.no_grad()
    def take(self, found: dict[str, torch.Tensor], updates: int) -> None:
        """A checkpoint's average, as `saved_average` returned it."""
        for name, s in self.shadow.items():
            s.copy_(found[name])
        self.updates = updates


def check_unaliased(params: Mapping[str, torch.Tensor]) -> None:
    """Refuses parameters whose memory overlaps (other than one tied parameter listed once): an
    in-place exchange would swap their shared bytes twice and leave the average in them."""
    spans = sorted(
        (p.data_ptr(), p.data_ptr() + p.numel() * p.element_size())
        for p in params.values()
        if p.is_floating_point() and p.numel() > 0
    )
    for (_, end), (start, _) in pairwise(spans):
        if start < end:
            raise AtomError("train.ema: two parameters share memory (tie them as one parameter)")


def saved_average(
    tensors: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], where: object
) -> dict[str, torch.Tensor] | None:
    """A checkpoint's weight average (its `ema/` tensors), checked against the model's
    parameters: by name, one for every floating-point parameter, each of its shape. None when the
    checkpoint has none."""
    found = {n[len(PREFIX) :]: t for n, t in tensors.items() if n.startswith(PREFIX)}
    if not found:
        return None
    expected = {n for n, p in params.items() if p.is_floating_point()}
    if set(found) != expected:
        odd = sorted(set(found) ^ expected)[0]
        raise AtomError(f"checkpoint {where}: its weight average ({PREFIX}) does not match {odd!r}")
    for name, t in found.items():
        if t.shape != params[name].shape:
            raise AtomError(
                f"checkpoint {where}: its weight average of {name!r} is {tuple(t.shape)}, "
                f"the model's {tuple(params[name].shape)}"
            )
    return found
