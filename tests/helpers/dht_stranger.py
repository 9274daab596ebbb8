"""A stranger's DHT client against a run's control plane: no forged signature is needed for most
of what it does. It runs its own hivemind DHT node (no record validator) whose DHT id it chooses
next to the run's ``peers`` key, and in every round sends raw ``rpc_store`` requests to every DHT
node it knows:

- ``forge``: records for the honest peers' ``peer:`` subkeys signed with its own key (draining,
  huge capacity), and a plain value that would replace the whole dictionary;
- ``flood``: hundreds of subkeys nobody validates (strings, random bytes, sha2-512 multihashes),
  1 KiB each, expiring in 70 years;
- ``cache``: one valid record of its own (signed by its own key) stored into the storing nodes'
  *cache* (``in_cache``), expiring later than any honest record;
- ``expiry``: valid records of its own that claim to live the longest a writer may claim, less
  0.1 s: a reader whose clock is behind sees them past the cap;
- ``replay``: the honest peers' own records as read at the start, with their older expiry;
- ``manifest``: another run's manifest signed by the same organiser, under this run's key;
- ``rsa``: records under ``peer:`` subkeys of RSA keys with a 3071-bit public exponent (no private
  key needed: the signatures are garbage, what costs is checking them).

``answer(node_index)`` reads what one DHT node answers for the run's ``peers`` key, raw (entries,
bytes), and ``visible()`` what an honest reader makes of it. Used by ``scripts/bench_dht_attack.py``
and ``tests/test_trust_swarm.py``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from node.net.membership import run_namespace
from node.net.records import MAX_RECORD_TTL_S, SwarmRecordValidator, manifest_subkey, peer_subkey
from security import PeerKey, new_ed25519_key
from security.identity import KEY_RSA, key_message, peer_id_of_public_key

LOOPBACK = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False, auto_nat=False,
                nat_port_map=False)
KINDS = ("forge", "flood", "cache", "expiry", "replay", "manifest", "rsa")
SEVENTY_YEARS = 70 * 365 * 86400.0


def huge_exponent_rsa_public_key(seed: int) -> bytes:
    """A libp2p RSA ``PublicKey`` protobuf whose public exponent has 3071 bits (the modulus is
    3072 bits; both random: nobody needs the private key to send such a key)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicNumbers

    rnd = int.from_bytes(os.urandom(384), "big") | (1 << 3071) | 1
    e = (int.from_bytes(os.urandom(384), "big") >> 1) | (1 << 3070) | 1
    e = min(e, rnd - 2) | 1
    der = RSAPublicNumbers(e, rnd).public_key().public_bytes(serialization.Encoding.DER,
                                                             serialization.PublicFormat.SubjectPublicKeyInfo)
    return key_message(KEY_RSA, der)


def _wrap(value: bytes, public_key: bytes, signature: bytes) -> bytes:
    return b"SWNR1" + MSGPackSerializer.dumps([value, public_key, signature])


@dataclasses.dataclass
class Round:
    """What one round sends: (key string, subkey, value bytes, expiration, in_cache) tuples."""

    items: list[tuple[str, object, bytes, float, bool]]
    kinds: dict[str, int]


async def _send(dht, node, items, batch: int, only=None, spare=()):
    """In the stranger's DHT process: send ``items`` to every DHT node it knows (those in ``only``
    if given, none in ``spare``; base58 peer ids), ``batch`` per request."""
    peers = [p for p in node.protocol.routing_table.peer_id_to_uid.keys()
             if (only is None or p.to_base58() in only) and p.to_base58() not in spare]
    stored = refused = 0
    for peer in peers:
        for i in range(0, len(items), batch):
            part = items[i:i + batch]
            out = await node.protocol.call_store(
                peer, keys=[DHTID.generate(source=k) for k, *_ in part], values=[v for _, _, v, _, _ in part],
                expiration_time=[e for *_, e, _ in part], subkeys=[s for _, s, *_ in part],
                in_cache=[c for *_, c in part])
            if out is not None:
                stored += sum(bool(x) for x in out)
                refused += sum(not x for x in out)
    return len(peers), stored, refused


