"""Prometheus metrics and the node's tiny HTTP server: ``/metrics``, ``/healthz``, ``/readyz``,
and ``/status`` (one JSON object: stage, state, version, loss, tokens/s, microbatch round trips).

Every metric lives in the node's own ``CollectorRegistry`` (never the process-global one), so
several nodes can run in one test process and nothing third-party leaks into the scrape. Names
start with ``swarm_node_``; docs/METRICS.md is the operator's reference.

The HTTP server runs in its own thread: a scrape must answer even while the event loop is busy,
and ``/healthz`` is exactly the check that the event loop is *not* stuck: the loop stamps a
heartbeat every second and ``/healthz`` fails when the stamp is older than ``stall_after`` s.
``/readyz`` is 200 only while the node is ``online`` (joined, state downloaded, serving).
"""

from __future__ import annotations

import errno
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from protocol import PROTOCOLS

STATES = ("starting", "joining", "online", "draining", "offline")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)


class NodeMetrics:
    """The node's metric families. Attributes are the prometheus_client objects themselves."""

    def __init__(self, stage: int = -1, run: str = "", peer_labels: bool = False):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.peer_labels = peer_labels
        ProcessCollector(registry=r, namespace="swarm_node")
        self.info = Gauge("swarm_node_info", "Constant 1; labels say which run and stage this node holds",
                          ["run", "stage", "role", "version"], registry=r)
        self.state = Gauge("swarm_node_state", "1 for the node's current lifecycle state", ["state"], registry=r)
        self.stage = Gauge("swarm_node_stage", "Pipeline stage index this node holds", registry=r)
        self.steps = Counter("swarm_node_steps", "Optimizer steps applied by this stage", registry=r)
        self.version = Gauge("swarm_node_version", "This stage's optimizer step count (sent on every frame)",
                             registry=r)
        self.loss = Gauge("swarm_node_loss", "Training loss of the last microbatch (tail stage only)", registry=r)
        self.loss_ema = Gauge("swarm_node_loss_ema", "EMA (0.9) of the training loss (tail stage only)", registry=r)
        self.tokens = Counter("swarm_node_tokens", "Tokens whose gradient this stage applied", registry=r)
        self.tokens_per_s = Gauge("swarm_node_tokens_per_second",
                                  "Tokens per second this stage trained on, over the last 10 s", registry=r)
        self.capacity = Gauge("swarm_node_capacity_tokens_per_second",
                              "Tokens per second of compute-busy time over the last 32 backwards (announced; "
                              "routers weigh replicas by it)", registry=r)
        self.microbatches = Counter("swarm_node_microbatches", "Microbatches by outcome", ["outcome"], registry=r)
        self.inflight = Gauge("swarm_node_inflight_microbatches",
                              "Microbatch contexts held waiting for their gradient", registry=r)
        self.contexts_expired = Counter("swarm_node_contexts_expired",
                                        "Microbatch contexts freed by the TTL (their gradient never came)",
                                        registry=r)
        self.queue_depth = Gauge("swarm_node_queue_depth", "Requests queued for compute", ["direction"], registry=r)
        self.compute_seconds = Histogram("swarm_node_compute_seconds", "Compute time per microbatch",
                                         ["kind"], buckets=_LATENCY_BUCKETS, registry=r)
        self.mb_rtt = Histogram("swarm_node_microbatch_rtt_seconds",
                                "Head: time from sending a microbatch forward to applying its gradient",
                                buckets=_LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram("swarm_node_request_seconds",
                                         "Time for a peer to acknowledge a request", ["protocol"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("swarm_node_requests", "Outgoing requests by protocol and result",
                                ["protocol", "result"], registry=r)
        self.served = Counter("swarm_node_served", "Incoming requests by protocol and result",
                              ["protocol", "result"], registry=r)
        self._wire_source = None
        self._forged_source = None
        r.register(_WireBytes(self))
        r.register(_Forged(self))
        self._averaging_source = None
        r.register(_Averaging(self))
        self._busy_source = None
        r.register(_ComputeBusy(self))
        self.staleness = Histogram("swarm_node_staleness_steps",
                                   "Own optimizer steps between a microbatch's forward and its gradient",
                                   buckets=_STALENESS_BUCKETS, registry=r)
        self.version_gap = Histogram("swarm_node_sender_version_gap",
                                     "This stage's version minus the sender's version on arrival",
                                     buckets=(-64, -16, -4, -1, 0, 1, 4, 16, 64), registry=r)
        self.verdicts = Counter("swarm_node_verifier_verdicts", "Verifier verdicts on accepted tensors",
                                ["direction", "verdict", "reason"], registry=r)
        self.verify_seconds = Histogram("swarm_node_verifier_seconds", "Verifier time per tensor",
                                        buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5), registry=r)
        self.banned_peers = Gauge("swarm_node_banned_peers", "Peers currently banned by routing", registry=r)
        self.bans = Counter("swarm_node_bans", "Peers banned by routing (failures, timeouts, verifier)",
                            ["cause"], registry=r)
        self.peers = Gauge("swarm_node_peers", "Online peers seen per stage in the DHT", ["stage"], registry=r)
        self.dht_neighbours = Gauge("swarm_node_dht_neighbours", "Peers in this node's DHT routing table", registry=r)
        self.dht_rejoins = Counter("swarm_node_dht_rejoins", "Times this node rejoined the DHT after losing every "
                                   "neighbour (its network was down)", registry=r)
        self.checkpoint_step = Gauge("swarm_node_checkpoint_step", "Step of the newest checkpoint written",
                                     registry=r)
        self.checkpoint_time = Gauge("swarm_node_checkpoint_timestamp_seconds",
                                     "Unix time of the newest checkpoint written", registry=r)
        self.state_sync_bytes = Counter("swarm_node_state_sync_bytes", "Stage state bytes sent/received by joiners",
                                        ["direction"], registry=r)
        # per-peer series only on request (--peer-labels): their number grows with the swarm
        self.peer_requests = (Counter("swarm_node_peer_requests", "Outgoing requests per peer, protocol and result",
                                      ["peer", "protocol", "result"], registry=r) if peer_labels else None)
        self.peer_rtt = (Gauge("swarm_node_peer_ack_seconds", "EMA of the time a peer takes to acknowledge",
                               ["peer", "stage"], registry=r) if peer_labels else None)
        # per neighbour stage (label values: stage indices, so at most n_stages series each)
        self.neighbour_rtt = Histogram("swarm_node_neighbour_rtt_seconds",
                                       "Round trip of one request to a peer of a neighbour stage (health: the "
                                       "bare network round trip; fwd/bwd: including writing the tensors)",
                                       ["peer_stage", "protocol"], buckets=_LATENCY_BUCKETS, registry=r)
        self._neighbour_bytes_source = None
        r.register(_NeighbourBytes(self))
        self._connections_source = None
        r.register(_Connections(self))
        self._holepunch_source = None
        r.register(_HolePunch(self))
        self.morph_epoch = Gauge("swarm_node_morph_epoch",
                                 "Morph epoch (basis of this stage's boundaries) the stage is in; 0 without morphing",
                                 registry=r)
        self.morph_seconds = Gauge("swarm_node_morph_seconds",
                                   "Wall time of this stage's last morph (fold of both sides, on the compute thread)",
                                   registry=r)
        self.morphs = Counter("swarm_node_morphs", "Morph epochs this stage entered by folding", registry=r)
        self.uptime_start = Gauge("swarm_node_start_time_seconds", "Unix time the node started", registry=r)
        self.uptime_start.set(time.time())
        self.set_state("starting")
        self.set_stage(stage, run)

    def set_stage(self, stage: int, run: str, role: str = "", version: str = "1") -> None:
        self.stage.set(stage)
        self.info.clear()
        self.info.labels(run=run, stage=str(stage), role=role, version=version).set(1)

    def request(self, protocol: str, result: str, peer: str | None = None) -> None:
        """Count an outgoing request (and per peer with --peer-labels)."""
        self.requests.labels(protocol=protocol, result=result).inc()
        if self.peer_requests is not None and peer:
            self.peer_requests.labels(peer=peer, protocol=protocol, result=result).inc()

    def set_state(self, state: str) -> None:
        for s in STATES:
            self.state.labels(state=s).set(1.0 if s == state else 0.0)

    def attach_wire_stats(self, source) -> None:
        """``source()`` -> ``{(protocol, direction): bytes}``, read at every scrape (the transport's
        own counters, so a scrape is never behind the traffic)."""
        self._wire_source = source

    def attach_compute_busy(self, source) -> None:
        """``source()`` -> seconds the compute worker has been busy (utilisation = its rate)."""
        self._busy_source = source

    def attach_forgeries(self, source) -> None:
        """``source()`` -> ``{(kind, check): count}`` of DHT records refused as forged, read at every
        scrape. kind: ``peer`` (announcements), ``manifest``, ``averaging`` (matchmaking), ``plain``
        (a plain value that would replace a dictionary); check ``signature``: refused by the record
        validator, ``binding``: a stored entry whose subkey does not bind what it claims."""
        self._forged_source = source

    def attach_neighbour_bytes(self, source) -> None:
        """``source()`` -> ``{(peer_stage, direction): bytes}`` exchanged with the peers of each
        neighbour stage, read at every scrape."""
        self._neighbour_bytes_source = source

    def attach_connections(self, source) -> None:
        """``source()`` -> ``node.net.connections.ConnectionTracker.snapshot()``, read at every scrape."""
        self._connections_source = source

    def attach_holepunch(self, source) -> None:
        """``source()`` -> ``{(side, outcome): count}`` of the daemon's hole punches, or None when the
        daemon does not report them (``node.net.connections.DaemonMetrics.holepunch``)."""
        self._holepunch_source = source

    def observe_neighbour_rtt(self, peer_stage: int | str | None, protocol: str, seconds: float) -> None:
        """One request round trip to a peer of stage ``peer_stage`` (ignored when the stage is unknown)."""
        if peer_stage is None or str(peer_stage) in ("", "-1"):
            return
        self.neighbour_rtt.labels(peer_stage=str(peer_stage), protocol=protocol).observe(seconds)

    def attach_averaging(self, source) -> None:
        """``source()`` -> ``node.net.averaging.AveragingStats.as_dict()``, read at every scrape."""
        self._averaging_source = source

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _WireBytes:
    """Collector for ``swarm_node_wire_bytes_total{protocol, direction}``."""

    # protocol id -> label, e.g. /swarm-node/fwd/1 -> fwd (the ids are defined in protocol/)
    NAMES = {pid: pid.split("/")[2] for pid in PROTOCOLS}

    def __init__(self, metrics: NodeMetrics):
        self.metrics = metrics

    def describe(self):
        return [CounterMetricFamily("swarm_node_wire_bytes", "Bytes on our stream protocols",
                                    labels=["protocol", "direction"])]

    def collect(self):
        fam = CounterMetricFamily("swarm_node_wire_bytes", "Bytes on our stream protocols",
                                  labels=["protocol", "direction"])
        source = self.metrics._wire_source
        raw: dict = {}
        if source is not None:
            for _ in range(3):  # the event loop may add a key while we copy
                try:
                    raw = dict(source())
                    break
                except RuntimeError:
                    continue
        counts = {(p, d): 0 for p in self.NAMES.values() for d in ("in", "out")}
        for (proto, direction), n in raw.items():
            key = (self.NAMES.get(proto, proto), direction)
            counts[key] = counts.get(key, 0) + n
        for (proto, direction), n in sorted(counts.items()):
            fam.add_metric([proto, direction], float(n))
        yield fam


class _Forged:
    """``swarm_node_forged_records_total{kind, check}`` (see ``NodeMetrics.attach_forgeries``)."""

    NAME, HELP = "swarm_node_forged_records", "DHT records refused as forged or unbound to their writer"

    def __init__(self, metrics: NodeMetrics):
        self.metrics = metrics

    def describe(self):
        return [CounterMetricFamily(self.NAME, self.HELP, labels=["kind", "check"])]

    def collect(self):
        source = self.metrics._forged_source
        counts = source() if source is not None else {}
        fam = CounterMetricFamily(self.NAME, self.HELP, labels=["kind", "check"])
        for (kind, check), n in sorted(counts.items()):
            fam.add_metric([kind, check], float(n))
        yield fam


class _ComputeBusy:
    """``swarm_node_compute_busy_seconds_total``: time the compute worker spent on jobs;
    ``rate()`` of it is the stage's utilisation."""

    def __init__(self, metrics: NodeMetrics):
        self.metrics = metrics

    def describe(self):
        return [CounterMetricFamily("swarm_node_compute_busy_seconds", "Seconds the compute worker was busy")]

    def collect(self):
        source = self.metrics._busy_source
        fam = CounterMetricFamily("swarm_node_compute_busy_seconds", "Seconds the compute worker was busy")
        fam.add_metric([], float(source()) if source is not None else 0.0)
        yield fam


# the ``outcome`` labels of swarm_node_averaging_rounds_total: rounds (AveragingStats.rounds_<o>),
# then slots skipped (AveragingStats.<o>)
AVERAGING_ROUNDS = ("started", "applied", "failed", "mismatched", "epoch_discarded", "state_replaced")
AVERAGING_SKIPS = ("skipped_alone", "skipped_busy")
AVERAGING_OUTCOMES = AVERAGING_ROUNDS + AVERAGING_SKIPS


class _Averaging:
    """Collector for the replica averager (AsyncMesh data axis); empty when averaging is off."""

    OUTCOMES = AVERAGING_ROUNDS
    SKIPS = AVERAGING_SKIPS

    def __init__(self, metrics: NodeMetrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        source = self.metrics._averaging_source
        if source is None:
            return
        try:
            st = dict(source())
        except Exception:  # noqa: BLE001 - a scrape must not fail because averaging did
            return
        rounds = CounterMetricFamily("swarm_node_averaging_rounds", "Replica averaging rounds by outcome",
                                     labels=["outcome"])
        for o in self.OUTCOMES:
            rounds.add_metric([o], float(st.get(f"rounds_{o}", 0)))
        for o in self.SKIPS:
            rounds.add_metric([o], float(st.get(o, 0)))
        yield rounds
        b = CounterMetricFamily("swarm_node_averaging_bytes", "Replica averaging payload bytes", labels=["direction"])
        b.add_metric(["out"], float(st.get("bytes_sent", 0)))
        b.add_metric(["in"], float(st.get("bytes_received", 0)))
        yield b
        yield GaugeMetricFamily("swarm_node_averaging_group_size", "Replicas in the last averaging group",
                                value=float(st.get("last_group_size", 0)))
        yield GaugeMetricFamily("swarm_node_averaging_round_seconds", "Duration of the last averaging round",
                                value=float(st.get("last_round_seconds", 0.0)))


def _read(source, default):
    """Call a scrape-time source; a source that fails gives ``default`` (a scrape never fails)."""
    if source is None:
        return default
    for _ in range(3):  # the event loop may change a dict while we copy it
        try:
            return source()
        except RuntimeError:
            continue
        except Exception:  # noqa: BLE001
            return default
    return default


class _NeighbourBytes:
    """``swarm_node_neighbour_bytes_total{peer_stage, direction}``."""

    NAME, HELP = "swarm_node_neighbour_bytes", "Bytes exchanged with the peers of a neighbour stage"

    def __init__(self, metrics: NodeMetrics):
        self.metrics = metrics

    def describe(self):
        return [CounterMetricFamily(self.NAME, self.HELP, labels=["peer_stage", "direction"])]

    def collect(self):
        fam = CounterMetricFamily(self.NAME, self.HELP, labels=["peer_stage", "direction"])
        counts = dict(_read(self.metrics._neighbour_bytes_source, {}) or {})
        for (stage, direction), n in sorted(counts.items()):
            fam.add_metric([str(stage), direction], float(n))
        yield fam


class _Connections:
    """The daemon's open connections, direct or relayed (``node.net.connections.ConnectionTracker``)."""

    def __init__(self, metrics: NodeMetrics):
        self.metrics = metrics

    def _families(self):
        return (
            GaugeMetricFamily("swarm_node_connections", "Open libp2p connections by kind (direct, relayed)",
                              labels=["kind"]),
            GaugeMetricFamily("swarm_node_connected_peers",
                              "Connected peers by the stage they hold and their best path (direct, relayed)",
                              labels=["peer_stage", "kind"]),
            CounterMetricFamily("swarm_node_relayed_peers",
                                "Relayed episodes: a peer seen connected only through a relay"),
            CounterMetricFamily("swarm_node_relay_upgrades",
                                "Relayed episodes that ended with a direct connection (hole punch or direct dial)"),
        )

    def describe(self):
        return list(self._families())

    def collect(self):
        conns, peers, relayed, upgrades = self._families()
        snap = _read(self.metrics._connections_source, None) or {}
        for kind in ("direct", "relayed"):
            conns.add_metric([kind], float(snap.get("connections", {}).get(kind, 0)))
        for (stage, kind), n in sorted(snap.get("peers", {}).items()):
            peers.add_metric([stage, kind], float(n))
        relayed.add_metric([], float(snap.get("relayed_seen", 0)))
        upgrades.add_metric([], float(snap.get("upgraded", 0)))
        yield from (conns, peers, relayed, upgrades)


class _HolePunch:
    """``swarm_node_holepunch_total{side, outcome}``: the daemon's hole punches (DCUtR), re-exported
    from p2pd's own counters; no samples while the daemon does not report them."""

    NAME, HELP = "swarm_node_holepunch", "Hole punches (DCUtR) by the daemon, by side and outcome"

    def __init__(self, metrics: NodeMetrics):
        self.metrics = metrics

    def describe(self):
        return [CounterMetricFamily(self.NAME, self.HELP, labels=["side", "outcome"])]

    def collect(self):
        fam = CounterMetricFamily(self.NAME, self.HELP, labels=["side", "outcome"])
        for (side, outcome), n in sorted((_read(self.metrics._holepunch_source, None) or {}).items()):
            fam.add_metric([side, outcome], float(n))
        yield fam


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on a thread; ``port=0`` picks a free port."""

    def __init__(self, metrics: NodeMetrics, host: str = "127.0.0.1", port: int = 9100,
                 stall_after: float = 15.0):
        self.metrics = metrics
        self.stall_after = stall_after
        self.ready = False
        self.state = "starting"
        self.heartbeat = time.monotonic()
        self.details: dict = {}
        self.status_fn = None  # () -> dict for /status (the runtime's view: stage, version, loss, rtt, ...)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, status, ctype = owner.metrics.render(), 200, CONTENT_TYPE_LATEST
                elif path == "/healthz":
                    age = time.monotonic() - owner.heartbeat
                    ok = age < owner.stall_after
                    body = json.dumps({"ok": ok, "loop_heartbeat_age_s": round(age, 3),
                                       "state": owner.state}).encode()
                    status, ctype = (200 if ok else 503), "application/json"
                elif path == "/status":
                    try:
                        info = owner.status_fn() if owner.status_fn is not None else {}
                    except Exception as e:  # noqa: BLE001 - a status page must not take the server down
                        info = {"error": repr(e)}
                    body = json.dumps({"state": owner.state, **info}).encode()
                    status, ctype = 200, "application/json"
                elif path == "/readyz":
                    body = json.dumps({"ready": owner.ready, "state": owner.state, **owner.details}).encode()
                    status, ctype = (200 if owner.ready else 503), "application/json"
                else:
                    body, status, ctype = b"not found: try /metrics, /healthz, /readyz, /status\n", 404, "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes are not log lines
                pass

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortInUse(host, port) from None
            raise
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.host = host
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def beat(self) -> None:
        self.heartbeat = time.monotonic()

    def set_state(self, state: str) -> None:
        self.state = state
        self.ready = state == "online"
        self.metrics.set_state(state)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class PortInUse(OSError):
    def __init__(self, host: str, port: int):
        super().__init__(errno.EADDRINUSE, f"{host}:{port} is in use")
        self.host, self.port = host, port
