"""The metric families read from live sources at scrape time (``prometheus_client`` collectors):
each asks its source (a callable ``NodeMetrics.attach_*`` was given) for the current numbers, so
a scrape is never behind the transport, the daemon or the averager, and a source that fails
gives no numbers rather than a failed scrape."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from protocol import PROTOCOLS

if TYPE_CHECKING:
    from node.ops.metrics import NodeMetrics


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
# the ``kind`` labels of swarm_node_averaging_judged_total (AveragingStats.<what>): what the
# averaging guard kept out (stages.robust_avg; docs/ASYNCMESH.md, "Who may average, and what is applied")
AVERAGING_JUDGED = ("contributions_dropped", "parts_refused", "strangers_refused", "groups_refused")


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
        judged = CounterMetricFamily("swarm_node_averaging_judged", "What replica averaging kept out, by kind",
                                     labels=["kind"])
        for w in AVERAGING_JUDGED:
            judged.add_metric([w], float(st.get(w, 0)))
        yield judged
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
