"""Keyed swarms: only members the swarm's owner admitted take part.

The swarm key (`atomtrain keygen`, 64 hex characters) is the *owner key*: the seed of the
Ed25519 key that signs members' certificates (certs.py). A peer holding it admits itself (it is
the owner, or one of the owner's own machines); a member the owner admitted holds only its
certificate and the identity it was issued for (`--peer.swarm-cert`, `--peer.identity`), and
cannot admit anyone, so every identity costs the owner's signature. Three gates close:

- **DHT.** Every DHT request and response carries an access token, the sender's certificate: the
  owner's signature over its RSA public key, and the message is signed with that RSA key
  (hivemind's token protocol, with the owner as its authority). Peers without a valid, unrevoked
  certificate can neither bootstrap from, read from nor write to a keyed swarm.
- **Averaging** and **state download.** hivemind checks none of these RPCs, so every member
  publishes its certificate in the (gated) DHT, under a subkey only it can write (records.py).
  Its averager answers `rpc_join_group`, `rpc_aggregate_part` and `rpc_download_state` only for
  callers whose transport-authenticated peer ID a valid certificate names: libp2p proves the
  caller owns its peer ID on every connection, so a certificate cannot be used by anyone else.

Bans and revocations name the certificate's member, not the peer ID. Without a key the swarm is
open (the peer says so at start). The transport stays encrypted either way (libp2p's TLS/Noise).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from atomtrain.errors import AtomError
from atomtrain.peer.certs import (
    Certificate,
    Revocations,
    issue,
    owner_public_hex,
    read_certificate,
    read_identity,
    unbracketed,
)
from atomtrain.peer.forgers import (
    EVIDENCE_KEPT,
    EVIDENCE_TTL_S,
    evidence_key,
    evidence_of,
    forged_in_answer,
    forged_in_store,
    forger_shown,
)
from atomtrain.peer.records import own_subkey, signer_of, swarm_validators

log = logging.getLogger(__name__)

KEY_ENV = "ATOM_SWARM_KEY"
KEY_HEX_CHARS = 64
SELF_CERT_LIFETIME_S = 3600.0
"""Certificates an owner's peer issues itself are short-lived (it reissues them)."""
PROOF_TTL_S = 30.0
"""Members republish their certificate this often or sooner; the gate trusts a check this long."""
PROOF_GRACE_S = 30.0
"""Past PROOF_TTL_S the gate trusts a check this much longer while it reads the roster anew in
the background; only past both does a check wait for the read. Read on the check's path, a
roster read waits for every DHT node, and a member whose averager is frozen answers none for
seconds (bench attack's stall: a member that had just joined a group started its all-reduce
3.7 s late, reading the certificates of its group, and was taken for a second staller). A
certificate revoked or gone is refused once that read lands: soon after PROOF_TTL_S where its
peer is checked then and the DHT answers, at most PROOF_TTL_S + PROOF_GRACE_S after its last
good check. A peer not checked for that long (back from an exclusion) waits for its read, as
before."""
ROSTER_TTL_S = 2.0
"""The gate reuses a roster it read from the DHT for this long, for a caller that first asked
before that read began. An honest peer stores its certificate before it first asks anything, so
such a read holds it; a caller no certificate names (a sybil identity) is refused from it, and
its requests share one read per ROSTER_TTL_S. Read anew for every request, two DHT gets each,
the refusals ate honest peers' matchmaking (bench attack's sybil: its two extra identities asked
and were asked every round). (A caller refused before its certificate could be read, which an
honest peer's order of start-up avoids, is refused for up to this long after it can be.)"""
ROSTER_READ_S = 10.0
"""A roster read that takes longer has failed: checks that share it are refused, not held."""
SEEN_KEPT = 4096
"""Peer IDs whose first request the gate remembers; past that it forgets them all (each then
costs one more read)."""
SHOWN_KEPT = 256
"""Pieces of evidence of forgers (forgers.py) the DHT's gate remembers having checked; past that
the oldest is checked again when shown again."""
SHOWN_PER_CALL = 8
"""New pieces of evidence the DHT's gate checks at each share (the rest at the next ones)."""


