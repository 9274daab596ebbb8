"""Connection metrics across the network lab (tests/helpers/netlab.py): two stages behind NATs
reach each other only through the bootstrap's relay, and their metrics say so; the public head
reaches everyone directly; bytes and round trips per neighbour stage flow through the relay too."""

from __future__ import annotations

import time

import pytest

from node.ops import metric_sum
from tests.helpers.netlab import Lab, Link, lab_unavailable

REASON = lab_unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or ""),
              pytest.mark.timeout(420)]


def test_two_nodes_behind_nat_are_linked_through_a_relay_and_the_metrics_say_so(tmp_path):
    from stages import load_manifest
    from tests.helpers.labswarm import LabSwarm

    m = load_manifest("test").replace(sentinel={"enabled": False})
    with Lab() as lab, LabSwarm(lab, m, workdir=tmp_path / "swarm") as sw:
        sw.start_bootstrap(lab.add_node("boot"))
        mid = sw.start_node(1, lab.add_node("home1", Link(delay_ms=10), nat=True), name="nat-mid")
        head = sw.start_node(0, lab.add_node("head", Link(delay_ms=10)), name="head")
        tail = sw.start_node(2, lab.add_node("home2", Link(delay_ms=10), nat=True), name="nat-tail")
        sw.wait_ready(timeout=200)

        def m_of(node):
            return sw.metrics(node)

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and sw.value(tail, "swarm_node_steps_total") < 10:
            time.sleep(1)
        first = {n.name: m_of(n) for n in (head, mid, tail)}
        time.sleep(12)  # a ping round (every 10 s) and more training
        now = {n.name: m_of(n) for n in (head, mid, tail)}
        summary = {name: {k: v for k, v in ms.items() if k.startswith(("swarm_node_connect", "swarm_node_relay"))}
                   for name, ms in now.items()}
        print("connection metrics:", summary)

        # the two NAT'd stages cannot dial each other: their link goes through the relay (or a hole
        # punch upgraded it, which the nodes count), and each saw a relayed episode with the other
        for name, other in (("nat-mid", "2"), ("nat-tail", "1")):
            ms = now[name]
            assert metric_sum(ms, "swarm_node_relayed_peers_total") >= 1, (name, summary)
            assert (metric_sum(ms, "swarm_node_connected_peers", peer_stage=other, kind="relayed") >= 1
                    or metric_sum(ms, "swarm_node_relay_upgrades_total") >= 1), (name, summary)
            # everyone else is reached directly: the public head, and the bootstrap (no stage)
            assert metric_sum(ms, "swarm_node_connected_peers", peer_stage="0", kind="direct") >= 1, (name, summary)
            assert metric_sum(ms, "swarm_node_connected_peers", peer_stage="none", kind="direct") >= 1, (name, summary)
        # the public head dials everyone directly, NAT'd or not
        assert metric_sum(now["head"], "swarm_node_connections", kind="relayed") == 0, summary
        assert metric_sum(now["head"], "swarm_node_relayed_peers_total") == 0, summary
        # public nodes' daemons run AutoNAT, hence DCUtR: hole-punch counters exist on every node
        for name, ms in now.items():
            assert any(k.startswith("swarm_node_holepunch_total{") for k in ms), name
        # activations and gradients flow over the relayed link, and round trips are timed on it
        for name, other, direction in (("nat-mid", "2", "out"), ("nat-tail", "1", "out"), ("nat-mid", "2", "in")):
            before = metric_sum(first[name], "swarm_node_neighbour_bytes_total", peer_stage=other, direction=direction)
            after = metric_sum(now[name], "swarm_node_neighbour_bytes_total", peer_stage=other, direction=direction)
            assert after > before, (name, other, direction, before, after)
        assert metric_sum(now["nat-mid"], "swarm_node_neighbour_rtt_seconds_count", peer_stage="2", protocol="fwd") > \
            metric_sum(first["nat-mid"], "swarm_node_neighbour_rtt_seconds_count", peer_stage="2", protocol="fwd")
        assert metric_sum(now["nat-tail"], "swarm_node_neighbour_rtt_seconds_count", peer_stage="1",
                          protocol="health") >= 1
        codes = sw.close()
    assert all(c == 0 for c in codes.values()), codes
