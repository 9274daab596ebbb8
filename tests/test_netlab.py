"""The network lab itself (tests/helpers/netlab.py): each shaping does what it says, measured with
plain TCP between two namespaces, and nothing the lab made outlives it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.netlab import Lab, LabError, Link, lab_unavailable

REASON = lab_unavailable()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(120)]

SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5001)); s.listen(64)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    n, t0 = 0, None
    while True:
        d = c.recv(1 << 20)
        if t0 is None:
            t0 = time.monotonic()
        if not d:
            break
        n += len(d)
    if n:  # handshake-only connections (the latency probes) print nothing
        print(n * 8 / max(1e-6, time.monotonic() - t0) / 1e6, flush=True)
    c.close()
"""


def _connect_ms(ip: str, n: int = 5, timeout: float = 3.0) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        with socket.create_connection((ip, 5001), timeout=timeout):
            out.append((time.perf_counter() - t0) * 1000)
    return out


def _send(ip: str, seconds: float) -> None:
    with socket.create_connection((ip, 5001), timeout=5) as s:
        buf = b"x" * 65536
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            s.sendall(buf)


def _sink(lab, node):
    proc = lab.popen(node, [sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "listening"
    return proc


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def test_lab_latency_rate_nat_and_partition_then_nothing_is_left():
    with Lab() as lab:
        a = lab.add_node("a", Link(up_mbit=8, down_mbit=40, delay_ms=15))
        b = lab.add_node("b", Link(delay_ms=10))
        home = lab.add_node("home", nat=True)
        prefix = lab.prefix
        assert len(_namespaces(prefix)) == 5  # router, a, b, home and its NAT box
        sink_b, sink_home = _sink(lab, b), _sink(lab, home)
        # a TCP handshake is one round trip: 2 * (15 + 10) ms, give or take scheduling
        rtt = lab.call(a, _connect_ms, b.ip)
        assert 48 <= min(rtt) <= 75, rtt
        # a's upload is 8 Mbit/s: a 4 s transfer arrives at close to that, never much above
        lab.call(a, _send, b.ip, 4.0)
        mbit = float(sink_b.stdout.readline())
        assert 6.0 <= mbit <= 8.8, mbit
        # behind NAT: dials out, cannot be dialled, neither at its own nor at its public address
        assert min(lab.call(home, _connect_ms, b.ip, 2)) < 40
        for ip in (home.ip, home.public_ip):
            with pytest.raises(OSError):
                lab.call(b, _connect_ms, ip, 1, 1.5)
        # a partition drops everything on b's link; healing restores it
        lab.partition(b)
        with pytest.raises(OSError):
            lab.call(a, _connect_ms, b.ip, 1, 1.5)
        lab.heal(b)
        assert min(lab.call(a, _connect_ms, b.ip, 2)) < 75
        del sink_home
    assert _namespaces(prefix) == []
    assert subprocess.run(["pgrep", "-f", f"tests.helpers.delayline {lab.delay_queue}"],
                          capture_output=True).returncode == 1


ECHO = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 5002))
print("listening", flush=True)
while True:
    data, addr = s.recvfrom(2048)
    s.sendto(data, addr)
"""


def _udp_echoes(ip: str, n: int) -> int:
    """Datagrams of ``n`` sent that came back (each crosses the link twice)."""
    got = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(0.05)
        for i in range(n):
            s.sendto(i.to_bytes(4, "big"), (ip, 5002))
            time.sleep(0.002)
            try:
                while True:
                    got.add(int.from_bytes(s.recv(16), "big"))
            except TimeoutError:
                pass
        s.settimeout(1.0)
        try:
            while True:
                got.add(int.from_bytes(s.recv(16), "big"))
        except TimeoutError:
            pass
    return len(got)


def test_lab_loss_drops_about_the_set_share():
    with Lab() as lab:
        a = lab.add_node("a", Link(loss=0.2))
        b = lab.add_node("b")
        echo = lab.popen(b, [sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
        assert echo.stdout.readline().strip() == "listening"
        got = lab.call(a, _udp_echoes, b.ip, 400)
        # 20 % dropped each way: 0.8 ** 2 = 64 % come back (256 of 400; binomial sd 9.6)
        assert 215 <= got <= 297, got
        lab.shape(a, Link())  # loss removed: everything comes back
        assert lab.call(a, _udp_echoes, b.ip, 100) == 100


def test_lab_cleans_up_after_a_failure_inside_the_block():
    prefix = None
    with pytest.raises(LabError):
        with Lab() as lab:
            prefix = lab.prefix
            lab.add_node("a")
            lab.sh(lab.router, "ip", "link", "set", "no-such-link", "up")  # fails: LabError
    assert prefix and _namespaces(prefix) == []


def _host_guard_routes(metric: str) -> list[str]:
    out = subprocess.run(["ip", "route", "show", "table", "main", "7.77.0.0/16"],
                         capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.startswith("blackhole") and f"metric {metric}" in line]


def test_lab_addresses_are_blackholed_in_the_host_namespace_while_the_lab_is_up():
    with Lab() as lab:
        a = lab.add_node("a")
        metric = lab.host_guard_metric
        assert metric is not None and len(_host_guard_routes(metric)) == 1
        # from the host namespace the lab's (real, public) addresses are unreachable, not routed out
        r = subprocess.run(["ip", "route", "get", a.public_ip], capture_output=True, text=True)
        assert r.returncode != 0 or r.stdout.startswith("blackhole"), r.stdout + r.stderr
    assert _host_guard_routes(metric) == []