@dataclass(frozen=True)
class SwarmKey:
    secret: bytes = field(repr=False)  # a logged or printed key object never shows the secret

    def owner(self) -> str:
        """The owner's public key (hex): what members' certificates are checked against."""
        return owner_public_hex(self.secret)

    def fingerprint(self) -> str:
        """A short public name of the key (safe to print): which key, never the key."""
        return self.owner()[:8]


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


# --- this peer's membership -----------------------------------------------------------------------


class Membership:
    """This peer's standing in a keyed swarm: the owner it trusts, the RSA key it signs with, and
    its certificate. An owner's peer (holding the swarm key) issues its own certificates; an
    admitted member holds one, issued for its identity."""

    def __init__(
        self,
        owner: str,
        private_key: RSAPrivateKey,
        member: str,
        key: SwarmKey | None = None,
        cert: Certificate | None = None,
    ) -> None:
        self.owner = owner
        self.private_key = private_key
        # an owner's peer certifies itself under its name: no brackets in it (certs.bracketed)
        self.member = unbracketed(member) if key is not None else member
        self._key = key
        self._cert = cert

    def __repr__(self) -> str:
        return f"Membership(member={self.member!r}, owner={self.owner[:8]})"

    @classmethod
    def of_owner(
        cls, key: SwarmKey, member: str, private_key: RSAPrivateKey | None = None
    ) -> Membership:
        return cls(key.owner(), private_key or RSAPrivateKey.process_wide(), member, key=key)

    @classmethod
    def admitted(cls, cert_path: str, identity_path: str) -> Membership:
        """A member's certificate and the identity it was issued for."""
        if not identity_path:
            raise AtomError(
                f"--peer.swarm-cert {cert_path} needs --peer.identity: the identity file it was "
                "issued for"
            )
        cert = read_certificate(cert_path)
        identity = read_identity(identity_path)
        if cert.public_key != identity.public_key or cert.peer_id != identity.peer_id:
            raise AtomError(
                f"certificate {cert_path} was issued for peer {cert.peer_id}, not for identity "
                f"{identity_path} ({identity.peer_id})"
            )
        return cls(cert.owner, identity.private_key, cert.member, cert=cert)

    @property
    def public_key(self) -> str:
        return self.private_key.get_public_key().to_bytes().decode()

    def certificate(self, peer_id: str = "") -> Certificate:
        """The certificate this peer shows for `peer_id` (empty: for the DHT only)."""
        cert = self._cert
        if self._key is None:
            assert cert is not None
            if peer_id and peer_id != cert.peer_id:
                raise AtomError(
                    f"this peer's ID {peer_id} is not the one its certificate names "
                    f"({cert.peer_id}); pass the identity it was issued for"
                )
            return cert
        if (
            cert is None
            or cert.expires < time.time() + SELF_CERT_LIFETIME_S / 2
            or (cert.peer_id != peer_id)
        ):
            cert = issue(
                self._key.secret, self.member, self.public_key, peer_id, SELF_CERT_LIFETIME_S
            )
            self._cert = cert
        return cert

    def authorizer(self) -> SwarmAuthorizer:
        return SwarmAuthorizer(self)

    def validators(self, swarm: str) -> list[Any]:
        return swarm_validators(swarm, self.private_key)


def as_membership(credential: SwarmKey | Membership | None, member: str) -> Membership | None:
    """A membership from a swarm key (an owner's peer named `member`) or as it is."""
    if isinstance(credential, SwarmKey):
        return Membership.of_owner(credential, member)
    return credential


def load_membership(
    key_file: str, cert_file: str, identity_file: str, name: str
) -> Membership | None:
    """This peer's membership: from its certificate, else from the swarm key (file or
    environment, which is then cleared so p2pd and the watchdog never see it); None: open."""
    if cert_file:
        os.environ.pop(KEY_ENV, None)  # never inherited by p2pd and the watchdog
        return Membership.admitted(cert_file, identity_file)
    key = load_swarm_key(key_file, consume_env=True)
    return Membership.of_owner(key, name) if key is not None else None


# --- the DHT gate ---------------------------------------------------------------------------------


