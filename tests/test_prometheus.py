"""A real Prometheus (Debian package `prometheus`, installed by .ci/run) scrapes a real local swarm.

One swarm (bootstrap + 3 stages, stages/runs/test.toml) serves every assertion here: Prometheus on
loopback with a generated config scrapes every node; after two scrapes its HTTP API must return
the swarm's series with sane values; and every metric the Grafana dashboard and the alert rules
name must be one that the running nodes really export.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from node.ops import LocalSwarm
from node.ops.local_swarm import free_port, metric_sum

from .test_docker_files import DOCKER, alert_exprs, dashboard_exprs

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="SKIPPED: the real-Prometheus test needs the Debian package `prometheus` "
    "(apt-get install prometheus; .ci/run installs it)",
)

# Prometheus functions/keywords that look like identifiers in an expression
_PROMQL_WORDS = {
    "sum", "rate", "increase", "histogram_quantile", "by", "on", "and", "or", "unless", "max", "min",
    "clamp_min", "time", "le", "without", "group_left", "count_over_time", "up", "label_replace", "vector",
}


def _query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _exported_names(metrics_text: str) -> set[str]:
    """Every sample name a node can export: TYPE lines expanded with the type's suffixes."""
    names = set()
    for line in metrics_text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if not m:
            continue
        name, kind = m.groups()
        names.add(name)
        if kind == "counter":
            base = name[:-6] if name.endswith("_total") else name
            names |= {base + "_total", base + "_created"}
        elif kind == "histogram":
            names |= {name + "_bucket", name + "_count", name + "_sum", name + "_created"}
        elif kind == "summary":
            names |= {name + "_count", name + "_sum"}
    return names


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    work = tmp_path_factory.mktemp("prom-swarm")
    s = LocalSwarm(manifest="test", workdir=work / "swarm")
    try:
        s.start_bootstrap()
        nodes = [s.start_node(i, name=f"stage{i}") for i in range(3)]
        s.wait_ready(nodes, timeout=150)
        yield s
    finally:
        codes = s.close()
        print("swarm exit codes:", codes)


@pytest.fixture(scope="module")
def prometheus(swarm, tmp_path_factory):
    work = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    targets = [f"127.0.0.1:{n.metrics_port}" for n in swarm.nodes]
    cfg = work / "prometheus.yml"
    cfg.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
        "scrape_configs": [{"job_name": "swarm-node", "static_configs": [{"targets": targets}]}],
    }))
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(work / "prometheus.err", "wb"), stdin=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, (work / "prometheus.err").read_text()
            try:
                # two scrapes of every target
                res = _query(base, 'count_over_time(up{job="swarm-node"}[1m]) >= 2')
                if len(res) == len(targets):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"Prometheus did not scrape every node twice:\n{(work / 'prometheus.err').read_text()}")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.mark.timeout(300)
def test_prometheus_scrapes_the_swarm(swarm, prometheus):
    up = _query(prometheus, 'up{job="swarm-node"}')
    assert len(up) == 3 and all(r["value"][1] == "1" for r in up)
    stages = sorted(int(float(r["value"][1])) for r in _query(prometheus, "swarm_node_stage"))
    assert stages == [0, 1, 2]
    online = _query(prometheus, 'swarm_node_state{state="online"} == 1')
    assert len(online) == 3
    # training progresses: the head's token counter increases between two scrapes
    first = sum(float(r["value"][1]) for r in _query(prometheus, "swarm_node_tokens_total"))
    deadline = time.monotonic() + 120
    later = first
    while time.monotonic() < deadline and later <= first:
        time.sleep(2)
        later = sum(float(r["value"][1]) for r in _query(prometheus, "swarm_node_tokens_total"))
    assert later > first, "tokens counter did not increase"
    inc = _query(prometheus, "increase(swarm_node_tokens_total[1m])")
    assert any(float(r["value"][1]) > 0 for r in inc)
    # the tail reports a finite, plausible loss (byte-level vocabulary: ln 256 = 5.55 at start)
    deadline = time.monotonic() + 60
    losses: list[float] = []
    while time.monotonic() < deadline:
        losses = [float(r["value"][1]) for r in _query(prometheus, "swarm_node_loss > 0")]
        if losses:
            break
        time.sleep(1)
    assert losses and all(math.isfinite(v) and 0 < v < 20 for v in losses), losses
    # peers per stage as seen in the DHT: every stage present
    peers = _query(prometheus, "max by (stage) (swarm_node_peers)")
    assert {r["metric"]["stage"] for r in peers if float(r["value"][1]) >= 1} >= {"0", "1", "2"}
    series = sorted({r["metric"]["__name__"] for r in _query(prometheus, '{__name__=~"swarm_node_.+"}')})
    print("series:", " ".join(series))
    assert len(series) >= 20


@pytest.mark.timeout(300)
def test_dashboard_and_alerts_name_only_exported_metrics(swarm):
    exported: set[str] = set()
    for n in swarm.nodes:
        status, text = swarm.get(n, "/metrics")
        assert status == 200
        exported |= _exported_names(text)
    missing = {}
    for expr in dashboard_exprs() + alert_exprs():
        clean = re.sub(r"\{[^}]*\}|\"[^\"]*\"|\[[^\]]*\]", "", expr)
        for word in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", clean):
            if word.startswith("swarm_node_") and word not in exported:
                missing.setdefault(word, expr)
            elif not word.startswith("swarm_node_") and word not in _PROMQL_WORDS and not word.isdigit():
                # label names inside by()/on() are fine; anything else would be a typo
                assert word in {"instance", "stage", "direction", "protocol", "result", "kind", "cause",
                                "verdict", "reason", "outcome", "state", "job", "peer_stage", "side", "error",
                                "check"}, (word, expr)
    assert not missing, f"dashboard/alerts name metrics no node exports: {missing}"


