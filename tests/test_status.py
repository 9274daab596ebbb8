"""`swarm-node status` reads what a node's metrics endpoint really exports."""

from __future__ import annotations

import subprocess
import sys

from node.ops import NodeMetrics
from node.ops.status import format_status, status_from_metrics


def _metrics_text() -> str:
    m = NodeMetrics(stage=2, run="swarm-test")
    m.set_stage(2, "swarm-test", role="tail")
    m.set_state("online")
    m.steps.inc(7)
    m.version.set(7)
    m.loss.set(3.25)
    m.loss_ema.set(3.5)
    m.tokens_per_s.set(1234.5)
    m.capacity.set(2000.0)
    m.peers.labels(stage="0").set(1)
    m.peers.labels(stage="1").set(2)
    m.peers.labels(stage="2").set(1)
    m.attach_connections(lambda: {"connections": {"direct": 3, "relayed": 1},
                                  "peers": {("1", "direct"): 1, ("1", "relayed"): 1, ("none", "direct"): 1}})
    m.attach_holepunch(lambda: {("initiator", "success"): 2.0, ("initiator", "failed"): 1.0,
                                ("receiver", "no_suitable_address"): 1.0})
    return m.render().decode()


def test_status_from_real_metrics():
    st = status_from_metrics(_metrics_text())
    assert st["run"] == "swarm-test"
    assert st["stage"] == 2
    assert st["state"] == "online"
    assert st["steps"] == 7 and st["version"] == 7
    assert st["loss"] == 3.25
    assert st["tokens_per_s"] == 1234.5 and st["capacity_tokens_per_s"] == 2000.0
    assert st["peers_per_stage"] == {"0": 1, "1": 2, "2": 1}
    text = format_status(st)
    assert "state        online" in text and "stage 1: 2" in text
    assert "tokens/s     1234.5 (capacity 2000.0 per busy second)" in text
    assert st["connections"] == {"direct": 3, "relayed": 1}
    assert st["peers_by_path"] == {"1": {"direct": 1, "relayed": 1}}
    assert st["holepunch"] == {"attempts": 4, "successes": 2}
    assert "connections  3 direct, 1 relayed; stage peers 1: 1 direct + 1 relayed" in text
    assert "hole punches 2 of 4 succeeded" in text
    # a --local node: no hole-punch series at all
    bare = status_from_metrics(NodeMetrics(stage=0).render().decode())
    assert bare["holepunch"] is None and bare["connections"] == {"direct": 0, "relayed": 0}
    assert "hole punches - (not reported" in format_status(bare)


def test_status_cli_unreachable_gives_one_line_error():
    r = subprocess.run([sys.executable, "-m", "node.cli", "status", "127.0.0.1:1", "--timeout", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot read http://127.0.0.1:1/metrics" in lines[0]