class SwarmAuthorizer(TokenAuthorizerBase):
    """hivemind's token protocol with the owner as its authority: a token is a certificate."""

    def __init__(self, credential: SwarmKey | Membership) -> None:
        membership = as_membership(credential, "owner")
        assert membership is not None
        super().__init__(membership.private_key)
        self.membership = membership
        self.revoked: set[str] = set()
        """Members whose tokens are refused (runs in the DHT's process: see note_revoked)."""
        self.forgers: dict[str, tuple[str, str]] = {}
        """Peers that sent a record they could not have signed (forgers.py), refused too: the
        RSA public key their certificate binds -> (its member, why). Refused by key, the identity
        that sent it (the averager's ban follows the member, as every ban: guarded.py)."""
        self.evidence: dict[str, str] = {}
        """The signed store requests that named forgers here (forgers.evidence_of), by the
        forger's public key: shown to the swarm (`share`)."""
        self._checker = RSASignatureValidator(membership.private_key)
        self._shown: dict[bytes, None] = {}  # digests of the evidence checked (SHOWN_KEPT)
        self._sharing = False
        self.owner = membership.owner

    async def get_token(self) -> AccessToken:
        cert = self.membership.certificate()
        return AccessToken(
            username=cert.to_text(),
            public_key=self.local_public_key.to_bytes(),
            expiration_time=datetime.fromtimestamp(cert.expires, timezone.utc).isoformat(),
        )

    def is_token_valid(self, access_token: AccessToken) -> bool:
        cert = Certificate.from_text(access_token.username)
        return (
            cert is not None
            and cert.valid(self.membership.owner)
            and cert.public_key.encode() == bytes(access_token.public_key)
            and cert.member not in self.revoked
            and cert.public_key not in self.forgers
        )

    async def validate_request(self, request: Any) -> bool:
        signature = bytes(request.auth.signature)  # (hivemind's check clears it)
        if not await super().validate_request(request):
            return False
        if forged_in_store(self._checker, request):
            token = request.auth.client_access_token
            self._name(token, "asked this peer to store", evidence_of(request, signature))
            return False
        return True

    async def validate_response(self, response: Any, request: Any) -> bool:
        if not await super().validate_response(response, request):
            return False
        if forged_in_answer(self._checker, response, request):
            self._name(response.auth.service_access_token, "answered this peer's find with")
            return False
        return True

    def _name(self, token: AccessToken, did: str, evidence: str | None = None) -> None:
        """The sender of a forged record (its token was checked: it signed the message), and
        the request that shows it (a store's), kept for the swarm."""
        cert = Certificate.from_text(token.username)
        if cert is None or cert.public_key in self.forgers:
            return
        why = f"{did} a DHT record it could not have signed (another member's, or made up)"
        self.forgers[cert.public_key] = (cert.member, why)
        log.warning("member %s %s: refused from now on", cert.member, why)
        if evidence is not None and len(self.evidence) < EVIDENCE_KEPT:
            self.evidence[cert.public_key] = evidence

    async def share(self, node: Any, swarm: str) -> None:
        """Store the evidence this node holds under its own subkey, then name the forgers that
        the certified members' evidence shows (forgers.forger_shown; each piece checked once,
        at most SHOWN_PER_CALL new ones a call). One share at a time."""
        if self._sharing:
            return
        self._sharing = True
        try:
            await self._share(node, swarm)
        finally:
            self._sharing = False

    async def _share(self, node: Any, swarm: str) -> None:
        key, own = evidence_key(swarm), own_subkey(self.membership.private_key)
        if self.evidence:
            expires = get_dht_time() + EVIDENCE_TTL_S
            await node.store(key, list(self.evidence.values()), expires, subkey=own)
        found = await node.get(key, latest=True)
        if not _entries(found):
            return
        members = await node.get(members_key(swarm), latest=True)
        roster = roster_of(members, await node.get(revoked_key(swarm), latest=True), self.owner)
        checked = 0
        for subkey, item in _entries(found).items():
            shown = getattr(item, "value", None)
            if subkey == own or signer_of(subkey) not in roster.by_signer:
                continue  # (keys anyone can make show nothing)
            for evidence in shown[:EVIDENCE_KEPT] if isinstance(shown, list) else ():
                if not isinstance(evidence, str) or checked >= SHOWN_PER_CALL:
                    continue
                digest = hashlib.sha256(evidence.encode("utf-8", "replace")).digest()
                if digest in self._shown:
                    continue
                self._shown[digest] = None
                while len(self._shown) > SHOWN_KEPT:
                    del self._shown[next(iter(self._shown))]
                checked += 1
                await asyncio.sleep(0)  # (each check verifies a few signatures: the DHT's loop)
                try:
                    named = forger_shown(evidence, self.owner, self._checker)
                except Exception:  # (whatever it holds, the next piece is checked)
                    named = None
                mine = self.membership.public_key  # (a forger's own node reads its evidence)
                if named is not None and named[0] not in self.forgers and named[0] != mine:
                    public_key, member = named
                    why = "asked another node to store a DHT record it could not have signed"
                    self.forgers[public_key] = (member, f"{why} (its signed request, shown)")
                    log.warning("member %s %s: refused from now on", member, why)

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        cert = Certificate.from_text(access_token.username)
        return cert is None or cert.expires < time.time() + SELF_CERT_LIFETIME_S / 4


