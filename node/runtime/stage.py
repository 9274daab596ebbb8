"""Stage runtime: one pipeline stage trained asynchronously from the frames that reach it.

``StageRuntime`` is the coordinator: it builds the parts, serves the stream protocols, owns the
stage's state (``starting`` → ``joining`` → ``online`` → ``draining``) and its lifecycle. The
parts each do one job and get only what they need:

- ``worker.ComputeWorker``: the one thread all torch work runs on (control > gradients > forwards);
- ``trainer.Trainer``: forward/backward compute, optimizer steps, look-ahead horizon, state;
- ``guard.Guard``: SENTINEL verdicts, bans, the downstream rule, re-sync while banned;
- ``pipeline.Pipeline`` and ``sends.Sender``: fwd/bwd handlers, contexts, sends with retries,
  the head's driver;
- ``liveness.Liveness``: context TTL, health probes, redial;
- ``morph.MorphEpochs``: the morph epoch, its seeds and when the stage enters the next one.

How one microbatch travels through them is in README.md ("One microbatch") and docs/NODE.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from typing import Callable

import torch

from node.net import StateSyncError, Verified, fetch_verified, serve_state
from node.runtime.guard import Guard
from node.runtime.liveness import Liveness
from node.runtime.morph import MorphEpochs, morph_every
from node.runtime.options import RuntimeOptions, max_batch_for
from node.runtime.pipeline import Pipeline
from node.runtime.sends import Sender
from node.runtime.trainer import Checkpointer, Trainer
from node.runtime.worker import ComputeWorker, Tasks
from protocol import BWD, FWD, HEALTH, MORPH, STATE, Expect, Limits, Reason, make_health, validate_health_request
from security import poison_state
from stages import Manifest, manifest_hash

log = logging.getLogger("swarm_node.runtime")


def neighbour_bytes(role_bytes: dict[tuple[str, str, str], int], index: int,
                    n_stages: int) -> dict[tuple[str, str], int]:
    """Fold the transport's ``{(protocol, role, direction): bytes}`` into ``{(peer stage,
    direction): bytes}`` for stage ``index``. Which stage a protocol's bytes went to follows from
    who opened the exchange: our ``fwd`` goes to stage ``index + 1`` and the ``fwd`` we serve comes
    from ``index - 1``; ``bwd`` the other way; ``state`` is between replicas of one stage. Replies
    count with their request. ``health`` is left out (it goes both ways and is a few bytes)."""
    towards = {(FWD, "client"): index + 1, (FWD, "server"): index - 1,
               (BWD, "client"): index - 1, (BWD, "server"): index + 1,
               (STATE, "client"): index, (STATE, "server"): index}
    out: dict[tuple[str, str], int] = {}
    for (protocol, role, direction), n in role_bytes.items():
        stage = towards.get((protocol, role))
        if stage is None or not 0 <= stage < n_stages:
            continue
        key = (str(stage), direction)
        out[key] = out.get(key, 0) + n
    return out


class StageRuntime:
    """One stage of one run: its parts, its protocols, its state and lifecycle."""

    def __init__(
        self,
        manifest: Manifest,
        index: int,
        stage: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        transport,
        router,
        metrics,
        verifier,
        peer_id: str,
        device: torch.device | str = "cpu",
        options: RuntimeOptions | None = None,
        batches=None,
        averager=None,
        checkpointer: Checkpointer | None = None,
        rng: random.Random | None = None,
        attacks: dict | None = None,
        step_log=None,
        verdict_log=None,
    ):
        self.manifest, self.index, self.peer_id = manifest, index, peer_id
        self.is_head, self.is_tail = index == 0, index == manifest.n_stages - 1
        self.options = options = options or RuntimeOptions()
        self.transport, self.router, self.metrics = transport, router, metrics
        self.batches = batches
        self.run_id, self.mhash = manifest.run.id, manifest_hash(manifest)
        self.max_batch = max_batch_for(manifest)
        self.state = "starting"
        self.started_at = time.monotonic()
        self.status_cache: dict = {}  # read by the metrics server's thread (/status)
        self.state_syncs: dict[str, int] = {}  # state sync outcome -> count (``sync_from_replicas``)
        self.last_state_sync: dict | None = None
        self.worker = ComputeWorker(name=f"compute-stage{index}")
        self.tasks = Tasks()
        self.trainer = Trainer(
            manifest, index, stage, optimizer, metrics=metrics, peer_id=peer_id, device=torch.device(device),
            options=options, busy_seconds=lambda: self.worker.busy_s,
            data_step=lambda: batches.step if batches is not None else 0,
            averager=averager, checkpointer=checkpointer, step_log=step_log,
        )
        self.guard = Guard(index, manifest.sentinel, options, verifier=verifier, router=router, metrics=metrics,
                           tasks=self.tasks, resync=self.resync_from_replica, verdict_log=verdict_log)
        attacks = dict(attacks or {})
        self.state_attack = attacks.pop("state", None)  # testing a joiner's check only: serve poisoned weights
        self.morph = MorphEpochs(morph_every(manifest), self.run_id, self.mhash, index, manifest.n_stages, peer_id,
                                 options, transport=transport, router=router, metrics=metrics, worker=self.worker,
                                 trainer=self.trainer, tasks=self.tasks, state=lambda: self.state,
                                 drop_all=lambda why, reason: self.pipeline.drop_all(why, reason),
                                 resync=self._morph_resync)
        self.sender = Sender(index, self.run_id, self.mhash, options, transport=transport, router=router,
                             metrics=metrics, guard=self.guard, version=lambda: self.trainer.version,
                             suspect=lambda peer: self.liveness.suspect(peer), morph=self.morph, attacks=attacks)
        k, seq_len, n = manifest.k, manifest.model.seq_len, manifest.n_stages
        self.pipeline = Pipeline(
            index, n, peer_id, options,
            expect_fwd=Expect.fwd(self.run_id, self.mhash, index, k, self.max_batch, seq_len) if index > 0 else None,
            expect_bwd=(Expect.bwd(self.run_id, self.mhash, index, k, self.max_batch, seq_len, self_peer=peer_id)
                        if index < n - 1 else None),
            worker=self.worker, trainer=self.trainer, guard=self.guard, sender=self.sender, router=router,
            metrics=metrics, tasks=self.tasks, state=lambda: self.state, morph=self.morph, batches=batches, rng=rng,
        )
        self.liveness = Liveness(options, transport=transport, router=router, metrics=metrics, tasks=self.tasks,
                                 contexts=self.pipeline.contexts, drop=self.pipeline.drop,
                                 lose_next_hop=self.pipeline.lose_next_hop,
                                 neighbours=tuple(s for s in (index - 1, index + 1) if 0 <= s < n))
        metrics.set_stage(index, self.run_id, role="head" if self.is_head else "tail" if self.is_tail else "body")

    # ------------------------------------------------------------------ what others read

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def stage(self) -> torch.nn.Module:
        return self.trainer.stage

    @property
    def inflight(self) -> int:
        """Head: microbatches injected and not yet finished."""
        return self.pipeline.inflight

    @property
    def step_log(self):
        return self.trainer.step_log

    def tokens_per_s(self) -> float:
        return self.trainer.tokens_per_s()

    def capacity_tokens_per_s(self) -> float:
        return self.trainer.capacity_tokens_per_s()

    # ------------------------------------------------------------------ lifecycle

    def set_state(self, state: str) -> None:
        self.state = state
        self.metrics.set_state(state)
        self.pipeline.wake.set()

    async def start(self) -> None:
        """Start the compute worker and serve our protocols (state stays as it is)."""
        self.worker.start()
        self.guard.start()
        self.metrics.attach_compute_busy(lambda: self.worker.busy_s)

        # per-protocol limits: a frame bigger than the largest valid one is refused before allocation
        def body_limit(expect) -> Limits:
            return Limits(max_body_bytes=expect.max_body_bytes() if expect is not None else 0, max_tensors=4)

        small = Limits(max_body_bytes=0, max_tensors=0)
        await self.transport.serve(FWD, self.pipeline.on_fwd, limits=body_limit(self.pipeline.expect_fwd))
        await self.transport.serve(BWD, self.pipeline.on_bwd, limits=body_limit(self.pipeline.expect_bwd))
        await self.transport.serve(HEALTH, self._on_health, limits=small)
        state = functools.partial(serve_state, run=self.run_id, mhash=self.mhash, stage_index=self.index,
                                  state=lambda: self.state, snapshot=self._snapshot, metrics=self.metrics,
                                  wait=self._state_wait)
        await self.transport.serve_stream(STATE, state, limits=small)
        if self.morph.enabled:
            seed_limits = Limits(max_body_bytes=64, max_tensors=1)
            await self.transport.serve(MORPH, self.morph.on_seed, limits=seed_limits)
        self.metrics.version.set(self.version)
        self.metrics.morph_epoch.set(self.morph.epoch)

    async def _snapshot(self) -> tuple[int, dict, int | None]:
        """What state sync serves: the trainer's snapshot and its morph epoch (None with morphing
        off), poisoned by a ``state-*`` test attack."""
        version, tensors, epoch = await self.worker.submit("ctl", self.trainer.snapshot)
        if self.state_attack:
            tensors = poison_state(self.state_attack, tensors, seed=version)
        return version, tensors, self.morph.frame_epoch(epoch)

    def _state_wait(self, peer: str) -> str | None:
        """Why ``peer`` must wait for our state: with morphing on, a peer gets it only after this node
        has seen it for two epoch changes (docs/PROTOCOL.md, "Morph epochs")."""
        wait = self.morph.settle_wait(peer)
        if not wait:
            return None
        return (f"morph: state goes to a peer two epochs after it appeared; {wait} more epoch(s) "
                f"(this stage is in epoch {self.morph.epoch})")

    def abandon(self) -> None:
        """Stop starting anything new (no more injections, sends, probes or re-syncs): the node
        leaves without waiting for what is in flight."""
        self.pipeline.stopping = self.sender.stopping = self.liveness.stopping = True
        self.guard.stopping = True

    async def stop(self) -> None:
        """Cancel background work and stop the worker (call after ``drain``)."""
        self.abandon()
        await self.tasks.cancel()
        await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)
        self.guard.stop()

    async def drain(self, timeout: float) -> bool:
        """Stop taking new work and wait (at most ``timeout`` s) for in-flight microbatches to finish.
        Returns True when everything finished."""
        self.set_state("draining")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.pipeline.busy():
                return True
            await asyncio.sleep(0.05)
        self.pipeline.drop_all("draining")
        return False

    async def drive(self) -> None:
        """Head: inject microbatches from our data shard (``Pipeline.drive``)."""
        await self.pipeline.drive()

    # ------------------------------------------------------------------ state

    def checkpoint_state(self) -> tuple[dict, dict]:
        """Worker (or when nothing runs): CPU copies of model + optimizer state, and the meta."""
        return self.trainer.checkpoint_state()

    def restore(self, tensors: dict, meta: dict) -> None:
        """Load a checkpoint written by ``checkpoint_state`` (before ``start``)."""
        self.trainer.restore(tensors, meta)
        if self.batches is not None:
            self.batches.step = int(meta.get("data_step", 0))

    async def sync_from_replicas(self) -> Verified:
        """Download this stage's current weights from the other online replicas and adopt them
        (between two compute jobs) with the version and morph epoch the sources agree on
        (``node.net.state_verify``): each source's claims are checked against its own signed
        record and the run's, and with ``verify_state`` the weights are taken only when a majority
        of up to three replicas agree on them (parameter distance); a replica whose claims or
        weights are refused is banned (``poisoned-state``). A lone source's state is taken as
        ``unconfirmed``, with a warning. Each outcome (verified, unconfirmed, refused) is counted
        and the last one shown in ``status()``. Optimizer moments are kept (local statistics,
        rebuilt within a few steps). Raises ``StateSyncError`` when no replica gave them or the
        replicas' state cannot be trusted."""
        stage_peers = self.router.stage_peers(self.index)
        peers = [p.peer_id for p in stage_peers]
        records = {p.peer_id: p for p in stage_peers}  # their signed announcements, as the router read them
        run_epochs = [int(e) for p in list(self.router.peers.values())
                      if p.in_dht and p.state == "online" and (e := getattr(p, "epoch", None)) is not None]
        timeout = max(30.0, self.options.request_timeout)
        try:
            got = await fetch_verified(self.transport, peers, self.run_id, self.mhash, self.index, self.stage,
                                       self.metrics, timeout=timeout, records=records, run_epochs=run_epochs,
                                       morphing=self.morph.enabled,
                                       max_sources=3 if self.options.verify_state else 1)
        except StateSyncError as e:
            self._ban_poisoned_state(e.refused)
            if e.untrusted:
                self._note_state_sync("refused", refused=len(e.refused), reason=str(e)[:200])
            raise
        self._ban_poisoned_state(got.refused)
        self._note_state_sync(got.outcome, source=got.source, version=got.version, epoch=got.epoch,
                              agreed=len(got.agreed), refused=len(got.refused))
        before = self.morph.epoch
        await self.worker.submit("ctl", self.trainer.adopt_state, got.version, got.tensors, got.epoch)
        if self.morph.enabled:
            self.morph.adopted(got.epoch)
            if got.epoch != before:
                # what was in flight here is in the old basis
                self.pipeline.drop_all("morph-epoch", Reason.WRONG_EPOCH)
        return got

    def _ban_poisoned_state(self, peers: list[str]) -> None:
        for peer in peers:
            self.router.ban(peer, self.options.state_ban_seconds, "poisoned-state")
            self.metrics.bans.labels(cause="poisoned-state").inc()

    def _note_state_sync(self, outcome: str, **detail) -> None:
        """Count one state sync's outcome (``verified``, ``unconfirmed``, ``refused``) and keep the
        last one for ``status()``."""
        self.state_syncs[outcome] = self.state_syncs.get(outcome, 0) + 1
        self.last_state_sync = {"outcome": outcome, **detail}
        counter = getattr(self.metrics, "state_syncs", None)  # swarm_node_state_sync_total, where declared
        if counter is not None:
            counter.labels(outcome=outcome).inc()

    async def resync_from_replica(self) -> bool:
        """Catch this replica's weights up with the others' (``sync_from_replicas``) after a ban, or
        after the next stage refused its outputs (``Guard``); False when that was not possible."""
        before = self.version
        try:
            got = await self.sync_from_replicas()
        except StateSyncError as e:
            log.info("re-sync from a replica: %s", e)
            return False
        log.info("re-synced stage %d weights from %s (version %d -> %d)", self.index, got.source[-8:],
                 before, got.version)
        return True

    async def _morph_resync(self) -> bool:
        """This stage fell behind the swarm's morph epoch (a seed missed): take an online replica's
        state, which is in the current basis; False when no replica gave it (then it waits)."""
        before = self.morph.epoch
        try:
            got = await self.sync_from_replicas()
        except StateSyncError as e:
            log.warning("morph: stage %d is behind (epoch %d) and could not re-download its state: %s", self.index,
                        before, e)
            return False
        log.info("morph: re-synced stage %d from %s: epoch %d -> %d, version %d", self.index, got.source[-8:],
                 before, got.epoch, got.version)
        return True

    # ------------------------------------------------------------------ status and maintenance

    def status(self) -> dict:
        """The node at a glance (health protocol reply and the metrics server's ``/status``)."""
        out = {
            "peer": self.peer_id, "run": self.run_id, "manifest": self.mhash, "stage": self.index,
            "state": self.state, "version": self.version, "queue": self.worker.depth("fwd"),
            "inflight": len(self.pipeline.contexts), "uptime_s": round(time.monotonic() - self.started_at, 1),
            "loss": self.trainer.last_loss, "tokens_per_s": round(self.tokens_per_s(), 2),
            "banned": len(self.router.banned()),
        }
        if self.last_state_sync is not None:
            out["state_sync"] = {**self.last_state_sync, "counts": dict(self.state_syncs)}
        if self.trainer.pipeline_horizon:
            out["lookahead_horizon"] = round(self.trainer.lookahead.extrapolation, 2)
        if self.morph.enabled:
            out["morph_epoch"] = self.morph.epoch
            out["morph_seconds"] = round(self.morph.last_cost_s, 4)
        rtts = sorted(self.pipeline.rtts)
        if rtts:
            out["mb_rtt_p50_ms"] = round(1000 * rtts[len(rtts) // 2], 2)
            out["mb_rtt_p99_ms"] = round(1000 * rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))], 2)
            out["mb_rtt_samples"] = len(rtts)
        return out

    def neighbour_bytes(self) -> dict[tuple[str, str], int]:
        """``{(peer stage, direction): bytes}`` on the wire with the peers of each neighbour stage
        (and of our own stage: state sync), from the transport's counters (``neighbour_bytes``)."""
        role_bytes = getattr(getattr(self.transport, "stats", None), "role_bytes", None)
        return neighbour_bytes(dict(role_bytes or {}), self.index, self.manifest.n_stages)

    async def _on_health(self, frame, peer: str):
        validate_health_request(frame)
        return make_health(self.status())

    def sweep(self) -> None:
        """One maintenance beat: context TTLs and probes, morph seeds, then the gauges and the status cache."""
        self.liveness.sweep()
        self.morph.sweep()
        self.pipeline.prune_routes()
        self.metrics.tokens_per_s.set(self.tokens_per_s())
        self.metrics.capacity.set(self.capacity_tokens_per_s())
        self.metrics.banned_peers.set(len(self.router.banned()))
        if self.metrics.peer_rtt is not None:
            for p in list(self.router.peers.values()):
                if p.rtt_ema is not None:
                    self.metrics.peer_rtt.labels(peer=p.peer_id, stage=str(p.stage)).set(p.rtt_ema)
        self.pipeline.update_gauges()
        self.status_cache = self.status()

    async def maintain(self, beat: Callable[[], None] | None = None, period: float = 0.5) -> None:
        while not self.pipeline.stopping:
            self.sweep()
            if beat is not None:
                beat()
            await asyncio.sleep(period)
