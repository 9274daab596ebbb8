"""The node's libp2p connections as an operator sees them: direct or through a relay, per
neighbour stage, and what the daemon's hole punching (DCUtR) did.

Three sources, each read where it is cheap:

- the daemon's list of open connections (p2pd's ``LIST_PEERS``: one entry per connection, holding
  the remote peer id and the connection's remote multiaddr). A connection through a circuit relay
  has a ``/p2p-circuit`` component in that multiaddr (``<relay address>/p2p/<relay id>/p2p-circuit``);
  any other connection is direct. :class:`ConnectionTracker` polls it and keeps the counts;
- what the node can see over time in that list: a peer first connected only through a relay and
  later directly has been upgraded (by a hole punch, or by a direct dial that worked);
- p2pd's own Prometheus endpoint (``-metricsAddr``), where go-libp2p counts hole-punch outcomes
  (``libp2p_holepunch_outcomes_total{side, num_attempts, outcome}``). p2pd runs DCUtR only when
  started with ``-autonat`` (hivemind's ``auto_nat=True``), and registers those counters only then.
  :class:`DaemonMetrics` reads and sums them.

docs/METRICS.md says exactly what each exported number means.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

log = logging.getLogger("swarm_node.connections")

KINDS = ("direct", "relayed")
NO_STAGE = "none"  # a connected peer that holds no stage in this run (bootstrap, DHT-only peers)


def is_relayed(maddr) -> bool:
    """True when ``maddr`` (a string or a multiaddr object) is a circuit-relay address: one of its
    protocols is ``p2p-circuit``. Parsed component by component, so a DNS name or a peer id that
    happens to read ``p2p-circuit`` does not count."""
    from hivemind.utils.multiaddr import Multiaddr

    try:
        ma = maddr if isinstance(maddr, Multiaddr) else Multiaddr(str(maddr))
        return any(p.name == "p2p-circuit" for p in ma.protocols())
    except Exception:  # noqa: BLE001 - an address we cannot parse is not one we know to be relayed
        return False


def connection_kind(maddr) -> str:
    return "relayed" if is_relayed(maddr) else "direct"


@dataclass(eq=False)
class ConnectionTracker:
    """Counts of the daemon's open connections, updated by :meth:`update` from ``(peer id,
    remote multiaddr)`` pairs (one per connection).

    ``stage_of(peer)`` names the stage a peer holds (a string, or None for a peer that holds
    none); it labels ``peers`` so an operator sees how each neighbour stage is reached.

    Node-observed relay history (for at most ``max_remembered`` peers at a time): a *relayed
    episode* starts when a poll finds a peer connected only through a relay and it is not already
    in one; it ends when a later poll finds the peer with a direct connection (counted in
    ``upgraded``: a hole punch, or a direct dial, worked) or when the peer has not been seen for
    ``forget_after`` s. ``relayed_seen`` counts the episodes started. Polls are seconds apart, so a
    relayed phase shorter than one poll is missed: both are lower bounds.
    """

    stage_of: Callable[[str], str | None] = lambda peer: None
    forget_after: float = 600.0
    max_remembered: int = 4096
    connections: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    peers: dict[tuple[str, str], int] = field(default_factory=dict)  # (stage label, kind) -> peers
    kinds: dict[str, str] = field(default_factory=dict)  # peer -> its best path now ("direct" wins)
    relayed_seen: int = 0
    upgraded: int = 0
    polls: int = 0
    _relayed: dict[str, float] = field(default_factory=dict)  # peer -> last time seen only relayed
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def update(self, conns: Iterable[tuple[str, object]], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        counts = {k: 0 for k in KINDS}
        by_peer: dict[str, set[str]] = {}
        for peer, maddr in conns:
            kind = connection_kind(maddr)
            counts[kind] += 1
            by_peer.setdefault(str(peer), set()).add(kind)
        kinds = {peer: ("direct" if "direct" in ks else "relayed") for peer, ks in by_peer.items()}
        peers: dict[tuple[str, str], int] = {}
        for peer, kind in kinds.items():
            label = self.stage_of(peer)
            key = (NO_STAGE if label is None else str(label), kind)
            peers[key] = peers.get(key, 0) + 1
        with self._lock:
            for peer, kind in kinds.items():
                if kind == "relayed":
                    if peer not in self._relayed:  # a relayed-only episode starts
                        self.relayed_seen += 1
                    self._relayed[peer] = now
                elif peer in self._relayed:  # ... and ends with a direct connection
                    self.upgraded += 1
                    del self._relayed[peer]
            for peer, seen in list(self._relayed.items()):
                if peer not in kinds and now - seen > self.forget_after:
                    del self._relayed[peer]
            extra = len(self._relayed) - self.max_remembered
            if extra > 0:  # forget the longest unseen first
                for peer in sorted(self._relayed, key=self._relayed.__getitem__)[:extra]:
                    del self._relayed[peer]
            self.connections, self.peers, self.kinds = counts, peers, kinds
            self.polls += 1

    def snapshot(self) -> dict:
        """What the metrics exporter reads (from its own thread)."""
        with self._lock:
            return {"connections": dict(self.connections), "peers": dict(self.peers),
                    "relayed_seen": self.relayed_seen, "upgraded": self.upgraded, "polls": self.polls}


async def poll_connections(transport, tracker: ConnectionTracker, every: float = 5.0,
                           stopping: Callable[[], bool] = lambda: False) -> None:
    """Update ``tracker`` from ``transport.connections()`` every ``every`` s until ``stopping()``."""
    while not stopping():
        try:
            tracker.update(await transport.connections())
        except Exception as e:  # noqa: BLE001 - a daemon hiccup must not stop the node
            log.debug("listing connections failed: %r", e)
        await asyncio.sleep(every)


# ---------------------------------------------------------------- p2pd's own metrics


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class DaemonMetrics:
    """Hole-punch outcomes read from p2pd's Prometheus endpoint at ``url`` (``http://host:port/metrics``).

    :meth:`holepunch` returns ``{(side, outcome): count}`` summed over go-libp2p's
    ``num_attempts`` label: ``side`` is ``initiator`` (this node dialled out in the punch) or
    ``receiver``; ``outcome`` is ``success``, ``failed``, ``no_suitable_address`` (or others a
    newer go-libp2p adds). Each hole punch ends in exactly one outcome, so their sum is the number
    of hole punches attempted. Returns None when the endpoint does not answer or has no hole-punch
    counters (p2pd runs DCUtR only with ``-autonat``). Reads are cached ``ttl`` s.
    """

    FAMILY = "libp2p_holepunch_outcomes"

    def __init__(self, url: str, timeout: float = 1.0, ttl: float = 5.0):
        self.url, self.timeout, self.ttl = url, timeout, ttl
        self._at = -1e9
        self._value: dict[tuple[str, str], float] | None = None
        self._lock = threading.Lock()

    def holepunch(self) -> dict[tuple[str, str], float] | None:
        with self._lock:
            if time.monotonic() - self._at < self.ttl:
                return self._value
            self._at = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=self.timeout) as r:
                    text = r.read(16 << 20).decode("utf-8", "replace")
                self._value = parse_holepunch(text)
            except (OSError, ValueError) as e:
                log.debug("p2pd metrics at %s: %r", self.url, e)
                self._value = None
            return self._value


def parse_holepunch(text: str) -> dict[tuple[str, str], float] | None:
    """``{(side, outcome): count}`` from p2pd's metrics text, or None when it has no hole-punch family."""
    from prometheus_client.parser import text_string_to_metric_families

    # the daemon's page is large (its resource manager's histograms): parse only the lines we read
    text = "".join(line + "\n" for line in text.splitlines() if DaemonMetrics.FAMILY in line)
    out: dict[tuple[str, str], float] | None = None
    for fam in text_string_to_metric_families(text):
        if fam.name != DaemonMetrics.FAMILY:
            continue
        out = {} if out is None else out
        for s in fam.samples:
            if not s.name.endswith("_total"):
                continue
            key = (s.labels.get("side", ""), s.labels.get("outcome", ""))
            out[key] = out.get(key, 0.0) + float(s.value)
    return out
