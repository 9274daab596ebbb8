"""DHT records a stranger can neither forge nor use to flood: a hivemind record validator that
knows every kind of record the swarm keeps, binds each to the key it sits under and to the
identity (libp2p key or organiser key) that signed it, and bounds its size, its key's cost and
its expiry.

What hivemind hands the validator (hivemind 1.1.12, ``dht/protocol.py``, ``dht/node.py``): one
``DHTRecord`` per dictionary entry, on every store a peer asks of this node, on every entry of
every dictionary a lookup returns (hivemind refuses the whole dictionary of an answer for one
refused entry; a node's guarded protocol, ``node.net.dht_guard``, drops only that entry), and on
this node's own stores. ``record.key`` is the key's DHT id, never the key
itself: the 20-byte SHA-1 of the msgpack of the key string (``dht_key_id``); ``record.subkey``
is the msgpack of the subkey, ``record.value`` the msgpack of the value (wrapped with a
signature for signed kinds), ``record.expiration_time`` the writer's claim in DHT time. A plain
value (no subkey) arrives with the reserved subkey ``msgpack(None)``.

Record types (``RECORD_TYPES``), each with its subkey form, the keys it may sit under, a value
check, a largest value and a longest life:

``peer:<peer id>`` (``peer``; under a run's ``<namespace>/peers``)
    A node's announcement. Its value is wrapped with the writer's libp2p public key and a
    signature over (key, subkey, value, expiration time). Valid only if the key's peer id is the
    one in the subkey and in the announcement itself, and the signature verifies: nobody can
    announce for a peer id whose private key they lack, or change a field of someone else's
    announcement (state, capacity, addresses, time).

``manifest:<organiser public key>`` or ``manifest:unsigned`` (``manifest``; under ``<namespace>/manifest``)
    The run's manifest as published in the DHT: its consensus fields, their hash and the
    organiser's signature over that hash. Valid only if the manifest is the run's whose key it
    sits under (the key is computed from the run id and organiser inside it, so every node,
    a bootstrap node too, checks this), the hash is the fields' hash, and the signature is the
    organiser key's (the one named in the subkey and in the manifest). Any node may re-publish
    it; nobody but the organisers can make a different one, nor move another run's manifest of
    theirs under this run's key.

``<peer id multihash>`` (``averaging``; under replica averaging's matchmaking keys)
    hivemind's averager declares itself in a group as ``store(<prefix>.0b<16 bits>, subkey=<its
    peer id bytes>, value=True/False)``; ``prefix`` is ``averaging_key_prefix(run, stage, organiser)`` and
    the 16 bits the clock slot (``node.net.averaging_round``). Only the two multihash forms of
    the project's key types are this type's: the identity multihash of an Ed25519 public key
    protobuf (38 bytes) and the sha2-256 multihash of an RSA one (34 bytes). The value is a bool,
    signed like an announcement, so nobody can enter another peer into (or take it out of) an
    averaging group. The averager runs with ``allow_state_sharing=False``, so it never writes
    hivemind's ``<prefix>.all_averagers`` state-download key, and nothing else in the node
    writes to the DHT: these three types are every record an honest node stores.

Everything else is refused and counted: plain values (one would replace a whole dictionary in
the storage of the nodes it reaches), subkeys of no type ("unknown"), subkeys longer than
``MAX_SUBKEY_BYTES``. Each type's size bound is checked before its value is deserialised; its
key is judged by ``security.peer_key_problem`` (Ed25519, or RSA with exponent 65537 and a
2048..4096-bit modulus) before any signature is verified, so a key that is slow to verify with
costs nothing.

Which keys a record may sit under: a validator made with a ``RunScope`` (the run's id,
organiser and stage count) computes its run's key ids (``<namespace>/manifest``,
``<namespace>/peers`` and every averaging group key of every stage) and refuses, under each of
them, every type but that key's own: no announcement, averaging declaration or junk under the
manifest key, no averaging declaration under the peers key, and so on. A key id outside its run
(another run sharing the DHT, or a made-up key) is judged as a validator without a scope judges
every key, as a bootstrap node that serves any run must: it cannot invert the hash, so it checks
the subkey's form, size, key, signature, expiry and, for a manifest, the binding to the key its
content names; an announcement or averaging declaration it accepts under any key.

Expiry: a writer claims at most ``max_ttl_s`` (``MAX_RECORD_TTL_S``, 300 s) from its own clock
(``writer_expiration``); a reader refuses a record only beyond ``max_ttl_s + MAX_CLOCK_SKEW_S``
from its clock, so an honest record is never refused by a node whose clock is behind the
writer's by up to the allowance, and a forged dictionary still cannot win lookups by claiming to
live much longer than honest ones.

Adding a record type (one entry in ``RECORD_TYPES``; every node must run the same list, since
every node judges every store it is asked for):

1. pick a subkey form no other type matches: a ``str`` prefix ending in ``:`` (``owns``), or an
   exactly described ``bytes`` form;
2. name the key it sits under: a suffix of the run's namespace (add it to ``RUN_KEYS``, its
   role name being the type's ``role``), so a scoped validator refuses it elsewhere in its run
   and other types under that key;
3. write its value check ``(record, subkey) -> bool``, which must not raise, and deserialise only
   after the size bound (``_signed_value`` does both, for records signed by a peer: give the
   type an ``owner`` and it is signed with the node's key by ``sign_value`` and checked like an
   announcement);
4. bound it: ``max_value_bytes`` (the largest honest value, with its signature wrapper, and
   some room) and ``max_ttl_s`` (no more than ``MAX_RECORD_TTL_S`` unless the record must live
   longer);
5. its ``kind`` becomes a label of ``swarm_node_forged_records_total``; add tests of an honest
   record accepted and of each refusal.

Refusals are counted by kind in a counter shared with the node's process (the DHT runs in a
child process) and exported as ``swarm_node_forged_records_total``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
from typing import Callable

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from security import (
    PeerKey,
    b58encode,
    peer_id_of_public_key,
    peer_key_problem,
    verify_manifest_signature,
    verify_peer_signature,
)
from node.net.run_keys import (  # noqa: F401 - the key names, where readers of records have found them
    AVERAGING_GROUP_BITS, MANIFEST_PREFIX, MAX_RECORD_TTL_S, PEER_PREFIX, RUN_KEYS, RunScope, UNSIGNED, averaging_key_prefix, dht_key_id, manifest_subkey, peer_subkey, run_key, run_namespace_of, writer_expiration,
)
from stages import consensus_hash

log = logging.getLogger("swarm_node.records")

MAX_CLOCK_SKEW_S = 30.0  # how far behind the writer's a reader's clock may be without refusing its records
MAX_SUBKEY_BYTES = 128  # the longest serialised subkey of any type (a peer: subkey is about 60)
_WRAP = b"SWNR1"  # signed-value wrapper: magic + msgpack [value, public key, signature]
_PLAIN = MSGPackSerializer.dumps(None)  # hivemind's subkey of a plain (non-dictionary) value
# ----------------------------------------------------------------------------- record types


@dataclasses.dataclass(frozen=True)
class RecordType:
    """One kind of record the swarm keeps (see the module docstring for adding one).

    ``owns(subkey)``: whether a deserialised subkey has this type's form. ``role``: the run key
    it sits under (a key of ``RUN_KEYS`` or ``averaging``). ``check(record, subkey)``: whether
    the value is valid (size, expiry and key role are judged before). ``owner(subkey)``: the peer
    id that must sign a record of this subkey (None: not signed by a peer)."""

    kind: str
    owns: Callable[[object], bool]
    role: str
    check: Callable[[DHTRecord, object], bool]
    max_value_bytes: int
    max_ttl_s: float = MAX_RECORD_TTL_S
    owner: Callable[[object], str | None] | None = None


def _signed_bytes(record: DHTRecord) -> bytes:
    return MSGPackSerializer.dumps([record.key, record.subkey, record.value, record.expiration_time])


def _signed_value(record: DHTRecord, peer_id: str):
    """The content of a record wrapped and signed by ``peer_id``'s key, or None if it is not: the
    key must be one ``peer_key_problem`` accepts (judged before the signature is verified) and
    hash to ``peer_id``, and the signature must cover key, subkey, value and expiry."""
    if not record.value.startswith(_WRAP):
        return None
    try:
        value, public_key, signature = MSGPackSerializer.loads(record.value[len(_WRAP):])
    except Exception:  # noqa: BLE001 - malformed: a forgery or garbage
        return None
    if not isinstance(public_key, bytes) or not isinstance(signature, bytes) or not isinstance(value, bytes):
        return None
    if peer_key_problem(public_key, signature) is not None:
        return None
    if peer_id_of_public_key(public_key) != peer_id:
        return None
    try:
        content = MSGPackSerializer.loads(value)
    except Exception:  # noqa: BLE001
        return None
    if not verify_peer_signature(public_key, _signed_bytes(dataclasses.replace(record, value=value)), signature):
        return None
    return content


def _peer_owner(subkey) -> str | None:
    return subkey[len(PEER_PREFIX):] if isinstance(subkey, str) and subkey.startswith(PEER_PREFIX) else None


def _check_peer(record: DHTRecord, subkey) -> bool:
    peer_id = _peer_owner(subkey)
    if not peer_id:
        return False
    content = _signed_value(record, peer_id)
    return isinstance(content, dict) and content.get("peer_id") == peer_id


_ED25519_MULTIHASH = b"\x00\x24\x08\x01\x12\x20"  # identity multihash (36 bytes) of PublicKey{Ed25519, 32 bytes}
_SHA256_MULTIHASH = b"\x12\x20"


def _is_peer_multihash(subkey) -> bool:
    """The raw peer id forms of the project's key types: Ed25519 (identity) or RSA (sha2-256)."""
    return isinstance(subkey, bytes) and (
        (len(subkey) == 38 and subkey.startswith(_ED25519_MULTIHASH))
        or (len(subkey) == 34 and subkey.startswith(_SHA256_MULTIHASH)))


