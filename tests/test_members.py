"""Keyed swarms by certificate (issue 12, items 3 and 4): a member cannot admit new identities,
bans and revocations follow the member, and no member can write another's DHT records."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
from hivemind import DHT
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from atomtrain.errors import AtomError
from atomtrain.peer import auth
from atomtrain.peer.auth import (
    MemberGate,
    Membership,
    SwarmKey,
    declare_member,
    members_key,
    note_revoked,
    read_roster,
    revoked_key,
)
from atomtrain.peer.certs import issue, read_identity, revoke, write_new_identity
from atomtrain.peer.figures import note_rejections
from atomtrain.peer.forgers import read_forgers
from atomtrain.peer.records import own_subkey
from atomtrain.peer.state import download_sources, resync_floor
from atomtrain.peer.status import PeerStatus, publish, read_statuses, status_key

SWARM = "mem"


def admit(key: SwarmKey, tmp_path: Path, member: str) -> tuple[Membership, str]:
    """A member the owner admitted: (its membership, its identity file)."""
    identity = write_new_identity(tmp_path / f"{member}-{secrets.token_hex(3)}.id")
    cert = issue(key.secret, member, identity.public_key, identity.peer_id)
    cert_file = tmp_path / f"{identity.peer_id}.cert"
    cert_file.write_text(cert.to_text())
    return Membership.admitted(str(cert_file), identity.path), identity.path


def start_dht(m: Membership, initial: list[str], identity: str = "") -> DHT:
    return DHT(
        initial_peers=initial,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        start=True,
        authorizer=m.authorizer(),
        record_validators=m.validators(SWARM),
        **({"identity_path": identity} if identity else {}),
    )


class AwaitableDHT:
    """The DHT as the gate sees it in the averager's process (gets it can await)."""

    def __init__(self, dht: DHT) -> None:
        self.dht = dht

    def get(self, key: str, latest: bool, return_future: bool):
        async def got():
            return self.dht.get(key, latest=latest)

        return got()


def allows(gate: MemberGate, dht: DHT, peer_id: str) -> bool:
    return asyncio.run(gate.allows(AwaitableDHT(dht), PeerID.from_base58(peer_id)))


def test_only_the_owner_admits_and_bans_and_revocations_follow_the_member(tmp_path: Path):
    key = SwarmKey(secrets.token_bytes(32))
    owner = Membership.of_owner(key, "owner", RSAPrivateKey())
    alice, alice_id = admit(key, tmp_path, "alice")
    alice2, alice2_id = admit(key, tmp_path, "alice")  # a second machine of alice's
    bob, bob_id = admit(key, tmp_path, "bob")
    # a member holds no owner key: its certificate serves its own identity only, so a sybil
    # (a new peer ID) needs the owner's signature
    sybil = write_new_identity(tmp_path / "sybil.id")
    (tmp_path / "alice.cert").write_text(alice.certificate().to_text())
    with pytest.raises(AtomError, match="was issued for peer"):
        Membership.admitted(str(tmp_path / "alice.cert"), sybil.path)
    (tmp_path / "loose.id").write_bytes(Path(sybil.path).read_bytes())
    (tmp_path / "loose.id").chmod(0o644)
    with pytest.raises(AtomError, match="readable by others.*chmod 600"):
        read_identity(str(tmp_path / "loose.id"))

    host = start_dht(owner, [])
    addrs = [str(a) for a in host.get_visible_maddrs()]
    others: list[DHT] = []
    try:
        # the DHT gate: alice's certificate behind another signing key is refused
        stolen = Membership(alice.owner, sybil.private_key, "alice", cert=alice.certificate())
        with pytest.raises(RuntimeError, match="bootstrap failed"):
            DHT(initial_peers=addrs, start=True, authorizer=stolen.authorizer())
        members = [(alice, alice_id), (alice2, alice2_id), (bob, bob_id)]
        for m, identity in members:
            others.append(start_dht(m, addrs, identity))
            declare_member(others[-1], SWARM, m, others[-1].peer_id, wait=True)
        ids = [dht.peer_id.to_base58() for dht in others]
        # the averaging gate: members pass, the sybil's peer ID does not
        gate = MemberGate(owner, SWARM)
        assert [allows(gate, host, p) for p in ids] == [True, True, True]
        assert not allows(gate, host, sybil.peer_id)
        # a ban follows the member: alice's other peer ID is refused too; bob is not
        gate.ban(PeerID.from_base58(ids[0]))
        assert [allows(gate, host, p) for p in ids] == [False, False, True]
        # the owner revokes bob: the signed list in the DHT closes the averaging gate...
        revoked = revoke(key.secret, ["bob"], None)
        expires = get_dht_time() + 60
        assert host.store(
            revoked_key(SWARM), revoked.to_text(), expires, own_subkey(owner.private_key)
        )
        assert read_roster(others[0], SWARM, key.owner()).revocations == revoked
        assert not allows(MemberGate(owner, SWARM), host, ids[2])
        # ...and, handed to the DHT's process, the DHT gate
        note_revoked(host, revoked.members)
        with pytest.raises(RuntimeError, match="bootstrap failed"):
            DHT(initial_peers=addrs, start=True, authorizer=bob.authorizer())
        # a list the owner did not sign changes nothing
        forged = revoke(secrets.token_bytes(32), ["alice"], None)
        others[1].store(
            revoked_key(SWARM), forged.to_text(), expires, own_subkey(alice2.private_key)
        )
        assert read_roster(host, SWARM, key.owner()).revocations == revoked
    finally:
        for dht in others:
            dht.shutdown()
        host.shutdown()


