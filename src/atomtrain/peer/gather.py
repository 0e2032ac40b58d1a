"""Signed round metadata: what a member tells its group travels under its own signature.

hivemind sends each member's gathered metadata (bandwidth, mode, and what the member says about
its contribution: weight, rms, probe, sketch...) to the group's leader in the join request, and
the leader sends every member the whole group's. Unsigned, a leader could rewrite any member's
claims (get it clipped or banned, move the weights). So each member seals its blob with the RSA
key its certificate binds to its peer ID (auth.py): the signature covers the blob, the averager's
prefix (the swarm), the signer's peer ID and the round's scheduled time. A leader can then
neither alter a blob, nor move it to another peer ID or swarm, nor replay one from a round older
than the freshness window (a replay inside it carries a stale probe: the probe check discards the
round; the signer itself sees its own blob changed).

Open swarms have no key bound to a peer ID (their records are signed with a per-runtime key that
nothing ties to the peer's libp2p identity), so their blobs are neither sealed nor checked; a
member there only sees whether its own blob came back as it sent it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer

TAG = "atom-gather/1"
NO_KEY = "no certified key"
"""Why a blob fails when no certificate names its peer ID (nobody to blame: the roster may not
have answered)."""


def _payload(prefix: str, peer_id: str, at: float, data: bytes) -> bytes:
    return MSGPackSerializer.dumps([TAG, prefix, peer_id, float(at), data])


def seal(key: RSAPrivateKey, prefix: str, peer_id: str, at: float, data: bytes) -> bytes:
    """`data` (hivemind's gathered blob) signed for this averager's `prefix`, the signer's
    `peer_id` (base58) and its round scheduled at `at` (DHT seconds): what the group is sent."""
    signature = key.sign(_payload(prefix, peer_id, at, data))
    return Sealed(float(at), data, signature).pack()


@dataclass(frozen=True)
class Sealed:
    at: float
    """The signer's round's scheduled time (DHT seconds)."""
    data: bytes
    """hivemind's gathered blob, as the signer made it."""
    signature: bytes

    def pack(self) -> bytes:
        return MSGPackSerializer.dumps([TAG, self.at, self.data, self.signature])


def unseal(blob: Any) -> Sealed | None:
    """The sealed blob's parts, or None when `blob` is not one."""
    try:
        tag, at, data, signature = MSGPackSerializer.loads(blob)
    except Exception:  # any bytes at all may arrive
        return None
    if tag != TAG or not isinstance(at, float) or not math.isfinite(at):
        return None
    if not isinstance(data, bytes) or not isinstance(signature, bytes):
        return None
    return Sealed(at, data, signature)


def check(
    blob: Any,
    prefix: str,
    peer_id: str,
    public_key: str | None,
    round_at: float,
    window_s: float,
) -> tuple[bytes | None, str]:
    """(hivemind's blob, "") when `blob` was sealed by `public_key` for `peer_id` and `prefix`,
    for a round scheduled within `window_s` of `round_at`; else (None, why)."""
    sealed = unseal(blob)
    if sealed is None:
        return None, "not sealed"
    if public_key is None:
        return None, NO_KEY
    try:
        key = RSAPublicKey.from_bytes(public_key.encode())
        valid = key.verify(_payload(prefix, peer_id, sealed.at, sealed.data), sealed.signature)
    except Exception:  # a malformed key or signature
        valid = False
    if not valid:
        return None, "a signature that fails"
    if abs(sealed.at - round_at) > window_s:
        return None, f"sealed for a round {sealed.at - round_at:+.0f} s from this one"
    return sealed.data, ""
