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

Readers trust only entries whose subkey binds them (a ``peer:`` subkey naming the record's own
peer id, the ``manifest:`` subkey of the run's organiser) and count the rest as forged.

The DHT runs in a child process (hivemind's design) that starts its own ``p2pd``. The node's
stream transport shares that daemon through ``await dht.replicate_p2p()``. ``SwarmDHT`` makes
both children die with the node even on ``kill -9`` (Linux parent-death signal), so a crashed
node never leaves a ``p2pd`` behind.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field

import hivemind
from hivemind.utils import get_dht_time

from node.net.p2p import split_peer, static_relays_only
from node.net.reach import unreachable_line
from node.net.records import ForgeryCounter, SwarmRecordValidator, manifest_subkey, peer_subkey
from node.net.routing import announced_rate
from node.ops import processes, set_parent_death_signal
from protocol import PROTOCOL_VERSION
from security import PeerKey, organiser_fingerprint
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


class BootstrapError(Exception):
    """No initial peer answered; the message names them and the fix."""


class IdentityInUse(Exception):
    """Another online peer already uses this identity key."""


class ManifestMismatch(Exception):
    """Our manifest differs from the swarm's; ``fields`` names the differing consensus fields."""

    def __init__(self, run: str, fields: list[str], theirs: str, ours: str):
        self.fields, self.theirs, self.ours = fields, theirs, ours
        shown = ", ".join(fields) if fields else "(unreadable published manifest)"
        super().__init__(
            f"manifest mismatch for run {run!r}: this node's manifest differs from the swarm's in {shown} "
            f"(swarm hash {theirs[:12]}, ours {ours[:12]}); use the swarm's manifest file"
        )


# ---------------------------------------------------------------- the DHT process


def _children_of(pid: int) -> list[int]:
    return [p.pid for p in processes() if p.ppid == pid]


_DEATH_SIGNAL = signal.SIGUSR2


class SwarmDHT(hivemind.DHT):
    """``hivemind.DHT`` whose child process (and its ``p2pd``) dies with the node.

    Must be started from the main thread: the parent-death signal fires when the *thread* that
    forked the child exits.

    ``daemon_metrics_addr`` (``host:port``, set before starting): p2pd also serves go-libp2p's own
    Prometheus metrics there (``-metricsAddr``; hivemind has no switch for it, so the child adds
    it to the daemon's command line), which is where hole-punch outcomes are counted
    (``node.net.connections.DaemonMetrics``).
    """

    daemon_metrics_addr: str | None = None

    @property
    def daemon_metrics_url(self) -> str | None:
        return f"http://{self.daemon_metrics_addr}/metrics" if self.daemon_metrics_addr else None

    def run(self) -> None:
        parent = self._parent_pid
        if self.daemon_metrics_addr:
            _add_daemon_flag("metricsAddr", self.daemon_metrics_addr)
        # Our own process group: a signal to the node's group (Ctrl-C in a terminal, `timeout`,
        # systemd) must not kill the DHT or its p2pd under the node's feet; the node stops them in
        # order. If the node itself dies, the parent-death signal takes them down.
        try:
            os.setpgid(0, 0)
        except OSError:
            pass

        def on_parent_death(signum, frame):
            for child in _children_of(os.getpid()):  # our p2pd
                try:
                    os.kill(child, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            os._exit(0)

        signal.signal(_DEATH_SIGNAL, on_parent_death)
        signal.signal(signal.SIGTERM, on_parent_death)
        set_parent_death_signal(_DEATH_SIGNAL)
        if os.getppid() != parent:  # the node died before we set the signal
            on_parent_death(_DEATH_SIGNAL, None)
        static_relays_only()  # this process starts the p2pd
        super().run()


def _add_daemon_flag(name: str, value: str) -> None:
    """In the DHT's child process only: every p2pd that hivemind starts here gets ``-name=value``."""
    from hivemind.p2p import P2P

    make_args = P2P._make_process_args

    def with_flag(*args, **kwargs):
        return make_args(*args, **{**kwargs, name: value})

    P2P._make_process_args = staticmethod(with_flag)


def p2p_options(local: bool, initial_peers: list[str] | tuple = ()) -> dict:
    """hivemind P2P options: loopback swarms switch off NAT port mapping, relays and AutoNAT.

    A public node has all of them: it relays for others (circuit relay v2, p2pd's relay service),
    answers AutoNAT dial-backs and hole-punches (p2pd enables DCUtR with AutoNAT), maps a port
    by UPnP/NAT-PMP where the router offers it, and runs auto-relay with its initial peers as
    static relays: when AutoNAT finds that nobody can dial it (behind NAT), it reserves a slot at
    one of them and announces ``/p2p/<relay>/p2p-circuit`` addresses, which the other nodes dial
    (docs/NODE.md, "Behind NAT")."""
    if local:
        return dict(use_relay=False, use_auto_relay=False, auto_nat=False, nat_port_map=False)
    opts = dict(use_relay=True, use_auto_relay=False, auto_nat=True, nat_port_map=True)
    if initial_peers:
        opts.update(use_auto_relay=True, trusted_relays=list(initial_peers))
    return opts


def start_dht(
    initial_peers: list[str],
    host_maddrs: list[str],
    announce_maddrs: list[str] | None = None,
    identity_path: str | None = None,
    local: bool = False,
    retries: int = 4,
    timeout: float = 15.0,
    retry_delay: float = 1.0,
    forgeries: ForgeryCounter | None = None,
    daemon_metrics: bool | None = None,
) -> SwarmDHT:
    """Start the DHT (and its p2pd), bootstrapping from ``initial_peers`` with retries.

    Every record passes ``records.SwarmRecordValidator``: this node's own announcements are signed
    with the key in ``identity_path`` (a node started without one validates only), and forged ones
    are refused and counted in ``forgeries``. Raises ``BootstrapError`` naming the peers and the fix
    when none answers after ``retries`` attempts, ``IdentityInUse`` when the key's peer id is
    already online. Call from the main thread.

    ``daemon_metrics``: p2pd serves its own Prometheus metrics on a free loopback port
    (``dht.daemon_metrics_url``); default: when hole punching is on (``auto_nat``), since its
    outcomes are what the node re-exports from there. The port is picked free just before the
    daemon starts; should another process take it meanwhile, p2pd only logs that and runs on
    without the endpoint, and the node reports no hole-punch numbers.
    """
    if daemon_metrics is None:
        daemon_metrics = bool(p2p_options(local)["auto_nat"])
    key = PeerKey(open(identity_path, "rb").read()) if identity_path else None
    kwargs = dict(
        host_maddrs=host_maddrs,
        announce_maddrs=announce_maddrs or None,
        identity_path=identity_path or None,
        record_validators=[SwarmRecordValidator(key, forgeries)],
        startup_timeout=timeout,
        bootstrap_timeout=min(timeout, 5.0),
        wait_timeout=3,
        shutdown_timeout=5,
        # hivemind's own check assumes RSA keys and spawns a second daemon; `swarm-node run`
        # checks with node.net.identity.anonymous_identity_in_use before starting the DHT
        check_if_identity_free=False,
        **p2p_options(local, initial_peers),
    )
    last: Exception | None = None
    for attempt in range(max(1, retries)):
        dht = SwarmDHT(initial_peers=initial_peers or None, start=False, **kwargs)
        if daemon_metrics:
            from node.net.connections import free_tcp_port

            dht.daemon_metrics_addr = f"127.0.0.1:{free_tcp_port()}"
        try:
            dht.run_in_background(await_ready=True, timeout=timeout + 5)
            return dht
        except Exception as e:  # noqa: BLE001 - classified below, re-raised with the fix
            last = e
            _stop(dht)
            text = str(e)
            if "already taken" in text or "identity" in text.lower() and "taken" in text.lower():
                raise IdentityInUse(
                    f"identity {identity_path} is already online in this swarm (peer id in use); "
                    "stop the other node or use another key (swarm-node keygen)"
                ) from None
            # p2pd connects to its initial peers before it says it is ready: a start that ends in
            # "failed to connect to bootstrap peers", or that times out (a peer that never answers
            # or never completes the libp2p handshake), is a reachability problem
            reach = "bootstrap" in text.lower() or "failed to start in" in text or isinstance(e, TimeoutError)
            if not initial_peers or not reach:
                raise  # not a reachability problem: retrying will not help
            log.warning("bootstrap attempt %d/%d failed: %s", attempt + 1, retries, text.strip()[:200])
            if attempt + 1 < retries:
                time.sleep(retry_delay * 2**attempt)
    log.info("p2pd's last word: %s", str(last).strip()[:300])
    raise BootstrapError(unreachable_line(initial_peers, max(1, retries)))


def _stop(dht: hivemind.DHT) -> None:
    try:
        if dht.is_alive():
            dht.shutdown()
    except Exception:  # noqa: BLE001 - best effort on a failed start
        pass
    if dht.is_alive():
        dht.terminate()
        dht.join(3)


def stop_dht(dht: hivemind.DHT, timeout: float = 5.0) -> None:
    """Shut the DHT process and its p2pd down; kill leftovers by pid if they do not go in time."""
    pid = dht.pid
    daemons = _children_of(pid) if pid else []
    try:
        dht.shutdown()
    except Exception:  # noqa: BLE001
        pass
    if dht.is_alive():
        dht.terminate()
        dht.join(timeout)
    deadline = time.monotonic() + timeout
    for d in daemons:
        while time.monotonic() < deadline:
            try:
                os.kill(d, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            try:
                os.kill(d, signal.SIGKILL)
            except ProcessLookupError:
                pass


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
                protocol=int(value.get("protocol", 0)),
                maddrs=[str(m) for m in value.get("maddrs", [])][:16], time=float(value.get("time", 0.0)),
                expiration=float(expiration),
            )
        except (KeyError, TypeError, ValueError):
            return None
        if rec.state not in STATES or rec.stage < 0 or not rec.peer_id:
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
    an unsigned run)."""
    organiser = manifest.run.organiser
    return f"swarm-node/{manifest.run.id}" + (f"/{organiser_fingerprint(organiser)}" if organiser else "")


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
        self.key_manifest = f"{namespace}/manifest"
        self.key_peers = f"{namespace}/peers"
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
        return self.dht.store(self.key_manifest, self._manifest_value(), get_dht_time() + self.ttl * 3,
                              subkey=self.manifest_subkey, **kwargs)

    def check_and_publish_manifest(self) -> bool:
        """Raise ``ManifestMismatch`` if the swarm runs a different manifest; publish ours if none is
        published yet. Returns True when the swarm already had (our) manifest."""
        found = self.dht.get(self.key_manifest, latest=True)
        if self._check_published(found):
            return True
        self._store_manifest()
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

    def peers(self) -> list[PeerRecord]:
        return self._parse_peers(self.dht.get(self.key_peers, latest=True))

    async def apeers(self, timeout: float = 10.0) -> list[PeerRecord]:
        found = await asyncio.wait_for(self.dht.get(self.key_peers, latest=True, return_future=True), timeout)
        return self._parse_peers(found)

    def announce(self, record: PeerRecord) -> bool:
        record.time = time.time()
        return bool(self.dht.store(self.key_peers, record.to_value(), get_dht_time() + self.ttl,
                                   subkey=self.subkey))

    async def aannounce(self, record: PeerRecord, ttl: float | None = None, timeout: float = 10.0) -> bool:
        record.time = time.time()
        fut = self.dht.store(self.key_peers, record.to_value(), get_dht_time() + (ttl or self.ttl),
                             subkey=self.subkey, return_future=True)
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