def owner_two_members_and_a_sybil(tmp_path: Path):
    """A new swarm's owner membership, alice and bob admitted (each with its identity file),
    and a sybil's peer ID no certificate names."""
    key = SwarmKey(secrets.token_bytes(32))
    owner = Membership.of_owner(key, "owner", RSAPrivateKey())
    sybil = PeerID.from_base58(write_new_identity(tmp_path / "sybil.id").peer_id)
    return owner, admit(key, tmp_path, "alice"), admit(key, tmp_path, "bob"), sybil


class CountedDHT(AwaitableDHT):
    """The same DHT, counting the gets the gate makes of it."""

    def __init__(self, dht: DHT) -> None:
        super().__init__(dht)
        self.gets = 0

    def get(self, key: str, latest: bool, return_future: bool):
        self.gets += 1
        return super().get(key, latest, return_future)


def test_the_gate_reads_the_roster_once_for_a_callers_many_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A sybil identity asking again and again costs one read of the roster per ROSTER_TTL_S,
    shared by its checks waiting on it (read for each, the refusals slowed honest matchmaking);
    a caller first asking after that read began is checked against a new one (an honest peer
    stores its certificate before it asks: a member admitted after the read is let in); a read
    that found no roster is not kept."""
    owner, (alice, alice_id), (bob, bob_id), sybil = owner_two_members_and_a_sybil(tmp_path)
    host = start_dht(owner, [])
    addrs = [str(a) for a in host.get_visible_maddrs()]
    others = [start_dht(alice, addrs, alice_id)]
    monkeypatch.setattr(auth, "ROSTER_TTL_S", 3600.0)  # no check below outlives the roster
    try:
        declare_member(others[0], SWARM, alice, others[0].peer_id, wait=True)
        counted, gate = CountedDHT(host), MemberGate(owner, SWARM)

        async def checks(peer: PeerID, n: int) -> list[bool]:
            return await asyncio.gather(*[gate.allows(counted, peer) for _ in range(n)])

        assert asyncio.run(checks(sybil, 20)) == [False] * 20
        assert counted.gets == 2  # one read: the members and the revocations
        assert asyncio.run(checks(sybil, 5)) == [False] * 5 and counted.gets == 2
        assert asyncio.run(checks(others[0].peer_id, 3)) == [True] * 3  # asks after that read
        assert counted.gets == 4
        others.append(start_dht(bob, addrs, bob_id))
        declare_member(others[1], SWARM, bob, others[1].peer_id, wait=True)
        assert asyncio.run(checks(others[1].peer_id, 1)) == [True] and counted.gets == 6
        assert asyncio.run(checks(sybil, 1)) == [False] and counted.gets == 6
        monkeypatch.setattr(auth, "ROSTER_TTL_S", 0.0)  # the roster has aged: read anew
        assert asyncio.run(checks(sybil, 1)) == [False] and counted.gets == 8
        # a read that found no certificate at all (this peer's own is always there) failed:
        # kept, it would refuse every caller for a while; each check reads again
        monkeypatch.setattr(auth, "ROSTER_TTL_S", 3600.0)
        elsewhere = MemberGate(owner, "no-such-swarm")
        assert asyncio.run(elsewhere.allows(counted, sybil)) is False and counted.gets == 10
        assert asyncio.run(elsewhere.allows(counted, sybil)) is False and counted.gets == 12
    finally:
        for dht in others:
            dht.shutdown()
        host.shutdown()


class FrozenDHT(AwaitableDHT):
    """A DHT whose reads hang, as they do while a member's averager is frozen (every read
    waits for that member's node)."""

    def get(self, key: str, latest: bool, return_future: bool):
        async def hung():
            await asyncio.sleep(3600)

        return hung()