@pytest.mark.timeout(300)
def test_connection_metrics_follow_the_traffic(swarm):
    """Each node's connections (all direct on loopback), bytes and round trips per neighbour stage:
    the counters grow while the pipeline trains, towards the stages next to the node only."""
    by_stage = {int(swarm.value(n, "swarm_node_stage")): n for n in swarm.nodes}
    assert sorted(by_stage) == [0, 1, 2]
    neighbours = {0: ("1",), 1: ("0", "2"), 2: ("1",)}

    def bytes_(m, stage, peer_stage, direction):
        return metric_sum(m[stage], "swarm_node_neighbour_bytes_total", peer_stage=peer_stage, direction=direction)

    def rtts(m, stage, peer_stage, protocol):
        return metric_sum(m[stage], "swarm_node_neighbour_rtt_seconds_count", peer_stage=peer_stage, protocol=protocol)

    first = {s: swarm.metrics(n) for s, n in by_stage.items()}
    deadline = time.monotonic() + 120
    while True:
        time.sleep(2)
        now = {s: swarm.metrics(n) for s, n in by_stage.items()}
        grown = all(bytes_(now, s, p, d) > bytes_(first, s, p, d) for s in by_stage for p in neighbours[s]
                    for d in ("in", "out"))
        grown = grown and rtts(now, 0, "1", "fwd") > rtts(first, 0, "1", "fwd")
        grown = grown and rtts(now, 2, "1", "bwd") > rtts(first, 2, "1", "bwd")
        pinged = all(rtts(now, s, p, "health") >= 1 for s in by_stage for p in neighbours[s])
        if (grown and pinged) or time.monotonic() > deadline:
            break
    for s in by_stage:
        for p in neighbours[s]:
            for d in ("in", "out"):
                assert bytes_(now, s, p, d) > bytes_(first, s, p, d), (s, p, d, bytes_(now, s, p, d))
            assert rtts(now, s, p, "health") >= 1, (s, p)  # the pings every 10 s
        # nothing is counted towards a stage that is not a neighbour
        others = {"0", "1", "2"} - set(neighbours[s]) - {str(s)}
        for p in others:
            assert metric_sum(now[s], "swarm_node_neighbour_bytes_total", peer_stage=p) == 0, (s, p)
            assert metric_sum(now[s], "swarm_node_neighbour_rtt_seconds_count", peer_stage=p) == 0, (s, p)
    assert rtts(now, 0, "1", "fwd") > rtts(first, 0, "1", "fwd")
    assert rtts(now, 1, "0", "bwd") > 0 and rtts(now, 1, "2", "fwd") > 0
    assert rtts(now, 2, "1", "bwd") > rtts(first, 2, "1", "bwd")
    for s, m in now.items():
        # loopback: every connection is direct; the neighbours and the bootstrap (no stage) are connected
        assert metric_sum(m, "swarm_node_connections", kind="direct") >= 2, s
        assert metric_sum(m, "swarm_node_connections", kind="relayed") == 0, s
        for p in neighbours[s]:
            assert metric_sum(m, "swarm_node_connected_peers", peer_stage=p, kind="direct") >= 1, (s, p)
        assert metric_sum(m, "swarm_node_connected_peers", peer_stage="none", kind="direct") >= 1, s
        assert metric_sum(m, "swarm_node_connected_peers", kind="relayed") == 0, s
        assert metric_sum(m, "swarm_node_relayed_peers_total") == 0, s
        # a local swarm's daemons run without AutoNAT: no hole punching, so no hole-punch series
        assert metric_sum(m, "swarm_node_holepunch_total") == 0 and not any(
            k.startswith("swarm_node_holepunch_total") for k in m), s


def _row_exprs(row: str) -> list[str]:
    """The queries of the dashboard panels under the row titled ``row``."""
    dash = json.loads((DOCKER / "grafana/swarm-node.json").read_text())
    out, inside = [], False
    for p in dash["panels"]:
        if p["type"] == "row":
            inside = p["title"] == row
        elif inside:
            out += [t["expr"] for t in p["targets"]]
    return out


@pytest.mark.timeout(300)
def test_every_dashboard_query_runs_and_the_connection_panels_show_the_swarm(swarm, prometheus):
    """Prometheus evaluates every panel query without an error (the joins on swarm_node_info
    included: one series per node, or the query fails at run time, which promtool cannot see),
    and the Connections row has data for a local swarm: every panel but the hole punches (no
    AutoNAT with --local) and the relayed-only table (nothing is relayed on loopback)."""
    for expr in dashboard_exprs():
        _query(prometheus, expr)  # asserts status "success"
    expect_data = [e for e in _row_exprs("Connections")
                   if "holepunch" not in e and 'kind="relayed", peer_stage' not in e]
    assert len(expect_data) >= 7, expect_data
    deadline = time.monotonic() + 120
    empty = expect_data
    while empty and time.monotonic() < deadline:
        empty = [e for e in expect_data if not _query(prometheus, e)]
        if empty:
            time.sleep(3)
    assert not empty, f"no data for: {empty}"
    # the stage -> stage links are the pipeline's: 0 -> 1, 1 -> 0, 1 -> 2, 2 -> 1 (and replicas' own)
    links = _query(prometheus, [e for e in expect_data if "neighbour_bytes_total" in e][0])
    pairs = {(r["metric"]["stage"], r["metric"]["peer_stage"]) for r in links if float(r["value"][1]) > 0}
    assert {("0", "1"), ("1", "0"), ("1", "2"), ("2", "1")} <= pairs, pairs
    assert not any(abs(int(a) - int(b)) > 1 for a, b in pairs), pairs
