"""Membership: who is in the swarm, which stage each peer holds, and whether we may join.

Everything lives in ``hivemind.DHT`` under two keys in the run's namespace, ``swarm-node/<run>/<f>``
where ``f`` is the fingerprint of the run's organiser key (``swarm-node/<run>`` for an unsigned,
local-only run), so two organisers' runs never share records even under one run id:

``<namespace>/manifest``
    one entry, subkey ``manifest:<organiser key>``: ``{hash, manifest, protocol, organiser,
    signature}``, the consensus fields of the run manifest, their hash and the organiser's
    signature. Every node re-publishes it; the record validator (``records.py``) refuses any
    other content under that subkey, so only the organisers can publish a different manifest. A
    node compares its own manifest against it and refuses to join on a mismatch, naming the
    differing fields (``diff_manifests``), which is why the whole consensus dict is published.

``<namespace>/peers``
    one entry per peer, subkey ``peer:<peer id>``, holding ``{peer_id, stage, state, throughput,
    capacity, queue, version, protocol, maddrs, time}``, signed with that peer's libp2p identity
    key (``records.SwarmRecordValidator``): only a peer can write or refresh its own entry, and
    no field of it can be changed by anyone else. Entries expire ``ttl`` seconds after their last
    refresh, so a peer that vanishes (kill -9, cable cut) drops out of everyone's view on its own.

A reader asks for ``peers`` both the key's nearest storers and its DHT neighbours, each of which
keeps its own record and what it read (``node.net.dht_neighbours``): a stranger holding every
nearest position can withhold the records there, not from the neighbours. Readers trust only
entries whose subkey binds them (a ``peer:`` subkey naming the record's own
peer id, the ``manifest:`` subkey of the run's organiser) and count the rest as forged.

Starting and stopping the DHT process itself is ``node.net.dht``'s.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from dataclasses import dataclass, field

import hivemind

from node.net.p2pd import split_peer
from node.net.dht import dht_result
from node.net.dht_neighbours import announce_and_keep, read_wide
from node.net.records import manifest_subkey, peer_subkey, run_key, run_namespace_of, writer_expiration
from node.net.routing import announced_rate
from protocol import PROTOCOL_VERSION
from stages import (
    Manifest,
    ManifestError,
    consensus_dict,
    diff_manifests,
    manifest_from_dict,
    manifest_hash,
)

log = logging.getLogger("swarm_node.membership")

STATES = ("joining", "online", "draining", "offline")
MAX_MADDRS = 16  # addresses a reader keeps of one announcement (a writer announces no more)


class ManifestMismatch(Exception):
    """Our manifest differs from the swarm's; ``fields`` names the differing consensus fields."""

    def __init__(self, run: str, fields: list[str], theirs: str, ours: str):
        self.fields, self.theirs, self.ours = fields, theirs, ours
        shown = ", ".join(fields) if fields else "(unreadable published manifest)"
        super().__init__(
            f"manifest mismatch for run {run!r}: this node's manifest differs from the swarm's in {shown} "
            f"(swarm hash {theirs[:12]}, ours {ours[:12]}); use the swarm's manifest file"
        )


# ---------------------------------------------------------------- records