def test_an_expired_check_is_renewed_off_the_path_and_a_revocation_still_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Past PROOF_TTL_S a verified member is let in at once while the roster is read anew in
    the background (a round's checks waited for that read: 3.7 s where a frozen member's DHT
    node held it); the new read ends its trust if its certificate was revoked meanwhile. Past
    the grace too, a check waits for the read, and one the DHT never answers is refused."""
    key = SwarmKey(secrets.token_bytes(32))
    owner = Membership.of_owner(key, "owner", RSAPrivateKey())
    alice, alice_id = admit(key, tmp_path, "alice")
    host = start_dht(owner, [])
    addrs = [str(a) for a in host.get_visible_maddrs()]
    others = [start_dht(alice, addrs, alice_id)]
    monkeypatch.setattr(auth, "ROSTER_READ_S", 3.0)  # (a hung read fails after it)
    monkeypatch.setattr(auth, "ROSTER_TTL_S", 0.0)  # every renewal reads the DHT
    try:
        declare_member(others[0], SWARM, alice, others[0].peer_id, wait=True)
        peer = others[0].peer_id
        counted, gate = CountedDHT(host), MemberGate(owner, SWARM)

        async def scenario() -> None:
            assert await gate.allows(counted, peer) and counted.gets == 2

            def expire(by: float) -> None:
                _, member, public = gate._verified[peer]
                gate._verified[peer] = (time.monotonic() - by, member, public)

            expire(1.0)  # within the grace: no read on the path, even from a hung DHT
            assert await asyncio.wait_for(gate.allows(FrozenDHT(host), peer), 0.5)
            await gate._renewing[peer]  # that renewal's read failed: the grace runs on
            assert gate._verified[peer][0] < time.monotonic()
            assert await gate.allows(counted, peer)  # renewed from the DHT this time
            await gate._renewing[peer]
            assert counted.gets == 4 and gate._verified[peer][0] > time.monotonic()
            # the owner revokes alice: the next renewal ends her trust
            revoked = revoke(key.secret, ["alice"], None)
            expires = get_dht_time() + 60
            assert host.store(
                revoked_key(SWARM), revoked.to_text(), expires, own_subkey(owner.private_key)
            )
            expire(1.0)
            assert await gate.allows(counted, peer)  # (still trusted while it reads)
            await gate._renewing[peer]
            assert not await gate.allows(counted, peer)
            gate.ban(peer)  # refused, its member is still known: a ban follows the member
            assert gate.banned_members == {"alice"}
            # past the grace a check waits for its read; a hung DHT refuses
            fresh = MemberGate(owner, SWARM)
            fresh._verified[peer] = (time.monotonic() - auth.PROOF_GRACE_S - 1.0, "alice", "")
            assert not await fresh.allows(FrozenDHT(host), peer)

        asyncio.run(scenario())
    finally:
        for dht in others:
            dht.shutdown()
        host.shutdown()


def test_a_rounds_members_checked_as_it_begins_need_no_dht_read_once_its_group_forms(
    tmp_path: Path,
):
    """guarded checks the round's live members as the round begins (MemberGate.warm): the
    checks of the group's metadata, made once the group has formed, answer from what that read
    found, even where the DHT's reads now hang (a read waits on every node it asks; the first
    stalled round of bench attack's Q6, whose checks met a cold cache, took 7-9 s). A caller no
    certificate names is refused as before; open swarms check nothing."""
    owner, (alice, alice_id), (bob, bob_id), sybil = owner_two_members_and_a_sybil(tmp_path)
    host = start_dht(owner, [])
    addrs = [str(a) for a in host.get_visible_maddrs()]
    others = [start_dht(alice, addrs, alice_id), start_dht(bob, addrs, bob_id)]
    try:
        for dht, m in zip(others, (alice, bob), strict=True):
            declare_member(dht, SWARM, m, dht.peer_id, wait=True)
        peers = [dht.peer_id for dht in others]
        counted, gate = CountedDHT(host), MemberGate(owner, SWARM)

        async def scenario() -> None:
            await gate.warm(counted, [*peers, sybil])
            assert counted.gets == 2  # one read of the roster for all three
            frozen = FrozenDHT(host)
            keys = [await asyncio.wait_for(gate.public_key(frozen, p), 0.5) for p in peers]
            assert keys == [alice.public_key, bob.public_key]
            assert not await gate.allows(counted, sybil)
            await MemberGate(None, SWARM).warm(counted, peers)  # open: nothing to check
            assert counted.gets <= 4

        asyncio.run(scenario())
    finally:
        for dht in others:
            dht.shutdown()
        host.shutdown()


def status(name: str, peer_id: str, round_: int) -> PeerStatus:
    return PeerStatus(name, round_, 10 * round_, 2.0, 100.0, 0.0, peer_id=peer_id, updated=1.0)


def test_no_member_writes_or_forges_another_members_records(tmp_path: Path):
    key = SwarmKey(secrets.token_bytes(32))
    victim_m = Membership.of_owner(key, "victim", RSAPrivateKey())
    mallory_m, mallory_id = admit(key, tmp_path, "mallory")  # a member, not the owner
    victim = start_dht(victim_m, [])
    mallory = start_dht(mallory_m, [str(a) for a in victim.get_visible_maddrs()], mallory_id)
    try:
        vid = victim.peer_id.to_base58()
        declare_member(victim, SWARM, victim_m, victim.peer_id, wait=True)
        declare_member(mallory, SWARM, mallory_m, mallory.peer_id, wait=True)
        assert publish(
            victim, SWARM, own_subkey(victim_m.private_key), status("victim", vid, 5)
        ).result()
        honest = read_statuses(victim, SWARM, key.owner())
        assert [(s.name, s.round) for s in honest] == [("victim", 5)]
        # mallory writes over every record it sees: later expiry, its own certificate as the
        # victim's proof, a status moving the round and finish flags
        later = get_dht_time() + 600
        forged = {
            **status("victim", vid, 10**6).__dict__,
            "done": True,
            "addrs": [],
            "rejected": [],
        }
        for k, value in (
            (members_key(SWARM), mallory_m.certificate().to_text()),
            (status_key(SWARM), forged),
        ):
            found = mallory.get(k, latest=True)
            assert found is not None
            for subkey in found.value:
                mallory.store(k, value, later, subkey)
        # ...or, under its own subkey, a status that claims the victim's peer ID
        mine = own_subkey(mallory_m.private_key)
        assert publish(mallory, SWARM, mine, status("victim", vid, 10**6)).result()
        # ...or a record of the wrong shape
        assert not mallory.store(
            status_key(SWARM), "junk", later, own_subkey(mallory_m.private_key)
        )
        for reader in (victim, mallory):
            assert [
                (s.name, s.round, s.done) for s in read_statuses(reader, SWARM, key.owner())
            ] == [("victim", 5, False)]
            roster = read_roster(reader, SWARM, key.owner())
            assert roster.of_peer(vid).member == "victim"
    finally:
        mallory.shutdown()
        victim.shutdown()


async def _find_at(_dht, node, peer: str, key: str):
    """The raw answer of the DHT node `peer` to a find of `key` (None: refused or none)."""
    key_id = DHTID.generate(source=key)
    found = await node.protocol.call_find(PeerID.from_base58(peer), [key_id])
    return None if found is None else found[key_id][0]


async def _pass_on(_dht, node, source: str, to: str, key: str) -> bool:
    """What hivemind does with a record it found (DHTNode.cache_nearest): store it, as signed
    by its owner, on another node."""
    key_id = DHTID.generate(source=key)
    found = await node.protocol.call_find(PeerID.from_base58(source), [key_id])
    value = found[key_id][0]
    sent = await node.protocol.call_store(
        PeerID.from_base58(to), [key_id], [value.value], [value.expiration_time], in_cache=True
    )
    return sent is not None  # answered: its gate let the request through


async def _plant(_dht, node, key: str, subkey: bytes, value: object, expiration: float) -> None:
    """A record put straight into this node's storage, signed by no one (what a node that made
    it up would answer finds with)."""
    node.protocol.storage.store_subkey(
        DHTID.generate(source=key), subkey, MSGPackSerializer.dumps(value), expiration
    )


async def _store_encoded_otherwise(
    _dht, node, to: str, key: str, subkey: bytes, value: object, expiration: float, how: str
) -> bool:
    """This node's own record (under its own `subkey`), signed by it, sent to `to` with its key
    or subkey encoded otherwise than hivemind encodes them: the key with a leading zero byte
    (the same DHTID), or the subkey as msgpack's bin32 (the same bytes). Whether it was stored."""
    key_bytes = DHTID.generate(source=key).to_bytes()
    tag = MSGPackSerializer.dumps(subkey)
    if how == "key":
        key_bytes = b"\0" + key_bytes
    else:
        tag = b"\xc6" + len(subkey).to_bytes(4, "big") + subkey
    record = DHTRecord(key_bytes, tag, MSGPackSerializer.dumps(value), expiration)
    request = dht_pb2.StoreRequest(
        keys=[key_bytes],
        subkeys=[tag],
        values=[node.protocol.record_validator.sign_value(record)],
        expiration_time=[expiration],
        in_cache=[False],
        peer=node.protocol.node_info,
    )
    try:
        response = await node.protocol.get_stub(PeerID.from_base58(to)).rpc_store(request)
    except Exception:  # refused: the gate answered nothing (hivemind's call_store logs it)
        return False
    return response is not None and all(response.store_ok)