async def _share(_dht: Any, node: Any, swarm: str) -> None:
    authorizer = getattr(node.protocol, "authorizer", None)
    if not isinstance(authorizer, SwarmAuthorizer):
        return
    try:
        await authorizer.share(node, swarm)
    except Exception as e:  # (the DHT going away, a store that failed: shared again later)
        log.debug("evidence of forgers not shared: %r", e)


def share_evidence(dht: Any, swarm: str) -> Any:
    """A future of this node's evidence of forgers shown to the swarm, and the forgers others'
    evidence shows named in the DHT's gate (read_forgers then reads them)."""
    return dht.run_coroutine(partial(_share, swarm=swarm), return_future=True)


async def _set_revoked(_dht: Any, node: Any, members: tuple[str, ...]) -> None:
    authorizer = getattr(node.protocol, "authorizer", None)
    if isinstance(authorizer, SwarmAuthorizer):
        authorizer.revoked = set(members)


def note_revoked(dht: Any, members: tuple[str, ...]) -> None:
    """Tell the DHT's process (its gate) which members are revoked."""
    dht.run_coroutine(partial(_set_revoked, members=members), return_future=True)


# --- the roster: certificates and revocations in the DHT ------------------------------------------


def members_key(swarm: str) -> str:
    return f"{swarm}_members"


def revoked_key(swarm: str) -> str:
    return f"{swarm}_revoked"


@dataclass
class Roster:
    """The members the DHT shows: valid certificates by the public key that published them, and
    the newest revocation list."""

    by_signer: dict[str, Certificate] = field(default_factory=dict)
    revocations: Revocations | None = None

    def of_peer(self, peer_id: str) -> Certificate | None:
        for cert in self.by_signer.values():
            if cert.peer_id == peer_id:
                return cert
        return None


def roster_of(members: Any, revoked: Any, owner: str) -> Roster:
    """The roster from the DHT's answers for the members and revocation keys (either None)."""
    out = Roster()
    for entry in _entries(revoked).values():
        found = Revocations.from_text(getattr(entry, "value", None), owner)
        if found and (out.revocations is None or found.issued > out.revocations.issued):
            out.revocations = found
    gone = set(out.revocations.members) if out.revocations else set()
    now = time.time()
    for subkey, entry in _entries(members).items():
        signer = signer_of(subkey)
        cert = Certificate.from_text(getattr(entry, "value", None))
        if signer is None or cert is None or cert.public_key != signer:
            continue  # a record its certificate's holder did not sign
        if cert.member not in gone and cert.valid(owner, now):
            out.by_signer[signer] = cert
    return out


def _entries(found: Any) -> dict:
    value = getattr(found, "value", None)
    return value if isinstance(value, dict) else {}


def read_roster(dht: Any, swarm: str, owner: str) -> Roster:
    return roster_of(
        dht.get(members_key(swarm), latest=True), dht.get(revoked_key(swarm), latest=True), owner
    )


