"""`swarm-node run`: the daemon that holds one pipeline stage, joins the swarm and trains.

Start-up is a straight line, and every step that can fail because of the operator fails with
one line naming what is wrong and how to fix it (``node.ops.cli.CliError``), before anything is
left running:

1. settings: flags > ``SWARM_NODE_*`` env > ``--config`` TOML > defaults (``node.ops.config``);
2. pre-flight: manifest, identity key permissions, listen and metrics ports free, device;
3. identity not already online (a throwaway daemon dials the key's peer id);
4. DHT + p2pd, bootstrapped from ``--initial-peers`` with retries (``node.net.membership``);
5. the swarm's manifest: same hash, or refuse naming the differing fields; publish if first;
6. stage: forced, from our checkpoint, or ``auto`` (least announced capacity);
7. memory: the stage must fit in the device's free memory (numbers in the error);
8. build the stage, restore the newest valid checkpoint, or download the weights from an online
   replica (``joining`` -> ``online``), serve fwd/bwd/state/health, announce, train.

SIGTERM/SIGINT: stop injecting, drain in-flight microbatches (bounded by ``--drain-timeout``),
write a checkpoint, announce ``offline``, stop p2pd, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from node.ops import CliError, announce_line, check_port_free, check_signed, fast_exit, uvloop_runner
from node.ops import config as node_config

log = logging.getLogger("swarm_node.daemon")


def _append_log(path: str, flag: str):
    """``path`` opened for appending JSON lines (None when unset); a clear error if it cannot be."""
    if not path:
        return None
    try:
        return open(path, "a", encoding="utf-8")
    except OSError as e:
        raise CliError(f"{flag} {path}: cannot open it ({e.strerror})") from None


def add_arguments(parser) -> None:
    node_config.add_arguments(parser)


def main(args) -> int:
    try:
        cfg = node_config.resolve_config(args)
        code = run_node(cfg)
    except CliError as e:
        print(f"swarm-node: error: {e}", file=sys.stderr)
        code = 2
    fast_exit(code)
    return code  # not reached


# ---------------------------------------------------------------- the node


def run_node(cfg: node_config.NodeConfig) -> int:
    import torch

    from node.net import (
        BootstrapError,
        ForgeryCounter,
        IdentityInUse,
        ManifestMismatch,
        Membership,
        anonymous_identity_in_use,
        check_identity,
        choose_stage,
        ephemeral_identity,
        start_dht,
        start_failure_line,
        stop_dht,
    )
    from node.ops import (
        CheckpointError,
        MetricsServer,
        NodeMetrics,
        PortInUse,
        available_device_bytes,
        estimate_stage_memory,
        fmt_bytes,
        load_latest_checkpoint,
        resolve_device,
    )
    from stages import ManifestError, load_manifest, manifest_hash

    t_start = time.monotonic()
    try:
        manifest = load_manifest(cfg.manifest)
    except ManifestError as e:
        raise CliError(f"--manifest {cfg.manifest}: {e}") from None
    check_signed(manifest, cfg.manifest, cfg.allow_unsigned)
    if cfg.stage != "auto" and int(cfg.stage) >= manifest.n_stages:
        raise CliError(f"--stage {cfg.stage}: the manifest has {manifest.n_stages} stages (0..{manifest.n_stages - 1})")
    if cfg.attack:
        from security import AttackNotAllowed, check_attack_allowed

        try:
            check_attack_allowed(cfg.attack, manifest.sentinel.allow_attacks, cfg.allow_attacks)
        except (AttackNotAllowed, ValueError) as e:
            raise CliError(str(e)) from None
    if cfg.identity:
        check_identity(cfg.identity)  # CliError: missing, world-readable, not a key
    for host, port in node_config.tcp_ports(cfg.host_maddrs):
        check_port_free(host, port, "listen", "--host-maddrs")
    try:
        device = torch.device(resolve_device(cfg.device))
    except ValueError as e:
        raise CliError(str(e)) from None
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)

    metrics = NodeMetrics(run=manifest.run.id, peer_labels=cfg.peer_labels)
    server = None
    if cfg.metrics_port >= 0:
        if cfg.metrics_port:
            check_port_free(cfg.metrics_host, cfg.metrics_port, "metrics", "--metrics-port")
        try:
            server = MetricsServer(metrics, cfg.metrics_host, cfg.metrics_port)
        except PortInUse:
            raise CliError(
                f"metrics port {cfg.metrics_port} on {cfg.metrics_host} is already in use; "
                "choose another with --metrics-port (0: any free port, -1: no metrics)"
            ) from None
        server.start()
        announce_line(f"metrics at {server.url}/metrics (health {server.url}/healthz, ready {server.url}/readyz)")

    dht = None
    # every node signs its DHT records with its libp2p key: one without --identity gets a fresh key
    # for this run only, in a private temporary directory removed at exit
    identity = cfg.identity or str(ephemeral_identity())
    forgeries = ForgeryCounter()
    try:
        if cfg.identity and cfg.initial_peers:
            from node.net import p2p_options

            in_use = asyncio.run(anonymous_identity_in_use(
                cfg.identity, cfg.initial_peers, timeout=5.0, startup_timeout=cfg.bootstrap_timeout,
                host_maddrs=["/ip4/127.0.0.1/tcp/0"] if cfg.local else ["/ip4/0.0.0.0/tcp/0"],
                **p2p_options(cfg.local)))
            # None: the check's daemon did not start (e.g. no initial peer answered it); the join
            # below retries and, if it fails too, says why in the same one line as without --identity
            if in_use:
                raise CliError(
                    f"identity {cfg.identity} is already online in this swarm (another node runs with this key); "
                    "stop that node first, or give this one its own key: swarm-node keygen NEWKEY"
                )
        try:
            dht = start_dht(cfg.initial_peers, cfg.host_maddrs, cfg.announce_maddrs, identity, local=cfg.local,
                            retries=cfg.bootstrap_retries, timeout=cfg.bootstrap_timeout, forgeries=forgeries)
        except (BootstrapError, IdentityInUse) as e:
            raise CliError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - p2pd refused to start: say why in one line
            raise CliError(start_failure_line(e, cfg.host_maddrs)) from None
        peer_id = dht.peer_id.to_base58()
        maddrs = [str(a) for a in dht.get_visible_maddrs()]
        membership = Membership(dht, manifest, ttl=max(4 * cfg.announce_every, 10.0))
        metrics.attach_forgeries(lambda: {
            **{(kind, "signature"): n for kind, n in forgeries.snapshot().items()},
            **{(kind, "binding"): n for kind, n in membership.forged.items()},
        })
        try:
            had_manifest = membership.check_and_publish_manifest()
        except ManifestMismatch as e:
            raise CliError(str(e)) from None
        log.info("%s manifest %s of run %s", "joined swarm with" if had_manifest else "published",
                 manifest_hash(manifest)[:12], manifest.run.id)

        # ---- stage: forced, our checkpoint's, or the least served one
        found = None
        if cfg.checkpoint_dir:
            try:
                found = load_latest_checkpoint(cfg.checkpoint_dir)
            except CheckpointError as e:
                raise CliError(f"--checkpoint-dir {cfg.checkpoint_dir}: {e}") from None
        if found is not None:
            ck_step, ck_tensors, ck_meta = found
            if ck_meta.get("manifest_hash") != manifest_hash(manifest) or ck_meta.get("kind") != "node":
                raise CliError(
                    f"--checkpoint-dir {cfg.checkpoint_dir}: its newest checkpoint (step {ck_step}) belongs to another "
                    "run or manifest; use an empty directory for this run"
                )
            ck_stage = int(ck_meta.get("stage", -1))
            if cfg.stage != "auto" and int(cfg.stage) != ck_stage:
                raise CliError(
                    f"--stage {cfg.stage}: the checkpoint in {cfg.checkpoint_dir} is of stage {ck_stage}; "
                    f"use --stage {ck_stage} (or auto) or another --checkpoint-dir"
                )
        peers = membership.peers()
        if found is not None:
            index = ck_stage
        elif cfg.stage == "auto":
            index = choose_stage(peers, manifest.n_stages)
            log.info("--stage auto: chose stage %d of %d", index, manifest.n_stages)
        else:
            index = int(cfg.stage)

        # ---- memory
        need = estimate_stage_memory(manifest, index)
        free = available_device_bytes(str(device))
        if need.total_bytes > free:
            raise CliError(
                f"stage {index} needs about {fmt_bytes(need.total_bytes)} ({need.params:,} parameters: "
                f"{fmt_bytes(need.param_bytes)} with optimizer state, + {fmt_bytes(need.activation_bytes)} "
                f"activations) but {device} has {fmt_bytes(free)} free; use a bigger device or a smaller stage"
            )

        node = Node(cfg, manifest, index, device, dht, membership, metrics, server, peer_id, maddrs,
                    checkpoint=found)
        node.setup()
        announce_line(f"peer {peer_id} holds stage {index}/{manifest.n_stages} of run {manifest.run.id}; "
                       f"listening on {' '.join(maddrs)}")
        log.info("start-up took %.1f s", time.monotonic() - t_start)
        with uvloop_runner() as runner:
            code = runner.run(node.serve())
        return code
    finally:
        t_stop = time.monotonic()
        if dht is not None:
            stop_dht(dht)
        if server is not None:
            server.close()
        if not cfg.identity:
            shutil.rmtree(os.path.dirname(identity), ignore_errors=True)
        log.info("p2p daemon and DHT stopped in %.1f s", time.monotonic() - t_stop)


class Node:
    """Everything one running node owns; ``serve()`` is its life on the event loop."""

    def __init__(self, cfg, manifest, index, device, dht, membership, metrics, server, peer_id, maddrs,
                 checkpoint=None):
        self.cfg, self.m, self.index, self.device = cfg, manifest, index, device
        self.dht, self.membership, self.metrics, self.server = dht, membership, metrics, server
        self.peer_id, self.maddrs = peer_id, maddrs
        self.checkpoint = checkpoint
        self.runtime = None
        self.averager = None
        self._ckpt_pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._stop = None
        self._announce_now = None
        self._closing = False
        self._isolated_since: float | None = None  # since when the DHT has had no neighbour
        self._had_neighbours = False

    # ---- synchronous part (main thread: hivemind's averager forks)

    def setup(self) -> None:
        """What must happen on the main thread before the event loop: the model, the optimizer,
        the data shard, the averager (hivemind's forks), the checkpoint to resume and the step log.
        The runtime itself is built in ``serve`` once the transport exists."""
        import torch

        from node.net import Router
        from node.runtime import new_microbatch_rng
        from stages import build_optimizer, build_stage

        m, index = self.m, self.index
        self.stage = build_stage(m, index, device=self.device)
        self.optimizer = build_optimizer(m, self.stage)
        self.batches = self._batches() if index == 0 else None
        self.router = Router(self.peer_id, rng=new_microbatch_rng(self.cfg.seed))
        self.averager = self._averager(self.stage, self.optimizer) if self.cfg.averaging else None
        if self.averager is not None:
            self.metrics.attach_averaging(lambda: self.averager.stats.as_dict())
        self.attacks = None
        if self.cfg.attack:
            self.attacks = make_attacks(self.cfg.attack, seed=self.cfg.seed)
            log.warning("TESTING: this node poisons what it sends with the %r attack", self.cfg.attack)
        self.step_log = _append_log(self.cfg.json_log, "--json-log")
        self.verdict_log = _append_log(self.cfg.verdict_log, "--verdict-log")
        torch.manual_seed(self.cfg.seed or int.from_bytes(os.urandom(4), "little"))

    def _runtime(self, transport):
        """The stage runtime over ``transport``, resumed from the checkpoint if there is one."""
        from node.runtime import RuntimeOptions, StageRuntime, new_microbatch_rng

        cfg = self.cfg
        options = RuntimeOptions(
            queue_size=cfg.queue_size, context_ttl=cfg.context_ttl, request_timeout=cfg.request_timeout,
            max_inflight=cfg.max_inflight, steps=cfg.steps, checkpoint_every=cfg.checkpoint_every,
            forward_deadline=max(10.0, cfg.request_timeout * 2), use_amp=self.device.type == "cuda",
            verify_state=cfg.verify_state, ping_every=10.0,
        )
        rt = StageRuntime(
            self.m, self.index, self.stage, self.optimizer, transport=transport, router=self.router,
            metrics=self.metrics, verifier=make_verifier(self.m, self.index), peer_id=self.peer_id,
            device=self.device, options=options, batches=self.batches, averager=self.averager,
            checkpointer=self._save_async if cfg.checkpoint_dir else None, rng=new_microbatch_rng(cfg.seed),
            attacks=self.attacks, step_log=self.step_log, verdict_log=self.verdict_log,
        )
        if self.checkpoint is not None:
            step, tensors, meta = self.checkpoint
            rt.restore(tensors, meta)
            self.metrics.checkpoint_step.set(step)
            announce_line(f"resumed stage {self.index} from checkpoint step {step} in {cfg.checkpoint_dir}")
            self.checkpoint = None
        if self.server is not None:
            self.server.status_fn = lambda: rt.status_cache
        return rt

    def _batches(self):
        from stages import Batches, DataError, load_corpus

        try:
            corpus = load_corpus(self.m.data)
        except DataError as e:
            raise CliError(str(e)) from None
        shard = self.cfg.data_shard
        if shard < 0:
            shard = int.from_bytes(self.peer_id.encode()[-8:], "big") % self.cfg.num_shards
        log.info("data: %s; shard %d of %d", corpus.description, shard, self.cfg.num_shards)
        return Batches(corpus.train, self.m.data.batch_size, self.m.model.seq_len, seed=self.m.run.seed,
                       shard=shard, num_shards=self.cfg.num_shards)

    def _averager(self, stage, optimizer):
        from node.net import ReplicaAverager, averaging_prefix

        a = self.m.asyncmesh
        try:
            avg = ReplicaAverager(
                self.dht, [p for _, p in stage.named_parameters()], optimizer=optimizer,
                prefix=averaging_prefix(self.m.run.id, self.index), fraction=a.avg_fraction, every=a.avg_every,
                seed=self.m.run.seed + self.index, correction=a.avg_correction, timeout=a.avg_timeout_s,
                period=a.avg_period_s, blend_steps=a.avg_blend_steps,
                peers_fn=lambda: self.router.count_by_stage(self.m.n_stages)[self.index] + 1,
                epoch_fn=lambda: self.runtime.trainer.epoch if self.runtime is not None else 0,
            )
            avg.start()
        except Exception as e:  # noqa: BLE001 - training works without averaging; say so
            log.warning("replica averaging is off: %r", e)
            return None
        return avg

    # ---- checkpoints

    def _save_async(self, step: int, tensors: dict, meta: dict) -> None:
        """Called by the compute worker after a step: write in the background (in order)."""
        self._ckpt_pool.submit(self._save, step, tensors, meta)

    def _save(self, step: int, tensors: dict, meta: dict) -> None:
        from node.ops import CheckpointError, save_checkpoint

        try:
            path = save_checkpoint(self.cfg.checkpoint_dir, step, tensors, meta)
        except CheckpointError as e:
            log.error("%s", e)
            return
        self.metrics.checkpoint_step.set(step)
        self.metrics.checkpoint_time.set(time.time())
        log.info("checkpoint step %d -> %s", step, path)

    # ---- the event loop

    async def serve(self) -> int:
        from node.net import PeerRecord, StateSyncError, Transport, poll_connections
        from node.runtime import max_batch_for
        from protocol import Limits

        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._announce_now = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

        p2p = await self.dht.replicate_p2p()
        max_batch = max_batch_for(self.m)
        limits = Limits(max_body_bytes=max(64 << 20, 2 * max_batch * self.m.model.seq_len * (self.m.k * 4 + 8)))
        transport = Transport(p2p, limits=limits, max_streams_per_peer=max(16, 4 * cfg.queue_size))
        self.transport = transport
        restored = self.checkpoint is not None
        self.runtime = rt = self._runtime(transport)
        await rt.start()
        self.metrics.attach_wire_stats(lambda: transport.stats.bytes)
        self.metrics.attach_neighbour_bytes(rt.neighbour_bytes)
        tracker = self._watch_connections()
        bg = [asyncio.ensure_future(self._announce_loop(PeerRecord)),
              asyncio.ensure_future(rt.maintain(beat=self.server.beat if self.server else None)),
              asyncio.ensure_future(poll_connections(transport, tracker, every=2.0,
                                                     stopping=lambda: self._closing))]
        code = 0
        try:
            # ---- join
            rt.set_state("joining")
            self._set_server_state("joining")
            await self._refresh_peers()
            if not restored:
                await self._join_state(rt, StateSyncError)
            rt.set_state("online")
            self._set_server_state("online")
            self._announce_now.set()
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
        from node.net import ConnectionTracker, DaemonMetrics

        def stage_of(peer: str) -> str | None:
            p = self.router.peers.get(peer)
            return str(p.stage) if p is not None and p.in_dht else None

        tracker = ConnectionTracker(stage_of=stage_of)
        self.metrics.attach_connections(tracker.snapshot)
        url = getattr(self.dht, "daemon_metrics_url", None)
        if url:
            self.metrics.attach_holepunch(DaemonMetrics(url).holepunch)
        return tracker

    async def _join_state(self, rt, StateSyncError, attempts: int = 6, wait_s: float = 10.0,
                          max_busy_s: float = 3600.0) -> None:
        """A new replica's weights: downloaded from the online replicas of its stage (verified by
        agreement, ``--verify-state``), or the run seed's initialisation when there are none. When
        the replicas' weights cannot be trusted (two that disagree, say) it waits for more replicas
        and tries again, then gives up with one line. While every replica answers ``busy`` (a
        morphing swarm serves a new peer two epochs after it appeared) it waits, up to ``max_busy_s``."""
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
                    await self._refresh_peers()
                    continue
                attempt += 1
                log.error("stage %d state: %s (attempt %d of %d)", self.index, e, attempt, attempts)
                if attempt == attempts:
                    raise CliError(f"could not get trustworthy stage {self.index} state from the online replicas "
                                   f"({e}); check connectivity to them and retry later") from None
                await asyncio.sleep(wait_s)
                await self._refresh_peers()
                continue
            how = (f"verified against {len(got.distances) - 1 - len(got.refused)} other replica(s)" if got.verified
                   else "unverified: one replica to compare with" if self.cfg.verify_state else "unverified")
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

    async def _refresh_peers(self) -> None:
        try:
            peers = await self.membership.apeers()
        except Exception as e:  # noqa: BLE001 - a DHT hiccup must not stop training
            log.warning("could not read peers from the DHT: %r", e)
            return
        self.router.update(peers)
        self.membership.remember(peers)
        counts = self.router.count_by_stage(self.m.n_stages)
        for s in range(self.m.n_stages):
            own = 1 if (s == self.index and self.runtime.state == "online") else 0
            self.metrics.peers.labels(stage=str(s)).set(counts[s] + own)

    async def _announce(self, PeerRecord, state: str | None = None, ttl: float | None = None,
                        timeout: float = 10.0) -> None:
        rt = self.runtime
        st = state or rt.state
        if st not in ("joining", "online", "draining", "offline"):
            st = "joining"
        rec = PeerRecord(self.peer_id, self.index, st,
                         throughput=rt.tokens_per_s(), capacity=rt.capacity_tokens_per_s(),
                         queue=rt.worker.depth("fwd"), version=rt.version, maddrs=self.maddrs)
        try:
            await self.membership.aannounce(rec, ttl=ttl, timeout=timeout)
        except Exception as e:  # noqa: BLE001
            log.warning("announce failed: %r", e)

    async def _stay_joined(self) -> None:
        """When the DHT lost every neighbour (this node's link was down long enough for every DHT
        request to fail), knock at the bootstrap peers and the peers met before until one answers
        (``Membership.arejoin``); tried again at every announcement until one answers."""
        now = time.monotonic()
        try:
            neighbours = await self.membership.aneighbours()
        except Exception as e:  # noqa: BLE001 - a DHT hiccup must not stop training
            log.debug("could not read the DHT's routing table: %r", e)
            return
        self.metrics.dht_neighbours.set(neighbours)
        if neighbours > 0:
            self._had_neighbours = True
            if self._isolated_since is not None:
                log.info("back in the DHT after %.0f s alone", now - self._isolated_since)
                self._isolated_since = None
            return
        if not self._had_neighbours and not self.cfg.initial_peers:
            return  # the first node of a swarm: alone until someone joins, nobody to knock at
        if self._isolated_since is None:
            self._isolated_since = now
            log.warning("the DHT lost every neighbour (this node's network was down?): rejoining through the "
                        "bootstrap peers and the peers met before")
        try:
            answered = await self.membership.arejoin(self.transport.connect, list(self.cfg.initial_peers))
        except Exception as e:  # noqa: BLE001
            log.debug("rejoin failed: %r", e)
            answered = 0
        if answered:
            self.metrics.dht_rejoins.inc()
            self.metrics.dht_neighbours.set(answered)
            log.info("rejoined the DHT through %d peer(s) after %.0f s alone", answered, now - self._isolated_since)
            self._isolated_since = None

    async def _refresh_maddrs(self) -> None:
        """Announce the addresses p2pd has now: behind NAT, a relay address (``.../p2p-circuit``)
        appears once AutoNAT found this node private and a relay gave it a slot; the others dial
        that (``liveness._redial``). Said once on stdout, as the other announcements."""
        try:
            maddrs = [str(a) for a in await self.transport.p2p.get_visible_maddrs(latest=True)]
        except Exception as e:  # noqa: BLE001 - the old addresses stay announced
            log.debug("could not read our addresses: %r", e)
            return
        if not maddrs or maddrs == self.maddrs:
            return
        relayed = [m for m in maddrs if "/p2p-circuit" in m]
        if relayed and not any("/p2p-circuit" in m for m in self.maddrs):
            announce_line(f"reachable through a relay: {' '.join(relayed)}")
        elif not relayed and any("/p2p-circuit" in m for m in self.maddrs):
            log.info("no relay address any more: %s", " ".join(maddrs))
        self.maddrs = maddrs

    async def _announce_loop(self, PeerRecord) -> None:
        last_manifest = 0.0
        while not self._closing:
            if not self.cfg.local:
                await self._refresh_maddrs()
            await self._stay_joined()
            await self._announce(PeerRecord)
            await self._refresh_peers()
            if time.monotonic() - last_manifest > 4 * self.cfg.announce_every:
                last_manifest = time.monotonic()
                try:
                    await self.membership.arefresh_manifest()
                except Exception as e:  # noqa: BLE001
                    log.warning("manifest refresh: %s", e)
            self._announce_now.clear()
            try:
                await asyncio.wait_for(self._announce_now.wait(), self.cfg.announce_every)
            except asyncio.TimeoutError:
                pass

    async def _shutdown(self, bg) -> int:
        """Drain, checkpoint, announce offline, stop serving. Bounded by --drain-timeout (+ a few s)."""
        from node.net import PeerRecord
        from node.runtime import cancel_all

        rt, cfg = self.runtime, self.cfg
        t0 = time.monotonic()
        # whatever happens below, this process is gone within the bound
        watchdog = threading.Timer(cfg.drain_timeout + 30.0, self._force_exit)
        watchdog.daemon = True
        watchdog.start()
        self._set_server_state("draining")
        rt.set_state("draining")
        self._announce_now.set()  # tell the swarm at once, so routers stop sending us work
        await asyncio.sleep(0)
        drained = await rt.drain(cfg.drain_timeout)
        log.info("drain %s in %.1f s", "complete" if drained else "timed out", time.monotonic() - t0)
        if self.dht.is_alive():
            await self._announce(PeerRecord, state="offline", ttl=max(2 * cfg.announce_every, 5.0), timeout=3.0)
        self._closing = True
        await cancel_all(bg)
        if cfg.checkpoint_dir and rt.version > 0:
            try:
                tensors, meta = await asyncio.wait_for(rt.worker.submit("ctl", rt.checkpoint_state), 30)
                await asyncio.get_running_loop().run_in_executor(self._ckpt_pool, self._save, rt.version,
                                                                 tensors, meta)
            except Exception as e:  # noqa: BLE001
                log.error("final checkpoint failed: %r", e)
        await rt.stop()
        self._ckpt_pool.shutdown(wait=True)
        if rt.step_log is not None:
            rt.step_log.close()
        if self.verdict_log is not None:
            self.verdict_log.close()
        if self.averager is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.averager.close)
        self._set_server_state("offline")
        try:
            await asyncio.wait_for(self.transport.close(), 5)
        except Exception as e:  # noqa: BLE001
            log.warning("transport close: %r", e)
        log.info("left the swarm after %.1f s of shutdown", time.monotonic() - t0)
        watchdog.cancel()
        return 0

    def _force_exit(self) -> None:
        """Watchdog (a thread): the orderly shutdown is stuck; stop the DHT and p2pd, and exit."""
        from node.net import stop_dht

        log.error("shutdown did not finish within %.0f s: forcing exit", self.cfg.drain_timeout + 30.0)
        try:
            stop_dht(self.dht, timeout=3.0)
        finally:
            fast_exit(1)


def make_attacks(name: str, seed: int = 0, **params) -> dict:
    """``--attack NAME`` (testing the verifier only): one attack instance per direction, ``act``
    for what we send forward and ``grad`` for what we send back, so a stateful attack (``delayed``)
    keeps a history of each and never replays an activation as a gradient."""
    from security import STATE_ATTACKS, make_attack, parse_attack

    name, spec_params = parse_attack(name)
    params = {**spec_params, **params}
    if name in STATE_ATTACKS:  # a replica that serves poisoned weights to joiners (testing their check)
        return {"state": name}
    return {d: make_attack(name, seed=2 * seed + i, direction=d, **params) for i, d in enumerate(("act", "grad"))}


def make_verifier(manifest, index: int):
    """The verifier every accepted tensor passes: SENTINEL when the manifest enables it, else the
    basic dtype/shape/finite checks (``security.verifier``)."""
    from node.runtime import max_batch_for
    from security import make_verifier as build

    return build(manifest.sentinel, k=manifest.k, seq_len=manifest.model.seq_len,
                 max_batch=max_batch_for(manifest), seed=manifest.run.seed + index)


if __name__ == "__main__":  # pragma: no cover
    from node.ops import main as cli_main

    sys.exit(cli_main(["run", *sys.argv[1:]]))
