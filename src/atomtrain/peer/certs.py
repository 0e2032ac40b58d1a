"""Certificates: the swarm's owner admits each member by signing its public key.

The owner key (`atomtrain keygen`, the same 64 hex characters a swarm key always was) is the seed
of an Ed25519 signing key. A member makes its own identity (`atomtrain keygen --member`: an RSA
key that is both its libp2p identity, hence its peer ID, and the key it signs DHT requests and
records with) and hands its public half to the owner, who signs a certificate binding a member
name to that public key and peer ID (`atomtrain admit`). A member cannot make a certificate for a
new peer ID, so a sybil costs the owner's signature. Bans and revocations name the member, so they
follow the certificate, not one peer ID. The owner revokes members with a signed, versioned list
(`atomtrain revoke`) that peers publish in the DHT.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from atomtrain.errors import AtomError

CERT_LIFETIME_DAYS = 90.0
MAX_MEMBER_CHARS = 64
MAX_REVOKED = 1024


def owner_signer(secret: bytes) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(secret)


def owner_public_hex(secret: bytes) -> str:
    raw = (
        owner_signer(secret)
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )
    return raw.hex()


def _owner_verifies(owner_hex: str, body: bytes, signature_hex: str) -> bool:
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(owner_hex))
        key.verify(bytes.fromhex(signature_hex), body)
        return True
    except (ValueError, InvalidSignature):
        return False


def peer_id_of(public_key: str) -> str:
    """The libp2p peer ID (base58) of an RSA public key in OpenSSH form, as p2pd derives it."""
    key = RSAPublicKey.from_bytes(public_key.encode())._public_key
    der = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(proto).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


# --- certificates ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Certificate:
    member: str
    """Who the owner admitted: bans and revocations name it."""
    peer_id: str
    """libp2p peer ID (base58) the member averages as; empty: DHT access only (an owner's peer
    before its peer ID is known)."""
    public_key: str
    """RSA public key (OpenSSH form) the member signs DHT requests and records with."""
    owner: str
    """The owner's Ed25519 public key (hex): the swarm a certificate belongs to."""
    expires: float
    """Unix seconds after which the certificate is void."""
    signature: str = ""

    def body(self) -> bytes:
        fields = [self.member, self.peer_id, self.public_key, self.owner, repr(self.expires)]
        return json.dumps(["atom-cert", *fields], separators=(",", ":")).encode()

    def to_text(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_text(cls, text: Any) -> Certificate | None:
        """A certificate from its text, or None when the text is not one (unsigned ones pass:
        `valid` checks the signature)."""
        try:
            d = json.loads(text)
            cert = cls(**{k: d[k] for k in cls.__dataclass_fields__})
        except (TypeError, ValueError, KeyError, RecursionError):  # (16,000 brackets: the last)
            return None
        strings = (cert.member, cert.peer_id, cert.public_key, cert.owner, cert.signature)
        if not all(isinstance(s, str) for s in strings) or not isinstance(cert.expires, float):
            return None
        return cert

    def valid(self, owner: str, now: float | None = None) -> bool:
        """Signed by `owner` and not expired."""
        now = time.time() if now is None else now
        if self.owner != owner or not math.isfinite(self.expires) or self.expires < now:
            return False
        if not 0 < len(self.member) <= MAX_MEMBER_CHARS:
            return False
        # the owner's signature binds the peer ID to the key (`atomtrain admit` checks that one
        # derives from the other; an owner's own peers may sign with another key than p2pd's)
        return _owner_verifies(owner, self.body(), self.signature)


def bracketed(name: str) -> bool:
    """Whether a member's name holds a square bracket: names are copied into the records every
    peer writes (revocation lists, certificates), and a `[signature:...]` there would make every
    copy fail hivemind's check of signed records on every node (forgers.py: each copier named a
    forger). `atomtrain admit` and `atomtrain revoke` refuse such names."""
    return "[" in name or "]" in name


def unbracketed(text: str) -> str:
    """`text` with its square brackets made round (`bracketed`): for a name this peer copies
    into its own records, its user's choice or another peer's."""
    return text.replace("[", "(").replace("]", ")")


def issue(
    secret: bytes,
    member: str,
    public_key: str,
    peer_id: str,
    lifetime_s: float = CERT_LIFETIME_DAYS * 86400,
) -> Certificate:
    """A certificate signed with the owner key (`secret`)."""
    cert = Certificate(
        member=member[:MAX_MEMBER_CHARS],
        peer_id=peer_id,
        public_key=public_key,
        owner=owner_public_hex(secret),
        expires=float(time.time() + lifetime_s),
    )
    return replace(cert, signature=owner_signer(secret).sign(cert.body()).hex())


def read_certificate(path: str) -> Certificate:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise AtomError(f"cannot read certificate {path}: {e.strerror or e}") from None
    cert = Certificate.from_text(text)
    if cert is None or not cert.valid(cert.owner):
        raise AtomError(
            f"{path} is not a valid certificate (expired, or not written by `atomtrain admit`)"
        )
    return cert


# --- member identities ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """A peer's RSA key: its libp2p identity (peer ID) and its DHT signing key."""

    private_key: RSAPrivateKey
    peer_id: str
    path: str = ""
    """The libp2p identity file it was read from (p2pd reads it there); empty: in memory."""

    def __repr__(self) -> str:  # never the private key
        return f"Identity(peer_id={self.peer_id!r})"

    @property
    def public_key(self) -> str:
        return self.private_key.get_public_key().to_bytes().decode()

    def public_text(self) -> str:
        """What a member hands the owner to be admitted (safe to share)."""
        return json.dumps({"peer_id": self.peer_id, "public_key": self.public_key}) + "\n"


def read_identity(path: str) -> Identity:
    """A libp2p identity file (RSA, as `atomtrain keygen --member` or p2pd write them). A file
    others may read is refused, like a swarm key."""
    try:
        data = Path(path).read_bytes()
        mode = os.stat(path).st_mode
    except OSError as e:
        raise AtomError(f"cannot read identity {path}: {e.strerror or e}") from None
    try:
        proto = crypto_pb2.PrivateKey.FromString(data)
        if proto.key_type != crypto_pb2.RSA:
            raise ValueError("not RSA")
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": proto.data})
        peer_id = PeerID.from_identity(data).to_base58()
    except Exception:
        raise AtomError(
            f"{path} is not an identity (an RSA libp2p key, as `atomtrain keygen --member` writes)"
        ) from None
    if os.name == "posix" and mode & 0o077:
        raise AtomError(
            f"identity {path} is readable by others (mode {mode & 0o777:o}); run `chmod 600 {path}`"
        )
    return Identity(key, peer_id, path)


def write_new_identity(path: Path, force: bool = False) -> Identity:
    """A new member identity (mode 400, as p2pd writes it) and, beside it, its public half
    (PATH.pub), which the member hands the owner."""
    if path.exists() and not force:
        raise AtomError(f"{path} already exists; pass --force to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    P2P.generate_identity(str(path))
    identity = read_identity(str(path))
    path.with_name(path.name + ".pub").write_text(identity.public_text())
    return identity


def read_public(path: str) -> tuple[str, str]:
    """(peer ID, public key) from a member's PATH.pub; the peer ID must be its key's."""
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8", errors="replace"))
        public_key, peer_id = str(d["public_key"]), str(d["peer_id"])
        if peer_id_of(public_key) != peer_id:
            raise ValueError("peer ID of another key")
    except OSError as e:
        raise AtomError(f"cannot read {path}: {e.strerror or e}") from None
    except Exception:  # malformed JSON, fields, or a key of a kind libp2p does not take
        raise AtomError(
            f"{path} is not a member's public key (the .pub file `atomtrain keygen --member` "
            "writes)"
        ) from None
    return peer_id, public_key


# --- revocation -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Revocations:
    """The members the owner revoked; a later list (`issued`) supersedes an earlier one."""

    owner: str
    issued: float
    members: tuple[str, ...]
    signature: str = ""

    def body(self) -> bytes:
        parts = ["atom-revoked", self.owner, repr(self.issued), *self.members]
        return json.dumps(parts, separators=(",", ":")).encode()

    def to_text(self) -> str:
        return json.dumps({**asdict(self), "members": list(self.members)}, sort_keys=True)

    @classmethod
    def from_text(cls, text: Any, owner: str) -> Revocations | None:
        """The list, or None unless it parses and `owner` signed it."""
        try:
            d = json.loads(text)
            members = d["members"]
            if not isinstance(members, list) or len(members) > MAX_REVOKED:
                return None
            out = cls(str(d["owner"]), float(d["issued"]), tuple(str(m) for m in members))
            out = replace(out, signature=str(d["signature"]))
        except (TypeError, ValueError, KeyError):
            return None
        if out.owner != owner or not _owner_verifies(owner, out.body(), out.signature):
            return None
        return out


def revoke(secret: bytes, members: list[str], previous: Revocations | None) -> Revocations:
    """A new signed list: the previous one's members and `members` (names with square
    brackets left out: no certificate names one, `bracketed`)."""
    members = [m for m in members if not bracketed(m)]
    names = sorted(set(previous.members if previous else ()) | set(members))
    issued = max(time.time(), previous.issued + 1e-3 if previous else 0.0)
    out = Revocations(owner_public_hex(secret), issued, tuple(names))
    return replace(out, signature=owner_signer(secret).sign(out.body()).hex())
