"""What the swarm agrees its state is, so that a downloaded state is checked before it is used.

Members of a round apply the same bits of the average (exact.py), so every peer at a round holds
the same synchronized parameters and outer momentum. Each peer publishes, signed under its own
key (a record no one else can write), exact digests of both for its last rounds. A downloaded
state is taken only when the digests of its parameters and momentum match those that more than
half of the live publishing peers hold for its round, and at least two of them where more than
one peer publishes: a forged model or an oversized momentum buffer, served by one peer (or by
two colluding members claiming a round no one else holds), matches too few records, and is
refused before it replaces anything. A record its peer has not stored again for `LIVE_S` is a
dead peer's and has no vote: counted until it expired, a killed peer's record made a joiner
refuse the state both survivors held ("match 2 of 4").

Peers whose arithmetic rounds differently (the outer step on CPUs with and without fused
multiply-add) would not hold the same bits; such a swarm would refuse its own states.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from hivemind import DHT
from hivemind.utils import get_dht_time

from atomtrain.peer.layout import digest
from atomtrain.peer.records import signer_of

if TYPE_CHECKING:
    from atomtrain.peer.auth import Roster

AGREEMENT_TTL_S = 30.0
LIVE_S = 16.0
"""A record stored longer ago than this is a dead peer's: a live one stores it again as each
round lands and at least every 10 s (presence.REPUBLISH_EVERY_S, at a 2 s status tick)."""
KEPT_ROUNDS = 3
"""Rounds a record holds: a state served at a round is still checkable while the swarm takes
the next ones."""


def agreement_key(swarm: str) -> str:
    return f"{swarm}_agreed"


@dataclass(frozen=True)
class RoundDigest:
    round: int
    params: str
    momentum: str

    @classmethod
    def of(cls, round: int, params: torch.Tensor, momentum: torch.Tensor) -> RoundDigest:
        return cls(round, digest(params), digest(momentum))


class AgreementRecord:
    """This peer's digests of its last rounds, published from its status thread."""

    def __init__(self) -> None:
        self.rounds: list[RoundDigest] = []

    def add(self, entry: RoundDigest) -> None:
        self.rounds = [r for r in self.rounds if r.round != entry.round][-(KEPT_ROUNDS - 1) :]
        self.rounds.append(entry)

    def publish(self, dht: DHT, swarm: str, subkey: bytes) -> Any:
        """Under this peer's signed subkey (records.py): no one else can write it, and one
        member, holding one certified key, has one record."""
        value = [[r.round, r.params, r.momentum] for r in self.rounds]
        return dht.store(
            agreement_key(swarm),
            subkey=subkey,
            value=value,
            expiration_time=get_dht_time() + AGREEMENT_TTL_S,
            return_future=True,
        )


def parse_records(
    found: object, exclude: bytes = b"", now: float | None = None
) -> dict[str, list[RoundDigest]]:
    """{signer's public key: digests} from what the DHT returned for the agreement key;
    malformed entries are skipped, and so is `exclude` (the asking peer's own subkey), and,
    given the DHT time `now`, every record not stored within LIVE_S of it (a dead peer's)."""
    value = getattr(found, "value", None)
    if not isinstance(value, dict):
        return {}
    out: dict[str, list[RoundDigest]] = {}
    for subkey, item in value.items():
        key = signer_of(subkey)  # the validators checked that this key signed the record
        if subkey == exclude or key is None:
            continue
        entries = getattr(item, "value", None)
        if not isinstance(entries, list):
            continue
        if now is not None and not _stored_within(item, now, LIVE_S):
            continue
        parsed = []
        for e in entries[:KEPT_ROUNDS]:
            try:
                parsed.append(RoundDigest(int(e[0]), str(e[1])[:32], str(e[2])[:32]))
            except (TypeError, ValueError, IndexError):
                continue
        out[key] = parsed
    return out


def _stored_within(item: object, now: float, seconds: float) -> bool:
    """Whether a record (stored to expire AGREEMENT_TTL_S after it was stored) was stored
    within `seconds` of `now`."""
    expires = getattr(item, "expiration_time", None)
    try:
        return float(expires) - AGREEMENT_TTL_S >= now - seconds  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def read_records(dht: DHT, swarm: str, exclude: bytes = b"") -> dict[str, list[RoundDigest]]:
    return parse_records(dht.get(agreement_key(swarm), latest=True), exclude, get_dht_time())


def members_only(
    records: dict[str, list[RoundDigest]], roster: Roster | None
) -> dict[str, list[RoundDigest]]:
    """In a keyed swarm (a `roster`): only records signed by a certified member's key, one per
    member, so keys anyone can make add no votes. An open swarm counts every record."""
    if roster is None:
        return records
    out: dict[str, list[RoundDigest]] = {}
    for signer, digests in records.items():
        cert = roster.by_signer.get(signer)
        if cert is not None:
            out.setdefault(cert.member, digests)
    return out


def disagreement(
    round: int,
    params: torch.Tensor,
    momentum: torch.Tensor,
    records: Mapping[str, Sequence[RoundDigest]],
) -> str | None:
    """Why a state of `round` is not what the swarm agrees on, or None when more than half of
    the publishing peers hold exactly it (two at least, unless a single peer publishes)."""
    if not records:
        return "no peer published what the swarm holds"
    have = RoundDigest.of(round, params, momentum)
    agree = sum(have in entries for entries in records.values())
    if agree * 2 <= len(records) or (agree < 2 and len(records) > 1):
        return (
            f"its round {round} parameters and momentum match {agree} of {len(records)} "
            f"peers' published digests"
        )
    return None
