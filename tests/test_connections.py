"""Connection metrics: direct vs relayed classification on hand-made multiaddrs, the tracker's
relayed episodes and upgrades, hole-punch counters read from a real p2pd's own metrics endpoint,
bytes per neighbour stage from a real transport, and round trips per neighbour stage growing as
an in-process pipeline trains."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from hivemind.utils.multiaddr import Multiaddr

from node.net import ConnectionTracker, DaemonMetrics, Transport, is_relayed, start_dht, stop_dht
from node.net.connections import free_tcp_port, parse_holepunch
from node.ops import NodeMetrics, metric_sum, parse_metrics
from node.runtime.stage import neighbour_bytes
from protocol import BWD, FWD, HEALTH, STATE, make_ack
from tests.conftest import ROOT
from tests.helpers.procs import assert_no_p2pd_left, p2pd_descendants
from tests.helpers.runtime import head_batches, link, make_runtime, start_all, stop_all, value, wait_for

RELAY = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
DEST = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"


@pytest.mark.parametrize("maddr, relayed", [
    (f"/ip4/203.0.113.7/tcp/4001/p2p/{RELAY}/p2p-circuit", True),  # what p2pd lists for a relayed conn
    (f"/ip4/203.0.113.7/udp/4001/quic-v1/p2p/{RELAY}/p2p-circuit/p2p/{DEST}", True),
    (f"/ip6/2001:db8::1/tcp/4001/p2p/{RELAY}/p2p-circuit", True),
    ("/ip4/127.0.0.1/tcp/31337", False),
    (f"/ip4/198.51.100.4/tcp/31337/p2p/{DEST}", False),
    ("/ip4/198.51.100.4/udp/4001/quic-v1", False),
    ("/dns4/p2p-circuit/tcp/4001", False),  # a host named so is not a relay: parsed, not grepped
    ("not a multiaddr /p2p-circuit", False),
    ("", False),
])
def test_relayed_or_direct_from_the_multiaddr(maddr, relayed):
    assert is_relayed(maddr) is relayed
    if maddr.startswith("/"):
        assert is_relayed(Multiaddr(maddr)) is relayed


def test_relayed_in_the_daemons_binary_form():
    """p2pd's connection list carries each remote address in go-multiaddr's binary form (a /p2p/
    component as a bare multihash, unlike hivemind's own encoder); it decodes, and classifies."""
    relay_mh = "002408011220c84063bed43e3d4380101b67398ab3d648d835e0e56d5cbb0ad6e976a37d1a0f"
    tcp = "047f000001" + "0688e9"  # /ip4/127.0.0.1/tcp/35049
    p2p = "a503" + f"{len(relay_mh) // 2:02x}" + relay_mh  # /p2p/<relay>
    relayed = Multiaddr(bytes.fromhex(tcp + p2p + "a202"))  # .../p2p-circuit
    assert str(relayed).endswith("/p2p-circuit") and is_relayed(relayed)
    assert not is_relayed(Multiaddr(bytes.fromhex(tcp)))
    t = ConnectionTracker()
    t.update([("X", relayed), ("Y", Multiaddr(bytes.fromhex(tcp)))])
    assert t.snapshot()["connections"] == {"direct": 1, "relayed": 1}


def _snap_metrics(tracker: ConnectionTracker) -> dict:
    m = NodeMetrics(stage=1)
    m.attach_connections(tracker.snapshot)
    return parse_metrics(m.render().decode())


def test_tracker_counts_kinds_stages_episodes_and_upgrades():
    stages = {"A": "0", "B": "2"}
    t = ConnectionTracker(stage_of=stages.get, forget_after=10.0)
    relay = f"/ip4/203.0.113.7/tcp/4001/p2p/{RELAY}/p2p-circuit"
    direct = "/ip4/198.51.100.4/tcp/31337"
    t.update([("A", relay), ("B", direct), ("C", direct)], now=0.0)
    s = t.snapshot()
    assert s["connections"] == {"direct": 2, "relayed": 1}
    assert s["peers"] == {("0", "relayed"): 1, ("2", "direct"): 1, ("none", "direct"): 1}
    assert (s["relayed_seen"], s["upgraded"]) == (1, 0)
    # still only relayed: the same episode, not a new one
    t.update([("A", relay), ("B", direct)], now=1.0)
    assert (t.snapshot()["relayed_seen"], t.snapshot()["upgraded"]) == (1, 0)
    # a direct connection opens beside the relayed one (a hole punch worked): an upgrade
    t.update([("A", relay), ("A", direct), ("B", direct)], now=2.0)
    s = t.snapshot()
    assert s["connections"] == {"direct": 2, "relayed": 1}
    assert s["peers"] == {("0", "direct"): 1, ("2", "direct"): 1}
    assert (s["relayed_seen"], s["upgraded"]) == (1, 1)
    # B loses its direct path and is reached through a relay: a second episode; it disconnects and
    # is forgotten after forget_after s, so coming back direct later is no upgrade
    t.update([("A", direct), ("B", relay)], now=3.0)
    t.update([("A", direct)], now=20.0)
    t.update([("A", direct), ("B", direct)], now=21.0)
    s = t.snapshot()
    assert (s["relayed_seen"], s["upgraded"]) == (2, 1)
    assert s["polls"] == 6
    # the exported families say the same
    fams = _snap_metrics(t)
    assert metric_sum(fams, "swarm_node_connections", kind="direct") == 2
    assert metric_sum(fams, "swarm_node_connections", kind="relayed") == 0
    assert metric_sum(fams, "swarm_node_connected_peers", peer_stage="2", kind="direct") == 1
    assert metric_sum(fams, "swarm_node_relayed_peers_total") == 2
    assert metric_sum(fams, "swarm_node_relay_upgrades_total") == 1


def test_tracker_remembers_a_bounded_number_of_relayed_peers():
    t = ConnectionTracker(max_remembered=100)
    relay = f"/ip4/203.0.113.7/tcp/4001/p2p/{RELAY}/p2p-circuit"
    for i in range(1000):
        t.update([(f"p{i}", relay)], now=float(i))
    assert len(t._relayed) == 100 and t.relayed_seen == 1000
    t.update([("p999", "/ip4/198.51.100.4/tcp/1"), ("p0", "/ip4/198.51.100.4/tcp/1")], now=1000.0)
    assert t.upgraded == 1  # p999 is remembered, p0 was forgotten to keep the bound


def test_holepunch_counters_from_the_metrics_text():
    text = """# TYPE libp2p_holepunch_outcomes_total counter
libp2p_holepunch_outcomes_total{num_attempts="1",outcome="success",side="initiator"} 3
libp2p_holepunch_outcomes_total{num_attempts="2",outcome="success",side="initiator"} 1
libp2p_holepunch_outcomes_total{num_attempts="3",outcome="failed",side="initiator"} 2
libp2p_holepunch_outcomes_total{num_attempts="1",outcome="no_suitable_address",side="receiver"} 5
# TYPE go_goroutines gauge
go_goroutines 30
"""
    assert parse_holepunch(text) == {("initiator", "success"): 4.0, ("initiator", "failed"): 2.0,
                                     ("receiver", "no_suitable_address"): 5.0}
    assert parse_holepunch("# TYPE go_goroutines gauge\ngo_goroutines 30\n") is None
    m = NodeMetrics()
    m.attach_holepunch(lambda: parse_holepunch(text))
    fams = parse_metrics(m.render().decode())
    assert metric_sum(fams, "swarm_node_holepunch_total") == 11
    assert metric_sum(fams, "swarm_node_holepunch_total", outcome="success") == 4


def _p2pd(*flags: str) -> tuple[subprocess.Popen, str]:
    from importlib.resources import files

    from hivemind.p2p.p2p_daemon import P2PD_FILENAME

    binary = str(files("hivemind.hivemind_cli") / P2PD_FILENAME)
    port = free_tcp_port()
    sock = f"/tmp/swarm-node-test-p2pd-{port}.sock"
    proc = subprocess.Popen([binary, f"-listen=/unix{sock}", "-hostAddrs=/ip4/127.0.0.1/tcp/0", "-q",
                             f"-metricsAddr=127.0.0.1:{port}", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}/metrics"


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "p2pd exited"
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"p2pd metrics at {url} did not answer")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("autonat", [True, False])
def test_a_real_p2pd_reports_holepunch_counters_only_with_autonat(autonat):
    proc, url = _p2pd("-autonat=1" if autonat else "-autonat=0")
    try:
        _wait_http(url, proc)
        got = DaemonMetrics(url).holepunch()
        if autonat:  # DCUtR is on: every (side, outcome) is there, at 0 before any punch
            assert got is not None
            assert {("initiator", "success"), ("receiver", "success"), ("initiator", "failed")} <= set(got)
            assert set(got.values()) == {0.0}
        else:
            assert got is None
    finally:
        proc.terminate()
        proc.wait(10)
    # the endpoint gone: no numbers rather than an error
    assert DaemonMetrics(url, ttl=0).holepunch() is None


@pytest.mark.timeout(120)
def test_the_dht_daemon_serves_its_metrics_when_asked():
    """start_dht(daemon_metrics=True): the p2pd under hivemind's DHT child gets -metricsAddr."""
    before = p2pd_descendants()
    dht = start_dht([], ["/ip4/127.0.0.1/tcp/0"], local=True, daemon_metrics=True)
    try:
        url = dht.daemon_metrics_url
        assert url and url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        assert "libp2p_rcmgr_connections" in text  # go-libp2p's own families
        assert DaemonMetrics(url).holepunch() is None  # a local swarm runs no AutoNAT, so no DCUtR
    finally:
        stop_dht(dht)
    assert p2pd_descendants() == before


CAN_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None

_PUBLIC_DHT = """
import json
from node.net import DaemonMetrics, start_dht, stop_dht
dht = start_dht([], ["/ip4/127.0.0.1/tcp/0"], local=False)
try:
    url = dht.daemon_metrics_url
    got = DaemonMetrics(url).holepunch() if url else None
    print(json.dumps({"url": url, "holepunch": None if got is None else [[*k, v] for k, v in got.items()]}))
finally:
    stop_dht(dht)
"""


@pytest.mark.timeout(180)
@pytest.mark.skipif(not CAN_NETNS, reason="needs root (ip netns): a public node's daemon (AutoNAT, NAT port "
                    "mapping) runs only inside a loopback-only network namespace here")
def test_a_public_nodes_daemon_reports_hole_punches():
    """Without --local the daemon runs AutoNAT, hence DCUtR: start_dht gives it a metrics endpoint by
    default, and its hole-punch counters are there (all 0: nobody to punch to). Run in a network
    namespace with only lo up, so the daemon's NAT discovery stays inside it."""
    ns = f"swn-dash-conn-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _PUBLIC_DHT], capture_output=True,
                           text=True, timeout=150, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    assert got["url"] and got["url"].startswith("http://127.0.0.1:")
    punches = {(side, outcome): v for side, outcome, v in got["holepunch"]}
    assert {("initiator", "success"), ("receiver", "success"), ("initiator", "failed")} <= set(punches)
    assert set(punches.values()) == {0.0}


def test_neighbour_bytes_follow_who_opened_the_exchange():
    role_bytes = {(FWD, "client", "out"): 1000, (FWD, "client", "in"): 10, (FWD, "server", "in"): 900,
                  (FWD, "server", "out"): 9, (BWD, "client", "out"): 800, (BWD, "server", "in"): 700,
                  (STATE, "server", "out"): 5000, (HEALTH, "client", "out"): 50}
    assert neighbour_bytes(role_bytes, 1, 3) == {("2", "out"): 1000, ("2", "in"): 10 + 700, ("0", "in"): 900,
                                                 ("0", "out"): 9 + 800, ("1", "out"): 5000}
    # the head has no stage before it, the tail none after: such bytes are not given a stage
    assert neighbour_bytes(role_bytes, 0, 3) == {("1", "out"): 1000, ("1", "in"): 10 + 700, ("0", "out"): 5000}
    assert neighbour_bytes(role_bytes, 2, 3) == {("1", "in"): 900, ("1", "out"): 9 + 800, ("2", "out"): 5000}


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_real_transport_counts_bytes_by_role_and_lists_direct_connections():
    assert p2pd_descendants() == []
    a = await Transport.start()
    b = None
    try:
        b = await Transport.start(initial_peers=await a.visible_maddrs())

        async def on_fwd(frame, peer):
            return make_ack(frame.header.get("mb", 0), 0, 0)

        await a.serve(FWD, on_fwd)
        before = dict(b.stats.role_bytes)
        for i in range(3):
            reply = await b.request(a.peer_id, FWD, {"type": "fwd", "mb": i}, [("x", torch.zeros(1250))], timeout=10)
            assert reply.header["type"] == "ack"
            # the caller's bytes count as client bytes, growing with each exchange
            assert b.stats.role_bytes[(FWD, "client", "out")] > before.get((FWD, "client", "out"), 0) + 5000 * i
        assert b.stats.role_bytes[(FWD, "client", "in")] > 0
        assert a.stats.role_bytes[(FWD, "server", "in")] == b.stats.role_bytes[(FWD, "client", "out")]
        assert a.stats.role_bytes[(FWD, "server", "out")] == b.stats.role_bytes[(FWD, "client", "in")]
        assert not any(role == "client" for _, role, _ in a.stats.role_bytes)
        # on loopback every connection is direct
        conns = await b.connections()
        assert a.peer_id in [peer for peer, _ in conns]
        t = ConnectionTracker(stage_of=lambda peer: "0" if peer == a.peer_id else None)
        t.update(conns)
        s = t.snapshot()
        assert s["connections"]["direct"] >= 1 and s["connections"]["relayed"] == 0
        assert s["peers"].get(("0", "direct")) == 1
    finally:
        if b is not None:
            await b.close()
        await a.close()
    assert_no_p2pd_left()


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_round_trips_per_neighbour_stage_grow_as_the_pipeline_trains(test_manifest):
    from tests.helpers.memnet import Net

    m = test_manifest
    net = Net()
    rts = [make_runtime(m, i, name, net, batches=head_batches(m) if i == 0 else None, ping_every=0.1)
           for i, name in enumerate(("head", "body", "tail"))]
    head, body, tail = rts
    link(rts)
    await start_all(rts)
    drive = asyncio.ensure_future(head.drive())
    maintain = [asyncio.ensure_future(rt.maintain(period=0.05)) for rt in rts]

    def rtts(rt, **labels):
        return value(rt, "swarm_node_neighbour_rtt_seconds_count", **labels)

    try:
        assert await wait_for(lambda: tail.version >= 3, timeout=60)
        first = rtts(head, peer_stage="1", protocol="fwd")
        assert first >= 3
        assert await wait_for(lambda: tail.version >= 8, timeout=60)
        # traffic flowed: more round trips to the next stage, each an acknowledged fwd
        assert rtts(head, peer_stage="1", protocol="fwd") > first
        assert rtts(head, peer_stage="1", protocol="fwd") <= value(head, "swarm_node_requests_total", protocol="fwd",
                                                                   result="ack")
        assert value(head, "swarm_node_neighbour_rtt_seconds_sum", peer_stage="1", protocol="fwd") > 0
        assert rtts(body, peer_stage="2", protocol="fwd") >= 8
        assert await wait_for(lambda: rtts(body, peer_stage="0", protocol="bwd") >= 6
                              and rtts(tail, peer_stage="1", protocol="bwd") >= 6, timeout=30)
        # pings: the body times both neighbours, the head and the tail their one neighbour
        assert await wait_for(lambda: rtts(body, peer_stage="0", protocol="health") >= 2
                              and rtts(body, peer_stage="2", protocol="health") >= 2
                              and rtts(head, peer_stage="1", protocol="health") >= 2
                              and rtts(tail, peer_stage="1", protocol="health") >= 2, timeout=10)
        assert rtts(head, peer_stage="0") == 0 and rtts(tail, peer_stage="2") == 0  # not neighbours
    finally:
        drive.cancel()
        for t in maintain:
            t.cancel()
        await asyncio.gather(drive, *maintain, return_exceptions=True)
        await stop_all(rts)