def _averaging_owner(subkey) -> str | None:
    return b58encode(subkey) if _is_peer_multihash(subkey) else None


def _check_averaging(record: DHTRecord, subkey) -> bool:
    return isinstance(_signed_value(record, b58encode(subkey)), bool)  # looking for a group, or not


def _is_manifest_subkey(subkey) -> bool:
    return isinstance(subkey, str) and subkey.startswith(MANIFEST_PREFIX)


def _check_manifest(record: DHTRecord, subkey) -> bool:
    organiser = subkey[len(MANIFEST_PREFIX):]
    try:
        published = MSGPackSerializer.loads(record.value)
    except Exception:  # noqa: BLE001
        return False
    if not isinstance(published, dict) or not isinstance(published.get("manifest"), dict):
        return False
    run = published["manifest"].get("run")
    if not isinstance(run, dict) or not isinstance(run.get("id"), str):
        return False
    run_organiser = run.get("organiser", "")
    if not isinstance(run_organiser, str):
        return False
    # the manifest must be the run's whose key it sits under (its id and organiser name the key)
    if record.key != dht_key_id(run_key(run_namespace_of(run["id"], run_organiser), "manifest")):
        return False
    try:
        digest = consensus_hash(published["manifest"])
    except Exception:  # noqa: BLE001 - fields a manifest cannot have
        return False
    if published.get("hash") != digest:
        return False
    if organiser == UNSIGNED:  # a local-only unsigned run: nothing to verify beyond the hash
        return run_organiser == "" and published.get("organiser", "") == ""
    return (run_organiser == organiser and published.get("organiser") == organiser
            and verify_manifest_signature(organiser, digest, str(published.get("signature", ""))))


