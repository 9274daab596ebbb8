"""The internet in a box: network namespaces, one per node, joined by a router namespace.

Test and benchmark tooling (needs root, ``ip``, ``tc`` and ``iptables``; ``lab_unavailable()``
says why not, for a skip). Every name the lab creates starts with its own prefix
(``$SWARM_LAB_PREFIX``, default ``swlab``, then the process id and a random tag), and everything it
creates it removes: on :meth:`Lab.close`, on leaving its ``with`` block (also on an exception),
and at interpreter exit (atexit) for a lab left open.

Topology::

    node ns "eth0" 7.77.i.2/24  <-veth->  "l<i>" 7.77.i.1/24  router ns  (ip_forward)
    home (NAT) node:
    node ns "eth0" 192.168.i.2 <-> "lan" 192.168.i.1  home ns  "wan" 7.77.i.2 <-> "l<i>" router
                                                      (MASQUERADE; inbound: only replies)

Each node's access link ("l<i>" in the router) is shaped on its own:

- rate: ``tc tbf`` on the egress of both ends (node side: upload, router side: download);
- loss: iptables ``statistic --mode random`` DROP on the router's FORWARD chain, each direction;
- latency: ``tc netem`` where the kernel has it, else the NFQUEUE delay line
  (``tests/helpers/delayline.py``) in the router: a forwarded packet waits the one-way delay of the
  link it came in on plus that of the link it goes out on, so the round trip between nodes A and
  B is ``2 * (delay_A + delay_B)``;
- partition: DROP rules on both directions of the link (:meth:`Lab.partition` / :meth:`Lab.heal`);
- NAT: a "home" namespace with MASQUERADE between the node and its link, which forwards only
  connections the node opened (:meth:`Lab.add_node` ``nat=True``).

Processes run in a node's namespace with :meth:`Lab.popen` (``ip netns exec``, environment and
PYTHONPATH kept); :func:`in_netns` runs a Python function on a thread inside a namespace (the
test process scrapes a node's metrics on the node's own 127.0.0.1 that way, so nothing is added
to the host's network).

Why 7.77.0.0/16: libp2p's AutoNAT and relay logic treat private and reserved ranges (10/8,
192.168/16, 100.64/10, 198.18/15, the documentation nets) as not public, so a lab built on them
cannot show a node that is reachable directly next to one that is not. The lab's "internet" uses
a public-looking range instead; it exists only inside the lab's namespaces (the router namespace
has no uplink). So that nothing in the host's own namespace can ever send a packet to those real
addresses while a lab is up (a stray dial of an announced lab address, say), each lab adds a
``blackhole`` route for 7.77.0.0/16 in the host namespace (its own metric, so labs may overlap)
and removes it on close.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
ROUTER_IF_PREFIX = "l"
LAB_NET = "7.77.0.0/16"  # the lab's "internet"; blackholed in the host namespace while a lab is up
_OPEN_LABS: list[Lab] = []


def lab_unavailable() -> str | None:
    """Why the lab cannot run here (a skip reason), or None."""
    if sys.platform != "linux":
        return "the network lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces, tc, iptables)"
    missing = [tool for tool in ("ip", "tc", "iptables") if shutil.which(tool) is None]
    if missing:
        return f"the network lab needs {', '.join(missing)} (Debian: apt-get install iproute2 iptables)"
    probe = f"{os.environ.get('SWARM_LAB_PREFIX', 'swlab')}-probe-{os.getpid()}-{secrets.token_hex(2)}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    try:
        r = subprocess.run(["ip", "netns", "exec", probe, "iptables", "-w", "-L", "-n"], capture_output=True, text=True)
        if r.returncode != 0:
            return f"iptables does not work in a network namespace: {r.stderr.strip()[:200]}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def netem_available(ns: str) -> bool:
    """Whether this kernel has the ``netem`` qdisc (tried on the loopback of ``ns``)."""
    r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                       capture_output=True)
    if r.returncode == 0:
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    return r.returncode == 0


def in_netns(ns: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a new thread that has entered network namespace ``ns``."""
    out: dict = {}

    def target():
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(NETNS_DIR / ns, os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns {ns}: {os.strerror(err)}")
        finally:
            os.close(fd)
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = e

    t = threading.Thread(target=target, name=f"netns-{ns}", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


@dataclass
class Link:
    """Shaping of one access link (None / 0: not limited)."""

    up_mbit: float | None = None  # node -> internet
    down_mbit: float | None = None  # internet -> node
    delay_ms: float = 0.0  # one-way delay this link adds (RTT A<->B = 2 (delay_A + delay_B))
    loss: float = 0.0  # drop probability per packet, each direction
    queue_ms: float = 50.0  # tbf queue, as time at the link rate (a home router's buffer)


@dataclass
class LabNode:
    name: str
    index: int
    ns: str  # the node's namespace
    ip: str  # its own address (private 192.168.i.2 behind NAT)
    public_ip: str  # where its packets come from, seen from the router (the NAT's WAN address)
    router_if: str  # its link's interface in the router namespace
    link: Link
    nat: bool = False
    home_ns: str | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)


class LabError(RuntimeError):
    pass


class Lab:
    """A router namespace and nodes linked to it; see the module docstring."""

    def __init__(self, prefix: str | None = None, delay: str = "auto"):
        base = prefix or os.environ.get("SWARM_LAB_PREFIX", "swlab")
        self.prefix = f"{base}-{os.getpid()}-{secrets.token_hex(2)}"
        self.router = f"{self.prefix}-r"
        self.namespaces: list[str] = []
        self.nodes: dict[str, LabNode] = {}
        self.delayline: subprocess.Popen | None = None
        self.delay_queue = 7000 + secrets.randbelow(50000)
        self.partitioned: set[str] = set()
        self._closed = False
        self.host_guard_metric: str | None = None
        reason = lab_unavailable()
        if reason:
            raise LabError(reason)
        _OPEN_LABS.append(self)
        try:
            self._guard_host()
            self._add_ns(self.router)
            self.sh(self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            self.netem = delay != "nfqueue" and netem_available(self.router)
            if delay == "netem" and not self.netem:
                raise LabError("this kernel has no netem qdisc")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ plumbing

    def sh(self, ns: str | None, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if check and r.returncode != 0:
            raise LabError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")
        return r

    def _guard_host(self) -> None:
        """Blackhole the lab's addresses in the host namespace (see the module docstring)."""
        for _ in range(20):
            metric = str(1000 + secrets.randbelow(60000))
            r = subprocess.run(["ip", "route", "add", "blackhole", LAB_NET, "metric", metric],
                               capture_output=True, text=True)
            if r.returncode == 0:
                self.host_guard_metric = metric
                return
            if "exists" not in r.stderr:
                raise LabError(f"ip route add blackhole {LAB_NET}: {r.stderr.strip()}")
        raise LabError(f"could not add a host blackhole route for {LAB_NET}")

    def _add_ns(self, ns: str) -> None:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        self.namespaces.append(ns)
        self.sh(ns, "ip", "link", "set", "lo", "up")

    def _veth(self, ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
        # created directly inside both namespaces: no name ever appears in the host's namespace
        tmp_a, tmp_b = f"{if_a}x{secrets.token_hex(2)}"[:15], f"{if_b}y{secrets.token_hex(2)}"[:15]
        self.sh(None, "ip", "link", "add", tmp_a, "netns", ns_a, "type", "veth", "peer", "name", tmp_b, "netns", ns_b)
        self.sh(ns_a, "ip", "link", "set", tmp_a, "name", if_a)
        self.sh(ns_b, "ip", "link", "set", tmp_b, "name", if_b)

    def _iptables(self, ns: str, *rule: str, check: bool = True) -> None:
        self.sh(ns, "iptables", "-w", "5", *rule, check=check)

    # ------------------------------------------------------------------ nodes

    def add_node(self, name: str, link: Link | None = None, *, nat: bool = False) -> LabNode:
        if name in self.nodes:
            raise ValueError(f"lab node {name!r} exists")
        i = len(self.nodes) + 1
        if i > 250:
            raise ValueError("at most 250 lab nodes")
        link = link or Link()
        ns = f"{self.prefix}-{i}"
        rif = f"{ROUTER_IF_PREFIX}{i}"
        self._add_ns(ns)
        wan_ip = f"7.77.{i}.2"
        if nat:
            home = f"{self.prefix}-h{i}"
            self._add_ns(home)
            self._veth(home, "wan", self.router, rif)
            self._veth(ns, "eth0", home, "lan")
            self._addr(home, "wan", f"{wan_ip}/24")
            self._addr(home, "lan", f"192.168.{i}.1/24")
            self._addr(ns, "eth0", f"192.168.{i}.2/24")
            self.sh(home, "ip", "route", "add", "default", "via", f"7.77.{i}.1")
            self.sh(ns, "ip", "route", "add", "default", "via", f"192.168.{i}.1")
            self.sh(home, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            self._iptables(home, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
            self._iptables(home, "-A", "FORWARD", "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                           "-j", "ACCEPT")
            self._iptables(home, "-A", "FORWARD", "-i", "wan", "-j", "DROP")
            self._iptables(home, "-A", "INPUT", "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                           "-j", "ACCEPT")
            self._iptables(home, "-A", "INPUT", "-i", "wan", "-j", "DROP")
            up_ns, up_if, own_ip = home, "wan", f"192.168.{i}.2"
        else:
            home = None
            self._veth(ns, "eth0", self.router, rif)
            self._addr(ns, "eth0", f"{wan_ip}/24")
            self.sh(ns, "ip", "route", "add", "default", "via", f"7.77.{i}.1")
            up_ns, up_if, own_ip = ns, "eth0", wan_ip
        self._addr(self.router, rif, f"7.77.{i}.1/24")
        node = LabNode(name, i, ns, own_ip, wan_ip, rif, link, nat, home)
        node._up = (up_ns, up_if)  # type: ignore[attr-defined]
        self.nodes[name] = node
        self.shape(node, link)
        return node

    def _addr(self, ns: str, ifname: str, cidr: str) -> None:
        self.sh(ns, "ip", "addr", "add", cidr, "dev", ifname)
        self.sh(ns, "ip", "link", "set", ifname, "up")

    def shape(self, node: LabNode, link: Link) -> None:
        """(Re)apply ``link``'s rate, delay and loss to ``node``'s access link."""
        up_ns, up_if = node._up  # type: ignore[attr-defined]
        old = node.link
        node.link = link
        self._rate(up_ns, up_if, link.up_mbit, link.queue_ms)
        self._rate(self.router, node.router_if, link.down_mbit, link.queue_ms)
        self._loss(node, old.loss if old is not link else 0.0, link.loss)
        self._delay(node, link.delay_ms)

    def _rate(self, ns: str, ifname: str, mbit: float | None, queue_ms: float) -> None:
        self.sh(ns, "tc", "qdisc", "del", "dev", ifname, "root", check=False)
        if mbit:
            rate_bytes = mbit * 1e6 / 8
            burst = max(16 * 1024, int(rate_bytes * 0.004))
            self.sh(ns, "tc", "qdisc", "add", "dev", ifname, "root", "tbf", "rate", f"{mbit}mbit",
                    "burst", str(burst), "latency", f"{queue_ms:g}ms")

    def _loss_rules(self, node: LabNode, p: float) -> list[list[str]]:
        return [["FORWARD", direction, node.router_if, "-m", "statistic", "--mode", "random",
                 "--probability", f"{p:.6f}", "-j", "DROP"] for direction in ("-i", "-o")]

    def _loss(self, node: LabNode, old: float, new: float) -> None:
        if old > 0:
            for rule in self._loss_rules(node, old):
                self._iptables(self.router, "-D", *rule, check=False)
        if new > 0:
            for rule in self._loss_rules(node, new):
                # after the partition rules (inserted at the top), before the delay queue
                self._iptables(self.router, "-I", rule[0], str(1 + 2 * (node.name in self.partitioned)), *rule[1:])

    def _delay(self, node: LabNode, ms: float) -> None:
        if self.netem:
            for ns, ifname in (node._up, (self.router, node.router_if)):  # type: ignore[attr-defined]
                # netem under tbf would need a class tree; with netem the delay goes on its own qdisc
                self.sh(ns, "tc", "qdisc", "del", "dev", ifname, "root", check=False)
                if ms > 0:
                    self.sh(ns, "tc", "qdisc", "add", "dev", ifname, "root", "netem", "delay", f"{ms:g}ms")
            if ms > 0 and (node.link.up_mbit or node.link.down_mbit):
                raise LabError("netem + rate on one link is not built; use delay='nfqueue'")
            return
        rules = [["FORWARD", d, node.router_if, "-j", "NFQUEUE", "--queue-num", str(self.delay_queue),
                  "--queue-bypass"] for d in ("-i", "-o")]
        for rule in rules:
            self._iptables(self.router, "-D", *rule, check=False)
        if ms > 0:
            self._start_delayline()
            for rule in rules:
                self._iptables(self.router, "-A", *rule)
        if self.delayline is not None:
            self.delayline.stdin.write(f"{node.router_if} {ms:g}\n")
            self.delayline.stdin.flush()
            line = self.delayline.stdout.readline()
            if not line.startswith("set "):
                raise LabError(f"the delay line did not take the delay: {line!r}")

    def _start_delayline(self) -> None:
        if self.delayline is not None and self.delayline.poll() is None:
            return
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.delayline = subprocess.Popen(
            ["ip", "netns", "exec", self.router, sys.executable, "-m", "tests.helpers.delayline",
             str(self.delay_queue)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True)
        line = self.delayline.stdout.readline()
        if line.strip() != "ready":
            err = self.delayline.stderr.read() if self.delayline.poll() is not None else ""
            raise LabError(f"the delay line did not start: {line!r} {err[-2000:]}")

    # ------------------------------------------------------------------ faults

    def partition(self, node: LabNode) -> None:
        """Cut ``node``'s link both ways (packets dropped silently, as on a dead line)."""
        if node.name in self.partitioned:
            return
        for d in ("-o", "-i"):
            self._iptables(self.router, "-I", "FORWARD", "1", d, node.router_if, "-j", "DROP")
        self.partitioned.add(node.name)

    def heal(self, node: LabNode) -> None:
        if node.name not in self.partitioned:
            return
        for d in ("-i", "-o"):
            self._iptables(self.router, "-D", "FORWARD", d, node.router_if, "-j", "DROP", check=False)
        self.partitioned.discard(node.name)

    # ------------------------------------------------------------------ processes

    def command(self, node: LabNode, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", node.ns, *argv]

    def popen(self, node: LabNode, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in ``node``'s namespace (its own session unless told otherwise); the lab
        kills its process group on close."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(node, argv), **kwargs)
        node.procs.append(proc)
        return proc

    def run(self, node: LabNode, argv: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(node, argv), timeout=timeout, **kwargs)

    def call(self, node: LabNode, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on a thread inside ``node``'s namespace."""
        return in_netns(node.ns, fn, *args, **kwargs)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        procs = [p for n in self.nodes.values() for p in n.procs]
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            _signal_group(p, signal.SIGKILL)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if self.delayline is not None:
            try:
                self.delayline.stdin.close()
            except OSError:
                pass
            try:
                self.delayline.wait(5)
            except subprocess.TimeoutExpired:
                _signal_group(self.delayline, signal.SIGKILL)
                self.delayline.wait(5)
        for ns in reversed(self.namespaces):
            _kill_namespace_processes(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()
        if self.host_guard_metric is not None:
            subprocess.run(["ip", "route", "del", "blackhole", LAB_NET, "metric", self.host_guard_metric],
                           capture_output=True)
            self.host_guard_metric = None
        if self in _OPEN_LABS:
            _OPEN_LABS.remove(self)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL whatever still runs in ``ns`` (started by us inside it: a node's p2pd that outlived
    its parent); ``ip netns pids`` lists only processes of that namespace."""
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@atexit.register
def _close_open_labs() -> None:
    for lab in list(_OPEN_LABS):
        lab.close()
