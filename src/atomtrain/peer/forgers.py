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
keeps the request as its sender signed it (`evidence_of`) and shows it to the swarm: its peer
stores that evidence under its own subkey of `{swarm}_forgers` every 10 s
(auth.SwarmAuthorizer.share, from the status thread, presence.py), and reads the certified
members', and names the sender of any request that checks
(`forger_shown`): a certificate the swarm's owner signed for the key that signed the request,
and a record in it that this key could not have signed. The verdict reads the request's bytes
alone, the same on every node at any time (no subkey whose encoding turns with the clock:
PLAIN_SUBKEYS), so showing an honest node's request names no one: that takes a store request
its key signed carrying such a record, and no honest node sends one. What is not shown: a
forger named from an answer to a find (an answer's signature does not cover the request it
answers, whose keys the check reads, so the asker could pair an honest answer with another
request), a forged request larger than EVIDENCE_MAX_BYTES, forgers past a node's first
EVIDENCE_KEPT, and any once the node that caught it has left (its record lives EVIDENCE_TTL_S;
others do not show it on). A verdict is the same on every node that runs the same cryptography
library (the signatures' checks).
"""

from __future__ import annotations

import base64
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
EVIDENCE_MAX_BYTES = 2**14
"""The largest signed request a node shows (bench attack's forged stores: about 4 KB, the
sender's certificate and one record under another's subkey). A forged request padded past it
is refused, and names its sender, where it arrives, and is not shown: its sender chose to
touch only those nodes (the record reaches no other: none stores it to pass it on)."""
EVIDENCE_KEPT = 2
"""Forgers a node shows evidence of (the first it caught): with EVIDENCE_MAX_BYTES, a node's
record stays under 44 KB, and the swarm's dictionary of them under hivemind's 4 MiB message
for about 90 nodes that caught one."""
EVIDENCE_TTL_S = 60.0
"""A node's evidence record lives this long; its peer stores it again every
presence.READ_EVERY_S (10 s)."""
PLAIN_SUBKEYS = (type(None), bytes)
"""The subkeys a record may have: None for a regular value, bytes otherwise (a peer ID's, a
signed subkey: hivemind's and Atom's own). msgpack can carry others, a DictionaryDHTValue among
them, whose encoding drops the entries that have expired: the check of a record under one would
turn with the clock, and an honest node's request, valid when sent, could be shown later as a
forgery. Subkeys of mixed types in one dictionary (str and bytes) fail to decode on arrival
(hivemind's storage orders entries of one expiry by their subkeys): with bytes alone no honest
node holds such a dictionary, and a dictionary that fails to decode names no one."""


EVIDENCE_CHARS = 4 * ((EVIDENCE_MAX_BYTES + 2) // 3)
"""EVIDENCE_MAX_BYTES in base64."""


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
    """A dictionary holds a record its owner did not sign, or a subkey no honest node sends.
    One that does not decode names no one (refused all the same: hivemind cannot store it)."""
    try:
        dictionary = MSGPackSerializer.loads(value)
    except Exception:
        return False
    if not isinstance(dictionary, DictionaryDHTValue):
        return True
    with dictionary.freeze():
        for subkey, (item, expiration) in dictionary.items():
            if not isinstance(subkey, PLAIN_SUBKEYS):
                return True
            record = DHTRecord(key, MSGPackSerializer.dumps(subkey), item, expiration)
            if not _signed(checker, record):
                return True
    return False


def _canonical(key: bytes, tag: bytes) -> bool:
    """The key and subkey are encoded as hivemind encodes them whenever it sends a record on: a
    node stores a record under the decoded key and subkey and encodes both anew to pass it on, so
    a record signed over another encoding of them (a 21-byte key with a leading zero, a subkey
    in a longer msgpack form) verifies on arrival and fails once an honest node passes it on.
    Accepting it would let its sender have honest nodes named; no honest node sends one. Nor
    does one send a subkey of another type than PLAIN_SUBKEYS."""
    try:
        if DHTID.from_bytes(key).to_bytes() != key:
            return False
        if tag == DHTProtocol.IS_DICTIONARY:
            return True
        subkey = MSGPackSerializer.loads(tag)
        return isinstance(subkey, PLAIN_SUBKEYS) and MSGPackSerializer.dumps(subkey) == tag
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


def evidence_of(request: Any, signature: bytes) -> str | None:
    """A store request as its sender signed it (hivemind's check cleared its signature), to show
    the swarm, in base64: a record's value must hold no `[signature:...]` but its own
    (hivemind's RSASignatureValidator), and a forged request may carry signed records. None
    when the request is larger than EVIDENCE_MAX_BYTES."""
    shown = dht_pb2.StoreRequest()
    shown.CopyFrom(request)
    shown.auth.signature = signature
    data = shown.SerializeToString()
    return base64.b64encode(data).decode("ascii") if len(data) <= EVIDENCE_MAX_BYTES else None


def forger_shown(
    evidence: Any, owner: str, checker: RSASignatureValidator
) -> tuple[str, str] | None:
    """(public key, member) of the sender of the store request `evidence` (evidence_of), when
    a certificate the owner signed binds that key to a member (expired or not: it was one when
    it sent the request), the key signed the request, and the request carries a record that
    key could not have signed (forged_in_store); else None."""
    if not isinstance(evidence, str) or len(evidence) > EVIDENCE_CHARS:
        return None
    try:
        request = dht_pb2.StoreRequest.FromString(base64.b64decode(evidence, validate=True))
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
