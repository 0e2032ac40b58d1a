"""What a recomputed block must see again in the backward: the forward's autocast and its random
state (dropout draws the same mask), on the device the engine runs on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    """The forward's autocast (none for fp32), also around a recompute."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def rng_state(training: bool, device: torch.device) -> tuple | None:
    """The random state a block's forward starts from (None in eval mode: nothing random)."""
    if not training:
        return None
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def replayed_rng(state: tuple | None, device: torch.device) -> Iterator[None]:
    """Run with the random state `rng_state` took, leaving the current one as it was."""
    if state is None:
        yield
        return
    cpu, cuda = state
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield
