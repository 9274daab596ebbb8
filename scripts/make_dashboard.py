"""Write docker/grafana/swarm-node.json, the Grafana dashboard for a swarm of nodes.

One row per concern, one panel per metric family the node exports (docs/METRICS.md). Run it
after changing metrics: ``python scripts/make_dashboard.py``; tests check that every PromQL
expression names a metric a running node really exports.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "docker" / "grafana" / "swarm-node.json"

# (title, unit, [(expr, legend)], kind)
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]], str]]]] = [
    ("Training", [
        ("Tokens per second (per node)", "short",
         [("swarm_node_tokens_per_second", "{{instance}}")], "timeseries"),
        ("Capacity: tokens per busy second (per node, what routing weighs)", "short",
         [("swarm_node_capacity_tokens_per_second", "{{instance}}")], "timeseries"),
        ("Swarm tokens per second (heads)", "short",
         [("sum(rate(swarm_node_tokens_total[1m]) and on (instance) (swarm_node_stage == 0))", "tokens/s")],
         "stat"),
        ("Loss (tail)", "none",
         [("swarm_node_loss", "loss {{instance}}"), ("swarm_node_loss_ema", "loss EMA {{instance}}")],
         "timeseries"),
        ("Optimizer version by stage", "none", [("swarm_node_version", "{{instance}}")], "timeseries"),
        ("Steps per minute", "short", [("rate(swarm_node_steps_total[1m]) * 60", "{{instance}}")], "timeseries"),
        ("Microbatches by outcome", "short",
         [("sum by (outcome) (rate(swarm_node_microbatches_total[1m]))", "{{outcome}}")], "timeseries"),
    ]),
    ("Pipeline", [
        ("In-flight microbatches", "short", [("swarm_node_inflight_microbatches", "{{instance}}")], "timeseries"),
        ("Queue depth", "short", [("swarm_node_queue_depth", "{{direction}} {{instance}}")], "timeseries"),
        ("Contexts expired (TTL)", "short",
         [("rate(swarm_node_contexts_expired_total[5m])", "{{instance}}")], "timeseries"),
        ("Microbatch round trip (head) p50/p99", "s",
         [("histogram_quantile(0.5, sum by (le) (rate(swarm_node_microbatch_rtt_seconds_bucket[5m])))", "p50"),
          ("histogram_quantile(0.99, sum by (le) (rate(swarm_node_microbatch_rtt_seconds_bucket[5m])))", "p99")],
         "timeseries"),
        ("Compute time p50/p99", "s",
         [("histogram_quantile(0.5, sum by (le, kind) (rate(swarm_node_compute_seconds_bucket[5m])))",
           "p50 {{kind}}"),
          ("histogram_quantile(0.99, sum by (le, kind) (rate(swarm_node_compute_seconds_bucket[5m])))",
           "p99 {{kind}}")], "timeseries"),
        ("Staleness (own steps) p50/p90", "none",
         [("histogram_quantile(0.5, sum by (le) (rate(swarm_node_staleness_steps_bucket[5m])))", "p50"),
          ("histogram_quantile(0.9, sum by (le) (rate(swarm_node_staleness_steps_bucket[5m])))", "p90")],
         "timeseries"),
        ("Sender version gap p50", "none",
         [("histogram_quantile(0.5, sum by (le) (rate(swarm_node_sender_version_gap_bucket[5m])))", "p50")],
         "timeseries"),
    ]),
    ("Wire", [
        ("Bytes on the wire by protocol", "Bps",
         [("sum by (protocol, direction) (rate(swarm_node_wire_bytes_total[1m]))", "{{protocol}} {{direction}}")],
         "timeseries"),
        ("Wire bytes per token", "bytes",
         [("sum(rate(swarm_node_wire_bytes_total{direction=\"out\"}[1m])) / "
           "clamp_min(sum(rate(swarm_node_tokens_total[1m]) and on (instance) (swarm_node_stage == 0)), 1)",
           "bytes/token")], "timeseries"),
        ("Request latency p50/p99 by protocol", "s",
         [("histogram_quantile(0.5, sum by (le, protocol) (rate(swarm_node_request_seconds_bucket[5m])))",
           "p50 {{protocol}}"),
          ("histogram_quantile(0.99, sum by (le, protocol) (rate(swarm_node_request_seconds_bucket[5m])))",
           "p99 {{protocol}}")], "timeseries"),
        ("Outgoing requests by result", "short",
         [("sum by (protocol, result) (rate(swarm_node_requests_total[1m]))", "{{protocol}} {{result}}")],
         "timeseries"),
        ("Served requests by result", "short",
         [("sum by (protocol, result) (rate(swarm_node_served_total[1m]))", "{{protocol}} {{result}}")],
         "timeseries"),
        ("State sync bytes", "bytes",
         [("sum by (direction) (increase(swarm_node_state_sync_bytes_total[5m]))", "{{direction}}")],
         "timeseries"),
    ]),
    ("Security", [
        ("Verifier verdicts", "short",
         [("sum by (direction, verdict, reason) (rate(swarm_node_verifier_verdicts_total[1m]))",
           "{{direction}} {{verdict}} {{reason}}")], "timeseries"),
        ("Verifier time p99", "s",
         [("histogram_quantile(0.99, sum by (le) (rate(swarm_node_verifier_seconds_bucket[5m])))", "p99")],
         "timeseries"),
        ("Banned peers", "short", [("swarm_node_banned_peers", "{{instance}}")], "timeseries"),
        ("Bans by cause", "short", [("sum by (cause) (increase(swarm_node_bans_total[5m]))", "{{cause}}")],
         "timeseries"),
    ]),
    ("Membership and averaging", [
        ("Peers per stage (DHT)", "short", [("max by (stage) (swarm_node_peers)", "stage {{stage}}")],
         "timeseries"),
        ("Node state", "none", [("swarm_node_state == 1", "{{instance}} {{state}}")], "table"),
        ("Averaging rounds by result", "short",
         [("sum by (outcome) (increase(swarm_node_averaging_rounds_total[5m]))", "{{outcome}}")], "timeseries"),
        ("Averaging group size", "short", [("swarm_node_averaging_group_size", "{{instance}}")], "timeseries"),
        ("Compute utilisation (busy / wall)", "percentunit",
         [("rate(swarm_node_compute_busy_seconds_total[1m])", "{{instance}}")], "timeseries"),
        ("Averaging bytes", "Bps",
         [("sum by (direction) (rate(swarm_node_averaging_bytes_total[1m]))", "{{direction}}")], "timeseries"),
    ]),
    ("Resources", [
        ("Resident memory", "bytes", [("swarm_node_process_resident_memory_bytes", "{{instance}}")],
         "timeseries"),
        ("CPU seconds per second", "short",
         [("rate(swarm_node_process_cpu_seconds_total[1m])", "{{instance}}")], "timeseries"),
        ("Checkpoint age", "s", [("time() - swarm_node_checkpoint_timestamp_seconds", "{{instance}}")],
         "timeseries"),
        ("Checkpoint step", "none", [("swarm_node_checkpoint_step", "{{instance}}")], "timeseries"),
        ("Uptime", "s", [("time() - swarm_node_start_time_seconds", "{{instance}}")], "stat"),
    ]),
]


def build() -> dict:
    panels = []
    pid = 1
    y = 0
    for row_title, row_panels in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid += 1
        y += 1
        for i, (title, unit, targets, kind) in enumerate(row_panels):
            x = (i % 3) * 8
            if i and i % 3 == 0:
                y += 8
            panels.append({
                "id": pid,
                "type": kind,
                "title": title,
                "datasource": {"type": "prometheus", "uid": "prometheus"},
                "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {},
                "targets": [
                    {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "prometheus"}}
                    for j, (expr, legend) in enumerate(targets)
                ],
            })
            pid += 1
        y += 8
    return {
        "uid": "swarm-node",
        "title": "swarm-node",
        "tags": ["swarm-node"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": []},
        "annotations": {"list": []},
        "panels": panels,
    }


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {OUT}")
