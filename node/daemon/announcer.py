"""The announce loop of a running node (as hivemind and Petals give theirs a class): every period
it refreshes the addresses p2pd reports (a relay address appears behind NAT), rejoins the DHT if
it lost every neighbour, stores the node's peer record and reads everyone else's.

It lives with the daemon rather than in ``node.net`` because it feeds the node's metrics
(``node.ops``) and reads the node's current stage and state: it asks ``holding()`` at every
period and freezes nothing at construction, so the node can change what it holds between two
announcements. Every call into p2pd or the DHT is bounded (the ``*_TIMEOUT_S`` constants): one
that does not answer costs one WARNING line, and the loop tries again next period.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from node.net import MAX_MADDRS, PeerRecord
from node.ops import announce_line

log = logging.getLogger("swarm_node.daemon")

MADDRS_TIMEOUT_S = 10.0  # p2pd's identify: the addresses it reports now
DHT_TIMEOUT_S = 10.0  # one DHT store or get (peer record, peers, manifest)
NEIGHBOURS_TIMEOUT_S = 5.0  # the DHT's routing-table size
REJOIN_DIAL_TIMEOUT_S = 3.0  # one dial of a bootstrap peer or a peer met before
REJOIN_TIMEOUT_S = 30.0  # a whole rejoin attempt (dials, then pings from the DHT)
STATES = ("joining", "online", "draining", "offline")  # what a peer record may say


@dataclass(frozen=True)
class Holding:
    """What the node holds and how it is doing now: read by the announcer at every period."""

    stage: int
    state: str
    throughput: float = 0.0
    capacity: float = 0.0
    queue: int = 0
    version: int = 0
    epoch: int | None = None  # morph epoch; None with morphing off


class Announcer:
    """Keeps this node's record in the DHT and the router's view of the swarm current.

    ``holding()``: the node's ``Holding`` now. ``membership``: ``node.net.Membership``.
    ``transport``: the stream transport (its ``p2p`` for addresses, ``connect`` to rejoin).
    ``router``: takes the peers read from the DHT. ``metrics``: ``node.ops.NodeMetrics``."""

    def __init__(self, *, peer_id: str, maddrs: list[str], holding: Callable[[], Holding], membership, transport,
                 router, metrics, n_stages: int, every: float, initial_peers=(), local: bool = False,
                 maddrs_timeout: float = MADDRS_TIMEOUT_S, dht_timeout: float = DHT_TIMEOUT_S,
                 neighbours_timeout: float = NEIGHBOURS_TIMEOUT_S, rejoin_timeout: float = REJOIN_TIMEOUT_S):
        self.peer_id, self.maddrs = peer_id, list(maddrs)
        self.holding, self.membership, self.transport = holding, membership, transport
        self.router, self.metrics, self.n_stages = router, metrics, n_stages
        self.every, self.initial_peers, self.local = every, list(initial_peers), local
        self.maddrs_timeout, self.dht_timeout = maddrs_timeout, dht_timeout
        self.neighbours_timeout, self.rejoin_timeout = neighbours_timeout, rejoin_timeout
        self.rounds = 0  # announce periods completed
        self._now = asyncio.Event()
        self._closing = False
        self._isolated_since: float | None = None  # since when the DHT has had no neighbour
        self._had_neighbours = False
        self._last_manifest = 0.0

    def poke(self) -> None:
        """Announce now rather than at the end of the period (the node's state changed)."""
        self._now.set()

    def close(self) -> None:
        """Start no new period (the task itself is cancelled by its owner)."""
        self._closing = True
        self._now.set()

    async def _bounded(self, what: str, call: Callable[[], Awaitable], timeout: float, *,
                       default=None, quiet: bool = False):
        """``await call()`` within ``timeout``; on timeout one WARNING line naming ``what``, on
        another failure one line (DEBUG when ``quiet``); ``default`` in both cases."""
        try:
            return await asyncio.wait_for(call(), timeout)
        except asyncio.TimeoutError:
            log.warning("%s did not answer within %g s; trying again in %g s", what, timeout, self.every)
        except Exception as e:  # noqa: BLE001 - a p2pd or DHT hiccup must not stop training
            log.log(logging.DEBUG if quiet else logging.WARNING, "%s failed: %r", what, e)
        return default

    async def run(self) -> None:
        """The loop, until ``close()`` (or cancellation)."""
        while not self._closing:
            await self.round()
            self._now.clear()
            if self._closing:
                break
            try:
                await asyncio.wait_for(self._now.wait(), self.every)
            except asyncio.TimeoutError:
                pass

    async def round(self) -> None:
        """One period: addresses, DHT neighbours, our record, everyone's, and now and then the manifest."""
        if not self.local:
            await self.refresh_maddrs()
        await self.stay_joined()
        await self.announce()
        await self.refresh_peers()
        if time.monotonic() - self._last_manifest > 4 * self.every:
            self._last_manifest = time.monotonic()
            await self._bounded("manifest refresh (DHT get/store)",
                                lambda: self.membership.arefresh_manifest(timeout=self.dht_timeout),
                                2 * self.dht_timeout)
        self.rounds += 1

    def record(self, state: str | None = None) -> PeerRecord:
        """Our peer record now (``state`` overrides the node's, e.g. ``offline`` when leaving)."""
        h = self.holding()
        st = state or h.state
        if st not in STATES:
            st = "joining"
        return PeerRecord(self.peer_id, h.stage, st, throughput=h.throughput, capacity=h.capacity,
                          queue=h.queue, version=h.version, epoch=h.epoch, maddrs=self.maddrs[:MAX_MADDRS])

    async def announce(self, state: str | None = None, ttl: float | None = None, timeout: float | None = None) -> None:
        """Store our record in the DHT (bounded by ``timeout``, the DHT bound by default)."""
        rec = self.record(state)
        timeout = self.dht_timeout if timeout is None else timeout
        await self._bounded(f"announce {rec.state} (DHT store)",
                            lambda: self.membership.aannounce(rec, ttl=ttl, timeout=timeout), timeout)

    async def refresh_peers(self) -> None:
        """Read every peer's record from the DHT into the router, and count them by stage."""
        peers = await self._bounded("reading peers (DHT get)", lambda: self.membership.apeers(timeout=self.dht_timeout),
                                    self.dht_timeout)
        if peers is None:
            return
        self.router.update(peers)
        self.membership.remember(peers)
        counts = self.router.count_by_stage(self.n_stages)
        h = self.holding()
        for s in range(self.n_stages):
            own = 1 if (s == h.stage and h.state == "online") else 0
            self.metrics.peers.labels(stage=str(s)).set(counts[s] + own)

    async def stay_joined(self) -> None:
        """When the DHT lost every neighbour (this node's link was down long enough for every DHT
        request to fail), knock at the bootstrap peers and the peers met before until one answers
        (``Membership.arejoin``); tried again at every announcement until one answers."""
        now = time.monotonic()
        neighbours = await self._bounded("the DHT's routing table", lambda: self.membership.aneighbours(
            timeout=self.neighbours_timeout), self.neighbours_timeout, quiet=True)
        if neighbours is None:
            return
        self.metrics.dht_neighbours.set(neighbours)
        if neighbours > 0:
            self._had_neighbours = True
            if self._isolated_since is not None:
                log.info("back in the DHT after %.0f s alone", now - self._isolated_since)
                self._isolated_since = None
            return
        if not self._had_neighbours and not self.initial_peers:
            return  # the first node of a swarm: alone until someone joins, nobody to knock at
        if self._isolated_since is None:
            self._isolated_since = now
            log.warning("the DHT lost every neighbour (this node's network was down?): rejoining through the "
                        "bootstrap peers and the peers met before")
        answered = await self._bounded("rejoining the DHT", lambda: self.membership.arejoin(
            self.transport.connect, self.initial_peers, timeout=REJOIN_DIAL_TIMEOUT_S),
            self.rejoin_timeout, default=0, quiet=True)
        if answered:
            self.metrics.dht_rejoins.inc()
            self.metrics.dht_neighbours.set(answered)
            log.info("rejoined the DHT through %d peer(s) after %.0f s alone", answered, now - self._isolated_since)
            self._isolated_since = None

    async def refresh_maddrs(self) -> None:
        """Announce the addresses p2pd has now: behind NAT, a relay address (``.../p2p-circuit``)
        appears once AutoNAT found this node private and a relay gave it a slot; the others dial
        that (``liveness._redial``). Said once on stdout, as the other announcements."""
        got = await self._bounded("p2pd's addresses (get_visible_maddrs)",
                                  lambda: self.transport.p2p.get_visible_maddrs(latest=True),
                                  self.maddrs_timeout, quiet=True)
        maddrs = [str(a) for a in got or ()]  # nothing read: the old addresses stay announced
        if not maddrs or maddrs == self.maddrs:
            return
        relayed = [m for m in maddrs if "/p2p-circuit" in m]
        if relayed and not any("/p2p-circuit" in m for m in self.maddrs):
            announce_line(f"reachable through a relay: {' '.join(relayed)}")
        elif not relayed and any("/p2p-circuit" in m for m in self.maddrs):
            log.info("no relay address any more: %s", " ".join(maddrs))
        self.maddrs = maddrs
