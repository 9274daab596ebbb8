"""A node behind NAT, in the network lab (tests/helpers/netlab.py): it joins by the bootstrap address,
gets a relay address, holds the middle stage and serves forward and backward traffic; a peer that
never talked to it reaches it through the relay. `swarm-node doctor` tells a NAT'd machine that it
is reachable only through a relay, and a public one that it is reachable directly."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.helpers.netlab import Lab, Link, lab_unavailable

REASON = lab_unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or ""),
              pytest.mark.timeout(300)]

DOCTOR = "import sys, json; from node.ops.doctor import check_nat; print(json.dumps(check_nat(sys.argv[2:], " \
         "float(sys.argv[1])).__dict__))"


def test_doctor_tells_a_machine_behind_nat_it_is_relayed_and_a_public_one_it_is_reachable(tmp_path):
    from stages import load_manifest
    from tests.helpers.labswarm import LabSwarm

    m = load_manifest("test").replace(sentinel={"enabled": False})
    with Lab() as lab, LabSwarm(lab, m, workdir=tmp_path / "swarm") as sw:
        peers = sw.start_bootstrap(lab.add_node("boot"))
        home = lab.add_node("home", Link(delay_ms=5), nat=True)
        public = lab.add_node("public", Link(delay_ms=5))
        doctors = {name: lab.popen(where, [sys.executable, "-c", DOCTOR, "30", *peers], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
                   for name, where in (("home", home), ("public", public))}
        verdict = {name: json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1])
                   for name, p in doctors.items()}
        assert verdict["home"]["status"] == "warn" and "only through a relay" in verdict["home"]["detail"], verdict
        assert peers[0].split("/p2p/")[1] in verdict["home"]["detail"]  # the bootstrap relays
        assert verdict["public"]["status"] == "ok" and "reachable directly" in verdict["public"]["detail"], verdict
        codes = sw.close()
    assert all(c == 0 for c in codes.values()), codes


def test_a_node_behind_nat_trains_in_a_swarm_through_its_relay_address(tmp_path):
    from stages import load_manifest
    from tests.helpers.labswarm import LabSwarm

    m = load_manifest("test").replace(sentinel={"enabled": False})
    with Lab() as lab, LabSwarm(lab, m, workdir=tmp_path / "swarm") as sw:
        sw.start_bootstrap(lab.add_node("boot"))
        home = lab.add_node("home", Link(delay_ms=5), nat=True)
        public = lab.add_node("public", Link(delay_ms=5))
        mid = sw.start_node(1, home, name="nat-mid")
        head = sw.start_node(0, lab.add_node("head", Link(delay_ms=5)), name="head")
        tail = sw.start_node(2, lab.add_node("tail", Link(delay_ms=5)), name="tail")
        sw.wait_ready(timeout=150)

        # the NAT'd node learns its relay address and announces it
        deadline = time.monotonic() + 60
        relayed = []
        while time.monotonic() < deadline and not relayed:
            relayed = [ln.split()[-1] for ln in mid.output().splitlines() if "reachable through a relay" in ln]
            time.sleep(0.5)
        assert relayed and "/p2p-circuit/p2p/" in relayed[0], mid.output()
        # its own addresses are private: nobody could dial those
        listening = [ln for ln in mid.output().splitlines() if "listening on" in ln][0]
        assert home.ip in listening and home.public_ip not in listening

        # it trains: forwards in from the head, backwards in from the tail, both answered
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and sw.value(tail, "swarm_node_steps_total") < 30:
            time.sleep(1)
        ms = sw.metrics(mid)
        from node.ops import metric_sum

        assert metric_sum(ms, "swarm_node_served_total", protocol="fwd", result="ack") >= 30, ms
        assert metric_sum(ms, "swarm_node_served_total", protocol="bwd", result="ack") >= 30, ms
        assert metric_sum(ms, "swarm_node_steps_total") >= 25
        assert sw.value(head, "swarm_node_steps_total") >= 25

        # a peer that never talked to it reaches it through the relay address it announced
        r = lab.run(public, [sys.executable, "-m", "node.cli", "status", "--json", relayed[0]], timeout=90)
        assert r.returncode == 0, r.stdout + r.stderr
        assert '"stage": 1' in r.stdout.replace("'", '"') or json.loads(r.stdout).get("stage") == 1, r.stdout

        codes = sw.close()
    assert all(c == 0 for c in codes.values()), codes