def declare_member(
    dht: Any,
    swarm: str,
    credential: SwarmKey | Membership | None,
    peer_id: PeerID,
    wait: bool = False,
    revocations: Revocations | None = None,
) -> list[Any]:
    """Publish this peer's certificate (refreshed with its status), and a copy of the newest
    revocation list it knows, so the list outlives whoever published it. `wait` at start, so the
    gates know this peer before it asks anything of them. Futures of the stores not waited for
    (each: whether it was stored)."""
    membership = as_membership(credential, peer_id.to_base58())
    if membership is None:
        return []
    subkey = own_subkey(membership.private_key)
    expires = get_dht_time() + PROOF_TTL_S
    cert = membership.certificate(peer_id.to_base58())
    stored = dht.store(members_key(swarm), cert.to_text(), expires, subkey, return_future=not wait)
    futures = [] if wait else [stored]
    if revocations is not None:
        listed = revocations.to_text()
        if "[signature:" in listed:  # (an older owner's list: every copy would fail the check)
            log.warning("not copying the revocation list on: a name in it holds a signature")
        else:
            futures.append(
                dht.store(revoked_key(swarm), listed, expires, subkey, return_future=True)
            )
    return futures


# --- the averaging and state-download gates -------------------------------------------------------


class MemberGate:
    """Decides, inside the averager's process, whether a caller may take part: a valid,
    unrevoked certificate in the DHT names its peer ID, and its member is not banned. A ban
    follows the member: every peer ID its certificates name. Verified peers are cached a while."""

    def __init__(self, credential: SwarmKey | Membership | None, swarm: str) -> None:
        membership = as_membership(credential, "gate")
        self.owner = membership.owner if membership is not None else None
        self.signing_key = membership.private_key if membership is not None else None
        """The key this peer's certificate binds to its peer ID: it seals the round metadata it
        tells its groups (gather.py). None in an open swarm."""
        self.swarm = swarm
        self.banned: set[PeerID] = set()
        self.banned_members: set[str] = set()
        self._verified: dict[PeerID, tuple[float, str, str]] = {}  # until, member, public key
        self._first_asked: dict[PeerID, float] = {}  # when each unverified caller first asked
        self._roster: tuple[float, Roster] | None = None  # when its read began, the roster
        self._reading: tuple[float, asyncio.Future] | None = None  # the read in flight
        self._renewing: dict[PeerID, asyncio.Future] = {}  # checks renewed in the background

    def ban(self, peer_id: PeerID) -> None:
        self.banned.add(peer_id)
        verified = self._verified.get(peer_id)
        if verified is not None:
            self.banned_members.add(verified[1])

    async def warm(self, dht: Any, peer_ids: list[PeerID]) -> None:
        """Check `peer_ids` now, as a round begins (its members, this peer too): the checks of
        the group it forms then read nothing from the DHT. Read once the group has formed, they
        wait for the DHT's read of the roster, which waits on every node it asks: in bench
        attack's stall (run Q6, seed 1) the first round, whose checks met a cold cache, took
        7-9 s where a round took 2.7, most of it between matchmaking's end and the all-reduce's
        start (where the checks are; the cause not traced further)."""
        if self.owner is None:
            return
        asked = time.monotonic()
        due = [p for p in peer_ids if self._verified.get(p, (-math.inf,))[0] <= asked]
        if not due:
            return
        roster = await self._read_roster(dht, asked)  # one read for them all
        for peer_id in due if roster is not None else ():
            cert = roster.of_peer(peer_id.to_base58())
            # a check since has the last word; one found nowhere is left to the checks
            if cert is not None and self._verified.get(peer_id, (-math.inf,))[0] <= asked:
                self._note(peer_id, cert, asked)
                self._first_asked.pop(peer_id, None)

    async def peers_of(self, dht: Any, public_key: str) -> list[PeerID]:
        """The peer IDs whose certificates bind `public_key`: from the checks made, and the
        roster."""
        found = [p for p, (_, _, key) in self._verified.items() if key == public_key]
        roster = await self._read_roster(dht, time.monotonic())
        cert = roster.by_signer.get(public_key) if roster is not None else None
        if cert is not None and cert.peer_id:
            found.append(PeerID.from_base58(cert.peer_id))
        return list(dict.fromkeys(found))

    async def allows(self, dht: Any, peer_id: PeerID) -> bool:
        if peer_id in self.banned:
            return False
        if self.owner is None:
            return True
        member = await self._certified(dht, peer_id)
        if member is None:
            return False
        if member[0] in self.banned_members:
            self.banned.add(peer_id)
            return False
        return True

    async def public_key(self, dht: Any, peer_id: PeerID) -> str | None:
        """The RSA key a valid certificate binds to `peer_id` (None: none does, or open swarm)."""
        if self.owner is None:
            return None
        member = await self._certified(dht, peer_id)
        return member[1] if member is not None else None

    async def _certified(self, dht: Any, peer_id: PeerID) -> tuple[str, str] | None:
        """(member, public key) a valid, unrevoked certificate names for `peer_id`."""
        now = time.monotonic()
        until, member, key = self._verified.get(peer_id, (-math.inf, "", ""))
        if until <= now < until + PROOF_GRACE_S:
            self._renew_later(dht, peer_id, until)
        elif until <= now:
            if len(self._first_asked) >= SEEN_KEPT:
                self._first_asked.clear()
            roster = await self._read_roster(dht, self._first_asked.setdefault(peer_id, now))
            cert = roster.of_peer(peer_id.to_base58()) if roster is not None else None
            if roster is not None:
                self._note(peer_id, cert, now)
            if cert is None:
                return None
            self._first_asked.pop(peer_id, None)
            member, key = cert.member, cert.public_key
        return member, key

    def _note(self, peer_id: PeerID, cert: Certificate | None, asked: float) -> None:
        """Record a check of `peer_id` against a roster read at `asked` or later: trusted for
        PROOF_TTL_S from then where `cert` names it; else refused until checked anew, its member
        still known to ban() (its other peer IDs follow a ban)."""
        if cert is not None:
            self._verified[peer_id] = (asked + PROOF_TTL_S, cert.member, cert.public_key)
        elif peer_id in self._verified:
            self._verified[peer_id] = (-math.inf, self._verified[peer_id][1], "")

    def _renew_later(self, dht: Any, peer_id: PeerID, expired: float) -> None:
        """Check `peer_id` again, in the background, against a roster read since its check
        expired (PROOF_GRACE_S): a certificate gone or revoked by then ends its trust."""
        task = self._renewing.get(peer_id)
        if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            return

        async def renew() -> None:
            asked = time.monotonic()
            roster = await self._read_roster(dht, expired)
            if roster is None:  # the DHT did not answer: the grace runs on
                return
            if self._verified.get(peer_id, (None,))[0] != expired:
                return  # a check since (a read on the path, past the grace) has the last word
            self._note(peer_id, roster.of_peer(peer_id.to_base58()), asked)

        self._renewing[peer_id] = asyncio.ensure_future(renew())
        if len(self._renewing) >= SEEN_KEPT:
            self._renewing = {p: t for p, t in self._renewing.items() if not t.done()}

    async def _read_roster(self, dht: Any, since: float) -> Roster | None:
        """The swarm's roster as read by a DHT read that began at `since` or later and at most
        ROSTER_TTL_S ago: the last one, the one in flight, or a new one (None: the DHT did not
        answer)."""
        now = time.monotonic()
        if self._roster is not None:
            began, roster = self._roster
            if began >= since and now - began < ROSTER_TTL_S:
                return roster
        reading = self._reading
        if (
            reading is None
            or reading[0] < since
            or reading[1].done()  # its roster is in self._roster, aged there (or it failed)
            or reading[1].get_loop() is not asyncio.get_running_loop()
        ):
            reading = self._reading = (now, asyncio.ensure_future(self._fetch_roster(dht, now)))
        roster = await asyncio.shield(reading[1])
        if self._reading is reading:
            self._reading = None
        return roster

    async def _get_roster(self, dht: Any) -> tuple[Any, Any]:
        members = await dht.get(members_key(self.swarm), latest=True, return_future=True)
        revoked = await dht.get(revoked_key(self.swarm), latest=True, return_future=True)
        return members, revoked

    async def _fetch_roster(self, dht: Any, began: float) -> Roster | None:
        try:
            members, revoked = await asyncio.wait_for(self._get_roster(dht), ROSTER_READ_S)
        except Exception:  # (a timeout too)
            return None
        if members is None:  # a keyed swarm holds this peer's own certificate: the read failed
            return None
        assert self.owner is not None
        roster = roster_of(members, revoked, self.owner)
        if self._roster is None or self._roster[0] < began:
            self._roster = (began, roster)
        return roster