def host_carol_mallory(tmp_path: Path) -> tuple[SwarmKey, tuple, tuple[DHT, DHT, DHT]]:
    """A keyed swarm's owner peer (host) and two admitted members: the swarm key, their
    memberships and their DHT nodes (started, joined to the host's)."""
    key = SwarmKey(secrets.token_bytes(32))
    host_m = Membership.of_owner(key, "host", RSAPrivateKey())
    carol_m, carol_id = admit(key, tmp_path, "carol")
    mallory_m, mallory_id = admit(key, tmp_path, "mallory")
    host = start_dht(host_m, [])
    addrs = [str(a) for a in host.get_visible_maddrs()]
    carol = start_dht(carol_m, addrs, carol_id)
    mallory = start_dht(mallory_m, addrs, mallory_id)
    return key, (host_m, carol_m, mallory_m), (host, carol, mallory)


def test_a_member_that_sends_a_record_it_could_not_sign_is_named_and_refused(tmp_path: Path):
    """Issue 12, item 4: a member that writes over another's DHT record is refused by every node
    (the signed records), but went on as before. Now the nodes it sent the forged record to name
    it: their DHT gate refuses it from then on, and their averager's gate bans its member (read at
    each round, guarded._ban_forgers). An honest node passing on another's signed record (as
    hivemind caches what it found) and a record of the wrong shape under its sender's own subkey
    name no one."""
    key, (host_m, carol_m, mallory_m), (host, carol, mallory) = host_carol_mallory(tmp_path)
    dhts = {"host": host, "carol": carol, "mallory": mallory}
    try:
        for dht, m in ((host, host_m), (carol, carol_m), (mallory, mallory_m)):
            declare_member(dht, SWARM, m, dht.peer_id, wait=True)
        hid = host.peer_id.to_base58()
        assert publish(host, SWARM, own_subkey(host_m.private_key), status("host", hid, 5)).result()
        ids = {name: dht.peer_id.to_base58() for name, dht in dhts.items()}
        # honest: carol passes the host's signed records on to mallory and back to the host, and
        # stores a record of the wrong shape under its own subkey
        for to in ("mallory", "host"):
            assert carol.run_coroutine(
                partial(_pass_on, source=hid, to=ids[to], key=status_key(SWARM))
            )
        later = get_dht_time() + 600
        assert not carol.store(status_key(SWARM), "junk", later, own_subkey(carol_m.private_key))
        for dht in dhts.values():
            assert read_forgers(dht).result() == {}
        forged = {**status("host", hid, 10**6).__dict__, "done": True, "addrs": [], "rejected": []}
        # mallory answers finds with a status of the host's it made up: carol, asking it, names it
        host_subkey = own_subkey(host_m.private_key)
        mallory.run_coroutine(
            partial(
                _plant, key=status_key(SWARM), subkey=host_subkey, value=forged, expiration=later
            )
        )
        assert (
            carol.run_coroutine(partial(_find_at, peer=ids["mallory"], key=status_key(SWARM)))
            is None
        )
        assert list(read_forgers(carol).result()) == [mallory_m.public_key]
        assert read_forgers(host).result() == {}
        # mallory writes over the host's status: a later expiry, the round moved
        found = mallory.get(status_key(SWARM), latest=True)
        for subkey in found.value:
            mallory.store(status_key(SWARM), forged, later, subkey)
        # every node it sent the record to named it, by the certificate it signs requests with
        for dht in (host, carol):
            named = read_forgers(dht).result()
            assert list(named) == [mallory_m.public_key], named
            member, why = named[mallory_m.public_key]
            assert member == "mallory" and "could not have signed" in why
        assert read_forgers(mallory).result() == {}
        # the host's DHT node answers carol, no longer mallory
        assert carol.run_coroutine(partial(_find_at, peer=hid, key=status_key(SWARM)))
        assert mallory.run_coroutine(partial(_find_at, peer=hid, key=status_key(SWARM))) is None
        # the averager's gate finds its peer ID by that key (and bans it: the harness's test in
        # test_security)
        gate = MemberGate(host_m, SWARM)
        found = asyncio.run(gate.peers_of(AwaitableDHT(host), mallory_m.public_key))
        assert found == [PeerID.from_base58(ids["mallory"])]
        # and the host's record stands
        assert [(s.name, s.round) for s in read_statuses(host, SWARM, key.owner())] == [("host", 5)]
    finally:
        for dht in dhts.values():
            dht.shutdown()