RECORD_TYPES: tuple[RecordType, ...] = (
    # an announcement: ~300 bytes of fields, up to 16 addresses, an RSA-4096 key and signature
    RecordType("peer", lambda s: _peer_owner(s) is not None, "peers", _check_peer, 8192, owner=_peer_owner),
    # the consensus fields of the manifest (about 1.5 KiB for the shipped runs), hash, signature
    RecordType("manifest", _is_manifest_subkey, "manifest", _check_manifest, 32768),
    # a bool, its signature and key (about 1.1 KiB with an RSA-4096 key)
    RecordType("averaging", _is_peer_multihash, "averaging", _check_averaging, 2048, owner=_averaging_owner),
)
KINDS = tuple(t.kind for t in RECORD_TYPES) + ("plain", "unknown", "unread")  # unread: over a sender's rate


def record_type_of(subkey) -> RecordType | None:
    """The type whose form ``subkey`` (deserialised) has; None for a subkey of no type."""
    for rtype in RECORD_TYPES:
        if rtype.owns(subkey):
            return rtype
    return None


class ForgeryCounter:
    """Rejected records by kind, in shared memory: the DHT child process counts, the node reads."""

    def __init__(self):
        self._counts = multiprocessing.Array("q", len(KINDS), lock=True)

    def add(self, kind: str, n: int = 1) -> None:
        with self._counts.get_lock():
            self._counts[KINDS.index(kind)] += n

    def snapshot(self) -> dict[str, int]:
        with self._counts.get_lock():
            return {k: int(self._counts[i]) for i, k in enumerate(KINDS)}


