"""Round metadata sealed by its member (gather.py): a leader can neither alter a member's blob,
nor move it to another peer ID or swarm, nor replay it from another round; a member checking its
group blames the leader for a blob its member did not seal, and the signer for malformed
metadata it did seal."""

import asyncio
from dataclasses import replace
from types import SimpleNamespace

from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer as Serializer

from atomtrain.peer.bounds import Defence
from atomtrain.peer.certs import peer_id_of
from atomtrain.peer.gather import check, seal, unseal
from atomtrain.peer.guarded import FORGED, MALFORMED, UNVERIFIED, GuardedAverager

PREFIX = "s_avg"
AT = 1000.0  # the round's scheduled time, DHT seconds
WINDOW_S = 10.0


def blob(info: dict) -> bytes:
    """hivemind's gathered blob: bandwidth (None: unknown, hivemind's default), mode, the
    member's metadata."""
    return Serializer.dumps([None, 0, Serializer.dumps(info)])


def member(key: RSAPrivateKey) -> tuple[str, str]:
    """(peer ID, public key) of a member whose certificate binds `key` to its peer ID."""
    public = key.get_public_key().to_bytes().decode()
    return peer_id_of(public), public


def test_a_sealed_blob_fails_when_tampered_replayed_moved_or_taken_to_another_swarm():
    key, other_key = RSAPrivateKey(), RSAPrivateKey()
    (peer, public), (other, other_public) = member(key), member(other_key)
    data = blob({"weight": 1.0, "probe": 1.5, "rms": 0.01})
    sealed = seal(key, PREFIX, peer, AT, data)
    assert check(sealed, PREFIX, peer, public, AT + 3.0, WINDOW_S) == (data, "")

    def fails(blob_: bytes, prefix=PREFIX, peer_=peer, public_=public, at=AT) -> str:
        got, why = check(blob_, prefix, peer_, public_, at, WINDOW_S)
        assert got is None and why
        return why

    opened = unseal(sealed)
    assert opened is not None
    # a field rewritten under the member's signature (what forge_gather does)
    forged = replace(opened, data=blob({"weight": 1e3, "probe": 1.5, "rms": 10.0})).pack()
    assert fails(forged) == "a signature that fails"
    # replayed from a round long before; or with its time moved to this round
    assert fails(sealed, at=AT + 100.0).startswith("sealed for a round -100 s")
    assert fails(replace(opened, at=AT + 100.0).pack(), at=AT + 100.0) == "a signature that fails"
    # moved to another member's peer ID (checked against that member's key, or the signer's)
    assert fails(sealed, peer_=other, public_=other_public) == "a signature that fails"
    assert fails(sealed, peer_=other) == "a signature that fails"
    # taken to another swarm, or signed by a key no certificate binds to the peer ID
    assert fails(sealed, prefix="t_avg") == "a signature that fails"
    assert fails(seal(other_key, PREFIX, peer, AT, data)) == "a signature that fails"
    # not sealed at all, garbage, a member without a certificate
    assert fails(data) == "not sealed"
    assert fails(b"\x00junk") == "not sealed"
    assert fails(sealed, public_=None) == "no certified key"


class Checker:
    """What of a GuardedAverager checks its group's metadata, without its process."""

    _checked = GuardedAverager._checked
    _unsealed = GuardedAverager._unsealed
    _well_formed = GuardedAverager._well_formed
    _name_in = GuardedAverager._name_in
    serializer = Serializer

    def __init__(self, own: RSAPrivateKey, keys: dict[PeerID, str], sent: bytes) -> None:
        async def public_key(_dht, peer_id):
            return keys.get(peer_id)

        self._gate = SimpleNamespace(signing_key=own, public_key=public_key)
        self.peer_id = PeerID.from_base58(member(own)[0])
        self.prefix, self.dht, self._round_at, self._window_s = PREFIX, None, AT, WINDOW_S
        self._sealed, self._leaders, self._led_by = sent, {}, {}
        self._discard = SimpleNamespace(value=0)
        self._defence = Defence()  # a defended swarm: the reported rms is checked too
        self._events = SimpleNamespace(put=lambda event: None)
        self.rejected: list[tuple[PeerID, str]] = []

    def _reject(self, peer_id: PeerID, why: str) -> None:
        self.rejected.append((peer_id, why))


def test_forged_metadata_blames_the_leader_and_malformed_signed_metadata_its_signer():
    keys = [RSAPrivateKey() for _ in range(3)]  # 0: this member; 1: the leader; 2: another
    ids = [PeerID.from_base58(member(k)[0]) for k in keys]
    public = {p: member(k)[1] for p, k in zip(ids, keys, strict=True)}
    honest = [
        seal(k, PREFIX, p.to_base58(), AT, blob({"weight": 1.0, "probe": 1.5, "rms": 0.01}))
        for k, p in zip(keys, ids, strict=True)
    ]

    def checked(gathered: list[bytes], certified: dict[PeerID, str] = public) -> Checker:
        me = Checker(keys[0], certified, honest[0])
        me._leaders[b"g"] = ids[1]
        out = asyncio.run(me._checked(GroupInfo(b"g", tuple(ids), tuple(gathered))))
        assert out.gathered[2] == (unseal(gathered[2]) or SimpleNamespace(data=gathered[2])).data
        return me

    me = checked(honest)
    assert (me._discard.value, me.rejected) == (0, [])
    # the leader rewrote member 2's claims: the round is discarded and the leader named
    opened = unseal(honest[2])
    forged = replace(opened, data=blob({"weight": 1e3, "probe": 1.5, "rms": 10.0})).pack()
    me = checked([honest[0], honest[1], forged])
    assert me._discard.value == FORGED
    assert [(p, why.split(":")[0]) for p, why in me.rejected] == [
        (ids[1], "led a round with forged metadata")
    ]
    # ...or this member's own blob (replaced by one it sealed for another round)
    stale = seal(keys[0], PREFIX, ids[0].to_base58(), AT - 1.0, blob({"weight": 1.0}))
    me = checked([stale, honest[1], honest[2]])
    assert me._discard.value == FORGED and [p for p, _ in me.rejected] == [ids[1]]
    # member 2 sealed metadata no honest member sends: it, not the leader, is named
    bad = seal(keys[2], PREFIX, ids[2].to_base58(), AT, blob({"weight": "x", "probe": 1.5}))
    me = checked([honest[0], honest[1], bad])
    assert me._discard.value == MALFORMED
    assert me.rejected == [(ids[2], "signed malformed round metadata")]
    # no certificate in this member's view for member 2 (its DHT did not answer): the round is
    # discarded, and no one blamed
    me = checked(honest, {p: k for p, k in public.items() if p != ids[2]})
    assert (me._discard.value, me.rejected) == (UNVERIFIED, [])
