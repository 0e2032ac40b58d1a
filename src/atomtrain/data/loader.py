"""Deterministic, resumable batches of token windows, prefetched in the background.

The windows of optimizer step `s` on peer `p` depend only on (seed, p, s): a resumed run, or a
peer restarted elsewhere, draws exactly the batches it would have drawn.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from atomtrain.data.shards import TokenShards
from atomtrain.errors import AtomError


@dataclass(frozen=True)
class LoaderConfig:
    """Shape and seeding of the batches."""

    rows: int = 16
    """Sequences per optimizer step (all micro-batches together)."""
    seq_len: int = 128
    """Tokens per sequence (the targets are the same window shifted by one)."""
    seed: int = 0
    """Base seed of the window draw."""
    peer_index: int = 0
    """This peer's index; enters the seed, and picks the slice when num_peers > 1."""
    num_peers: int = 1
    """Split the training windows into this many disjoint slices, one per peer (0: no slices,
    the index only seeds this peer's own draw over the whole split)."""
    prefetch: int = 2
    """Batches prepared ahead of the trainer by a background thread (0: none)."""


class WindowSampler:
    """Maps (split, step) to a (rows, seq_len + 1) array of token windows."""

    def __init__(self, shards: TokenShards, cfg: LoaderConfig) -> None:
        self.cfg = cfg
        self.shards = shards
        self._index = {
            s: self._valid_starts(shards.splits[s], cfg.seq_len) for s in ("train", "val")
        }
        if cfg.num_peers and not 0 <= cfg.peer_index < cfg.num_peers:
            raise AtomError(
                f"peer.index ({cfg.peer_index}) must be below peer.num_peers ({cfg.num_peers})"
            )
        if self._index["train"][-1] == 0:
            raise AtomError(
                f"{shards.root}: training split has fewer than {cfg.seq_len + 1} tokens per shard"
            )

    @staticmethod
    def _valid_starts(arrays: list[np.ndarray], seq_len: int) -> np.ndarray:
        counts = [max(len(a) - seq_len, 0) for a in arrays]  # window of seq_len + 1 tokens
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def starts(self, split: str, key: int) -> np.ndarray:
        """Global start positions of the windows for `key` (a step, or a validation index)."""
        total = int(self._index[split][-1])
        if total == 0:
            raise AtomError(f"{self.shards.root}: {split} split is shorter than one window")
        lo, hi = 0, total
        if split == "train" and self.cfg.num_peers > 1:
            lo = total * self.cfg.peer_index // self.cfg.num_peers
            hi = total * (self.cfg.peer_index + 1) // self.cfg.num_peers
        split_code = 0 if split == "train" else 1
        peer = self.cfg.peer_index if split == "train" else 0  # every peer validates alike
        rng = np.random.default_rng([self.cfg.seed, peer, split_code, key])
        return rng.integers(lo, hi, size=self.cfg.rows)

    def windows(self, split: str, key: int) -> np.ndarray:
        cum = self._index[split]
        starts = self.starts(split, key)
        shard_of = np.searchsorted(cum, starts, side="right") - 1
        out = np.empty((self.cfg.rows, self.cfg.seq_len + 1), dtype=np.int64)
        arrays = self.shards.splits[split]
        for r, (g, s) in enumerate(zip(starts, shard_of, strict=True)):
            off = int(g - cum[s])
            out[r] = arrays[s][off : off + self.cfg.seq_len + 1]
        return out


def to_xy(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, each (rows, seq_len)."""
    t = torch.from_numpy(windows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def put_until_stopped(q: queue.Queue, item: object, stop: threading.Event) -> bool:
    """Put `item` into a bounded queue, giving up when `stop` is set; True if it went in."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


class TrainLoader:
    """Iterates training batches from `state['step']` on, prefetching in a daemon thread."""

    def __init__(self, sampler: WindowSampler) -> None:
        self.sampler = sampler
        self.next_step = 0
        self._queue: queue.Queue[tuple[int, np.ndarray | BaseException]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self.next_step,
            "seed": self.sampler.cfg.seed,
            "peer_index": self.sampler.cfg.peer_index,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.close()
        self.next_step = int(state["step"])

    def _produce(self, first: int, q: queue.Queue, stop: threading.Event) -> None:
        step = first
        while not stop.is_set():
            try:
                item: tuple[int, np.ndarray | BaseException] = (
                    step,
                    self.sampler.windows("train", step),
                )
            except BaseException as e:  # handed to the consumer, which raises it
                item = (step, e)
            put_until_stopped(q, item, stop)
            step += 1

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        depth = self.sampler.cfg.prefetch
        if depth <= 0:
            windows = self.sampler.windows("train", self.next_step)
        else:
            if self._thread is None:
                self._stop = threading.Event()
                self._queue = queue.Queue(maxsize=depth)
                self._thread = threading.Thread(
                    target=self._produce,
                    args=(self.next_step, self._queue, self._stop),
                    daemon=True,
                    name="atom-prefetch",
                )
                self._thread.start()
            assert self._queue is not None
            step, item = self._queue.get()
            if isinstance(item, BaseException):
                self.close()
                raise item
            assert step == self.next_step, (step, self.next_step)
            windows = item
        self.next_step += 1
        return to_xy(windows)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
            self._queue = None


def validation_batches(
    sampler: WindowSampler, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same `count` validation batches every time, so val losses compare across a run."""
    return [to_xy(sampler.windows("val", i)) for i in range(count)]
