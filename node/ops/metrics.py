"""Prometheus metrics: the node's metric families (``NodeMetrics``). The families read at scrape
time live in ``metrics_collectors``, the HTTP server (``/metrics``, ``/healthz``, ``/readyz``,
``/status``) in ``metrics_server``; both are re-exported here.

Every metric lives in the node's own ``CollectorRegistry`` (never the process-global one), so
several nodes can run in one test process and nothing third-party leaks into the scrape. Names
start with ``swarm_node_``; docs/METRICS.md is the operator's reference.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from node.ops.metrics_collectors import (
    AVERAGING_OUTCOMES,
    AVERAGING_ROUNDS,
    AVERAGING_SKIPS,
    _Averaging,
    _ComputeBusy,
    _Connections,
    _Forged,
    _HolePunch,
    _NeighbourBytes,
    _WireBytes,
)
from node.ops.metrics_server import MetricsServer, PortInUse

__all__ = [
    "AVERAGING_OUTCOMES", "AVERAGING_ROUNDS", "AVERAGING_SKIPS", "COMPUTE_FAILURE_ERRORS", "STATES", "MetricsServer",
    "NodeMetrics", "PortInUse", "_WireBytes",
]

STATES = ("starting", "joining", "online", "draining", "offline")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)
# distinct ``error`` label values of swarm_node_compute_failures_total; later classes count as "other"
COMPUTE_FAILURE_ERRORS = 20


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
        self.compute_failures = Counter("swarm_node_compute_failures",
                                        "Failures of stage code (the microbatch dropped) by direction and exception "
                                        "class", ["direction", "error"], registry=r)
        self._failure_errors: set[str] = set()
        self._failure_lock = threading.Lock()
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
        self.state_syncs = Counter("swarm_node_state_sync", "State downloads by outcome: verified (agreeing "
                                   "sources), unconfirmed (one source, checked against its signed record), refused",
                                   ["outcome"], registry=r)
        for outcome in ("verified", "unconfirmed", "refused"):  # exported at 0 before the first download
            self.state_syncs.labels(outcome=outcome)
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

    def compute_failure(self, direction: str, error: str) -> None:
        """Count one failure of stage code (``node.runtime.failures``): ``direction`` one of fwd,
        bwd, head, average; ``error`` the exception's class name, a label value of its own for the
        first ``COMPUTE_FAILURE_ERRORS`` classes seen, ``other`` after (bounded series)."""
        with self._failure_lock:
            if error not in self._failure_errors:
                if len(self._failure_errors) < COMPUTE_FAILURE_ERRORS:
                    self._failure_errors.add(error)
                else:
                    error = "other"
        self.compute_failures.labels(direction=direction, error=error).inc()

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
        (a plain value that would replace a dictionary), ``unknown`` (no record type), ``unread``;
        check ``signature``: refused by the record validator, ``binding``: a stored entry whose
        subkey does not bind what it claims, ``rate``: refused unread, past its sender's rate
        (``node.net.dht_storage.SenderRates``)."""
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


