"""No Docker engine runs here, so the files are tested instead: they parse, the provisioning
points at the dashboard, every command line is one the CLI accepts, and every PromQL expression
is valid (promtool) — tests/test_prometheus.py checks the metric names against a running swarm."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess

import pytest
import yaml

from node.cli import build_parser

from .conftest import ROOT

DOCKER = ROOT / "docker"
SAMPLE_MADDR = "/ip4/172.18.0.2/tcp/31337/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


def _compose():
    return yaml.safe_load((DOCKER / "compose.yml").read_text())


def _swarm_node_commands(script: str) -> list[list[str]]:
    """The swarm-node invocations in a service's sh -c script, with $(...) filled in."""
    script = re.sub(r"\$\([^)]*\)", SAMPLE_MADDR, script)
    out = []
    for part in re.split(r";|&&|\|\|", script):
        words = shlex.split(part)
        if "exec" in words[:1]:
            words = words[1:]
        if words and words[0] == "swarm-node":
            out.append(words[1:])
    return out


def test_compose_parses_and_has_the_swarm():
    c = _compose()
    services = c["services"]
    for name in ("bootstrap", "stage0", "stage1a", "stage1b", "stage2", "prometheus", "grafana"):
        assert name in services, name
    for name in ("stage0", "stage1a", "stage1b", "stage2"):
        assert services[name]["depends_on"]["bootstrap"]["condition"] == "service_healthy"
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert sorted(targets) == sorted(f"{n}:9100" for n in ("stage0", "stage1a", "stage1b", "stage2"))


def test_every_compose_command_is_accepted_by_the_cli():
    parser = build_parser()
    seen = 0
    for name, svc in _compose()["services"].items():
        if svc.get("entrypoint") != ["/bin/sh", "-c"]:
            continue
        for argv in _swarm_node_commands(svc["command"][0]):
            args = parser.parse_args(argv)  # SystemExit on an unknown flag fails the test
            assert args.command in ("run", "bootstrap", "keygen", "manifest")
            if args.command == "run":
                assert args.metrics_host == "0.0.0.0", f"{name}: Prometheus must reach the metrics port"
            seen += 1
    assert seen >= 11  # keygen, manifest keygen + sign, bootstrap; keygen + run for four nodes


def test_grafana_provisioning_points_at_the_dashboard():
    ds = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    prov = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/swarm-node.yml").read_text())
    path = prov["providers"][0]["options"]["path"]
    mounts = _compose()["services"]["grafana"]["volumes"]
    assert any(m.endswith(f"{path}/swarm-node.json:ro") for m in mounts)
    dash = json.loads((DOCKER / "grafana/swarm-node.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(panels) >= 20
    for p in panels:
        assert p["datasource"]["uid"] == uid
        assert p["targets"] and all(t["expr"] for t in p["targets"])


def test_dashboard_is_generated_from_the_script():
    from tests.helpers.scripts import load_script

    mod = load_script("make_dashboard")
    assert json.loads((DOCKER / "grafana/swarm-node.json").read_text()) == mod.build()


def test_every_documented_metric_is_on_a_dashboard_panel():
    """Each family in docs/METRICS.md's table appears in some panel's query (histograms through
    their _bucket/_count/_sum series), and each panel query names only documented families."""
    doc = (ROOT / "docs" / "METRICS.md").read_text()
    documented = set(re.findall(r"^\| `(swarm_node_[a-z0-9_]+)` \|", doc, re.M))
    assert len(documented) >= 40
    named = {re.sub(r"_(bucket|count|sum)$", "", n) for e in dashboard_exprs() for n in re.findall(r"swarm_node_\w+", e)}
    assert documented - named == set(), "documented but on no dashboard panel"
    # the process_* families are documented as one row (swarm_node_process_*)
    assert {n for n in named - documented if not n.startswith("swarm_node_process_")} == set()


def test_dashboard_json_has_what_grafana_provisioning_needs():
    dash = json.loads((DOCKER / "grafana/swarm-node.json").read_text())
    assert dash["uid"] == "swarm-node" and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids)
    occupied = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"{p['title']} overlaps another panel"
        occupied |= cells
        if p["type"] == "row":
            assert p["panels"] == [] and p["collapsed"] is False  # its panels follow it at the top level
            continue
        assert p["type"] in ("timeseries", "stat", "table"), p["type"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs == [chr(ord("A") + i) for i in range(len(refs))], p["title"]
        assert p["fieldConfig"]["defaults"]["unit"], p["title"]
    titles = [p["title"] for p in dash["panels"]]
    assert len(titles) == len(set(titles))


def dashboard_exprs() -> list[str]:
    dash = json.loads((DOCKER / "grafana/swarm-node.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((DOCKER / "alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_promql_is_valid(tmp_path):
    r = subprocess.run(["promtool", "check", "rules", str(DOCKER / "alerts.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # promtool checks rule expressions: wrap every dashboard expression in a recording rule
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr{i}", "expr": e} for i, e in enumerate(dashboard_exprs())]}]}
    f = tmp_path / "dash_rules.yml"
    f.write_text(yaml.safe_dump(rules))
    r = subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