async def _store_at(
    _dht, node, to: str, key: str, subkey: bytes, value: bytes, expiration: float
) -> None:
    """A record's `value` (its bytes as they are) sent in a store request to the node `to`
    only."""
    await node.protocol.call_store(
        PeerID.from_base58(to), [DHTID.generate(source=key)], [value], [expiration], [subkey]
    )


def test_a_forger_that_one_node_caught_is_named_by_every_node_its_evidence_reaches(
    tmp_path: Path,
):
    """A forged store reaches only the nodes its sender sends it to (bench attack's F1, seed 1:
    one honest node of three got none and never named the overwriter). The node that refused it
    shows the request as its sender signed it, in the DHT (forgers.py); another node, sent no
    forged record, checks it and names the forger too. The forged value carries a signature
    (a made-up one: a replayed record's would do as well); shown as it is, it would have made
    the showing node's own record fail every node's check, and named it."""
    _, (host_m, carol_m, mallory_m), (host, carol, mallory) = host_carol_mallory(tmp_path)
    dhts = (host, carol, mallory)
    try:
        for dht, m in ((host, host_m), (carol, carol_m), (mallory, mallory_m)):
            declare_member(dht, SWARM, m, dht.peer_id, wait=True)
        hid = host.peer_id.to_base58()
        assert publish(host, SWARM, own_subkey(host_m.private_key), status("host", hid, 5)).result()
        for dht in dhts:  # nothing to show yet: nothing named
            auth.share_evidence(dht, SWARM).result()
            assert read_forgers(dht).result() == {}
        forged = {**status("host", hid, 10**6).__dict__, "done": True, "addrs": [], "rejected": []}
        mallory.run_coroutine(
            partial(
                _store_at,
                to=carol.peer_id.to_base58(),
                key=status_key(SWARM),
                subkey=own_subkey(host_m.private_key),
                value=MSGPackSerializer.dumps(forged) + b"[signature:" + b"x" * 256 + b"]",
                expiration=get_dht_time() + 600,
            )
        )
        assert list(read_forgers(carol).result()) == [mallory_m.public_key]
        assert read_forgers(host).result() == {}  # sent nothing
        auth.share_evidence(carol, SWARM).result()  # carol shows its evidence
        auth.share_evidence(host, SWARM).result()  # the host reads and checks it
        named = read_forgers(host).result()
        assert list(named) == [mallory_m.public_key], named
        member, why = named[mallory_m.public_key]
        assert member == "mallory" and "could not have signed" in why and "shown" in why
        for dht in dhts:  # carol's record of evidence passed every check: no one named it
            auth.share_evidence(dht, SWARM).result()
            assert carol_m.public_key not in read_forgers(dht).result()
        # the host's DHT node refuses mallory from then on
        assert mallory.run_coroutine(partial(_find_at, peer=hid, key=status_key(SWARM))) is None
        assert carol.run_coroutine(partial(_find_at, peer=hid, key=status_key(SWARM)))
    finally:
        for dht in dhts:
            dht.shutdown()


