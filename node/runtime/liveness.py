"""Liveness of a stage's neighbours: the TTL sweep of contexts, health probes of a next hop that
keeps us waiting, a redial at its announced address, and what happens to the microbatches of a
next hop that died or restarted."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from node.net import PeerBusy, PeerRejected, PeerUnreachable
from node.runtime.options import Context, RuntimeOptions
from node.runtime.sends import Skip
from node.runtime.worker import Tasks
from protocol import HEALTH, ProtocolError, Reason, make_health_request, parse_health

log = logging.getLogger("swarm_node.runtime")


class Liveness:
    """Probes and expiry for one stage. ``contexts`` is the pipeline's table of microbatches in
    flight (read here); ``drop`` and ``lose_next_hop`` free them."""

    def __init__(self, options: RuntimeOptions, *, transport, router, metrics, tasks: Tasks,
                 contexts: dict[int, Context], drop: Callable[[int, Skip], None],
                 lose_next_hop: Callable[[str, float | None], int], neighbours: tuple[int, ...] = ()):
        self.options, self.transport, self.router, self.metrics, self.tasks = options, transport, router, metrics, tasks
        self.contexts, self.drop, self.lose_next_hop = contexts, drop, lose_next_hop
        self.neighbours = neighbours  # the stages next to ours, pinged for the round-trip metric
        self.probing: set[str] = set()
        self.last_probe: dict[str, float] = {}
        self.stopping = False
        self._next_ping = time.monotonic() + options.ping_every
        self._ping_turn = 0
        self._pinging: set[str] = set()

    def sweep(self) -> None:
        """TTL expiry of contexts and health probes of next hops that keep us waiting."""
        now = time.monotonic()
        waiting: dict[str, float] = {}
        for mb, ctx in list(self.contexts.items()):
            if now - ctx.created > self.options.context_ttl:
                self.metrics.contexts_expired.inc()
                self.drop(mb, Skip("expired", Reason.STALE))
                continue
            if ctx.next_peer and ctx.sent_at:
                waiting[ctx.next_peer] = max(waiting.get(ctx.next_peer, 0.0), now - ctx.sent_at)
        for peer, age in waiting.items():
            if age > self.options.probe_after:
                self.suspect(peer)
        if self.options.ping_every > 0 and now >= self._next_ping and not self.stopping:
            self._next_ping = now + self.options.ping_every
            self.ping_neighbours()

    def ping_neighbours(self) -> None:
        """One health request to one peer of each neighbour stage (taking their replicas in turn),
        timed into ``swarm_node_neighbour_rtt_seconds{protocol="health"}``: the bare network round
        trip, next to the fwd/bwd ack times that also carry the tensors. A ping that fails is only
        not timed; probes (``suspect``) decide about dead peers."""
        self._ping_turn += 1
        for stage in self.neighbours:
            peers = sorted(p.peer_id for p in self.router.stage_peers(stage))
            if not peers:
                continue
            peer = peers[self._ping_turn % len(peers)]
            if peer not in self._pinging:
                self._pinging.add(peer)
                self.tasks.spawn(self._ping(peer, stage))

    async def _ping(self, peer: str, stage: int) -> None:
        try:
            t0 = time.monotonic()
            await self.transport.request(peer, HEALTH, make_health_request(), timeout=3.0)
            self.metrics.observe_neighbour_rtt(stage, "health", time.monotonic() - t0)
        except (asyncio.TimeoutError, PeerBusy, PeerRejected, PeerUnreachable, ConnectionError, OSError,
                ProtocolError) as e:
            log.debug("ping of %s failed: %r", peer[-8:], e)
        finally:
            self._pinging.discard(peer)

    def suspect(self, peer: str, cooldown: float = 2.0) -> None:
        """Something went wrong with ``peer``: health-probe it (one probe at a time, at most every
        ``cooldown`` s)."""
        now = time.monotonic()
        if peer in self.probing or self.stopping or now - self.last_probe.get(peer, -1e9) < cooldown:
            return
        self.probing.add(peer)
        self.last_probe[peer] = now
        self.tasks.spawn(self._probe(peer))

    async def _probe(self, peer: str, attempts: int = 2) -> None:
        """Health-probe ``peer``; if it does not answer ``attempts`` times, ban it and drop every
        microbatch waiting on it (their gradients will never come)."""
        try:
            for attempt in range(attempts):
                try:
                    await self._health(peer)
                    return
                except (PeerBusy, PeerRejected):
                    return
                except (asyncio.TimeoutError, PeerUnreachable, ConnectionError, OSError) as e:
                    if attempt + 1 < attempts:
                        await asyncio.sleep(0.2)
                    elif await self._redial(peer):
                        # it restarted on a new address our p2pd did not know yet
                        log.info("%s answers again at its announced address", peer[-8:])
                    else:
                        self._failed(peer, e)
        finally:
            self.probing.discard(peer)

    async def _health(self, peer: str) -> None:
        """Health-probe ``peer`` (raises what the transport raises). If it started after we sent it
        a microbatch (killed and restarted with the same identity), that microbatch died with its
        old process: drop it now rather than at the context TTL, or its in-flight slot stays
        taken. Its start is placed no later than ``asked − uptime`` (its uptime was read after we
        asked; status rounds it to 0.1 s, hence the margin), so only microbatches surely sent to
        the old process are dropped."""
        asked = time.monotonic()
        reply = await self.transport.request(peer, HEALTH, make_health_request(), timeout=3.0)
        known = self.router.peers.get(peer)
        if known is not None:
            self.metrics.observe_neighbour_rtt(known.stage, "health", time.monotonic() - asked)
        try:
            uptime = float(parse_health(reply)["uptime_s"])
        except (ProtocolError, KeyError, TypeError, ValueError):
            return
        lost = self.lose_next_hop(peer, asked - uptime - 0.1)
        if lost:
            log.info("%s restarted %.1f s ago: %d microbatch(es) sent to it before are lost", peer[-8:], uptime, lost)

    async def _redial(self, peer: str) -> bool:
        """Dial ``peer`` at the multiaddrs it announced in the DHT, then health-probe it once."""
        p = self.router.peers.get(peer)
        connect = getattr(self.transport, "connect", None)
        if p is None or not p.maddrs or connect is None:
            return False
        for maddr in p.maddrs:
            if not maddr.endswith(f"/p2p/{peer}"):
                continue
            try:
                await connect(maddr, timeout=3.0)
                await self._health(peer)
                return True
            except (PeerBusy, PeerRejected):
                return True
            except (asyncio.TimeoutError, PeerUnreachable, ConnectionError, OSError, ValueError):
                continue
        return False

    def _failed(self, peer: str, err: BaseException) -> None:
        seconds = self.router.on_failure(peer, "unreachable")
        self.metrics.request("health", "failed", peer)
        self.metrics.bans.labels(cause="unreachable").inc()
        log.warning("health to %s failed (%s); banned for %.0f s", peer[-8:], type(err).__name__, seconds)
        self.lose_next_hop(peer, None)
