"""`atomtrain admit` (the owner signs a member's certificate) and `atomtrain revoke`.

A member makes its identity with `atomtrain keygen --member alice.id` and hands the owner
`alice.id.pub`; the owner runs `atomtrain admit alice.id.pub --member alice --swarm-key
owner.key` and hands back `alice.cert`; alice trains with `--swarm-cert alice.cert
--peer.identity=alice.id`.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    a = sub.add_parser(
        "admit",
        help="sign a member's certificate with the swarm's owner key",
        description="Write a certificate admitting the member whose public key is in PUB "
        "(written by `atomtrain keygen --member`) to the swarm of the owner key.",
    )
    a.add_argument("pub", metavar="PUB", help="the member's public key file (NAME.id.pub)")
    a.add_argument("--member", required=True, help="the member's name (bans and revocations)")
    a.add_argument("--swarm-key", metavar="FILE", help="the owner key (default $ATOM_SWARM_KEY)")
    a.add_argument("--days", type=float, default=90.0, help="days the certificate is valid")
    a.add_argument("--out", "-o", type=Path, help="certificate file (default MEMBER.cert)")
    a.set_defaults(func=run_admit)

    r = sub.add_parser(
        "revoke",
        help="revoke members of a live swarm (their certificates stop working)",
        description="Publish, in the swarm at --join, a new owner-signed revocation list that "
        "adds MEMBER...; peers refuse the members' certificates from then on.",
    )
    r.add_argument("members", nargs="+", metavar="MEMBER")
    r.add_argument("--join", required=True, metavar="MULTIADDR", help="any live peer")
    r.add_argument("--swarm", default="local", help="swarm name")
    r.add_argument("--swarm-key", metavar="FILE", help="the owner key (default $ATOM_SWARM_KEY)")
    r.set_defaults(func=run_revoke)


def _owner_key(path: str | None):
    from atomtrain.errors import AtomError
    from atomtrain.peer.auth import load_swarm_key

    key = load_swarm_key(path or "")
    if key is None:
        raise AtomError("needs the owner key: pass --swarm-key FILE (atomtrain keygen)")
    return key


MAX_DAYS = 3650


def run_admit(args: argparse.Namespace, _extra: list[str]) -> int:
    from atomtrain.errors import AtomError
    from atomtrain.peer.certs import MAX_MEMBER_CHARS, bracketed, issue, read_public

    key = _owner_key(args.swarm_key)
    if not 0 < len(args.member) <= MAX_MEMBER_CHARS:
        raise AtomError(f"--member must be 1 to {MAX_MEMBER_CHARS} characters")
    if bracketed(args.member):
        raise AtomError(f"--member must hold no square brackets, got {args.member!r}")
    if not 0 < args.days <= MAX_DAYS:  # a longer expiry does not fit the DHT's token dates
        raise AtomError(f"--days must be in (0, {MAX_DAYS}], got {args.days}")
    peer_id, public_key = read_public(args.pub)
    cert = issue(key.secret, args.member, public_key, peer_id, args.days * 86400)
    out = args.out or Path(f"{args.member}.cert")
    try:
        out.write_text(cert.to_text() + "\n")
    except OSError as e:
        raise AtomError(f"cannot write {out} ({e.strerror or e})") from None
    print(f"admitted {args.member} (peer {peer_id}) to swarm {key.fingerprint()}: wrote {out}")
    return 0


def run_revoke(args: argparse.Namespace, _extra: list[str]) -> int:
    from hivemind import DHT
    from hivemind.utils.crypto import RSAPrivateKey
    from hivemind.utils.timed_storage import get_dht_time

    from atomtrain.errors import AtomError
    from atomtrain.peer.auth import Membership, read_roster, revoked_key
    from atomtrain.peer.certs import bracketed, revoke
    from atomtrain.peer.records import own_subkey

    named = [m for m in args.members if bracketed(m)]
    if named:  # (no member is admitted under such a name)
        raise AtomError(f"member names hold no square brackets, got {named[0]!r}")
    key = _owner_key(args.swarm_key)
    signing = RSAPrivateKey()
    owner = Membership.of_owner(key, "owner", signing)
    try:
        dht = DHT(
            initial_peers=[args.join],
            client_mode=True,
            start=True,
            authorizer=owner.authorizer(),
            record_validators=owner.validators(args.swarm),
        )
    except Exception as e:
        raise AtomError(f"cannot reach the swarm at {args.join} ({type(e).__name__})") from None
    try:
        previous = read_roster(dht, args.swarm, key.owner()).revocations
        revoked = revoke(key.secret, args.members, previous)
        stored = dht.store(
            revoked_key(args.swarm),
            revoked.to_text(),
            get_dht_time() + 60.0,  # live peers copy it on within seconds, and keep it
            own_subkey(signing),
        )
        if not stored:
            raise AtomError(f"the swarm at {args.join} did not store the revocation list")
    finally:
        dht.shutdown()
    print(f"revoked {', '.join(revoked.members)} in swarm {args.swarm}")
    return 0
