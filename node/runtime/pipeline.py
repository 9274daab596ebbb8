"""The pipeline side of a stage: the ``fwd``/``bwd`` handlers, the contexts of microbatches in
flight, and (at the head) the driver that injects microbatches.

- **Inbound queues are bounded**: a ``fwd`` that finds ``queue_size`` forwards waiting is
  answered ``busy`` at once, and the sender's router tries another replica.
- **Failures** of the stage's compute drop the microbatch (upstream is told to skip it) and are
  logged with their traceback once per kind, then counted (``failures.FailureLog``).
- **Contexts**: for a microbatch in flight a stage keeps only its input, its route, the weights
  version it was forwarded with (``stages.asyncmesh.StageWeights``, the look-ahead snapshot the
  backward must recompute with) and the peer it went to. Each context has a TTL
  (``liveness.Liveness``); a context whose next hop stops answering is dropped at once, and every
  drop sends a ``skip`` upstream so the stages before free theirs too. Nothing waits forever and
  nothing leaks.
- **Head** stages draw microbatches from their own data shard and keep at most ``max_inflight``
  in flight (``StepPolicy``; ``head.HeadDriver``); the **tail** computes the loss from the token
  ids carried in the ``fwd`` frame and starts the backward; gradients go back along the recorded
  route.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
from typing import Callable

import torch

from node.runtime.failures import FailureLog
from node.runtime.guard import Guard
from node.runtime.head import HeadDriver
from node.runtime.options import Context, RuntimeOptions
from node.runtime.sends import Sender, Skip
from node.runtime.trainer import EpochChanged, Trainer
from node.runtime.worker import ComputeWorker, QueueFull, Tasks
from protocol import Expect, ProtocolError, Reason, make_ack, make_reject, validate_bwd, validate_fwd
from security import verdict_score

log = logging.getLogger("swarm_node.runtime")


class Pipeline(HeadDriver):
    """Microbatches through one stage: handlers, contexts, drops, and (``HeadDriver``) the head's driver."""

    def __init__(self, index: int, n_stages: int, peer_id: str, options: RuntimeOptions, *,
                 expect_fwd: Expect | None, expect_bwd: Expect | None, worker: ComputeWorker, trainer: Trainer,
                 guard: Guard, sender: Sender, router, metrics, tasks: Tasks, state: Callable[[], str],
                 morph, batches=None, rng: random.Random | None = None):
        self.index, self.peer_id, self.options = index, peer_id, options
        self.is_head, self.is_tail = index == 0, index == n_stages - 1
        self.expect_fwd, self.expect_bwd = expect_fwd, expect_bwd
        self.worker, self.trainer, self.guard, self.sender = worker, trainer, guard, sender
        self.router, self.metrics, self.tasks, self.state = router, metrics, tasks, state
        self.morph = morph  # morph.MorphEpochs: this stage's epoch and its changes
        self.batches = batches  # the head's data shard
        self.rng = rng or random.Random()
        self.contexts: dict[int, Context] = {}
        self.pending: set[int] = set()  # microbatches accepted and queued for compute
        # microbatches whose fwd is being verified (not yet pending): a copy arriving meanwhile
        # along another route is a duplicate too, not a second microbatch to compute
        self.admitting: set[int] = set()
        # the upstream route each microbatch held here (pending or in a context) came with, to
        # tell a sender's retry from a copy of the same microbatch sent along another route
        self.routes: dict[int, tuple[str, ...]] = {}
        self.reserved = 0  # fwd slots held by requests under verification
        self.inflight = 0  # head: microbatches injected and not yet finished
        self.rtts: collections.deque = collections.deque(maxlen=2048)  # head: microbatch round trips (s)
        self.wake = asyncio.Event()  # the head driver waits on it for a free slot
        self.stopping = False
        self.failures = FailureLog(metrics, log)

    def busy(self) -> bool:
        """Anything in flight or queued here."""
        return bool(self.contexts or self.pending or self.inflight
                    or self.worker.depth("fwd") or self.worker.depth("bwd"))

    def is_live(self, mb: int) -> bool:
        return mb in self.contexts

    # ------------------------------------------------------------------ inbound fwd

    def _busy_reply(self, mb: int | None, detail: str, retry_ms: int = 200) -> list:
        self.metrics.served.labels(protocol="fwd", result="busy").inc()
        return make_reject(Reason.BUSY, detail, mb=mb, retry_ms=retry_ms)

    def _validated(self, protocol: str, frame, peer: str, expect: Expect | None, validate, no_such: str):
        """The frame's typed view (``protocol.validate_fwd``/``validate_bwd`` against what this stage
        expects now); a ``ProtocolError`` is counted and raised (the transport answers ``reject``)."""
        if expect is None:
            raise ProtocolError(Reason.WRONG_STAGE, no_such)
        expect.version = self.trainer.version
        try:
            return validate(frame, expect, sender=peer)
        except ProtocolError as e:
            self.metrics.served.labels(protocol=protocol, result=e.reason.value).inc()
            raise

    async def on_fwd(self, frame, peer: str):
        fwd = self._validated("fwd", frame, peer, self.expect_fwd, validate_fwd,
                              "this node holds stage 0 (the head); it takes no fwd")
        if self.guard.is_banned_sender(peer):
            self.metrics.served.labels(protocol="fwd", result="banned").inc()
            return make_reject(Reason.BANNED, "this peer is banned here", mb=fwd.mb)
        state = self.state()
        if state != "online":
            return self._busy_reply(fwd.mb, f"node is {state}", retry_ms=1000)
        if fwd.epoch != self.morph.epoch:
            # another basis: the next epoch makes this stage enter it first; anything else is refused
            refusal = await self.morph.admit(fwd.epoch, fwd.mb)
            if refusal is not None:
                self.metrics.served.labels(protocol="fwd", result=Reason.WRONG_EPOCH.value).inc()
                return refusal
        if fwd.mb in self.pending or fwd.mb in self.contexts or fwd.mb in self.admitting:
            return self._again(fwd)
        if self.worker.depth("fwd") + self.reserved >= self.options.queue_size:
            return self._busy_reply(fwd.mb, "compute queue full")
        self.metrics.version_gap.observe(self.trainer.version - fwd.version)
        self.reserved += 1
        self.admitting.add(fwd.mb)
        self.routes[fwd.mb] = fwd.route
        admitted = False
        try:
            verdict = await self.guard.verify(peer, "act", fwd.c, fwd.version, fwd.ids, fwd.mb)
            reply, admitted = self._admit(fwd, verdict)
        finally:
            self.reserved -= 1
            self.admitting.discard(fwd.mb)
            if not admitted:
                self.routes.pop(fwd.mb, None)
        return reply

    def _admit(self, fwd, verdict) -> tuple[list, bool]:
        """After the verdict: (the reply, whether the microbatch was queued for compute)."""
        if not verdict.accept:
            self.metrics.served.labels(protocol="fwd", result="rejected-by-verifier").inc()
            return make_reject(Reason.REJECTED_BY_VERIFIER, str(verdict.reason), mb=fwd.mb,
                               score=verdict_score(verdict)), False
        if fwd.horizon_s is not None and self.trainer.pipeline_horizon:
            self.trainer.note_head_horizon(fwd.horizon_s)
        try:
            fut = self.worker.submit("fwd", self.trainer.compute_fwd, fwd)
        except QueueFull:
            return self._busy_reply(fwd.mb, "compute queue full"), False
        self.pending.add(fwd.mb)
        self.tasks.spawn(self._after_fwd(fut, fwd))
        self.metrics.served.labels(protocol="fwd", result="ack").inc()
        self.update_gauges()
        return make_ack(fwd.mb, self.index, self.trainer.version, queue=self.worker.depth("fwd")), True

    def _again(self, fwd) -> list:
        """A fwd for a microbatch this stage already holds (queued, in a context, or in its
        backward). An ack can be lost on its way back (a reset stream, a timeout) after the fwd
        was taken, and the sender then sends the same microbatch again: to us (a retry along the
        same route: acked again, it is the same microbatch) or to another replica of our stage,
        which passes it on, so a copy reaches the next stage along a second route. From here only
        one gradient goes back, along the route it came first; the copy is acked and skipped at
        once, so the stages on its route free their contexts now rather than at their TTL."""
        first = self.routes.get(fwd.mb)
        if first is not None and first != fwd.route:
            self.metrics.served.labels(protocol="fwd", result="duplicate").inc()
            log.info("mb %x came again along another route (%s, first %s): skipped there", fwd.mb,
                     fwd.route[-1][-8:], first[-1][-8:] if first else "-")
            self.tasks.spawn(self.sender.send_bwd(
                fwd.mb, fwd.route + (self.peer_id,),
                skip=Skip("duplicate", Reason.STALE, "this microbatch reached the next stage along another route")))
        return make_ack(fwd.mb, self.index, self.trainer.version, queue=self.worker.depth("fwd"))

    async def _after_fwd(self, fut: asyncio.Future, fwd) -> None:
        route = fwd.route + (self.peer_id,)
        try:
            result = await fut
        except EpochChanged as e:  # this stage entered the next epoch while the fwd waited: never mixed
            log.debug("%s", e)
            self.pending.discard(fwd.mb)
            self.metrics.microbatches.labels(outcome="dropped").inc()
            await self.sender.send_bwd(fwd.mb, route, skip=Skip("morph-epoch", Reason.WRONG_EPOCH), epoch=fwd.epoch)
            return
        except Exception as e:  # noqa: BLE001 - logged and counted; the stage goes on with the next one
            self.failures.record("fwd", e, f"mb {fwd.mb:x}")
            self.pending.discard(fwd.mb)
            self.routes.pop(fwd.mb, None)
            self.metrics.microbatches.labels(outcome="failed").inc()
            await self.sender.send_bwd(fwd.mb, route, skip=Skip("failed", Reason.INTERNAL, str(e)[:200]),
                                       epoch=fwd.epoch)
            return
        self.pending.discard(fwd.mb)
        self.update_gauges()
        if self.is_tail:
            self.routes.pop(fwd.mb, None)  # its gradient is all the tail owes upstream
            grad = result[0]
            self.metrics.microbatches.labels(outcome="done").inc()
            await self.sender.send_bwd(fwd.mb, route, grad=grad, epoch=fwd.epoch)
            return
        code, x, ids, w, version = result
        ctx = Context(fwd.mb, route, x, ids, fwd.ids.to(torch.int32), w, version, horizon_s=fwd.horizon_s,
                      epoch=fwd.epoch)
        self.contexts[fwd.mb] = ctx
        await self._forward(ctx, code)

    async def _forward(self, ctx: Context, code: torch.Tensor) -> None:
        """Send a context's output on; drop the context if no replica of the next stage takes it."""
        skip = await self.sender.send_fwd(ctx, code, self.is_live, horizon_s=self.trainer.horizon_to_send(ctx))
        if skip is not None:
            if skip.refused == "own" and skip.why == "rejected-downstream":
                self.trainer.output_refused(ctx.weights)
                self.guard.own_output_refused(skip.score)
            self.drop(ctx.mb, skip)

    # ------------------------------------------------------------------ inbound bwd

    async def on_bwd(self, frame, peer: str):
        bwd = self._validated("bwd", frame, peer, self.expect_bwd, validate_bwd,
                              "this node holds the last stage; it takes no bwd")
        ctx = self.contexts.get(bwd.mb)
        if ctx is None:
            # expired, dropped or never ours: tell upstream at once so it frees its context too
            self.metrics.served.labels(protocol="bwd", result="stale").inc()
            if self.index > 0 and bwd.skip is None:
                self.tasks.spawn(self.sender.send_bwd(bwd.mb, bwd.route[: self.index + 1],
                                                      skip=Skip("stale", Reason.STALE, "no context"), epoch=bwd.epoch))
            return make_reject(Reason.STALE, f"no in-flight microbatch {bwd.mb:x} here", mb=bwd.mb)
        if ctx.next_peer != peer:
            self.metrics.served.labels(protocol="bwd", result="bad-frame").inc()
            raise ProtocolError(Reason.BAD_FRAME, "this microbatch was not sent to you")
        if bwd.skip is not None:
            self.metrics.served.labels(protocol="bwd", result="skip").inc()
            verifier_refusal = bwd.skip == Reason.REJECTED_BY_VERIFIER.value
            if verifier_refusal and bwd.refused == "own":
                self.guard.downstream_outcome(peer, True, bwd.score, bwd.detail, version=bwd.version)
            # passed on upstream as relayed: only the hop whose tensors were refused is blamed
            self.drop(bwd.mb, Skip(f"skip-{bwd.skip}", bwd.skip, bwd.detail, score=bwd.score,
                                   refused="relayed" if verifier_refusal else None))
            if self.guard.is_banned_sender(peer):
                # banned here (by this refusal, or before): say so, or a replica whose outputs the
                # next stage refuses without banning it would never learn it and never re-sync
                self.metrics.served.labels(protocol="bwd", result="banned").inc()
                return make_reject(Reason.BANNED, "this peer is banned here", mb=bwd.mb)
            return make_ack(bwd.mb, self.index, self.trainer.version)
        if self.guard.is_banned_sender(peer):
            self.metrics.served.labels(protocol="bwd", result="banned").inc()
            self.drop(bwd.mb, Skip("sender-banned", Reason.BANNED))
            return make_reject(Reason.BANNED, "this peer is banned here", mb=bwd.mb)
        if bwd.epoch != ctx.epoch:  # a gradient in another basis than the forward's: never mixed
            self.metrics.served.labels(protocol="bwd", result=Reason.WRONG_EPOCH.value).inc()
            self.drop(bwd.mb, Skip("morph-epoch", Reason.WRONG_EPOCH))
            return make_reject(Reason.WRONG_EPOCH, f"gradient of morph epoch {bwd.epoch} for a microbatch forwarded "
                                                   f"in epoch {ctx.epoch}", mb=bwd.mb, epoch=self.morph.epoch)
        self.guard.downstream_outcome(peer, False)  # a gradient came back: the next stage took its output
        verdict = await self.guard.verify(peer, "grad", bwd.grad, bwd.version, ctx.ids_wire, bwd.mb)
        if not verdict.accept:
            self.metrics.served.labels(protocol="bwd", result="rejected-by-verifier").inc()
            self.drop(bwd.mb, Skip("grad-rejected", Reason.REJECTED_BY_VERIFIER))
            return make_reject(Reason.REJECTED_BY_VERIFIER, str(verdict.reason), mb=bwd.mb,
                               score=verdict_score(verdict))
        if bwd.mb not in self.contexts:  # dropped while we verified
            return make_reject(Reason.STALE, "microbatch dropped meanwhile", mb=bwd.mb)
        del self.contexts[bwd.mb]
        self.router.on_done(peer)
        self.pending.add(bwd.mb)
        fut = self.worker.submit("bwd", self.trainer.compute_bwd, ctx, bwd.grad)
        self.tasks.spawn(self._after_bwd(fut, ctx, bwd))
        self.metrics.served.labels(protocol="bwd", result="ack").inc()
        self.update_gauges()
        return make_ack(bwd.mb, self.index, self.trainer.version)

    async def _after_bwd(self, fut: asyncio.Future, ctx: Context, bwd) -> None:
        try:
            gx = await fut
        except EpochChanged as e:  # the stage entered the next epoch while the gradient waited
            log.debug("%s", e)
            self.pending.discard(ctx.mb)
            self._finish(ctx, "dropped")
            await self.sender.send_bwd(ctx.mb, bwd.route, skip=Skip("morph-epoch", Reason.WRONG_EPOCH), epoch=ctx.epoch)
            return
        except Exception as e:  # noqa: BLE001 - logged and counted; the stage goes on with the next one
            self.failures.record("bwd", e, f"mb {ctx.mb:x}")
            self.pending.discard(ctx.mb)
            self.routes.pop(ctx.mb, None)
            self._finish(ctx, "failed")
            await self.sender.send_bwd(ctx.mb, bwd.route, skip=Skip("failed", Reason.INTERNAL, str(e)[:200]),
                                       epoch=ctx.epoch)
            return
        self.pending.discard(ctx.mb)
        self.routes.pop(ctx.mb, None)
        self.update_gauges()
        self._finish(ctx, "done")
        if self.index > 0:
            await self.sender.send_bwd(ctx.mb, bwd.route, grad=gx, epoch=ctx.epoch, ids=ctx.ids_wire)

    # ------------------------------------------------------------------ finishing and dropping

    def _finish(self, ctx: Context, outcome: str) -> None:
        self.metrics.microbatches.labels(outcome=outcome).inc()
        if self.is_head:
            self.inflight = max(0, self.inflight - 1)
            if outcome == "done" and ctx.sent_at:
                rtt = time.monotonic() - ctx.sent_at
                self.rtts.append(rtt)
                self.metrics.mb_rtt.observe(rtt)
            self.wake.set()
        self.metrics.inflight.set(len(self.contexts))

    def drop(self, mb: int, skip: Skip) -> None:
        """Free a microbatch's context; tell upstream (when ``skip.reason`` is set) to skip it;
        let the step policy count it."""
        ctx = self.contexts.pop(mb, None)
        if ctx is None:
            return
        self.routes.pop(mb, None)
        if ctx.next_peer and ctx.sent_at:
            self.router.on_done(ctx.next_peer)
        log.debug("dropped mb %x (%s)", mb, skip.why)
        self._finish(ctx, "expired" if skip.why == "expired" else "dropped")
        if not self.stopping:
            with contextlib.suppress(RuntimeError):
                self.worker.submit("ctl", self.trainer.dropped)
        if self.index > 0 and skip.reason is not None:
            self.tasks.spawn(self.sender.send_bwd(mb, ctx.route, skip=skip, epoch=ctx.epoch))

    def drop_all(self, why: str, reason: Reason | None = None) -> None:
        """Drop every microbatch in flight here (``reason``: tell upstream to skip them)."""
        for mb in list(self.contexts):
            self.drop(mb, Skip(why, reason))

    def lose_next_hop(self, peer: str, sent_before: float | None = None) -> int:
        """Drop every microbatch sent to ``peer`` (before ``sent_before``, monotonic time, if given)
        whose gradient can no longer come back; returns how many."""
        lost = [mb for mb, ctx in self.contexts.items()
                if ctx.next_peer == peer and ctx.sent_at and (sent_before is None or ctx.sent_at < sent_before)]
        for mb in lost:
            self.drop(mb, Skip("next-hop-lost", Reason.INTERNAL))
        return len(lost)

    def prune_routes(self) -> None:
        """Forget the route of a microbatch no longer held here (each path that lets one go does
        so itself; this bounds the table whatever happens). Call between events, not inside one."""
        if len(self.routes) > len(self.pending) + len(self.contexts):
            for mb in [mb for mb in self.routes if mb not in self.pending and mb not in self.contexts]:
                del self.routes[mb]

    def update_gauges(self) -> None:
        self.metrics.queue_depth.labels(direction="fwd").set(self.worker.depth("fwd"))
        self.metrics.queue_depth.labels(direction="bwd").set(self.worker.depth("bwd"))
        self.metrics.inflight.set(len(self.contexts))
