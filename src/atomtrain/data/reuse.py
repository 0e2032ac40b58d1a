"""Data echoing: keep the device busy when the input pipeline cannot keep up.

Every batch that arrives from upstream is used once as it is. While the next one is not ready,
the loader reuses what it holds instead of waiting: rows drawn from the last few upstream batches,
reshuffled across them, each window cut at a fresh offset inside its chunk, so no batch repeats
back to back. How many reuses a fresh batch may have (the echo factor) follows the measured
upstream and step times, up to `max_echo`; when upstream keeps up, nothing is reused.

What an echo is worth is watched through the training loss the caller reports (`record_loss`):
an echoed batch whose loss sits well below that of the fresh batch before it has been learnt
(memorised rows teach little and pull towards overfitting), so the cap on echoes drops by one;
it rises back by one every `recover_fresh` fresh batches without a drop.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from atomtrain.data.loader import to_xy
from atomtrain.data.stream import StreamingSource


@dataclass(frozen=True)
class ReuseConfig:
    """Bounds of data echoing."""

    enabled: bool = True
    """Reuse when upstream is late (off: always wait for upstream)."""
    max_echo: int = 4
    """Most uses of one fresh batch (the upper bound of the echo factor)."""
    buffer_batches: int = 16
    """Recent upstream batches whose rows reuse draws from."""
    seq_len: int = 128
    """Training window; upstream chunks are longer by the slack offsets come from."""
    seed: int = 0
    ema: float = 0.8
    """Smoothing of the measured upstream and step times."""
    fit_nats: float = 0.3
    """How far below the fresh batch's training loss echoed batches may sit, on average over
    `gap_window` echoes, before they count as memorised and the echo cap drops by one."""
    gap_window: int = 16
    """Echoes whose loss gaps are averaged before the cap may change."""
    recover_fresh: int = 32
    """Fresh batches after a drop before the cap rises back by one (and is tested again)."""


class EchoingLoader:
    def __init__(self, source: StreamingSource, cfg: ReuseConfig) -> None:
        if source.cfg.chunk_len < cfg.seq_len + 1:
            raise ValueError("stream chunks must hold at least one training window")
        self.source = source
        self.cfg = cfg
        self.buffer: deque[np.ndarray] = deque(maxlen=cfg.buffer_batches)
        self.rng = np.random.default_rng(cfg.seed)
        self.fresh = 0
        self.echoed = 0
        self.echoes_left = 0
        self.up_s: float | None = None  # measured time between upstream batches
        self.step_s: float | None = None  # measured time between our batches
        self._last_take = time.perf_counter()
        self._last_call: float | None = None
        self._window: deque[bool] = deque(maxlen=64)  # recent batches: fresh or reused
        self.cap = cfg.max_echo  # uses of a fresh batch allowed now: lowered when echoes are learnt
        self._fresh_loss: float | None = None
        self._gaps: deque[float] = deque(maxlen=cfg.gap_window)
        self._fresh_since_drop = 0

    # --- measurements ---------------------------------------------------------------------------

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else self.cfg.ema * old + (1 - self.cfg.ema) * new

    @property
    def allowance(self) -> int:
        """Reuses a fresh batch may have: upstream time over step time, rounded up, capped."""
        if not self.cfg.enabled or self.up_s is None or not self.step_s:
            return 0
        return max(0, min(self.cap, math.ceil(self.up_s / self.step_s)) - 1)

    @property
    def echo_factor(self) -> float:
        """Batches used per fresh batch, over the recent window."""
        fresh = sum(self._window)
        return len(self._window) / fresh if fresh else 1.0

    def record_loss(self, loss: float) -> None:
        """The training loss of the batch `next_batch` returned last."""
        if not self._window or not math.isfinite(loss):
            return
        if self._window[-1]:
            self._fresh_loss = loss
            return
        if self._fresh_loss is None:
            return
        self._gaps.append(loss - self._fresh_loss)
        if (
            len(self._gaps) == self._gaps.maxlen
            and sum(self._gaps) / len(self._gaps) < -self.cfg.fit_nats
        ):
            self.cap = max(1, self.cap - 1)
            self._gaps.clear()
            self._fresh_since_drop = 0

    def _on_fresh(self) -> None:
        self._fresh_since_drop += 1
        if self.cap < self.cfg.max_echo and self._fresh_since_drop >= self.cfg.recover_fresh:
            self.cap += 1
            self._fresh_since_drop = 0

    # --- batches --------------------------------------------------------------------------------

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        now = time.perf_counter()
        if self._last_call is not None:
            self.step_s = self._smooth(self.step_s, now - self._last_call)
        self._last_call = now
        if self.buffer and self.echoes_left > 0 and not self.source.ready():
            self.echoes_left -= 1
            self.echoed += 1
            self._window.append(False)
            return to_xy(self._echo())
        chunk = self.source.take()
        t = time.perf_counter()
        self.up_s = self._smooth(self.up_s, t - self._last_take)
        self._last_take = t
        self._last_call = t  # time spent waiting for upstream is not step time
        self.buffer.append(chunk)
        self.fresh += 1
        self._on_fresh()
        self.echoes_left = self.allowance
        self._window.append(True)
        return to_xy(chunk[:, : self.cfg.seq_len + 1])

    def _echo(self) -> np.ndarray:
        pool = np.concatenate(list(self.buffer))  # (batches * rows, chunk_len)
        rows = self.buffer[-1].shape[0]
        pick = np.asarray(self.rng.choice(len(pool), size=rows, replace=len(pool) < rows))
        slack = pool.shape[1] - (self.cfg.seq_len + 1)
        offsets = (
            self.rng.integers(1, slack + 1, size=rows)
            if slack > 0
            else np.zeros(rows, dtype=np.int64)
        )
        n = self.cfg.seq_len + 1
        return np.stack(
            [pool[int(p), int(o) : int(o) + n] for p, o in zip(pick, offsets, strict=True)]
        )

    # --- the loader interface -------------------------------------------------------------------

    @property
    def next_step(self) -> int:
        return self.fresh + self.echoed

    def stats(self) -> dict[str, float]:
        return {
            "echo": round(self.echo_factor, 2),
            "echo_cap": self.cap,
            "fresh_batches": self.fresh,
        }

    def state_dict(self) -> dict:
        return {
            "source": self.source.state_dict(),
            "buffer": [b.tolist() for b in self.buffer],
            "rng": self.rng.bit_generator.state,
            "fresh": self.fresh,
            "echoed": self.echoed,
            "echoes_left": self.echoes_left,
            "up_s": self.up_s,
            "step_s": self.step_s,
            "cap": self.cap,
            "fresh_loss": self._fresh_loss,
            "gaps": list(self._gaps),
            "fresh_since_drop": self._fresh_since_drop,
        }

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state["source"])
        self.buffer = deque(
            (np.asarray(b, dtype=np.int64) for b in state["buffer"]), maxlen=self.cfg.buffer_batches
        )
        self.rng = np.random.default_rng()
        self.rng.bit_generator.state = state["rng"]
        self.fresh, self.echoed = int(state["fresh"]), int(state["echoed"])
        self.echoes_left = int(state["echoes_left"])
        self.up_s, self.step_s = state["up_s"], state["step_s"]
        # checkpoints from before the echo cap have none: the cap starts where a new run does
        self.cap = int(state.get("cap", self.cfg.max_echo))
        self._fresh_loss = state.get("fresh_loss")
        self._gaps = deque(state.get("gaps", []), maxlen=self.cfg.gap_window)
        self._fresh_since_drop = int(state.get("fresh_since_drop", 0))

    def close(self) -> None:
        self.source.close()