def test_evidence_of_a_forger_names_only_the_member_whose_signed_request_carries_a_forgery(
    tmp_path: Path,
):
    """forgers.forger_shown: a store request its sender signed, carrying a record under another
    member's subkey that member did not sign, names the sender (by the key its certificate
    binds); an honest member's signed request, a forged one whose certificate was swapped for
    another member's, one whose signature was altered, one from another swarm's member, and
    bytes that are no request name no one."""
    from atomtrain.peer.auth import SwarmAuthorizer
    from atomtrain.peer.forgers import evidence_of, forger_shown

    key = SwarmKey(secrets.token_bytes(32))
    host_m = Membership.of_owner(key, "host", RSAPrivateKey())
    carol_m = Membership.of_owner(key, "carol", RSAPrivateKey())
    mallory_m = Membership.of_owner(key, "mallory", RSAPrivateKey())
    stranger_m = Membership.of_owner(SwarmKey(secrets.token_bytes(32)), "x", RSAPrivateKey())
    checker = host_m.validators(SWARM)[-1]
    key_id = DHTID.generate(source=status_key(SWARM)).to_bytes()
    expires = get_dht_time() + 60

    def record(owner: Membership, signer: Membership, value: object) -> tuple[bytes, bytes]:
        """(subkey, value): `value` under `owner`'s subkey, signed by `signer`'s key."""
        subkey = own_subkey(owner.private_key)
        tag = MSGPackSerializer.dumps(subkey)
        raw = DHTRecord(key_id, tag, MSGPackSerializer.dumps(value), expires)
        return tag, signer.validators(SWARM)[-1].sign_value(raw)

    def request(sender: Membership, tag: bytes, value: bytes) -> tuple[object, bytes]:
        req = dht_pb2.StoreRequest(
            keys=[key_id], subkeys=[tag], values=[value], expiration_time=[expires]
        )
        asyncio.run(SwarmAuthorizer(sender).sign_request(req, None))
        return req, bytes(req.auth.signature)

    def shown(req: object, signature: bytes) -> tuple[str, str] | None:
        evidence = evidence_of(req, signature)
        assert evidence is not None
        return forger_shown(evidence, key.owner(), checker)

    # mallory's key signs a record under carol's subkey: forged
    forged_req, forged_sig = request(mallory_m, *record(carol_m, mallory_m, {"round": 9}))
    assert shown(forged_req, forged_sig) == (mallory_m.public_key, "mallory")
    # carol's own record, signed by her: honest
    assert shown(*request(carol_m, *record(carol_m, carol_m, {"round": 1}))) is None
    # the forged request with carol's certificate in place of mallory's: its signature fails
    framed = dht_pb2.StoreRequest()
    framed.CopyFrom(forged_req)
    carol_req, _ = request(carol_m, *record(carol_m, carol_m, {"round": 1}))
    framed.auth.client_access_token.CopyFrom(carol_req.auth.client_access_token)
    assert shown(framed, forged_sig) is None
    assert shown(forged_req, bytes(b ^ 1 for b in forged_sig)) is None
    # another swarm's member forging: its certificate is not this owner's
    assert shown(*request(stranger_m, *record(carol_m, stranger_m, {"round": 9}))) is None
    for junk in (b"", b"\xff" * 100, "text", "!" * 64, None):
        assert forger_shown(junk, key.owner(), checker) is None
    # a subkey whose encoding turns with the clock (a dictionary's drops its expired entries)
    # is sent by no honest node: it names its sender, whenever the request is checked
    ext = DictionaryDHTValue()
    ext.store(own_subkey(mallory_m.private_key), b"x", get_dht_time() + 3600)
    ext.store(b"filler", b"y", get_dht_time() + 0.5)
    tag = MSGPackSerializer.dumps(ext)
    raw = DHTRecord(key_id, tag, MSGPackSerializer.dumps({"round": 1}), expires)
    signed = mallory_m.validators(SWARM)[-1].sign_value(raw)
    assert shown(*request(mallory_m, tag, signed)) == (mallory_m.public_key, "mallory")
    # so is a subkey of text (bytes alone: no honest dictionary holds subkeys of mixed types)
    text_tag = MSGPackSerializer.dumps("x")
    assert shown(*request(mallory_m, text_tag, b"v")) == (mallory_m.public_key, "mallory")
    # an honest node passing a whole dictionary on (hivemind's caching) names no one: carol's
    # record, signed by her, in a dictionary the host sends
    whole = DictionaryDHTValue()
    _, carol_value = record(carol_m, carol_m, {"round": 1})
    whole.store(own_subkey(carol_m.private_key), carol_value, expires)
    dictionary = MSGPackSerializer.dumps(whole)
    assert shown(*request(host_m, DHTProtocol.IS_DICTIONARY, dictionary)) is None
    # nor does a dictionary that cannot be decoded (refused all the same): subkeys of mixed
    # types at one expiry, which hivemind's storage cannot order
    mixed = MSGPackSerializer.dumps(
        [None, expires, [["x", b"1", expires], [b"y", b"2", expires], [1, b"3", expires]]]
    )
    code = MSGPackSerializer._ext_types[DictionaryDHTValue]
    packed = msgpack.packb(msgpack.ExtType(code, mixed), use_bin_type=True)
    assert shown(*request(host_m, DHTProtocol.IS_DICTIONARY, packed)) is None


def test_a_status_naming_a_peer_with_brackets_still_passes_every_check():
    """A peer's name is its user's choice, and the peers it rejected are named by what they
    called themselves: a `[signature:...]` copied into a record's value would fail hivemind's
    signature check on every node, and the storing node would be named a forger. Brackets are
    made round as a status is published."""
    key = SwarmKey(secrets.token_bytes(32))
    host_m = Membership.of_owner(key, "host", RSAPrivateKey())
    host = start_dht(host_m, [])
    try:
        declare_member(host, SWARM, host_m, host.peer_id, wait=True)
        hid = host.peer_id.to_base58()
        own = replace(
            status("[signature:abc]", hid, 3), rejected=("[signature:" + "x" * 40 + "]", "b")
        )
        assert publish(host, SWARM, own_subkey(host_m.private_key), own).result()
        [got] = read_statuses(host, SWARM, key.owner())
        assert got.name == "(signature:abc)" and got.rejected[0].startswith("(signature:")
    finally:
        host.shutdown()


