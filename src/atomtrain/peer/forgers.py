"""Members caught sending DHT records they could not have signed, named and banned.

Every record of a keyed swarm lives under a subkey that names its writer's RSA key
(records.py), and every DHT node refuses a record under such a subkey that this key did not sign.
That keeps a member from writing over another's certificate or status, but on its own it costs
the writer nothing: it goes on training and averaging while its writes are refused.

No honest node sends such a record. A node signs only what it writes under its own subkey,
stores only what passed the same check, and passes on (hivemind caches a record it found on the
nodes nearest its key) only what it stored or found checked, encoded anew. That last step is
why a store is also refused, and its sender named, when its key or subkey is not encoded as
hivemind encodes them (_canonical): a record signed over another encoding verifies on arrival
and would fail once an honest node passed it on, naming that node. So a record whose signature
does not verify, in a store request or in an answer to a find, shows that its sender forged it
or made it up, and every DHT request and answer of a keyed swarm is signed by its sender under
its certificate (auth.py): the sender is known. The DHT's gate (auth.SwarmAuthorizer, in the
DHT's process) then refuses the RSA key that signed it from then on, and the averager's gate
(guarded.py) reads the names at each round and bans that peer ID and its member, as any ban:
reported like any other rejection. (A node of an older Atom, without this check, could still
store a record so encoded and pass it on.)

Only signatures count: a record of the wrong shape under the sender's own subkey (a peer of
another version, say) is refused by the schema check, but names no one.

A forged store reaches only the nodes its sender sends it to (in bench attack's run F1, seed 1,
one honest node of three received none and never named the forger). So the node that refused it
keeps the request as its sender signed it (`evidence_of`) and shows it to the swarm: it stores
its evidence under its own subkey of `{swarm}_forgers` (auth.SwarmAuthorizer.share, as each
round of its peer begins), and every node reads the others' and names the sender of any request
that checks (`forger_shown`): a certificate the swarm's owner signed for the key that signed the
request, and a record in it that this key could not have signed. No one can frame an honest
member so: that takes a store request its key signed carrying such a record, and no honest node
sends one. (Answers to a find are not shown: an answer's signature does not cover the request
it answers, whose keys the check reads, so the asker could pair an honest answer with another
request.)
"""

from __future__ import annotations

import math
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.proto import dht_pb2
from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer

from atomtrain.peer.certs import Certificate

FORGERS_READ_S = 5.0
"""The averager's read of the names (a call into the DHT's process) gives up after this long."""
EVIDENCE_MAX_BYTES = 2**18
"""The largest signed request a node shows: above any honest store request (the largest record
Atom writes is a revocation list of at most 128 KiB, records.py; bench attack's forged stores
are about 4 KB). A larger forged request is refused and names its sender where it arrives, and
is not shown: its sender padded it on purpose."""
EVIDENCE_KEPT = 4
"""Forgers a node shows evidence of (the first it caught); a record holds no more."""
EVIDENCE_TTL_S = 60.0
"""A node's evidence record lives this long; it stores it again as each round of its peer
begins."""


def evidence_key(swarm: str) -> str:
    return f"{swarm}_forgers"


def _signed(checker: RSASignatureValidator, record: DHTRecord) -> bool:
    """The record's signature is its owner's, or it names no owner (hivemind's own check: it
    does not depend on the checking node's key)."""
    try:
        return checker.validate(record)
    except Exception:  # a subkey that is not a public key, a signature that is not base64...
        return False


def _dictionary_forged(checker: RSASignatureValidator, key: bytes, value: bytes) -> bool:
    try:
        dictionary = MSGPackSerializer.loads(value)
    except Exception:
        return True  # made up: not a dictionary
    if not isinstance(dictionary, DictionaryDHTValue):
        return True
    with dictionary.freeze():
        for subkey, (item, expiration) in dictionary.items():
            record = DHTRecord(key, MSGPackSerializer.dumps(subkey), item, expiration)
            if not _signed(checker, record):
                return True
    return False


