"""What a node holds for its stage, together in one ``StageSlot``: the stage's model and optimizer,
the data shard (stage 0), the replica averager, the runtime that trains it, the checkpoints it
writes and the logs it keeps. The node's lifecycle (``node.daemon.node``) owns one slot; keeping
every stage-specific part here is what would let a node close one slot and open another for a
different stage without leaving the swarm.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from node.net import ReplicaAverager, averaging_prefix
from node.base import CheckpointError, CliError, save_checkpoint
from node.ops import announce_line
from node.daemon.verifier import make_attacks, make_verifier
from node.runtime import RuntimeOptions, StageRuntime, new_microbatch_rng
from stages import Batches, DataError, build_optimizer, build_stage, load_corpus

log = logging.getLogger("swarm_node.daemon")

FINAL_CHECKPOINT_TIMEOUT_S = 30.0  # the compute worker's copy of the state for the last checkpoint


def _append_log(path: str, flag: str):
    """``path`` opened for appending JSON lines (None when unset); a clear error if it cannot be."""
    if not path:
        return None
    try:
        return open(path, "a", encoding="utf-8")
    except OSError as e:
        raise CliError(f"{flag} {path}: cannot open it ({e.strerror})") from None


class StageSlot:
    """Stage ``index`` of the run as this node holds it. ``build()`` on the main thread (hivemind's
    averager forks), ``start(transport)`` on the event loop, ``close()`` when leaving."""

    def __init__(self, cfg, manifest, index: int, device, *, dht, router, metrics, server, peer_id: str,
                 checkpoint=None):
        self.cfg, self.m, self.index, self.device = cfg, manifest, index, device
        self.dht, self.router, self.metrics, self.server, self.peer_id = dht, router, metrics, server, peer_id
        self.checkpoint = checkpoint  # (step, tensors, meta) to resume from, until the runtime took it
        self.runtime: StageRuntime | None = None
        self.averager = None
        self.step_log = self.verdict_log = None
        self._ckpt_pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")

    # ---- synchronous part (main thread)

    def build(self) -> None:
        """The model, the optimizer, the data shard, the averager, the attacks (testing) and the
        logs. The runtime itself is built in ``start`` once the transport exists."""
        import torch

        cfg, m, index = self.cfg, self.m, self.index
        self.stage = build_stage(m, index, device=self.device)
        self.optimizer = build_optimizer(m, self.stage)
        self.batches = self._batches() if index == 0 else None
        self.averager = self._averager() if cfg.averaging else None
        if self.averager is not None:
            self.metrics.attach_averaging(lambda: self.averager.stats.as_dict())
        self.attacks = None
        if cfg.attack:
            self.attacks = make_attacks(cfg.attack, seed=cfg.seed)
            log.warning("TESTING: this node poisons what it sends with the %r attack", cfg.attack)
        self.step_log = _append_log(cfg.json_log, "--json-log")
        self.verdict_log = _append_log(cfg.verdict_log, "--verdict-log")
        torch.manual_seed(cfg.seed or int.from_bytes(os.urandom(4), "little"))

    def _batches(self):
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

    def _averager(self):
        a = self.m.asyncmesh
        try:
            avg = ReplicaAverager(
                self.dht, [p for _, p in self.stage.named_parameters()], optimizer=self.optimizer,
                prefix=averaging_prefix(self.m.run.id, self.index, self.m.run.organiser),
                fraction=a.avg_fraction, every=a.avg_every,
                seed=self.m.run.seed + self.index, correction=a.avg_correction, timeout=a.avg_timeout_s,
                period=a.avg_period_s, blend_steps=a.avg_blend_steps,
                peers_fn=lambda: self.router.count_by_stage(self.m.n_stages)[self.index] + 1,
                epoch_fn=lambda: self.runtime.trainer.epoch if self.runtime is not None else 0,
                # only peers holding a live signed record for this stage share a group with us
                members_fn=lambda: {p.peer_id for p in self.router.stage_peers(self.index)},
            )
            avg.start()
        except Exception as e:  # noqa: BLE001 - training works without averaging; say so
            log.warning("replica averaging is off: %r", e)
            return None
        return avg

    # ---- on the event loop

    async def start(self, transport) -> StageRuntime:
        """The stage runtime over ``transport``, resumed from the checkpoint if there is one, started."""
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
        self.runtime = rt
        await rt.start()
        return rt

    async def close(self) -> None:
        """Write the last checkpoint, stop the runtime, close the logs and the averager."""
        rt, loop = self.runtime, asyncio.get_running_loop()
        if rt is not None:
            if self.cfg.checkpoint_dir and rt.version > 0:
                try:
                    tensors, meta = await asyncio.wait_for(rt.worker.submit("ctl", rt.checkpoint_state),
                                                           FINAL_CHECKPOINT_TIMEOUT_S)
                    await loop.run_in_executor(self._ckpt_pool, self._save, rt.version, tensors, meta)
                except Exception as e:  # noqa: BLE001
                    log.error("final checkpoint failed: %r", e)
            await rt.stop()
        self._ckpt_pool.shutdown(wait=True)
        for f in (rt.step_log if rt is not None else self.step_log, self.verdict_log):
            if f is not None:
                f.close()
        if self.averager is not None:
            await loop.run_in_executor(None, self.averager.close)

    # ---- checkpoints

    def _save_async(self, step: int, tensors: dict, meta: dict) -> None:
        """Called by the compute worker after a step: write in the background (in order)."""
        self._ckpt_pool.submit(self._save, step, tensors, meta)

    def _save(self, step: int, tensors: dict, meta: dict) -> None:
        try:
            path = save_checkpoint(self.cfg.checkpoint_dir, step, tensors, meta)
        except CheckpointError as e:
            log.error("%s", e)
            return
        self.metrics.checkpoint_step.set(step)
        self.metrics.checkpoint_time.set(time.time())
        log.info("checkpoint step %d -> %s", step, path)
