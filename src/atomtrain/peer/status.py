"""Each peer publishes its progress in the DHT; anyone joined to the swarm can read the table."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from atomtrain.peer.auth import read_roster
from atomtrain.peer.certs import unbracketed
from atomtrain.peer.records import signer_of

STATUS_TTL_S = 30.0


@dataclass(frozen=True)
class PeerStatus:
    name: str
    round: int
    step: int
    loss: float
    tokens_per_s: float
    last_sync: float
    """Wall-clock time of the last applied round (0: never)."""
    failed_rounds: int = 0
    addrs: tuple[str, ...] = ()
    updated: float = 0.0
    """Wall-clock time of this record: peers publish every second, so an old one is a gone peer."""
    finishing: bool = False
    """Done with local steps and waiting for the last round."""
    done: bool = False
    """Past the last round (and serving its result to any peer the group left out)."""
    rejected: tuple[str, ...] = ()
    """Peers whose contributions this one rejected (and now ignores)."""
    peer_id: str = ""
    """libp2p peer ID (what the averager sees): the key of this peer's own record."""
    sync_every: int = 0
    """Local steps between rounds now (chosen automatically unless set)."""
    round_s: float = 0.0
    """Duration of the last applied round, from its start to its result."""
    period_s: float = 0.0
    """With H auto: seconds between this peer's round slots now (0: none yet); a peer that
    starts takes the swarm's (the median of the live peers')."""
    init_digest: str = ""
    """While at round 0: a digest of the initial parameters (joiners that built the same ones
    from the shared seed need no download)."""
    sent_bps: float = 0.0
    received_bps: float = 0.0
    """Bytes a second the peer sent and received lately: on the wire, as the kernel counts its
    p2p daemon's sockets (wire.py), or where it cannot, what the averager moved (traffic.py)."""
    round_bytes: float = 0.0
    """Bytes sent plus received from the round before the last applied one to it: on the wire
    (every byte the peer moved meanwhile: the round, failed tries, the DHT, headers), or the
    round's averager messages where the kernel's counters are not available."""
    matchmaking_s: float = 0.0
    """Of the last applied round: time from its start until its all-reduce began."""
    success_share: float = 0.0
    """Share of the last rounds (up to 20) that were applied."""
    schedule_step: int = 0
    """Where the peer's learning-rate schedule stands: its steps plus the swarm's progress it
    took with a downloaded state (a joiner follows the swarm's, not its own step count)."""
    protocol: str = ""
    """How the peer averages (protocol.py): peers that differ never join one round."""

    def fresh(self, now: float, within_s: float = 5.0) -> bool:
        return now - self.updated <= within_s

    @classmethod
    def from_record(cls, value: Any) -> PeerStatus | None:
        """A status from a DHT record, or None when the record is malformed."""
        if not isinstance(value, dict):
            return None
        try:
            return cls(
                name=str(value["name"])[:64],
                round=int(value["round"]),
                step=int(value["step"]),
                loss=float(value["loss"]),
                tokens_per_s=float(value["tokens_per_s"]),
                last_sync=float(value["last_sync"]),
                failed_rounds=int(value.get("failed_rounds", 0)),
                addrs=_strings(value.get("addrs", ()), 8),
                updated=float(value.get("updated", 0.0)),
                finishing=bool(value.get("finishing", False)),
                done=bool(value.get("done", False)),
                rejected=_strings(value.get("rejected", ()), 16),
                peer_id=str(value.get("peer_id", ""))[:128],
                sync_every=int(value.get("sync_every", 0)),
                round_s=float(value.get("round_s", 0.0)),
                period_s=_nonnegative(value.get("period_s", 0.0)),
                init_digest=str(value.get("init_digest", ""))[:64],
                sent_bps=_nonnegative(value.get("sent_bps", 0.0)),
                received_bps=_nonnegative(value.get("received_bps", 0.0)),
                round_bytes=_nonnegative(value.get("round_bytes", 0.0)),
                matchmaking_s=_nonnegative(value.get("matchmaking_s", 0.0)),
                success_share=min(_nonnegative(value.get("success_share", 0.0)), 1.0),
                schedule_step=max(int(value.get("schedule_step", 0)), 0),
                protocol=str(value.get("protocol", ""))[:64],
            )
        except (KeyError, TypeError, ValueError, OverflowError):
            return None


def _nonnegative(value: Any) -> float:
    x = float(value)
    if not (x >= 0 and x != float("inf")):
        raise ValueError("expected a finite non-negative number")
    return x


def _strings(value: Any, most: int) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise TypeError("expected a list of strings")
    return tuple(str(v)[:256] for v in value[:most])


def status_key(swarm: str) -> str:
    return f"{swarm}_status"


def publish(dht: DHT, swarm: str, subkey: bytes, status: PeerStatus) -> Any:
    """Store this peer's record under its own signed subkey (records.py), so no peer can write
    another's; a future of whether it was stored."""
    record = asdict(status)
    record["name"] = unbracketed(status.name)
    record["addrs"] = list(status.addrs)
    # a `[signature:...]` besides its own would fail every node's check of this record, and
    # name this peer a forger (forgers.py): the peers it rejected named themselves
    record["rejected"] = [unbracketed(name) for name in status.rejected]
    return dht.store(
        status_key(swarm),
        subkey=subkey,
        value=record,
        expiration_time=get_dht_time() + STATUS_TTL_S,
        return_future=True,
    )


def read_statuses(dht: DHT, swarm: str, owner: str | None = None) -> list[PeerStatus]:
    """The peers' records. In a keyed swarm (`owner`), only those whose signer holds a valid
    certificate for the peer ID the record claims: no member speaks for another."""
    found = dht.get(status_key(swarm), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    roster = read_roster(dht, swarm, owner) if owner is not None else None
    out = []
    for subkey, item in found.value.items():
        st = PeerStatus.from_record(getattr(item, "value", None))
        signer = signer_of(subkey)
        if st is None or signer is None:
            continue
        if roster is not None:
            cert = roster.by_signer.get(signer)
            if cert is None or cert.peer_id != st.peer_id:
                continue
        out.append(st)
    return sorted(out, key=lambda s: s.name)


def status_rows(statuses: list[PeerStatus]) -> list[list[str]]:
    now = time.time()

    def rejected_by(name: str) -> str:
        return ",".join(o.name for o in statuses if name in o.rejected) or "-"

    return [
        [
            s.name,
            str(s.round),
            str(s.step),
            f"{s.loss:.3f}",
            f"{s.tokens_per_s:.0f}",
            f"{now - s.last_sync:.1f}s" if s.last_sync else "never",
            str(s.sync_every or "-"),
            f"{s.round_s:.1f}s" if s.round_s else "-",
            f"{s.matchmaking_s:.1f}s" if s.round_s else "-",
            f"{s.round_bytes / 1e6:.2f}" if s.round_bytes else "-",
            f"{s.sent_bps * 8 / 1e6:.2f}/{s.received_bps * 8 / 1e6:.2f}",
            f"{s.success_share:.0%}" if s.round_s or s.failed_rounds else "-",
            str(s.failed_rounds),
            rejected_by(s.name),
            s.protocol or "-",
        ]
        for s in statuses
    ]


STATUS_HEADERS = [
    "peer",
    "round",
    "step",
    "loss",
    "tokens/s",
    "since sync",
    "H",
    "round time",
    "matchmaking",
    "round MB",
    "Mb/s up/down",
    "rounds ok",
    "failed",
    "rejected by",
    "protocol",
]
