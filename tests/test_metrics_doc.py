"""docs/METRICS.md documents every family the node exports, and only those."""

from __future__ import annotations

import re

from node.ops import NodeMetrics

from .conftest import ROOT


def _exported_families() -> set[str]:
    m = NodeMetrics(stage=0, run="doc")
    # families read from live sources at scrape time appear once those are attached (as the daemon does)
    m.attach_compute_busy(lambda: 1.5)
    m.attach_averaging(lambda: {"rounds_applied": 1, "bytes_sent": 10, "bytes_received": 10})
    m.attach_wire_stats(lambda: {("/swarm-node/fwd/1", "out"): 100})
    text = m.render().decode()
    fams = set()
    for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M):
        name, kind = m.groups()
        if name.endswith("_created") or name.startswith("swarm_node_process_"):
            continue
        fams.add(name)
    return fams


def test_every_exported_family_is_documented():
    doc = (ROOT / "docs" / "METRICS.md").read_text()
    documented = set(re.findall(r"^\| `(swarm_node_[a-z0-9_]+)` \|", doc, re.M))
    exported = _exported_families()
    assert exported - documented == set(), "exported but not in docs/METRICS.md"
    assert documented - exported == set(), "documented but not exported"