def _canonical(key: bytes, tag: bytes) -> bool:
    """The key and subkey are encoded as hivemind encodes them whenever it sends a record on: a
    node stores a record under the decoded key and subkey and encodes both anew to pass it on, so
    a record signed over another encoding of them (a 21-byte key with a leading zero, a subkey
    in a longer msgpack form) verifies on arrival and fails once an honest node passes it on.
    Accepting it would let its sender have honest nodes named; no honest node sends one."""
    try:
        if DHTID.from_bytes(key).to_bytes() != key:
            return False
        return (
            tag == DHTProtocol.IS_DICTIONARY
            or MSGPackSerializer.dumps(MSGPackSerializer.loads(tag)) == tag
        )
    except Exception:
        return False


def forged_in_store(checker: RSASignatureValidator, request: Any) -> bool:
    """A store request carries a record its owner did not sign, or one encoded so that it
    would fail once passed on (_canonical)."""
    if not isinstance(request, dht_pb2.StoreRequest):
        return False
    for key, tag, value, expiration in zip(
        request.keys, request.subkeys, request.values, request.expiration_time, strict=False
    ):  # (as hivemind's rpc_store reads them: up to the shortest list)
        if not _canonical(key, tag):
            return True
        if tag == DHTProtocol.IS_DICTIONARY:
            if _dictionary_forged(checker, key, value):
                return True
        elif not _signed(checker, DHTRecord(key, tag, value, expiration)):
            return True
    return False


def forged_in_answer(checker: RSASignatureValidator, response: Any, request: Any) -> bool:
    """An answer to a find carries a record its owner did not sign."""
    if not isinstance(response, dht_pb2.FindResponse):
        return False
    for key, result in zip(request.keys, response.results, strict=False):
        if result.type == dht_pb2.FOUND_DICTIONARY:
            if _dictionary_forged(checker, key, result.value):
                return True
        elif result.type == dht_pb2.FOUND_REGULAR and not _signed(
            checker,
            DHTRecord(key, DHTProtocol.IS_REGULAR_VALUE, result.value, result.expiration_time),
        ):
            return True
    return False


async def _named(_dht: Any, node: Any) -> dict[str, tuple[str, str]]:
    return dict(getattr(node.protocol.authorizer, "forgers", {}))


def read_forgers(dht: Any) -> Any:
    """A future of the peers the DHT's gate named: their public key -> (member, why)."""
    return dht.run_coroutine(_named, return_future=True)


def evidence_of(request: Any, signature: bytes) -> bytes | None:
    """A store request as its sender signed it (hivemind's check cleared its signature), to show
    the swarm; None when it is larger than EVIDENCE_MAX_BYTES."""
    shown = dht_pb2.StoreRequest()
    shown.CopyFrom(request)
    shown.auth.signature = signature
    data = shown.SerializeToString()
    return data if len(data) <= EVIDENCE_MAX_BYTES else None


def forger_shown(
    evidence: Any, owner: str, checker: RSASignatureValidator
) -> tuple[str, str] | None:
    """(public key, member) of the sender of the store request `evidence` (evidence_of), when
    a certificate the owner signed binds that key to a member (expired or not: it was one when
    it sent the request), the key signed the request, and the request carries a record that
    key could not have signed (forged_in_store); else None."""
    if not isinstance(evidence, bytes) or len(evidence) > EVIDENCE_MAX_BYTES:
        return None
    try:
        request = dht_pb2.StoreRequest.FromString(evidence)
    except Exception:  # (anything at all may be shown)
        return None
    token = request.auth.client_access_token
    cert = Certificate.from_text(token.username)
    if cert is None or not cert.valid(owner, now=-math.inf):
        return None
    if cert.public_key.encode() != bytes(token.public_key):
        return None
    signature = bytes(request.auth.signature)
    request.auth.signature = b""
    try:
        key = RSAPublicKey.from_bytes(bytes(token.public_key))
        signed = key.verify(request.SerializeToString(), signature)
    except Exception:  # not a key, not a signature
        return None
    if not signed or not forged_in_store(checker, request):
        return None
    return cert.public_key, cert.member