@dataclass
class PeerRecord:
    """One peer's announcement, as read from the DHT."""

    peer_id: str
    stage: int
    state: str
    throughput: float = 0.0  # tokens/s this peer trained on recently (what it got)
    capacity: float | None = None  # tokens/s of compute-busy time (what it can do); 0: not measured
    # yet; None: the record has no such field (a peer from before it: weigh it by throughput)
    queue: int = 0  # requests waiting for its compute
    version: int = 0  # its optimizer step count
    epoch: int | None = None  # its morph epoch; None: morphing off, or a peer from before the field
    protocol: int = PROTOCOL_VERSION
    maddrs: list[str] = field(default_factory=list)
    time: float = 0.0
    expiration: float = 0.0

    def to_value(self) -> dict:
        value = {
            "peer_id": self.peer_id, "stage": self.stage, "state": self.state,
            "throughput": float(self.throughput), "queue": int(self.queue), "version": int(self.version),
            "protocol": int(self.protocol), "maddrs": list(self.maddrs), "time": float(self.time),
        }
        if self.capacity is not None:
            value["capacity"] = float(self.capacity)
        if self.epoch is not None:
            value["epoch"] = int(self.epoch)
        return value

    @classmethod
    def from_value(cls, value: object, expiration: float = 0.0) -> PeerRecord | None:
        """Parse an announcement; ``None`` for anything malformed (never trust the DHT)."""
        if not isinstance(value, dict):
            return None
        try:
            rec = cls(
                peer_id=str(value["peer_id"]), stage=int(value["stage"]), state=str(value["state"]),
                throughput=float(value.get("throughput", 0.0)),
                capacity=float(value["capacity"]) if "capacity" in value else None,
                queue=int(value.get("queue", 0)), version=int(value.get("version", 0)),
                epoch=int(value["epoch"]) if value.get("epoch") is not None else None,
                protocol=int(value.get("protocol", 0)),
                maddrs=[str(m) for m in value.get("maddrs", [])][:MAX_MADDRS], time=float(value.get("time", 0.0)),
                expiration=float(expiration),
            )
        except (KeyError, TypeError, ValueError):
            return None
        if rec.state not in STATES or rec.stage < 0 or not rec.peer_id or (rec.epoch or 0) < 0:
            return None
        if not all(math.isfinite(x) and x >= 0 for x in (rec.throughput, rec.capacity or 0.0)):
            return None  # a NaN would win or lose every routing comparison
        return rec


def choose_stage(records: list[PeerRecord], n_stages: int) -> int:
    """``--stage auto``: the stage with the least announced capacity among joining/online peers
    (a peer's ``capacity``, or its ``throughput`` where it announces none); ties go to the stage
    with fewer peers, then the lower index. Capacity, not throughput: in a running pipeline every
    microbatch passes every stage, so the stages' throughputs are equal and the slowest stage is
    the one with the least compute."""
    tput = [0.0] * n_stages
    count = [0] * n_stages
    for r in records:
        if r.state in ("joining", "online") and 0 <= r.stage < n_stages:
            tput[r.stage] += announced_rate(r)
            count[r.stage] += 1
    return min(range(n_stages), key=lambda s: (tput[s], count[s], s))


def run_namespace(manifest: Manifest) -> str:
    """The run's DHT namespace: ``swarm-node/<run id>/<organiser fingerprint>`` (no fingerprint for
    an unsigned run); the formula is ``records.run_namespace_of``, which the record validator
    uses to bind a published manifest to its key."""
    return run_namespace_of(manifest.run.id, manifest.run.organiser)


