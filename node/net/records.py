"""DHT records a stranger cannot forge: a hivemind record validator that binds each protected
record to the libp2p identity, or the organiser key, that signed it.

Two kinds of protected entries live under a run's keys (``membership.py``):

``peer:<peer id>`` (subkey of ``.../peers``)
    A node's announcement. Its value is wrapped with the writer's libp2p public key and a
    signature over (key, subkey, value, expiration time). Valid only if the key's peer id is the
    one in the subkey and in the announcement itself, and the signature verifies: nobody can
    announce for a peer id whose private key they lack, or change a field of someone else's
    announcement (state, capacity, addresses, time).

``manifest:<organiser public key>`` (subkey of ``.../manifest``)
    The run's manifest as published in the DHT: its consensus fields, their hash and the
    organiser's signature over that hash. Valid only if the hash is the fields' hash and the
    signature is the organiser key's (the one named in the subkey). Any node may re-publish it;
    nobody but the organisers can make a different one.

``<peer id bytes>`` (subkeys of replica averaging's matchmaking keys, written by hivemind's averager)
    Signed the same way: an averaging announcement is bound to the peer it announces, so nobody
    can enter another peer into (or take it out of) an averaging group.

The swarm's DHT holds dictionaries only: a plain value would replace a whole dictionary (every
peer's announcement) in the storage of the nodes it reaches, so the validator refuses plain values.

The validator runs in every DHT node of the swarm (hivemind calls it on every store it is asked to
do and on every value a lookup returns), so honest nodes neither keep nor believe a forgery. Its
expiration check also caps how far ahead a record may claim to live, so a forged dictionary cannot
win a lookup by expiring later than honest ones (``MAX_RECORD_TTL_S``). Rejections are counted in
a counter shared with the node's process (the DHT runs in a child process) and exported as
``swarm_node_forged_records_total``.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from security import (
    PeerKey,
    b58encode,
    peer_id_of_public_key,
    verify_manifest_signature,
    verify_peer_signature,
)
from stages import consensus_hash

log = logging.getLogger("swarm_node.records")

PEER_PREFIX = "peer:"
MANIFEST_PREFIX = "manifest:"
UNSIGNED = "unsigned"  # the organiser part of an unsigned (local-only) run's manifest subkey
MAX_RECORD_TTL_S = 300.0  # a record may not claim to live longer than this from now
_WRAP = b"SWNR1"  # signed-value wrapper: magic + msgpack [value, public key, signature]
KINDS = ("peer", "manifest", "averaging", "plain")


def peer_subkey(peer_id: str) -> str:
    return PEER_PREFIX + peer_id


def manifest_subkey(organiser: str) -> str:
    return MANIFEST_PREFIX + (organiser or UNSIGNED)


class ForgeryCounter:
    """Rejected records by kind, in shared memory: the DHT child process counts, the node reads."""

    def __init__(self):
        self._counts = multiprocessing.Array("q", len(KINDS), lock=True)

    def add(self, kind: str) -> None:
        with self._counts.get_lock():
            self._counts[KINDS.index(kind)] += 1

    def snapshot(self) -> dict[str, int]:
        with self._counts.get_lock():
            return {k: int(self._counts[i]) for i, k in enumerate(KINDS)}


_PLAIN = MSGPackSerializer.dumps(None)  # hivemind's subkey of a plain (non-dictionary) value


def _subkey(record: DHTRecord):
    try:
        return MSGPackSerializer.loads(record.subkey)
    except Exception:  # noqa: BLE001 - not ours to judge
        return None


def _owner(subkey) -> str | None:
    """The peer id a record with this (deserialized) subkey must be signed by: ``peer:<id>``
    subkeys (announcements) and raw peer id subkeys (averaging matchmaking); None for records no
    peer owns."""
    if isinstance(subkey, str) and subkey.startswith(PEER_PREFIX):
        return subkey[len(PEER_PREFIX):]
    if isinstance(subkey, bytes) and (
            (len(subkey) == 34 and subkey[:2] == b"\x12\x20")  # sha2-256 multihash (RSA keys)
            or (len(subkey) > 2 and subkey[0] == 0 and subkey[1] == len(subkey) - 2)):  # identity multihash
        return b58encode(subkey)
    return None


def _signed_bytes(record: DHTRecord) -> bytes:
    return MSGPackSerializer.dumps([record.key, record.subkey, record.value, record.expiration_time])


class SwarmRecordValidator(RecordValidatorBase):
    """Signs this node's own peer announcements with its libp2p key; refuses forged or
    tampered protected records (see the module docstring). ``key``: this node's ``PeerKey``
    (None on a node that only validates, such as a bootstrap peer)."""

    def __init__(self, key: PeerKey | None = None, counter: ForgeryCounter | None = None):
        self.key = key
        self.counter = counter

    # ---- signing (our own records)

    def sign_value(self, record: DHTRecord) -> bytes:
        if self.key is None or _owner(_subkey(record)) != self.key.peer_id:
            return record.value
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
        subkey = _subkey(record)
        owner = _owner(subkey)
        if record.subkey == _PLAIN:
            ok, kind = False, "plain"
        elif owner is not None:
            kind = "peer" if isinstance(subkey, str) else "averaging"
            ok = self._valid_owned(record, owner, check_value=kind == "peer")
        elif isinstance(subkey, str) and subkey.startswith(MANIFEST_PREFIX):
            ok = self._valid_manifest(record, subkey[len(MANIFEST_PREFIX):])
            kind = "manifest"
        else:
            return True
        if ok and record.expiration_time > get_dht_time() + MAX_RECORD_TTL_S:
            ok = False
        if not ok and self.counter is not None:
            self.counter.add(kind)
        return ok

    @staticmethod
    def _valid_owned(record: DHTRecord, peer_id: str, check_value: bool) -> bool:
        """Signed by ``peer_id``'s key; an announcement (``check_value``) must also name it."""
        if not record.value.startswith(_WRAP):
            return False
        try:
            value, public_key, signature = MSGPackSerializer.loads(record.value[len(_WRAP):])
            content = MSGPackSerializer.loads(value)
        except Exception:  # noqa: BLE001 - malformed: a forgery or garbage
            return False
        if not isinstance(public_key, bytes) or not isinstance(signature, bytes) or not isinstance(value, bytes):
            return False
        if peer_id_of_public_key(public_key) != peer_id:
            return False
        if check_value and not (isinstance(content, dict) and content.get("peer_id") == peer_id):
            return False
        return verify_peer_signature(public_key, _signed_bytes(dataclasses.replace(record, value=value)), signature)

    @staticmethod
    def _valid_manifest(record: DHTRecord, organiser: str) -> bool:
        try:
            published = MSGPackSerializer.loads(record.value)
        except Exception:  # noqa: BLE001
            return False
        if not isinstance(published, dict) or not isinstance(published.get("manifest"), dict):
            return False
        digest = consensus_hash(published["manifest"])
        if published.get("hash") != digest:
            return False
        if organiser == UNSIGNED:  # a local-only unsigned run: nothing to verify beyond the hash
            return published.get("organiser", "") == ""
        return published.get("organiser") == organiser and verify_manifest_signature(
            organiser, digest, str(published.get("signature", "")))

    @property
    def priority(self) -> int:
        return 5

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SwarmRecordValidator)

