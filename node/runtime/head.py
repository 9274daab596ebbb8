"""The head's driver: stage 0 draws microbatches from its own data shard and keeps at most
``max_inflight`` of them in flight (``StepPolicy``); at the version that begins the next morph
epoch it lets the ones in flight come back first, then enters the epoch."""

from __future__ import annotations

import asyncio
import contextlib
import time

import torch

from node.runtime.options import Context


class HeadDriver:
    """The head's part of ``pipeline.Pipeline`` (a mixin: it uses the pipeline's contexts, worker,
    trainer, router, morph epochs, failure log and its ``_forward``/``_finish``)."""

    def _new_mb(self) -> int:
        while True:
            mb = self.rng.getrandbits(63)
            if mb not in self.contexts and mb not in self.pending:
                return mb

    async def drive(self) -> None:
        """Head: inject microbatches from our data shard while the step policy allows."""
        assert self.is_head and self.batches is not None
        policy = self.trainer.policy
        while not self.stopping:
            if self.options.steps and self.trainer.version >= self.options.steps:
                return
            if self.morph.due() and not await self._enter_next_epoch():
                continue
            ready = (
                self.state() == "online"
                and policy.may_inject(self.inflight)
                and (self.is_tail or bool(self.router.stage_peers(1)))  # not choose(): it counts cool-downs
            )
            if not ready:
                self.wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), 0.25)
                continue
            mb = self._new_mb()
            ids = next(self.batches)
            self.inflight += 1
            policy.injected()
            self.pending.add(mb)
            fut = self.worker.submit("fwd", self.trainer.compute_head, ids)
            self.tasks.spawn(self._after_head(fut, mb, ids))

    async def _enter_next_epoch(self, drain_s: float = 10.0) -> bool:
        """Head, at the version that begins the next morph epoch: stop injecting, let the microbatches
        in flight come back (at most ``drain_s``; whatever is left is dropped by the fold), then
        enter the epoch. False (after a short wait) while the seeds are not here yet."""
        deadline = time.monotonic() + drain_s
        while self.inflight and time.monotonic() < deadline and not self.stopping:
            self.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), 0.1)
        if await self.morph.enter(self.morph.epoch + 1):
            return True
        await asyncio.sleep(0.1)
        return False

    async def _after_head(self, fut: asyncio.Future, mb: int, ids_cpu: torch.Tensor) -> None:
        try:
            code, ids, w, version, epoch = await fut
        except Exception as e:  # noqa: BLE001 - logged and counted; the head goes on with the next one
            self.failures.record("head", e, f"mb {mb:x}")
            self.pending.discard(mb)
            self.inflight = max(0, self.inflight - 1)
            self.wake.set()
            return
        self.pending.discard(mb)
        ctx = Context(mb, (self.peer_id,), None, ids, ids_cpu.to(torch.int32), w, version, epoch=epoch)
        if self.is_tail:
            self._finish(ctx, "done")
            return
        self.contexts[mb] = ctx
        self.metrics.inflight.set(len(self.contexts))
        await self._forward(ctx, code)
