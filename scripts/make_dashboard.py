"""Write docker/grafana/swarm-node.json, the Grafana dashboard for a swarm of nodes.

Built with Grafana's typed builder (``grafana-foundation-sdk``, in the ``dev`` extra): every panel
is a builder object, so a misspelt option is an AttributeError here, not a panel that Grafana
silently ignores. One row per concern, one panel per metric family the node exports
(docs/METRICS.md). Run it after changing metrics: ``python scripts/make_dashboard.py``; tests check
that the committed JSON is this script's output, that every documented family is on a panel, and
that every PromQL expression names a metric a running node really exports.

To add a panel: append ``timeseries_panel(...)`` (or ``stat_panel``, ``table_panel``) with its
queries ``q(expr, legend)`` to a row in ``rows()`` (or add a row), then rerun this script.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DataSourceRef

OUT = Path(__file__).resolve().parent.parent / "docker" / "grafana" / "swarm-node.json"
# the Prometheus data source provisioned in docker/grafana/provisioning/datasources/prometheus.yml
DATASOURCE = DataSourceRef(type_val="prometheus", uid="prometheus")
WIDTH, HEIGHT = 8, 8  # three panels per grid line (Grafana's grid is 24 wide)


# ---------------------------------------------------------------- building blocks


def q(expr: str, legend: str = "") -> prometheus.Dataquery:
    """One PromQL query of a panel; its refId is set when the panel is built."""
    return prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DATASOURCE)


def _panel(builder, title: str, unit: str, queries, description: str):
    builder = builder.title(title).unit(unit).datasource(DATASOURCE).height(HEIGHT).span(WIDTH)
    if description:
        builder = builder.description(description)
    for i, query in enumerate(queries):
        builder = builder.with_target(query.ref_id(chr(ord("A") + i)))
    return builder


def timeseries_panel(title: str, unit: str, *queries: prometheus.Dataquery, description: str = ""):
    p = timeseries.Panel().legend(
        cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST).placement(cm.LegendPlacement.BOTTOM)
        .show_legend(True)
    ).tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.NONE))
    return _panel(p, title, unit, queries, description)


def stat_panel(title: str, unit: str, *queries: prometheus.Dataquery, description: str = ""):
    p = stat.Panel().graph_mode(cm.BigValueGraphMode.AREA).reduce_options(
        cb.ReduceDataOptions().calcs(["lastNotNull"]))
    return _panel(p, title, unit, queries, description)


def table_panel(title: str, unit: str, *queries: prometheus.Dataquery, description: str = ""):
    return _panel(table.Panel().show_header(True), title, unit, queries, description)


# each node's own stage, joined onto a per-node series: "... * on (instance) group_left (stage) STAGE_OF"
STAGE_OF = "swarm_node_info"


def per_stage(expr: str) -> str:
    """``expr`` (per node) with the node's own stage as label ``stage`` (``swarm_node_info`` is 1)."""
    return f"{expr} * on (instance) group_left (stage) {STAGE_OF}"


def quantiles(metric: str, by: str, qs=(0.5, 0.99), legend: str = "", selector: str = "", window: str = "5m",
              by_own_stage: bool = False):
    """``histogram_quantile`` queries of a histogram family, one per quantile; ``by_own_stage``: the
    node's stage joined in as label ``stage`` (put it in ``by``)."""
    series = f"rate({metric}_bucket{selector}[{window}])"
    if by_own_stage:
        series = per_stage(series)
    return [q(f"histogram_quantile({x}, sum by ({by}) ({series}))",
              f"p{round(100 * x)}{(' ' + legend) if legend else ''}") for x in qs]


# ---------------------------------------------------------------- the dashboard


