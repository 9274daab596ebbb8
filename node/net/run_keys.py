"""The names of a run's DHT keys and subkeys, and the key ids a node of that run knows as its own.

A run's records live under ``swarm-node/<run id>/<organiser fingerprint>`` (no fingerprint for an
unsigned, local-only run): ``<namespace>/manifest`` and ``<namespace>/peers``; a stage's replicas
average under matchmaking keys ``<averaging prefix>.0b<slot bits>``. hivemind hands a record
validator only a key's id (the SHA-1 of the msgpack of the key string), so ``RunScope`` computes the
ids of every key of one run once. The validator that uses all this is ``node.net.records``.
"""

from __future__ import annotations

import array
import bisect
import hashlib

from hivemind.utils import MSGPackSerializer, get_dht_time

from security import organiser_fingerprint

PEER_PREFIX = "peer:"
MANIFEST_PREFIX = "manifest:"
UNSIGNED = "unsigned"  # the organiser part of an unsigned (local-only) run's manifest subkey
MAX_RECORD_TTL_S = 300.0  # a writer's record may claim to live at most this long from its now
AVERAGING_GROUP_BITS = 16  # the matchmaking group key's bits: the clock slot number mod 2**16




# ----------------------------------------------------------------------------- keys and namespaces


def dht_key_id(key: str) -> bytes:
    """The bytes hivemind passes as ``DHTRecord.key`` for a record stored under ``key``: its
    ``DHTID.generate(key).to_bytes()``, the SHA-1 of the key's msgpack (computed here directly,
    without the integer round trip, since a ``RunScope`` computes it for every averaging group key)."""
    return hashlib.sha1(MSGPackSerializer.dumps(key)).digest()


def run_namespace_of(run_id: str, organiser: str) -> str:
    """A run's DHT namespace: ``swarm-node/<run id>/<organiser fingerprint>`` (no fingerprint for
    an unsigned run, whose ``organiser`` is empty), so two organisers' runs never share records."""
    return f"swarm-node/{run_id}" + (f"/{organiser_fingerprint(organiser)}" if organiser else "")


RUN_KEYS = {"manifest": "manifest", "peers": "peers"}  # role -> key suffix under the run's namespace


def run_key(namespace: str, role: str) -> str:
    """The key of the run's records of ``role`` (``manifest``, ``peers``): ``<namespace>/<suffix>``."""
    return f"{namespace}/{RUN_KEYS[role]}"


def averaging_key_prefix(run_id: str, stage: int, organiser: str = "") -> str:
    """The matchmaking key prefix of a stage's replicas, in the run's namespace: the run id and the
    fingerprint of its organiser key (none for an unsigned run), so runs of two organisers under
    one id never meet (hivemind forbids '.' in it); its group keys are ``<prefix>.0b<bits>``.
    ``node.net.averaging.averaging_prefix`` is this."""
    fingerprint = f"_{organiser_fingerprint(organiser)}" if organiser else ""
    return f"{run_id.replace('.', '_')}{fingerprint}_stage{stage}_avg"


def writer_expiration(ttl: float) -> float:
    """The expiration time a writer gives a record meant to live ``ttl`` seconds: capped at
    ``MAX_RECORD_TTL_S``, past which every reader refuses it."""
    return get_dht_time() + min(float(ttl), MAX_RECORD_TTL_S)


def peer_subkey(peer_id: str) -> str:
    return PEER_PREFIX + peer_id


def manifest_subkey(organiser: str) -> str:
    return MANIFEST_PREFIX + (organiser or UNSIGNED)


def _key_prefix64(key_id: bytes) -> int:
    return int.from_bytes(key_id[:8], "big")


class RunScope:
    """The key ids of one run, for a validator in a node of that run: which role each of its
    keys has (``role``). Averaging group keys of ``n_stages`` stages are kept as sorted 64-bit
    prefixes of their ids (512 KiB and about 0.1 s per stage, once, at construction)."""

    def __init__(self, run_id: str, organiser: str = "", n_stages: int = 0):
        self.run_id, self.organiser, self.n_stages = run_id, organiser, int(n_stages)
        self.namespace = run_namespace_of(run_id, organiser)
        self._roles = {dht_key_id(run_key(self.namespace, role)): role for role in RUN_KEYS}
        ids = []
        for stage in range(self.n_stages):
            prefix = averaging_key_prefix(run_id, stage, organiser)
            ids.append(_key_prefix64(dht_key_id(f"{prefix}.0b")))  # hivemind's initial (empty) group bits
            ids.extend(_key_prefix64(dht_key_id(f"{prefix}.0b{slot:0{AVERAGING_GROUP_BITS}b}"))
                       for slot in range(1 << AVERAGING_GROUP_BITS))
        self._averaging = array.array("Q", sorted(ids))

    @classmethod
    def of(cls, manifest) -> RunScope:
        """The scope of a ``stages.Manifest``'s run."""
        return cls(manifest.run.id, manifest.run.organiser, manifest.n_stages)

    def role(self, key_id: bytes) -> str | None:
        """``manifest``, ``peers`` or ``averaging`` for a key id of this run; None for any other."""
        role = self._roles.get(key_id)
        if role is not None:
            return role
        prefix = _key_prefix64(key_id)
        i = bisect.bisect_left(self._averaging, prefix)
        return "averaging" if i < len(self._averaging) and self._averaging[i] == prefix else None