async def _answers(dht, node, key: str):
    """In the stranger's DHT process: every known node's raw answer for ``key``: peer -> (entries,
    bytes of values and subkeys, {subkey: (value bytes, expiration)})."""
    from hivemind.dht.storage import DictionaryDHTValue

    key_id = DHTID.generate(source=key)
    out = {}
    for peer in list(node.protocol.routing_table.peer_id_to_uid.keys()):
        try:
            found = await node.protocol.call_find(peer, [key_id])
        except Exception as e:  # noqa: BLE001 - an answer too big to receive is what is measured
            out[str(peer)] = (-1, -1, repr(e)[:200])
            continue
        if not found or key_id not in found:
            out[str(peer)] = (-1, -1, "no answer")
            continue
        value = found[key_id][0]
        if value is None:
            out[str(peer)] = (0, 0, {})
        elif isinstance(value.value, DictionaryDHTValue):
            entries = {s: (v, e) for s, (v, e) in value.value.items()}
            size = sum(len(v) + len(MSGPackSerializer.dumps(s)) for s, (v, _) in entries.items())
            out[str(peer)] = (len(entries), size, entries)
        else:
            out[str(peer)] = (1, len(value.value), {None: (value.value, value.expiration_time)})
    return out


def round_items(spec: dict) -> Round:
    """One round's records, built from ``spec`` (small: keys, peer ids, key files, replays) in the
    process that sends them (hivemind's pipe to the DHT process does not carry megabytes)."""
    now = get_dht_time()
    key_peers, key_manifest = spec["key_peers"], spec["key_manifest"]
    own = [PeerKey(b) for b in spec["own"]]
    items: list[tuple[str, object, bytes, float, bool]] = []
    kinds = {k: 0 for k in KINDS}

    def add(kind, key, subkey, value, expiration, in_cache=False):
        items.append((key, subkey, value, expiration, in_cache))
        kinds[kind] += 1

    def signed_own(key: PeerKey, expiration: float, **fields) -> tuple[object, bytes]:
        subkey = peer_subkey(key.peer_id)
        value = MSGPackSerializer.dumps({"peer_id": key.peer_id, "stage": 1, "state": "online", "throughput": 0.0,
                                         "capacity": 1.0, "queue": 0, "version": 0, "protocol": 1, "maddrs": [],
                                         "time": time.time(), **fields})
        record = DHTRecord(DHTID.generate(source=key_peers).to_bytes(), MSGPackSerializer.dumps(subkey), value,
                           expiration)
        return subkey, SwarmRecordValidator(key).sign_value(record)

    # forge: honest peers' subkeys, signed with the stranger's key; a plain value
    _, wrapped = signed_own(own[0], now + 200, state="draining", capacity=1e9)
    for victim in spec["victims"]:
        add("forge", key_peers, peer_subkey(victim), wrapped, now + 240)
    add("forge", key_peers, None, MSGPackSerializer.dumps({"x": 1}), now + 240)
    # flood: subkeys nobody validates, far-future expiry
    for i in range(spec["flood"]):
        junk = os.urandom(1024)
        sub = (f"junk:{os.urandom(8).hex()}" if i % 3 == 0 else os.urandom(16) if i % 3 == 1
               else b"\x13\x40" + os.urandom(64))  # the last: a well-formed sha2-512 multihash
        add("flood", key_peers, sub, MSGPackSerializer.dumps({"junk": junk}), now + SEVENTY_YEARS)
    # cache: a valid record of its own, into the cache, expiring later than honest ones
    sub, val = signed_own(own[1], now + MAX_RECORD_TTL_S - 1.0)
    add("cache", key_peers, sub, val, now + MAX_RECORD_TTL_S - 1.0, True)
    # expiry: valid records at the writer's cap less 0.1 s
    for key in own[2:]:
        sub, val = signed_own(key, now + MAX_RECORD_TTL_S - 0.1)
        add("expiry", key_peers, sub, val, now + MAX_RECORD_TTL_S - 0.1)
    # replay: honest records as read at the start, with their (older) expiry
    for sub, val, exp in spec["replays"]:
        if exp > now:
            add("replay", key_peers, sub, val, exp)
    # manifest: another run of the same organiser under this run's key
    if spec["other"] is not None:
        subkey, published = spec["other"]
        add("manifest", key_manifest, subkey, MSGPackSerializer.dumps(published), now + MAX_RECORD_TTL_S - 0.1)
    # rsa: keys whose checking costs
    for i in range(spec["rsa"]):
        pub = huge_exponent_rsa_public_key(i)
        pid = peer_id_of_public_key(pub)
        value = MSGPackSerializer.dumps({"peer_id": pid, "stage": 1, "state": "online"})
        add("rsa", key_peers, peer_subkey(pid), _wrap(value, pub, os.urandom(384)), now + 200)
    return Round(items, kinds)