class Membership:
    """Reads and writes this run's records in the DHT. Sync methods block (startup), ``a*`` methods
    are for the event loop. Entries a reader refuses (see the module docstring) are counted in
    ``self.forged`` by kind."""

    def __init__(self, dht: hivemind.DHT, manifest: Manifest, ttl: float = 20.0):
        self.dht = dht
        self.manifest = manifest
        self.run = manifest.run.id
        self.hash = manifest_hash(manifest)
        self.ttl = ttl
        namespace = run_namespace(manifest)
        self.key_manifest = run_key(namespace, "manifest")
        self.key_peers = run_key(namespace, "peers")
        self.manifest_subkey = manifest_subkey(manifest.run.organiser)
        self.peer_id = dht.peer_id.to_base58()
        self.subkey = peer_subkey(self.peer_id)
        self.forged = {"peer": 0, "manifest": 0}
        self._seen_forged: set = set()  # (kind, subkey, expiration) already counted
        # peer id -> (multiaddrs it announced, when we last saw it): where to knock when we lost the DHT
        self._met: dict[str, tuple[list[str], float]] = {}
        self.rejoins = 0

    def _count_forged(self, kind: str, subkey, expiration: float) -> None:
        mark = (kind, repr(subkey)[:200], expiration)
        if mark not in self._seen_forged:
            if len(self._seen_forged) > 10_000:
                self._seen_forged.clear()
            self._seen_forged.add(mark)
            self.forged[kind] += 1

    # ---- manifest

    def _manifest_value(self) -> dict:
        return {"hash": self.hash, "manifest": consensus_dict(self.manifest), "protocol": PROTOCOL_VERSION,
                "organiser": self.manifest.run.organiser, "signature": self.manifest.signature.ed25519}

    def _check_published(self, found) -> bool:
        """True if the swarm publishes our manifest under the organiser's subkey; raise
        ``ManifestMismatch`` if it publishes another one there. Entries under any other subkey
        (another organiser's key, or none) are not this run's: counted, never believed."""
        if found is None or not isinstance(found.value, dict):
            return False
        ours = None
        for subkey, entry in found.value.items():
            if subkey == self.manifest_subkey:
                ours = entry
            else:
                self._count_forged("manifest", subkey, getattr(entry, "expiration_time", 0.0))
        theirs = getattr(ours, "value", None)
        if not isinstance(theirs, dict):
            return False
        their_hash = str(theirs.get("hash", ""))
        if their_hash == self.hash:
            return True
        fields: list[str] = []
        try:
            other = manifest_from_dict(theirs.get("manifest", {}))
            fields = diff_manifests(other, self.manifest)
        except (ManifestError, TypeError, ValueError) as e:
            log.warning("the swarm's published manifest does not parse here: %s", e)
        raise ManifestMismatch(self.run, fields, their_hash, self.hash)

    def _store_manifest(self, **kwargs):
        # capped where every reader takes it (records.MAX_RECORD_TTL_S), whatever --announce-every is
        return self.dht.store(self.key_manifest, self._manifest_value(), writer_expiration(self.ttl * 3),
                              subkey=self.manifest_subkey, **kwargs)

    def check_and_publish_manifest(self, timeout: float = 30.0) -> bool:
        """Raise ``ManifestMismatch`` if the swarm runs a different manifest; publish ours if none is
        published yet. Returns True when the swarm already had (our) manifest. Each DHT call waits
        at most ``timeout`` seconds (``TimeoutError`` naming it)."""
        found = dht_result(self.dht.get(self.key_manifest, latest=True, return_future=True), timeout, "manifest read")
        if self._check_published(found):
            return True
        dht_result(self._store_manifest(return_future=True), timeout, "manifest store")
        return False

    async def arefresh_manifest(self, timeout: float = 10.0) -> None:
        found = await asyncio.wait_for(self.dht.get(self.key_manifest, latest=True, return_future=True), timeout)
        self._check_published(found)
        await asyncio.wait_for(self._store_manifest(return_future=True), timeout)

    # ---- peers

    def _parse_peers(self, found) -> list[PeerRecord]:
        if found is None or not isinstance(found.value, dict):
            return []
        out = {}
        for subkey, entry in found.value.items():
            value = getattr(entry, "value", None)
            expiration = getattr(entry, "expiration_time", 0.0)
            rec = PeerRecord.from_value(value, expiration)
            if rec is None or rec.protocol != PROTOCOL_VERSION:
                continue
            if subkey != peer_subkey(rec.peer_id):  # not signed by the peer it names
                self._count_forged("peer", subkey, expiration)
                continue
            prev = out.get(rec.peer_id)
            if prev is None or rec.time > prev.time:
                out[rec.peer_id] = rec
        return list(out.values())

    def _read_peers(self):
        # the key's nearest storers and our DHT neighbours, the members we met first (dht_neighbours)
        return self.dht.run_coroutine(functools.partial(read_wide, self.key_peers, list(self._met)),
                                      return_future=True)

    def peers(self, timeout: float = 30.0) -> list[PeerRecord]:
        """The swarm's peer records (blocking; at most ``timeout`` seconds, ``TimeoutError`` naming it)."""
        return self._parse_peers(dht_result(self._read_peers(), timeout, "peer records read"))

    async def apeers(self, timeout: float = 10.0) -> list[PeerRecord]:
        return self._parse_peers(await asyncio.wait_for(self._read_peers(), timeout))

    async def aannounce(self, record: PeerRecord, ttl: float | None = None, timeout: float = 10.0) -> bool:
        """Store our signed record in the DHT and keep it in our DHT node's own storage, where
        neighbours reading the run's peers hear it from us (``node.net.dht_neighbours``)."""
        record.time = time.time()
        fut = self.dht.run_coroutine(functools.partial(
            announce_and_keep, self.key_peers, self.subkey, record.to_value(), writer_expiration(ttl or self.ttl)),
            return_future=True)
        return bool(await asyncio.wait_for(fut, timeout))

    # ---- staying joined

    def remember(self, records: list[PeerRecord]) -> None:
        """Keep the announced addresses of the peers we saw (the most recent ``MET_KEEP``): where
        ``arejoin`` knocks when the DHT lost every neighbour and the bootstrap peers are gone too."""
        now = time.monotonic()
        for r in records:
            if r.maddrs and r.peer_id != self.peer_id:
                self._met[r.peer_id] = (list(r.maddrs)[:8], now)
        if len(self._met) > MET_KEEP:
            for pid, _ in sorted(self._met.items(), key=lambda kv: kv[1][1])[: len(self._met) - MET_KEEP]:
                del self._met[pid]

    async def aneighbours(self, timeout: float = 5.0) -> int:
        """How many peers the DHT's routing table holds now."""
        return int(await asyncio.wait_for(self.dht.run_coroutine(_routing_table_size, return_future=True), timeout))

    async def arejoin(self, connect, initial_peers: list[str], timeout: float = 3.0) -> int:
        """Put peers back into a DHT routing table that lost them all.

        The DHT drops a neighbour from its table when a request to it fails and takes one in only
        when it answers or asks something; a node whose link was down for longer than a few
        requests (a Wi-Fi drop, a router restart) ends with an empty table, and nobody asks a
        node that nobody knows: it would stay out of the swarm for good, its records expired
        everywhere. So dial (``connect(maddr, timeout)``, the stream transport's) the bootstrap
        peers and the peers met before, then ping them from the DHT, which takes every one that
        answers back into its table (and they take us into theirs). Returns how many answered."""
        candidates: dict[str, list[str]] = {}
        for maddr in initial_peers:
            pid = split_peer(maddr)[1]
            if pid:
                candidates.setdefault(pid, []).append(maddr)
        for pid, (maddrs, _) in sorted(self._met.items(), key=lambda kv: -kv[1][1]):
            full = [m for m in maddrs if split_peer(m)[1] == pid]
            if full and pid not in candidates:
                candidates[pid] = full[:3]

        async def dial(maddrs: list[str]) -> str | None:
            for maddr in maddrs:  # the first address of the peer's that answers
                try:
                    return await connect(maddr, timeout=timeout)
                except Exception as e:  # noqa: BLE001 - one unreachable peer is expected here
                    log.debug("rejoin: %s did not answer: %r", maddr, e)
            return None

        dialled = [p for p in await asyncio.gather(*(dial(m) for m in candidates.values())) if p]
        if not dialled:
            return 0
        answered = await asyncio.wait_for(
            self.dht.run_coroutine(functools.partial(_ping_all, dialled), return_future=True), timeout + 5.0)
        if answered:
            self.rejoins += 1
        return int(answered)


MET_KEEP = 64  # peers whose addresses Membership.remember keeps


async def _routing_table_size(dht, node) -> int:
    """In the DHT's process: peers in its routing table."""
    return len(node.protocol.routing_table.peer_id_to_uid)


async def _ping_all(peer_ids: list[str], dht, node) -> int:
    """In the DHT's process: ping each peer (already dialled); the routing table takes those that answer."""
    from hivemind.p2p import PeerID

    got = await asyncio.gather(*(node.protocol.call_ping(PeerID.from_base58(p), validate=False) for p in peer_ids),
                               return_exceptions=True)
    return sum(1 for g in got if g is not None and not isinstance(g, BaseException))
