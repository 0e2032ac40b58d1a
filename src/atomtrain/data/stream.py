"""Streaming input: raw text read and tokenized on the fly by background workers.

An alternative to prepared shards for corpora too large to prepare, or read over a slow link. A
rate limit (`rate_tokens_per_s`) stands for a slow disk or network. The stream is deterministic:
files in a seeded order per epoch, each cut into consecutive chunks; its position is a cursor
(epoch, file, chunk) that `state_dict` saves and `load_state_dict` restores.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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


@dataclass
class Cursor:
    epoch: int = 0
    file: int = 0
    chunk: int = 0


class StreamingSource:
    """Batches of (rows, chunk_len) token chunks, numbered 0, 1, 2, ... in stream order."""

    def __init__(self, files: list[Path], cfg: StreamConfig, tokenizer: Tokenizer | None = None,
                 peer_index: int = 0, num_peers: int = 1) -> None:
        if not files:
            raise AtomError("the stream has no files to read")
        self.files = files[peer_index::max(num_peers, 1)] or files
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

    def _batches(self, start: Cursor):  # type: ignore[no-untyped-def]
        """(cursor after the batch, batch) forever, from `start`."""
        c = Cursor(start.epoch, start.file, start.chunk)
        rows: list[np.ndarray] = []
        empty_epochs = 0
        while True:
            order = self._order(c.epoch)
            chunks = self._chunks(order[c.file])
            while c.chunk < len(chunks):
                rows.append(chunks[c.chunk])
                c.chunk += 1
                if len(rows) == self.cfg.rows:
                    empty_epochs = 0
                    yield Cursor(c.epoch, c.file, c.chunk), np.stack(rows)
                    rows = []
            c.file, c.chunk = c.file + 1, 0
            if c.file == len(self.files):
                c.epoch, c.file = c.epoch + 1, 0
                empty_epochs += 1
                if empty_epochs > 1:
                    raise AtomError("the streamed text is too short for one batch")

    def _produce(self, start: Cursor, q: queue.Queue, stop: threading.Event) -> None:
        t_next = time.perf_counter()
        try:
            for item in self._batches(start):
                if self.cfg.rate_tokens_per_s > 0:  # a slow disk or link
                    t_next += item[1].size / self.cfg.rate_tokens_per_s
                    delay = t_next - time.perf_counter()
                    if delay > 0 and stop.wait(delay):
                        return
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:
            q.put((None, e))

    def _ensure(self) -> queue.Queue:
        if self._thread is None:
            self._stop = threading.Event()
            self._queue = queue.Queue(maxsize=max(self.cfg.prefetch, 1))
            self._thread = threading.Thread(target=self._produce, daemon=True,
                                            args=(self.cursor, self._queue, self._stop),
                                            name="atom-stream")
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
        return {"epoch": c.epoch, "file": c.file, "chunk": c.chunk, "produced": self.produced}

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.cursor = Cursor(int(state["epoch"]), int(state["file"]), int(state["chunk"]))
        self.produced = int(state["produced"])

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
            self._queue = None
