"""A running node's lifecycle: connect the stream transport to the DHT's p2pd, start the stage,
join (download the stage's state from its replicas, with retries), serve until a signal or the
step limit, then leave in order. What it does for its stage lives in its ``StageSlot``
(``node.daemon.slot``), what it tells the swarm in its ``Announcer`` (``node.daemon.announcer``).

SIGTERM/SIGINT: stop injecting, drain in-flight microbatches (bounded by ``--drain-timeout``),
write a checkpoint, announce ``offline``, stop serving; a second signal leaves without draining.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

from node.daemon.announcer import Announcer, Holding
from node.daemon.checks import REPLICATE_TIMEOUT_S, StartUp, replicate_p2p
from node.daemon.slot import StageSlot
from node.net import ConnectionTracker, DaemonMetrics, Router, StateSyncError, Transport, poll_connections, stop_dht
from node.base import CliError
from node.ops import announce_line, fast_exit
from node.runtime import cancel_all, max_batch_for, new_microbatch_rng
from protocol import Limits

log = logging.getLogger("swarm_node.daemon")

FORCE_EXIT_GRACE_S = 30.0  # beyond --drain-timeout, the watchdog's bound on the whole shutdown
TRANSPORT_CLOSE_TIMEOUT_S = 5.0
OFFLINE_ANNOUNCE_TIMEOUT_S = 3.0


class Node:
    """Everything one running node owns; ``serve()`` is its life on the event loop."""

    def __init__(self, cfg, started: StartUp, *, replicate_timeout: float = REPLICATE_TIMEOUT_S):
        self.cfg, self.m, self.device = cfg, started.manifest, started.device
        self.replicate_timeout = replicate_timeout
        self.dht, self.membership = started.dht, started.membership
        self.metrics, self.server = started.metrics, started.server
        self.peer_id, self.maddrs = started.peer_id, started.maddrs
        self.router = Router(self.peer_id, rng=new_microbatch_rng(cfg.seed))
        self.slot = StageSlot(cfg, self.m, started.index, self.device, dht=self.dht, router=self.router,
                              metrics=self.metrics, server=self.server, peer_id=self.peer_id,
                              checkpoint=started.checkpoint)
        self.transport = None
        self.announcer: Announcer | None = None
        self._stop: asyncio.Event | None = None
        self._closing = False

    @property
    def index(self) -> int:
        return self.slot.index

    @property
    def runtime(self):
        return self.slot.runtime

    def holding(self) -> Holding:
        """What this node holds and how it is doing now (the announcer reads it every period)."""
        rt = self.runtime
        return Holding(self.index, rt.state, throughput=rt.tokens_per_s(), capacity=rt.capacity_tokens_per_s(),
                       queue=rt.worker.depth("fwd"), version=rt.version,
                       epoch=rt.morph.epoch if rt.morph.enabled else None)

    def setup(self) -> None:
        """What must happen on the main thread before the event loop (hivemind's averager forks)."""
        self.slot.build()

    # ---- the event loop

    async def serve(self) -> int:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            p2p = await replicate_p2p(self.dht, self.replicate_timeout)
        except CliError:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await self.slot.close()
            raise
        max_batch = max_batch_for(self.m)
        limits = Limits(max_body_bytes=max(64 << 20, 2 * max_batch * self.m.model.seq_len * (self.m.k * 4 + 8)))
        self.transport = transport = Transport(p2p, limits=limits, max_streams_per_peer=max(16, 4 * cfg.queue_size))
        restored = self.slot.checkpoint is not None
        rt = await self.slot.start(transport)
        self.metrics.attach_wire_stats(lambda: transport.stats.bytes)
        self.metrics.attach_neighbour_bytes(rt.neighbour_bytes)
        self.announcer = Announcer(
            peer_id=self.peer_id, maddrs=self.maddrs, holding=self.holding, membership=self.membership,
            transport=transport, router=self.router, metrics=self.metrics, n_stages=self.m.n_stages,
            every=cfg.announce_every, initial_peers=cfg.initial_peers, local=cfg.local)
        tracker = self._watch_connections()
        bg = [asyncio.ensure_future(self.announcer.run()),
              asyncio.ensure_future(rt.maintain(beat=self.server.beat if self.server else None)),
              asyncio.ensure_future(poll_connections(transport, tracker, every=2.0,
                                                     stopping=lambda: self._closing))]
        code = 0
        try:
            # ---- join
            rt.set_state("joining")
            self._set_server_state("joining")
            await self.announcer.refresh_peers()
            if not restored:
                await self._join_state()
            rt.set_state("online")
            self._set_server_state("online")
            self.announcer.poke()
            announce_line(f"online: stage {self.index}, version {rt.version}")
            if rt.is_head:
                bg.append(asyncio.ensure_future(rt.drive()))
            bg.append(asyncio.ensure_future(self._steps_watch()))
            await self._stop.wait()
        finally:
            code = await self._shutdown(bg)
        return code

    def _watch_connections(self):
        """The daemon's connections (direct or relayed, by the stage each peer holds) and its
        hole punches, for the metrics (``node.net.connections``)."""

        def stage_of(peer: str) -> str | None:
            p = self.router.peers.get(peer)
            return str(p.stage) if p is not None and p.in_dht else None

        tracker = ConnectionTracker(stage_of=stage_of)
        self.metrics.attach_connections(tracker.snapshot)
        url = getattr(self.dht, "daemon_metrics_url", None)
        if url:
            self.metrics.attach_holepunch(DaemonMetrics(url).holepunch)
        return tracker

    async def _join_state(self, attempts: int = 6, wait_s: float = 10.0, max_busy_s: float = 3600.0) -> None:
        """A new replica's weights: downloaded from the online replicas of its stage (verified by
        agreement, ``--verify-state``), or the run seed's initialisation when there are none. When
        the replicas' weights cannot be trusted (two that disagree, say) it waits for more replicas
        and tries again, then gives up with one line. While every replica answers ``busy`` (a
        morphing swarm serves a new peer two epochs after it appeared) it waits, up to ``max_busy_s``."""
        rt = self.runtime
        attempt, busy_since = 0, None
        while attempt < attempts:
            if not self.router.stage_peers(self.index):
                return  # the first replica of its stage: starts from the seed's initialisation
            t0 = time.monotonic()
            try:
                got = await rt.sync_from_replicas()
            except StateSyncError as e:
                if e.busy and (busy_since is None or time.monotonic() - busy_since < max_busy_s):
                    if busy_since is None:
                        busy_since = time.monotonic()
                        announce_line(f"waiting for stage {self.index} state: {e}")
                    await asyncio.sleep(2.0)
                    await self.announcer.refresh_peers()
                    continue
                attempt += 1
                log.error("stage %d state: %s (attempt %d of %d)", self.index, e, attempt, attempts)
                if attempt == attempts:
                    raise CliError(f"could not get trustworthy stage {self.index} state from the online replicas "
                                   f"({e}); check connectivity to them and retry later") from None
                await asyncio.sleep(wait_s)
                await self.announcer.refresh_peers()
                continue
            how = (f"verified against {len(got.distances) - 1 - len(got.refused)} other replica(s)" if got.verified
                   else "UNCONFIRMED: one replica, checked against its signed record only")
            log.info("stage %d state ready in %.2f s (%s)", self.index, time.monotonic() - t0, how)
            announce_line(f"downloaded stage {self.index} state at version {got.version} from {got.source} ({how})")
            for peer in got.refused:
                announce_line(f"refused the stage {self.index} state of {peer}: it disagrees with the other replicas")
            return

    def _on_signal(self, sig) -> None:
        if self._stop.is_set():
            log.warning("second %s: leaving without draining", signal.Signals(sig).name)
            if self.runtime is not None:
                self.runtime.abandon()
        log.info("%s received: draining and leaving", signal.Signals(sig).name)
        self._stop.set()

    def _set_server_state(self, state: str) -> None:
        if self.server is not None:
            self.server.set_state(state)
            self.server.details = {"stage": self.index, "version": self.runtime.version}

    async def _steps_watch(self) -> None:
        rt = self.runtime
        while self.cfg.steps and not self._closing:
            if rt.version >= self.cfg.steps and (not rt.is_head or rt.inflight == 0):
                log.info("reached %d steps: leaving", rt.version)
                self._stop.set()
                return
            await asyncio.sleep(0.2)

    async def _shutdown(self, bg) -> int:
        """Drain, announce offline, stop the background tasks, close the stage (last checkpoint),
        stop serving. Bounded by --drain-timeout (+ ``FORCE_EXIT_GRACE_S``)."""
        rt, cfg = self.runtime, self.cfg
        t0 = time.monotonic()
        # whatever happens below, this process is gone within the bound
        watchdog = threading.Timer(cfg.drain_timeout + FORCE_EXIT_GRACE_S, self._force_exit)
        watchdog.daemon = True
        watchdog.start()
        self._set_server_state("draining")
        rt.set_state("draining")
        self.announcer.poke()  # tell the swarm at once, so routers stop sending us work
        await asyncio.sleep(0)
        drained = await rt.drain(cfg.drain_timeout)
        log.info("drain %s in %.1f s", "complete" if drained else "timed out", time.monotonic() - t0)
        if self.dht.is_alive():
            await self.announcer.announce(state="offline", ttl=max(2 * cfg.announce_every, 5.0),
                                          timeout=OFFLINE_ANNOUNCE_TIMEOUT_S)
        self._closing = True
        self.announcer.close()
        await cancel_all(bg)
        await self.slot.close()
        self._set_server_state("offline")
        try:
            await asyncio.wait_for(self.transport.close(), TRANSPORT_CLOSE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            log.warning("transport close: %r", e)
        log.info("left the swarm after %.1f s of shutdown", time.monotonic() - t0)
        watchdog.cancel()
        return 0

    def _force_exit(self) -> None:
        """Watchdog (a thread): the orderly shutdown is stuck; stop the DHT and p2pd, and exit."""
        log.error("shutdown did not finish within %.0f s: forcing exit", self.cfg.drain_timeout + FORCE_EXIT_GRACE_S)
        try:
            stop_dht(self.dht, timeout=3.0)
        finally:
            fast_exit(1)