class Stranger:
    """The stranger's DHT node, next to the run's ``peers`` key, and its attack loop."""

    def __init__(self, initial_peers: list[str], manifest, other_run_manifest=None, *, flood: int = 300,
                 batch: int = 100, pause: float = 0.2, rsa: int = 20):
        ns = run_namespace(manifest)
        self.key_peers, self.key_manifest = f"{ns}/peers", f"{ns}/manifest"
        target = DHTID.generate(source=self.key_peers)
        self.dht = hivemind.DHT(initial_peers=initial_peers, start=True, node_id=DHTID(target ^ 1), **LOOPBACK)
        self.own = [new_ed25519_key() for _ in range(4)]
        other = None
        if other_run_manifest is not None:
            from stages import consensus_dict, manifest_hash

            m = other_run_manifest
            other = (manifest_subkey(m.run.organiser),
                     {"hash": manifest_hash(m), "manifest": consensus_dict(m), "protocol": 1,
                      "organiser": m.run.organiser, "signature": m.signature.ed25519})
        self.other = other
        self.flood, self.batch, self.pause, self.rsa = flood, batch, pause, rsa
        self.victims: list[str] = []
        self.only: list[str] | None = None  # send only to these DHT nodes (base58 peer ids); None: to all
        self.spare: list[str] = []  # and never to these
        self.replays: list[tuple[object, bytes, float]] = []
        self.rounds = 0
        self.sent = {k: 0 for k in KINDS}
        self.stored = self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="stranger")

    def spec(self) -> dict:
        return {"key_peers": self.key_peers, "key_manifest": self.key_manifest, "own": self.own,
                "victims": list(self.victims), "replays": list(self.replays), "other": self.other,
                "flood": self.flood, "rsa": self.rsa, "only": self.only, "spare": list(self.spare)}

    # ---- running it

    def capture_replays(self) -> int:
        """Read the honest records now (raw, from the nodes' answers) to replay them later."""
        seen: dict[object, tuple[bytes, float]] = {}
        for _, _, entries in self.answers(full=True).values():
            if isinstance(entries, dict):
                for sub, (val, exp) in entries.items():
                    if isinstance(sub, str) and sub.startswith("peer:") and sub[5:] in self.victims:
                        if sub not in seen or exp < seen[sub][1]:
                            seen[sub] = (val, exp)
        self.replays = [(s, v, e) for s, (v, e) in seen.items()]
        return len(self.replays)

    def attack_once(self) -> None:
        kinds, stored, refused = self.dht.run_coroutine(_send_partial(self.spec(), self.batch))
        self.stored += stored
        self.refused += refused
        for k, n in kinds.items():
            self.sent[k] += n
        self.rounds += 1

    def answers(self, key: str | None = None, full: bool = False) -> dict:
        """Each DHT node's raw answer for ``key``: peer -> (entries, bytes, entries themselves with
        ``full``, else a short note)."""
        return self.dht.run_coroutine(_answers_partial(key or self.key_peers, full))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.attack_once()
            except Exception:  # noqa: BLE001 - a stranger keeps trying
                pass
            self._stop.wait(self.pause)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(60)

    def close(self) -> None:
        self.stop()
        self.dht.shutdown()


class _send_partial:
    """A picklable ``run_coroutine`` callable (sent to the stranger's DHT process): builds a
    round's records there and sends them; returns (records by kind, stored, refused)."""

    def __init__(self, spec, batch):
        self.spec, self.batch = spec, batch

    async def __call__(self, dht, node):
        r = round_items(self.spec)
        _, stored, refused = await _send(dht, node, r.items, self.batch, self.spec.get("only"),
                                         self.spec.get("spare", ()))
        return r.kinds, stored, refused


class _answers_partial:
    def __init__(self, key, full):
        self.key, self.full = key, full

    async def __call__(self, dht, node):
        out = await _answers(dht, node, self.key)
        if self.full:
            return out
        return {p: (n, b, e if isinstance(e, str) else "") for p, (n, b, e) in out.items()}