def rows() -> list[tuple[str, list]]:
    heads = "and on (instance) (swarm_node_stage == 0)"
    return [
        ("Training", [
            timeseries_panel("Tokens per second (per node)", "short", q("swarm_node_tokens_per_second", "{{instance}}")),
            timeseries_panel("Capacity: tokens per busy second (per node, what routing weighs)", "short",
                             q("swarm_node_capacity_tokens_per_second", "{{instance}}")),
            stat_panel("Swarm tokens per second (heads)", "short",
                       q(f"sum(rate(swarm_node_tokens_total[1m]) {heads})", "tokens/s")),
            timeseries_panel("Loss (tail)", "none", q("swarm_node_loss", "loss {{instance}}"),
                             q("swarm_node_loss_ema", "loss EMA {{instance}}")),
            timeseries_panel("Optimizer version by stage", "none", q("swarm_node_version", "{{instance}}")),
            timeseries_panel("Steps per minute", "short", q("rate(swarm_node_steps_total[1m]) * 60", "{{instance}}")),
            timeseries_panel("Microbatches by outcome", "short",
                             q("sum by (outcome) (rate(swarm_node_microbatches_total[1m]))", "{{outcome}}")),
        ]),
        ("Pipeline", [
            timeseries_panel("In-flight microbatches", "short", q("swarm_node_inflight_microbatches", "{{instance}}")),
            timeseries_panel("Queue depth", "short", q("swarm_node_queue_depth", "{{direction}} {{instance}}")),
            timeseries_panel("Contexts expired (TTL)", "short",
                             q("rate(swarm_node_contexts_expired_total[5m])", "{{instance}}")),
            timeseries_panel("Microbatch round trip (head) p50/p99", "s",
                             *quantiles("swarm_node_microbatch_rtt_seconds", "le")),
            timeseries_panel("Compute time p50/p99", "s",
                             *quantiles("swarm_node_compute_seconds", "le, kind", legend="{{kind}}")),
            timeseries_panel("Staleness (own steps) p50/p90", "none",
                             *quantiles("swarm_node_staleness_steps", "le", qs=(0.5, 0.9))),
            timeseries_panel("Sender version gap p50", "none",
                             *quantiles("swarm_node_sender_version_gap", "le", qs=(0.5,))),
        ]),
        ("Connections", [
            timeseries_panel(
                "Connections: direct vs relayed (per node)", "short",
                q("sum by (instance, kind) (swarm_node_connections)", "{{instance}} {{kind}}"),
                description="Open libp2p connections of each node's daemon (all peers, DHT included). "
                            "'relayed' goes through a circuit relay: every byte crosses a third machine. "
                            "On a swarm of reachable machines it stays 0."),
            timeseries_panel(
                "Neighbour links by path (stage → stage)", "short",
                q("sum by (stage, peer_stage, kind) (%s)" % per_stage('swarm_node_connected_peers{peer_stage!="none"}'),
                  "{{stage}} → {{peer_stage}} {{kind}}"),
                description="Peers of each stage that the nodes of each stage are connected to, by best path. "
                            "A relayed neighbour link means activations or gradients go through a relay: "
                            "expect it slower until a hole punch upgrades it."),
            stat_panel(
                "Relayed share of connections", "percentunit",
                q("sum(swarm_node_connections{kind=\"relayed\"}) / clamp_min(sum(swarm_node_connections), 1)",
                  "relayed"),
                description="Fraction of all open connections in the swarm that go through a relay."),
            timeseries_panel(
                "Hole punches per minute by outcome (daemon)", "short",
                q("sum by (side, outcome) (rate(swarm_node_holepunch_total[5m])) * 60", "{{side}} {{outcome}}"),
                description="DCUtR hole punches counted by the go-libp2p daemon (only nodes that run AutoNAT; "
                            "a --local swarm shows no data). The sum over outcomes is the attempts."),
            stat_panel(
                "Hole-punch success rate (1 h)", "percentunit",
                q("sum(increase(swarm_node_holepunch_total{outcome=\"success\"}[1h])) / "
                  "clamp_min(sum(increase(swarm_node_holepunch_total[1h])), 1)", "success"),
                description="Successful hole punches over all attempts in the last hour."),
            timeseries_panel(
                "Relayed episodes and upgrades to direct (node-observed)", "short",
                q("sum(increase(swarm_node_relayed_peers_total[5m]))", "relayed episodes"),
                q("sum(increase(swarm_node_relay_upgrades_total[5m]))", "upgraded to direct"),
                description="Seen by the nodes themselves every 2 s: a peer reached only through a relay "
                            "(an episode), and episodes that ended with a direct connection. Lower bounds."),
            timeseries_panel(
                "Round trip to neighbour stage (ping) p50/p99", "s",
                *quantiles("swarm_node_neighbour_rtt_seconds", "le, stage, peer_stage", legend="{{stage}} → {{peer_stage}}",
                           selector="{protocol=\"health\"}", by_own_stage=True),
                description="Bare network round trip from the nodes of one stage to those of the next or "
                            "previous one (a small health request every 10 s). This is the link's latency."),
            timeseries_panel(
                "Activation / gradient ack time to neighbour stage p50", "s",
                *quantiles("swarm_node_neighbour_rtt_seconds", "le, stage, peer_stage, protocol", qs=(0.5,),
                           legend="{{protocol}} {{stage}} → {{peer_stage}}", selector="{protocol!=\"health\"}",
                           by_own_stage=True),
                description="From sending a microbatch's activations (fwd) or gradients (bwd) until the peer "
                            "acknowledged them: latency plus the tensors' time through the link. Far above the "
                            "ping means the link's bandwidth, not its latency, is the limit."),
            timeseries_panel(
                "Bytes per second to neighbour stage", "Bps",
                q("sum by (stage, peer_stage) (%s)"
                  % per_stage('rate(swarm_node_neighbour_bytes_total{direction="out"}[1m])'),
                  "{{stage}} → {{peer_stage}}"),
                description="What the nodes of each stage send to the peers of each neighbour stage (and to "
                            "their own: state sync to joiners). Compare with the link's rate."),
            table_panel(
                "Neighbours reached only through a relay", "short",
                q("swarm_node_connected_peers{kind=\"relayed\", peer_stage!=\"none\"} > 0",
                  "{{instance}} → stage {{peer_stage}}"),
                description="Per node: how many peers of each stage it reaches only through a relay right now."),
        ]),
        ("Wire", [
            timeseries_panel("Bytes on the wire by protocol", "Bps",
                             q("sum by (protocol, direction) (rate(swarm_node_wire_bytes_total[1m]))",
                               "{{protocol}} {{direction}}")),
            timeseries_panel("Wire bytes per token", "bytes",
                             q("sum(rate(swarm_node_wire_bytes_total{direction=\"out\"}[1m])) / "
                               f"clamp_min(sum(rate(swarm_node_tokens_total[1m]) {heads}), 1)", "bytes/token")),
            timeseries_panel("Request latency p50/p99 by protocol", "s",
                             *quantiles("swarm_node_request_seconds", "le, protocol", legend="{{protocol}}")),
            timeseries_panel("Outgoing requests by result", "short",
                             q("sum by (protocol, result) (rate(swarm_node_requests_total[1m]))",
                               "{{protocol}} {{result}}")),
            timeseries_panel("Served requests by result", "short",
                             q("sum by (protocol, result) (rate(swarm_node_served_total[1m]))",
                               "{{protocol}} {{result}}")),
            timeseries_panel("Compute failures", "short",
                             q("sum by (instance, direction, error) (increase(swarm_node_compute_failures_total[5m]))",
                               "{{instance}} {{direction}} {{error}}"),
                             description="Exceptions in a stage's own compute (forward, backward, the head's "
                                         "forward, averaging). Any increase is a bug or a broken device: the "
                                         "node's log has the traceback of the first of each kind."),
            timeseries_panel("State sync bytes", "bytes",
                             q("sum by (direction) (increase(swarm_node_state_sync_bytes_total[5m]))",
                               "{{direction}}")),
        ]),
        ("Security", [
            timeseries_panel("Verifier verdicts", "short",
                             q("sum by (direction, verdict, reason) (rate(swarm_node_verifier_verdicts_total[1m]))",
                               "{{direction}} {{verdict}} {{reason}}")),
            timeseries_panel("Verifier time p99", "s", *quantiles("swarm_node_verifier_seconds", "le", qs=(0.99,))),
            timeseries_panel("Banned peers", "short", q("swarm_node_banned_peers", "{{instance}}")),
            timeseries_panel("Bans by cause", "short",
                             q("sum by (cause) (increase(swarm_node_bans_total[5m]))", "{{cause}}")),
            timeseries_panel("State downloads by outcome", "short",
                             q("sum by (outcome) (increase(swarm_node_state_sync_total[5m]))", "{{outcome}}"),
                             description="unconfirmed: a joiner took the state of the only replica online, checked "
                                         "against its signed record only; refused: a source whose claims or weights "
                                         "disagreed with the others (banned)."),
            timeseries_panel("Averaging: kept out", "short",
                             q("sum by (kind) (increase(swarm_node_averaging_judged_total[5m]))", "{{kind}}"),
                             description="Contributions dropped as outside the group's spread, ranges refused "
                                         "as returned too far from a receiver's own, and peers without the "
                                         "stage's record refused a group."),
            timeseries_panel("Forged DHT records refused", "short",
                             q("sum by (kind, check) (increase(swarm_node_forged_records_total[5m]))",
                               "{{kind}} {{check}}"),
                             description="Any increase means someone writes records in other peers' names."),
        ]),
        ("Membership and averaging", [
            timeseries_panel("Peers per stage (DHT)", "short",
                             q("max by (stage) (swarm_node_peers)", "stage {{stage}}")),
            timeseries_panel("DHT neighbours and rejoins", "short",
                             q("swarm_node_dht_neighbours", "{{instance}} neighbours"),
                             q("increase(swarm_node_dht_rejoins_total[5m])", "{{instance}} rejoins"),
                             description="Peers in each node's DHT routing table. At 0 a node cannot reach the "
                                         "swarm's records (its network was down); it knocks at its bootstrap peers "
                                         "and the peers it met until one answers, counted as a rejoin."),
            table_panel("Node state", "none", q("swarm_node_state == 1", "{{instance}} {{state}}")),
            table_panel("Nodes: run, stage and role", "none", q(STAGE_OF, "{{instance}} {{role}} {{stage}}")),
            timeseries_panel("Averaging rounds by result", "short",
                             q("sum by (outcome) (increase(swarm_node_averaging_rounds_total[5m]))", "{{outcome}}")),
            timeseries_panel("Averaging group size", "short", q("swarm_node_averaging_group_size", "{{instance}}")),
            timeseries_panel("Averaging round duration", "s", q("swarm_node_averaging_round_seconds", "{{instance}}")),
            timeseries_panel("Compute utilisation (busy / wall)", "percentunit",
                             q("rate(swarm_node_compute_busy_seconds_total[1m])", "{{instance}}")),
            timeseries_panel("Averaging bytes", "Bps",
                             q("sum by (direction) (rate(swarm_node_averaging_bytes_total[1m]))", "{{direction}}")),
        ]),
        ("Morph epochs", [
            timeseries_panel("Morph epoch (per node)", "none", q("swarm_node_morph_epoch", "{{instance}}"),
                             description="The basis epoch each stage is in (docs/MORPH.md). All nodes climb "
                                         "together, one epoch every morph.every head steps; a node that "
                                         "stays behind has missed a seed and re-downloads its stage's state."),
            timeseries_panel("Last morph cost (per node)", "s", q("swarm_node_morph_seconds", "{{instance}}"),
                             description="Wall time of the node's last fold (both sides, float64 master copy, "
                                         "on the compute thread: microbatches wait behind it)."),
            timeseries_panel("Morphs and epoch refusals", "short",
                             q("sum(increase(swarm_node_morphs_total[5m]))", "morphs"),
                             q("sum by (protocol) (increase(swarm_node_served_total{result=\"wrong-epoch\"}[5m]))",
                               "refused {{protocol}} (wrong epoch)"),
                             description="Frames of another epoch are refused, never mixed; a few per epoch "
                                         "change are normal with several replicas per stage."),
        ]),
        ("Resources", [
            timeseries_panel("Resident memory", "bytes", q("swarm_node_process_resident_memory_bytes", "{{instance}}")),
            timeseries_panel("CPU seconds per second", "short",
                             q("rate(swarm_node_process_cpu_seconds_total[1m])", "{{instance}}")),
            timeseries_panel("Checkpoint age", "s",
                             q("time() - swarm_node_checkpoint_timestamp_seconds", "{{instance}}")),
            timeseries_panel("Checkpoint step", "none", q("swarm_node_checkpoint_step", "{{instance}}")),
            stat_panel("Uptime", "s", q("time() - swarm_node_start_time_seconds", "{{instance}}")),
        ]),
    ]


def dashboard_builder() -> dashboard.Dashboard:
    d = (dashboard.Dashboard("swarm-node").uid("swarm-node").tags(["swarm-node"]).timezone("browser")
         .refresh("10s").time("now-30m", "now").version(1).tooltip(DashboardCursorSync.CROSSHAIR))
    pid = 1
    for title, panels in rows():
        d = d.with_row(dashboard.Row(title).id(pid))
        pid += 1
        for panel in panels:
            d = d.with_panel(panel.id(pid))
            pid += 1
    return d


def build() -> dict:
    """The dashboard as the JSON object Grafana's provisioning loads."""
    return json.loads(json.dumps(dashboard_builder().build(), cls=JSONEncoder))


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {OUT}")