@pytest.mark.parametrize("how", ["key", "subkey"])
def test_a_record_signed_over_another_encoding_names_its_sender_not_whoever_passes_it_on(
    tmp_path: Path, how: str
):
    """A member's own record, signed by it over a key or subkey encoded otherwise than hivemind
    encodes them, verifies on arrival; a node that stored it would encode it anew to pass it on
    (a find's answer, hivemind's caching), where it no longer verifies, and that honest node
    would be named. So such a store is refused and names its sender (forgers._canonical)."""
    key = SwarmKey(secrets.token_bytes(32))
    host_m = Membership.of_owner(key, "host", RSAPrivateKey())
    mallory_m, mallory_id = admit(key, tmp_path, "mallory")
    host = start_dht(host_m, [])
    mallory = start_dht(mallory_m, [str(a) for a in host.get_visible_maddrs()], mallory_id)
    try:
        for dht, m in ((host, host_m), (mallory, mallory_m)):
            declare_member(dht, SWARM, m, dht.peer_id, wait=True)
        mid = mallory.peer_id.to_base58()
        stored = mallory.run_coroutine(
            partial(
                _store_encoded_otherwise,
                to=host.peer_id.to_base58(),
                key=status_key(SWARM),
                subkey=own_subkey(mallory_m.private_key),
                value={**status("mallory", mid, 3).__dict__, "addrs": [], "rejected": []},
                expiration=get_dht_time() + 60,
                how=how,
            )
        )
        assert not stored
        assert list(read_forgers(host).result()) == [mallory_m.public_key]
        assert [s.name for s in read_statuses(host, SWARM, key.owner())] == []
    finally:
        mallory.shutdown()
        host.shutdown()


def test_a_peer_banned_before_any_round_with_it_is_reported_by_the_name_its_status_gives():
    """A member banned before any round with it (a forger, at its first store) has told no
    group its name: the step's record names it as its signed status does, not by peer ID (bench
    attack matches the attacker by name)."""
    averager = SimpleNamespace(
        rejections=lambda: [("QmForger", "sent a forged record"), ("QmGone", "forged metadata")],
        stalls=lambda: [
            ("QmSlow", "sent none of its parts"),
            ("QmLean", "sent an update that leans one way from this peer's (...)"),
        ],
        agreements=lambda: [],
    )
    known = [
        status("mallory", "QmForger", 3),
        status("bob", "QmSlow", 3),
        status("eve", "QmLean", 3),
    ]
    peer = SimpleNamespace(
        averager=averager, rejected={}, presence=SimpleNamespace(known_others=known)
    )
    record: dict = {}
    note_rejections(peer, record)
    assert record["rejected_peers"] == ["QmGone", "mallory"]  # (no status: its peer ID)
    assert record["stalled_peers"] == ["bob", "eve"]
    assert record["left_out_for_updates"] == ["eve"]  # for what its update read as, not a stall


def test_a_joiner_ranks_sources_by_rounds_capped_at_the_swarms():
    honest = [status(f"h{i}", f"H{i}", 7) for i in range(3)]
    liar = status("liar", "L", 10**9)  # claims a huge round (a huge state-sharing priority)
    behind = status("behind", "B", 3)
    for _ in range(20):
        ranked = download_sources([*honest, liar, behind], own_peer_id="H0")
        assert "H0" not in ranked and ranked[-1] == "B"  # itself never; the peer behind last
        assert set(ranked[:3]) == {"H1", "H2", "L"}  # the liar no better than an honest peer
    assert {download_sources([*honest, liar])[0] for _ in range(60)} == {"H0", "H1", "H2", "L"}


def test_a_member_claiming_a_huge_round_does_not_make_every_resync_download_look_behind():
    """A re-synchronizing member accepts a download at the largest round its group claimed,
    capped at the round most live peers' signed statuses give, never below the claims' lower
    median (before: the largest claim, so one member claiming 10**9 kept its victim out of
    sync)."""
    assert resync_floor([7, 10**9], swarm_round=8) == 8  # itself and the liar
    assert resync_floor([7, 8], swarm_round=8) == 8  # behind its honest partner: the partner's
    assert resync_floor([7, 7], swarm_round=9) == 7  # the group's, not newer
    assert resync_floor([7, 7, 7], swarm_round=0) == 7  # a status claiming 0 lowers nothing
    assert resync_floor([7, 10**9]) == 7
    assert resync_floor([7, 8, 9, 9]) == 8
    assert resync_floor(["x", None, 5, float("inf")]) == 5  # malformed claims claim nothing
    assert resync_floor([]) == 0


def test_keygen_admit_and_a_certificate_for_another_identity_from_the_command_line(tmp_path):
    from .conftest import run_cli

    assert run_cli("keygen", "swarm.key", cwd=tmp_path).returncode == 0
    made = run_cli("keygen", "--member", "alice.id", cwd=tmp_path)
    assert made.returncode == 0 and "alice.id.pub" in made.stdout, made.stderr
    admitted = run_cli(
        "admit", "alice.id.pub", "--member", "alice", "--swarm-key", "swarm.key", cwd=tmp_path
    )
    assert admitted.returncode == 0 and (tmp_path / "alice.cert").is_file(), admitted.stderr
    m = Membership.admitted(str(tmp_path / "alice.cert"), str(tmp_path / "alice.id"))
    assert m.member == "alice" and m.owner == read_key(tmp_path / "swarm.key").owner()
    assert run_cli("keygen", "--member", "other.id", cwd=tmp_path).returncode == 0
    for identity, message in (("other.id", "was issued for peer"), ("", "needs --peer.identity")):
        out = run_cli(
            "train",
            "--swarm",
            "s",
            "--swarm-cert",
            "alice.cert",
            f"--peer.identity={identity}",
            "--train.steps=1",
            cwd=tmp_path,
        )
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr
    bad = run_cli("admit", "swarm.key", "--member", "x", "--swarm-key", "swarm.key", cwd=tmp_path)
    assert bad.returncode == 2 and "is not a member's public key" in bad.stderr
    # a name copied into every peer's records must not carry a signature's brackets (forgers.py)
    for cmd in (
        ("admit", "other.id.pub", "--member", "[signature:x]", "--swarm-key", "swarm.key"),
        ("revoke", "[signature:x]", "--swarm-key", "swarm.key", "--join", "/ip4/127.0.0.1/tcp/1"),
    ):
        bad = run_cli(*cmd, cwd=tmp_path)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
        assert "square brackets" in bad.stderr, bad.stderr


