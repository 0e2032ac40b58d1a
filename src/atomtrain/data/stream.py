"""Streaming input: raw text read and tokenized on the fly by background workers.

An alternative to prepared shards for corpora too large to prepare, or read over a slow link. A
rate limit (`rate_tokens_per_s`) stands for a slow disk or network. The stream is deterministic:
files in a seeded order per epoch, several read at once and cut into chunks that rows take in
turn; its position is a cursor that `state_dict` saves and `load_state_dict` restores.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from atomtrain.data.loader import put_until_stopped
from atomtrain.data.tokenizer import ByteTokenizer, Tokenizer
from atomtrain.errors import AtomError


@dataclass(frozen=True)
class StreamConfig:
    """How raw text becomes batches."""

    rows: int = 16
    """Sequences per batch."""
    chunk_len: int = 129
    """Tokens per row (a training window plus the slack reuse cuts fresh offsets from)."""
    seed: int = 0
    rate_tokens_per_s: float = 0.0
    """Upper bound on the tokens the stream delivers per second (0: as fast as it can)."""
    prefetch: int = 2
    """Batches tokenized ahead."""
    interleave: int = 64
    """Files read at once, rows taken from each in turn, so a batch mixes documents."""


@dataclass
class Cursor:
    """Where the stream is: the epoch, the next file to open, and the files being read (each
    with the next chunk to take), rows taken from them in turn."""

    epoch: int = 0
    next_file: int = 0
    active: list[list[int]] = field(default_factory=list)
    turn: int = 0

    def copy(self) -> Cursor:
        return Cursor(self.epoch, self.next_file, [list(a) for a in self.active], self.turn)


class StreamingSource:
    """Batches of (rows, chunk_len) token chunks, numbered 0, 1, 2, ... in stream order."""

    def __init__(
        self,
        files: list[Path],
        cfg: StreamConfig,
        tokenizer: Tokenizer | None = None,
        peer_index: int = 0,
        num_peers: int = 1,
    ) -> None:
        if not files:
            raise AtomError("the stream has no files to read")
        self.files = files[peer_index :: max(num_peers, 1)] or files
        self.cfg = cfg
        self.tok = tokenizer or ByteTokenizer()
        self.cursor = Cursor()
        self.produced = 0
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.files)))
        random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _chunks(self, file_index: int) -> np.ndarray:
        text = self.files[file_index].read_text(encoding="utf-8", errors="replace")
        ids = np.asarray(self.tok.encode(text), dtype=np.int64)
        n = len(ids) // self.cfg.chunk_len
        return ids[: n * self.cfg.chunk_len].reshape(n, self.cfg.chunk_len)

    def _batches(self, start: Cursor):
        """(cursor after the batch, batch) forever, from `start`."""
        c = start.copy()
        cache: dict[int, np.ndarray] = {}
        rows: list[np.ndarray] = []
        since_batch = 0
        while True:
            while len(c.active) < self.cfg.interleave and c.next_file < len(self.files):
                c.active.append([self._order(c.epoch)[c.next_file], 0])
                c.next_file += 1
            if not c.active:  # the epoch is over
                c.epoch, c.next_file, c.turn = c.epoch + 1, 0, 0
                if since_batch > len(self.files):
                    raise AtomError("the streamed text is too short for one batch")
                continue
            c.turn %= len(c.active)
            f, k = c.active[c.turn]
            if f not in cache:
                cache[f] = self._chunks(f)
            since_batch += 1
            if k >= len(cache[f]):
                cache.pop(f, None)
                c.active.pop(c.turn)
                continue
            rows.append(cache[f][k])
            c.active[c.turn][1] += 1
            c.turn += 1
            if len(rows) == self.cfg.rows:
                since_batch = 0
                yield c.copy(), np.stack(rows)
                rows = []

    def _produce(self, start: Cursor, q: queue.Queue, stop: threading.Event) -> None:
        t_next = time.perf_counter()
        try:
            for item in self._batches(start):
                if self.cfg.rate_tokens_per_s > 0:  # a slow disk or link
                    t_next += item[1].size / self.cfg.rate_tokens_per_s
                    delay = t_next - time.perf_counter()
                    if delay > 0 and stop.wait(delay):
                        return
                if not put_until_stopped(q, item, stop):
                    return
        except BaseException as e:
            q.put((None, e))

    def _ensure(self) -> queue.Queue:
        if self._thread is None:
            self._stop = threading.Event()
            self._queue = queue.Queue(maxsize=max(self.cfg.prefetch, 1))
            self._thread = threading.Thread(
                target=self._produce,
                daemon=True,
                args=(self.cursor, self._queue, self._stop),
                name="atom-stream",
            )
            self._thread.start()
        assert self._queue is not None
        return self._queue

    def ready(self) -> bool:
        """Whether the next batch can be taken without waiting."""
        return not self._ensure().empty()

    def take(self) -> np.ndarray:
        cursor, batch = self._ensure().get()
        if cursor is None:
            self.close()
            raise batch
        self.cursor = cursor
        self.produced += 1
        return batch

    def state_dict(self) -> dict:
        c = self.cursor
        return {
            "epoch": c.epoch,
            "next_file": c.next_file,
            "active": c.active,
            "turn": c.turn,
            "produced": self.produced,
        }

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.cursor = Cursor(
            int(state["epoch"]),
            int(state["next_file"]),
            [[int(f), int(k)] for f, k in state["active"]],
            int(state["turn"]),
        )
        self.produced = int(state["produced"])

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
            self._queue = None
