"""The DHT records Atom writes: each signed by its writer and checked against a schema.

Every record lives under a subkey that names its writer's RSA public key (`[owner:ssh-rsa ...]`);
hivemind's RSASignatureValidator makes every DHT node refuse a value under such a subkey unless
that key signed it, and its SchemaValidator refuses values of the wrong shape. So a member can
write only its own membership certificate, status and copy of the revocation list, never
another's. Readers map a record's signer to its certificate (auth.py): a status that claims a
peer ID other than its signer's certificate names is dropped.
"""

from __future__ import annotations

import re

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey

from atomtrain.peer.forgers import EVIDENCE_CHARS, EVIDENCE_KEPT

Number = pydantic.StrictInt | pydantic.StrictFloat
Text = pydantic.constr(strict=True, max_length=256)
CertText = pydantic.constr(strict=True, max_length=4096)
ListText = pydantic.constr(strict=True, max_length=2**17)


AgreedRound = pydantic.conlist(  # [round, parameters' digest, momentum's digest]
    pydantic.StrictInt | pydantic.constr(strict=True, max_length=32),  # type: ignore[arg-type]
    min_items=3,
    max_items=3,
)
AgreedRounds = pydantic.conlist(AgreedRound, max_items=3)
Evidence = pydantic.conlist(
    pydantic.constr(strict=True, max_length=EVIDENCE_CHARS),  # type: ignore[arg-type]
    max_items=EVIDENCE_KEPT,
)


class StatusRecord(pydantic.BaseModel):
    """A peer's status (status.py), as it travels."""

    name: pydantic.constr(strict=True, max_length=64)  # type: ignore[valid-type]
    round: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    step: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    loss: Number
    tokens_per_s: Number
    last_sync: Number
    failed_rounds: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    addrs: pydantic.conlist(Text, max_items=8)  # type: ignore[valid-type]
    updated: Number
    finishing: pydantic.StrictBool
    done: pydantic.StrictBool
    rejected: pydantic.conlist(Text, max_items=16)  # type: ignore[valid-type]
    peer_id: pydantic.constr(strict=True, max_length=128)  # type: ignore[valid-type]
    sync_every: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    round_s: Number
    period_s: Number = 0.0
    init_digest: pydantic.constr(strict=True, max_length=64)  # type: ignore[valid-type]
    sent_bps: Number
    received_bps: Number
    round_bytes: Number
    matchmaking_s: Number
    success_share: Number
    schedule_step: pydantic.conint(strict=True, ge=0) = 0  # type: ignore[valid-type]
    protocol: pydantic.constr(strict=True, max_length=64) = ""  # type: ignore[valid-type]


class SwarmRecords(pydantic.BaseModel):
    """The swarm's keys (`{swarm}_members` and so on), each a dictionary by signed subkey."""

    members: dict[BytesWithPublicKey, CertText | None]  # type: ignore[valid-type]
    """Each member's certificate (certs.py)."""
    status: dict[BytesWithPublicKey, StatusRecord | None]
    revoked: dict[BytesWithPublicKey, ListText | None]  # type: ignore[valid-type]
    """The newest owner-signed revocation list each member has seen (any copy will do)."""
    agreed: dict[BytesWithPublicKey, AgreedRounds | None]  # type: ignore[valid-type]
    """Digests of the state each peer held at its last rounds (agreement.py)."""
    forgers: dict[BytesWithPublicKey, Evidence | None]  # type: ignore[valid-type]
    """The signed store requests that named forgers at each node, in base64 (forgers.py)."""


def swarm_validators(swarm: str, private_key: RSAPrivateKey) -> list[RecordValidatorBase]:
    """For DHT(record_validators=...): this peer signs its records with `private_key`, and
    checks every record of the swarm's keys it stores or reads."""
    return [SchemaValidator(SwarmRecords, prefix=swarm), RSASignatureValidator(private_key)]


def own_subkey(private_key: RSAPrivateKey) -> bytes:
    """The subkey this peer's records go under: it names this peer's public key."""
    return RSASignatureValidator(private_key).local_public_key


_SIGNER = re.compile(rb"^\[owner:(.+?)\]$")


def signer_of(subkey: object) -> str | None:
    """The public key a record's subkey names (the validator checked it signed the record)."""
    if not isinstance(subkey, bytes):
        return None
    found = _SIGNER.match(subkey)
    return found.group(1).decode(errors="replace") if found else None
