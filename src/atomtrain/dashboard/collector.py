"""Reads a swarm's status records every `every_s` seconds and keeps what the page draws: the
latest record of each peer and each peer's loss over time.

The collector never writes to the swarm: it is a DHT client (client mode) that only reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import asdict
from typing import Any

from atomtrain.peer.status import PeerStatus, read_statuses

log = logging.getLogger(__name__)

HISTORY_POINTS = 2000
"""Loss points kept per peer (at one a second, more than half an hour)."""
GONE_AFTER_S = 10.0
"""A peer whose record is older than this is shown as gone."""


class SwarmWatch:
    def __init__(
        self, dht: Any, swarm: str, owner: str | None = None, every_s: float = 1.0
    ) -> None:
        self.dht, self.swarm, self.every_s = dht, swarm, every_s
        self.owner = owner
        """A keyed swarm's owner: only statuses signed under its certificates are shown."""
        self._lock = threading.Lock()
        self._latest: dict[str, PeerStatus] = {}
        self._history: dict[str, deque[tuple[float, int, float]]] = {}
        self._read_at = 0.0
        self._error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="atom-dashboard")

    def start(self) -> SwarmWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.collect(read_statuses(self.dht, self.swarm, self.owner), time.time())
            except Exception as e:  # the DHT busy or gone: say so on the page, keep trying
                with self._lock:
                    self._error = f"cannot read the swarm's status ({type(e).__name__})"
            self._stop.wait(self.every_s)

    def collect(self, statuses: list[PeerStatus], now: float) -> None:
        """Take one reading of the records."""
        with self._lock:
            self._read_at, self._error = now, ""
            for s in statuses:
                key = s.peer_id or s.name
                known = self._latest.get(key)
                if known is not None and known.updated >= s.updated:
                    continue  # the same record as last time
                self._latest[key] = s
                points = self._history.setdefault(key, deque(maxlen=HISTORY_POINTS))
                if s.step > 0 and (not points or points[-1][1] != s.step):
                    points.append((s.updated, s.step, s.loss))

    def snapshot(self) -> dict[str, Any]:
        """What the page shows, as JSON-ready values."""
        with self._lock:
            now = time.time()
            latest = sorted(self._latest.items(), key=lambda kv: kv[1].name)
            peers = []
            for key, s in latest:
                row = asdict(s)
                row["addrs"], row["rejected"] = list(s.addrs), list(s.rejected)
                row["key"] = key
                row["live"] = now - s.updated <= GONE_AFTER_S and not s.done
                row["since_sync_s"] = now - s.last_sync if s.last_sync else None
                row["rejected_by"] = sorted(o.name for _, o in latest if s.name in o.rejected)
                peers.append(row)
            live = [p for p in peers if p["live"]]
            return {
                "swarm": self.swarm,
                "time": now,
                "read_at": self._read_at,
                "error": self._error,
                "peers": peers,
                "totals": {
                    "live_peers": len(live),
                    "tokens_per_s": sum(p["tokens_per_s"] for p in live),
                    "sent_bps": sum(p["sent_bps"] for p in live),
                    "received_bps": sum(p["received_bps"] for p in live),
                },
                "history": {
                    key: [list(p) for p in self._history.get(key, ())] for key, _ in latest
                },
            }