def read_key(path: Path) -> SwarmKey:
    from atomtrain.peer.auth import load_swarm_key

    key = load_swarm_key(str(path))
    assert key is not None
    return key


def test_a_dead_peers_record_has_no_vote_and_one_alone_never_decides():
    """A killed peer's record (live in the DHT until it expires) is no vote against the state
    the survivors hold; colluders claiming a round no one else holds, or one peer alone, do not
    outvote the live members."""
    import torch
    from hivemind.dht.crypto import RSASignatureValidator

    from atomtrain.peer.agreement import (
        AGREEMENT_TTL_S,
        LIVE_S,
        RoundDigest,
        disagreement,
        parse_records,
    )

    held = (torch.ones(8), torch.zeros(8))
    forged = (torch.full((8,), 2.0), torch.zeros(8))
    old = (torch.full((8,), 0.5), torch.zeros(8))
    now = 1000.0

    def record(state: tuple, rounds: list[int], stored_s_ago: float) -> SimpleNamespace:
        digests = [RoundDigest.of(r, *state) for r in rounds]
        return SimpleNamespace(
            value=[[d.round, d.params, d.momentum] for d in digests],
            expiration_time=now - stored_s_ago + AGREEMENT_TTL_S,
        )

    def records(named: dict[str, SimpleNamespace], at: float | None = now) -> dict:
        keys = {name: RSASignatureValidator(RSAPrivateKey()).local_public_key for name in named}
        return parse_records(SimpleNamespace(value={keys[n]: r for n, r in named.items()}), b"", at)

    survivors = {n: record(held, [5, 6, 7], 3.0) for n in ("a", "b")}
    killed = {n: record(old, [3, 4, 5], LIVE_S + 4) for n in ("k", "l")}
    # counted until their records expire, two killed peers outvoted the survivors (2 of 4)
    assert "2 of 4" in (disagreement(7, *held, records({**survivors, **killed}, None)) or "")
    assert disagreement(7, *held, records({**survivors, **killed})) is None  # now 2 of 2
    # two colluders serving a round no live member holds match 2 of 4: refused
    colluders = {n: record(forged, [9], 1.0) for n in ("f", "g")}
    assert disagreement(9, *forged, records({**survivors, **colluders})) is not None
    # one peer alone never decides, unless it is the only other peer of a swarm of two
    assert disagreement(9, *forged, records({"a": survivors["a"], "f": colluders["f"]}))
    assert disagreement(7, *held, records({"a": survivors["a"]})) is None
    assert disagreement(7, *held, {}) is not None


def test_only_certified_members_vote_on_what_the_swarm_holds():
    """Digests signed by keys anyone can make (a forger's sybil votes) are not counted; each
    member counts once."""
    import torch
    from hivemind.dht.crypto import RSASignatureValidator

    from atomtrain.peer.agreement import RoundDigest, disagreement, members_only, parse_records
    from atomtrain.peer.auth import Roster

    key = SwarmKey(secrets.token_bytes(32))
    held = (torch.ones(8), torch.zeros(8))
    forged = (torch.full((8,), 2.0), torch.zeros(8))
    honest_keys = [RSAPrivateKey() for _ in range(2)]
    sybil_keys = [RSAPrivateKey() for _ in range(3)]

    def signer(k: RSAPrivateKey) -> str:
        return k.get_public_key().to_bytes().decode()

    def entry(state: tuple) -> SimpleNamespace:  # a DHT value, as hivemind returns it
        d = RoundDigest.of(3, *state)
        return SimpleNamespace(value=[[3, d.params, d.momentum]])

    found = SimpleNamespace(
        value={
            **{RSASignatureValidator(k).local_public_key: entry(held) for k in honest_keys},
            **{RSASignatureValidator(k).local_public_key: entry(forged) for k in sybil_keys},
        }
    )
    records = parse_records(found)
    assert len(records) == 5 and set(records) == {signer(k) for k in honest_keys + sybil_keys}
    # without the roster the forger's three keys outvote the two members
    assert disagreement(3, *forged, records) is None
    roster = Roster(
        by_signer={
            signer(k): issue(key.secret, f"m{i}", signer(k), f"P{i}")
            for i, k in enumerate(honest_keys)
        }
    )
    counted = members_only(records, roster)
    assert set(counted) == {"m0", "m1"}
    assert disagreement(3, *held, counted) is None
    assert "digests" in (disagreement(3, *forged, counted) or "")
    # a member whose two keys both hold certificates still counts once
    roster.by_signer[signer(sybil_keys[0])] = issue(key.secret, "m0", signer(sybil_keys[0]), "P9")
    assert set(members_only(records, roster)) == {"m0", "m1"}
