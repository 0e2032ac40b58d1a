"""Swarm keys: only peers that hold the swarm's secret take part.

A swarm key is 32 random bytes, written as 64 hex characters by `atomtrain keygen`. Peers load it
from `--swarm-key FILE` or from the `ATOM_SWARM_KEY` environment variable (the key's text). With a
key, three gates close:

- **DHT.** Every DHT request and response carries an access token: the sender's RSA public key and
  an expiry, authenticated with an HMAC under the swarm key, and the message is signed with that
  RSA key (hivemind's token protocol, with the HMAC in place of an authority's signature). Peers
  without the key can neither bootstrap from, read from nor write to a keyed swarm.
- **Averaging** and **state download.** hivemind checks none of these RPCs, so every peer
  publishes a *membership proof* in the (gated) DHT: an HMAC of its libp2p peer ID under the swarm
  key. Its averager answers `rpc_join_group`, `rpc_aggregate_part` and `rpc_download_state` only
  for callers whose transport-authenticated peer ID has a valid proof. A proof cannot be replayed
  by anyone else: libp2p proves the caller owns its peer ID on every connection.

Without a key the swarm is open (the peer says so at start). The transport stays encrypted either
way (libp2p's TLS/Noise).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from hivemind.p2p import PeerID
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.timed_storage import get_dht_time

from atomtrain.errors import AtomError

KEY_ENV = "ATOM_SWARM_KEY"
KEY_HEX_CHARS = 64
TOKEN_LIFETIME = timedelta(hours=1)
PROOF_TTL_S = 30.0


@dataclass(frozen=True)
class SwarmKey:
    secret: bytes = field(repr=False)  # a logged or printed key object never shows the secret

    def mac(self, purpose: bytes, *parts: bytes) -> bytes:
        h = hmac.new(self.secret, purpose, hashlib.sha256)
        for part in parts:  # length-prefixed, so no two part lists authenticate alike
            h.update(len(part).to_bytes(4, "big"))
            h.update(part)
        return h.digest()

    def fingerprint(self) -> str:
        """A short public name of the key (safe to print): which key, never the key."""
        return self.mac(b"atom-fingerprint").hex()[:8]


def parse_key(text: str, where: str) -> SwarmKey:
    """The key from its text form; AtomError names `where` when the text is not a key."""
    body = text.strip()
    if len(body) != KEY_HEX_CHARS or any(c not in "0123456789abcdefABCDEF" for c in body):
        raise AtomError(
            f"{where} is not a swarm key (expected {KEY_HEX_CHARS} hex characters, "
            "as written by `atomtrain keygen`)"
        )
    return SwarmKey(bytes.fromhex(body))


def load_swarm_key(path: str, consume_env: bool = False) -> SwarmKey | None:
    """The key from a file, else from the environment; None for an open swarm.

    A key file others may read is refused (a key is a password). With `consume_env`, a key taken
    from the environment is removed from it, so the processes this one starts afterwards (p2pd,
    the watchdog) do not inherit the secret."""
    if path:
        try:
            text = Path(path).read_text(encoding="ascii", errors="replace")
            mode = os.stat(path).st_mode
        except OSError as e:
            raise AtomError(f"cannot read swarm key {path}: {e.strerror or e}") from None
        key = parse_key(text, f"swarm key file {path}")
        if os.name == "posix" and mode & 0o077:
            raise AtomError(
                f"swarm key file {path} is readable by others (mode {mode & 0o777:o}); "
                f"run `chmod 600 {path}`"
            )
        return key
    if os.environ.get(KEY_ENV):
        key = parse_key(os.environ[KEY_ENV], f"${KEY_ENV}")
        if consume_env:
            del os.environ[KEY_ENV]
        return key
    return None


def write_new_key(path: Path, force: bool = False) -> SwarmKey:
    """A fresh random key, readable by its owner only. An existing file is never replaced
    unless `force`."""
    if path.exists() and not force:
        raise AtomError(f"{path} already exists; pass --force to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    key = SwarmKey(secrets.token_bytes(KEY_HEX_CHARS // 2))
    # a new file of a random name (O_EXCL, mode 600): never one planted in its place
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(key.secret.hex() + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return key


# --- the DHT gate ---------------------------------------------------------------------------------


class SwarmAuthorizer(TokenAuthorizerBase):
    """hivemind's token protocol with tokens authenticated by the swarm key."""

    def __init__(self, key: SwarmKey) -> None:
        super().__init__()
        self.key = key

    def _token_mac(self, token: AccessToken) -> bytes:
        return self.key.mac(
            b"atom-token",
            token.username.encode(),
            bytes(token.public_key),
            token.expiration_time.encode(),
        )

    async def get_token(self) -> AccessToken:
        expires = datetime.now(timezone.utc) + TOKEN_LIFETIME
        token = AccessToken(
            username="atom-peer",
            public_key=self.local_public_key.to_bytes(),
            expiration_time=expires.isoformat(),
        )
        token.signature = self._token_mac(token)
        return token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        if not hmac.compare_digest(bytes(access_token.signature), self._token_mac(access_token)):
            return False
        try:
            expires = datetime.fromisoformat(access_token.expiration_time)
        except ValueError:
            return False
        return expires.tzinfo is not None and expires > datetime.now(timezone.utc)

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        expires = datetime.fromisoformat(access_token.expiration_time)
        return expires - datetime.now(timezone.utc) < TOKEN_LIFETIME / 4


# --- the averaging and state-download gates -------------------------------------------------------


def members_key(swarm: str) -> str:
    return f"{swarm}_members"


def member_proof(key: SwarmKey, peer_id: PeerID) -> bytes:
    return key.mac(b"atom-member", peer_id.to_bytes())


def declare_member(
    dht: Any, swarm: str, key: SwarmKey | None, peer_id: PeerID, wait: bool = False
) -> None:
    """Publish this peer's membership proof (refreshed with its status). `wait` at start, so
    the gates know this peer before it asks anything of them."""
    if key is None:
        return
    dht.store(
        members_key(swarm),
        subkey=peer_id.to_base58(),
        value=member_proof(key, peer_id).hex(),
        expiration_time=get_dht_time() + PROOF_TTL_S,
        return_future=not wait,
    )


class MemberGate:
    """Decides, inside the averager's process, whether a caller may take part: it holds the key
    (a valid proof in the DHT) and is not banned. Verified peers are cached for a while."""

    def __init__(self, key: SwarmKey | None, swarm: str) -> None:
        self.key = key
        self.swarm = swarm
        self.banned: set[PeerID] = set()
        self._verified: dict[PeerID, float] = {}

    def ban(self, peer_id: PeerID) -> None:
        self.banned.add(peer_id)

    async def allows(self, dht: Any, peer_id: PeerID) -> bool:
        if peer_id in self.banned:
            return False
        if self.key is None:
            return True
        now = time.monotonic()
        if self._verified.get(peer_id, 0.0) > now:
            return True
        try:
            found = await dht.get(members_key(self.swarm), latest=True, return_future=True)
        except Exception:
            return False
        entries = getattr(found, "value", None)
        entry = entries.get(peer_id.to_base58()) if isinstance(entries, dict) else None
        proof = getattr(entry, "value", None)
        if not isinstance(proof, str) or len(proof) != 64:
            return False
        try:
            ok = hmac.compare_digest(bytes.fromhex(proof), member_proof(self.key, peer_id))
        except ValueError:
            return False
        if ok:
            self._verified[peer_id] = now + PROOF_TTL_S
        return ok