def _subkey(record: DHTRecord):
    try:
        return MSGPackSerializer.loads(record.subkey)
    except Exception:  # noqa: BLE001 - not ours to judge
        return None


# ----------------------------------------------------------------------------- the validator


class SwarmRecordValidator(RecordValidatorBase):
    """Signs this node's own peer-signed records with its libp2p key; refuses every record that
    is not a valid record of a known type (see the module docstring). ``key``: this node's
    ``PeerKey`` (None on a node that only validates, such as a bootstrap peer). ``scope``: the
    ``RunScope`` of the node's run, so records under its run's keys are bound to their key's
    type (None: a node serving any run, which cannot tell keys apart)."""

    def __init__(self, key: PeerKey | None = None, counter: ForgeryCounter | None = None,
                 scope: RunScope | None = None):
        self.key = key
        self.counter = counter
        self.scope = scope

    # ---- signing (our own records)

    def sign_value(self, record: DHTRecord) -> bytes:
        if self.key is None or len(record.subkey) > MAX_SUBKEY_BYTES:
            return record.value
        subkey = _subkey(record)
        rtype = record_type_of(subkey)
        if rtype is None or rtype.owner is None or rtype.owner(subkey) != self.key.peer_id:
            return record.value
        if record.expiration_time > get_dht_time() + rtype.max_ttl_s:
            log.warning("this node stores a %s record that claims to live %.0f s (at most %.0f s: "
                        "readers may refuse it)", rtype.kind, record.expiration_time - get_dht_time(), rtype.max_ttl_s)
        signature = self.key.sign(_signed_bytes(record))
        return _WRAP + MSGPackSerializer.dumps([record.value, self.key.public_key, signature])

    def strip_value(self, record: DHTRecord) -> bytes:
        if record.value.startswith(_WRAP):
            try:
                return MSGPackSerializer.loads(record.value[len(_WRAP):])[0]
            except Exception:  # noqa: BLE001 - validate() refused it already
                return record.value
        return record.value

    # ---- validation (everyone's records)

    def validate(self, record: DHTRecord) -> bool:
        kind, ok = self._judge(record)
        if not ok and self.counter is not None:
            self.counter.add(kind)
        return ok

    def _judge(self, record: DHTRecord) -> tuple[str, bool]:
        """(the record's kind, whether it is valid); cheap checks first, signatures last."""
        if record.subkey == _PLAIN:
            return "plain", False
        if len(record.subkey) > MAX_SUBKEY_BYTES:
            return "unknown", False
        subkey = _subkey(record)
        rtype = record_type_of(subkey)
        if rtype is None:
            return "unknown", False
        role = self.scope.role(record.key) if self.scope is not None else None
        if role is not None and role != rtype.role:  # under one of our run's keys, of another type
            return rtype.kind, False
        if len(record.value) > rtype.max_value_bytes:
            return rtype.kind, False
        expiration = record.expiration_time
        if not math.isfinite(expiration) or expiration > get_dht_time() + rtype.max_ttl_s + MAX_CLOCK_SKEW_S:
            return rtype.kind, False
        try:
            return rtype.kind, bool(rtype.check(record, subkey))
        except Exception:  # noqa: BLE001 - a peer's bad input never crashes the DHT
            log.debug("a %s record's check raised", rtype.kind, exc_info=True)
            return rtype.kind, False

    @property
    def priority(self) -> int:
        return 5

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SwarmRecordValidator)
