"""Stage runtime: one pipeline stage trained asynchronously from the frames that reach it.

Read with DESIGN.md, "One microbatch through the swarm". Per node:

- **Compute** runs in ONE worker thread (``ComputeWorker``), never on the event loop; it takes
  control jobs first, then gradients, then forwards, so work already paid for downstream is
  finished before new work starts and a stage's memory (stored inputs) drains first.
- **Inbound queues are bounded**: a ``fwd`` that finds ``queue_size`` forwards waiting is
  answered ``busy`` at once, and the sender's router tries another replica.
- **Every accepted tensor passes the verifier first** (activations on ``fwd``, gradients on
  ``bwd``), off the event loop on its own thread with its own small torch thread count (so it
  never competes with the compute worker for cores); verdicts are counted by reason, and a sender
  flagged ``sentinel.flags_to_ban`` times among its last 20 verdicts is banned, routed around, and
  forgotten by the verifier (a later return is judged afresh, as a newcomer). A next hop whose
  *own output* the stage after it refused several times in a row (its ``skip:
  rejected-by-verifier``) is banned here too, so the stage before a poisoner stops sending it work.
- **Contexts**: for a microbatch in flight a stage keeps only its input, its route, the weights
  version it was forwarded with (``stages.asyncmesh.StageWeights``, the look-ahead snapshot the
  backward must recompute with) and the peer it went to. Each context has a TTL; a context whose
  next hop stops answering (health probe) is dropped at once, and every drop sends a ``skip``
  upstream so the stages before free theirs too. Nothing waits forever and nothing leaks.
- **Head** stages draw microbatches from their own data shard and keep at most ``max_inflight``
  in flight (``StepPolicy``); the **tail** computes the loss from the token ids carried in the
  ``fwd`` frame and starts the backward; gradients go back along the recorded route.
- **Steps**: each gradient is applied as it arrives (after ``grad_accum`` of them), no flush;
  every frame carries the sender's optimizer version and the staleness τ (own steps between a
  microbatch's forward and its gradient) is measured. ``asyncmesh.mode`` picks plain async,
  look-ahead or GPipe (``stages.asyncmesh.LookaheadForward``). After each step the replica
  averager (``node.net.averaging``), when configured, gets its chance to average in the background.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from node.net.p2p import BWD, FWD, HEALTH, STATE, PeerBusy, PeerRejected, PeerUnreachable
from node.net.routing import CapacityMeter
from protocol.frames import Limits, ProtocolError, Reason
from protocol.messages import (
    Expect,
    make_ack,
    make_bwd,
    make_fwd,
    make_health,
    make_health_request,
    make_reject,
    parse_health,
    validate_bwd,
    validate_fwd,
    validate_health_request,
)
from security.bans import BanList, ban_weight, refusal_weight, verdict_detail
from stages.asyncmesh import LookaheadForward, StageWeights, StepClock, StepPolicy
from stages.manifest import Manifest, manifest_hash
from stages.model import lm_loss
from stages.optim import lr_at, set_lr
from stages.warmup import ArchWarmup

log = logging.getLogger("swarm_node.runtime")

_MAX_U64 = 2**64 - 1

# ``detail`` of a ``skip: rejected-by-verifier`` that a stage sends when the next stage refused its
# OWN output; a stage that only passes a skip on marks it relayed, so upstream blames only the hop
# whose tensors were actually refused (see ``StageRuntime._on_bwd``).
OUTPUT_REJECTED = "output-rejected"
RELAYED = "relayed"


class QueueFull(Exception):
    """The compute queue for this kind of job is at its bound."""


class ComputeWorker:
    """One thread for all torch work. Jobs are ``fn(*args)``; results come back as asyncio futures.

    Priority: ``ctl`` (state snapshots, checkpoints) > ``bwd`` > ``fwd``. ``bound`` limits how many
    jobs of a kind may wait (``None``: unbounded); ``submit`` raises ``QueueFull`` beyond it.
    """

    KINDS = ("ctl", "bwd", "fwd")

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "compute"):
        self.loop = loop
        self._cv = threading.Condition()
        self._queues: dict[str, collections.deque] = {k: collections.deque() for k in self.KINDS}
        self._stopped = False
        self.busy_s = 0.0
        self.current: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def depth(self, kind: str) -> int:
        return len(self._queues[kind])

    def submit(self, kind: str, fn: Callable, *args, bound: int | None = None) -> asyncio.Future:
        fut = self.loop.create_future()
        with self._cv:
            if self._stopped:
                raise RuntimeError("the compute worker is stopped")
            if bound is not None and len(self._queues[kind]) >= bound:
                raise QueueFull(kind)
            self._queues[kind].append((fut, fn, args))
            self._cv.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and not any(self._queues.values()):
                    self._cv.wait()
                if self._stopped:
                    pending = [j for q in self._queues.values() for j in q]
                    for q in self._queues.values():
                        q.clear()
                    break
                kind = next(k for k in self.KINDS if self._queues[k])
                fut, fn, args = self._queues[kind].popleft()
                self.current = kind
            t0 = time.perf_counter()
            try:
                result, ok = fn(*args), True
            except BaseException as e:  # noqa: BLE001 - delivered to the awaiting coroutine
                result, ok = e, False
            self.busy_s += time.perf_counter() - t0
            self.current = None
            self._deliver(fut, ok, result)
        for fut, _, _ in pending:
            self._deliver(fut, False, RuntimeError("the compute worker stopped"))

    def _deliver(self, fut: asyncio.Future, ok: bool, value: Any) -> None:
        def resolve():
            if fut.done():
                return
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self.loop.call_soon_threadsafe(resolve)

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout)


@dataclass(eq=False)
class Context:
    """What a stage keeps for one in-flight microbatch until its gradient arrives."""

    mb: int
    route: tuple[str, ...]  # peers of stages 0..self (self last)
    x: torch.Tensor | None  # stage input (None at the head: ids are its input)
    ids: torch.Tensor  # (B, L) int64 on the compute device
    ids_wire: torch.Tensor  # (B, L) int32 on the CPU, what goes on the wire
    weights: StageWeights  # the weights the forward used; the backward recomputes with them
    version: int  # own optimizer version at forward time
    created: float = field(default_factory=time.monotonic)
    next_peer: str | None = None
    sent_at: float = 0.0
    horizon_s: float | None = None  # the head's look-ahead horizon (seconds) this microbatch came with

    @property
    def tokens(self) -> int:
        return int(self.ids.numel())


@dataclass
class RuntimeOptions:
    queue_size: int = 8
    context_ttl: float = 120.0
    request_timeout: float = 20.0
    max_inflight: int = 0  # 0: the manifest's
    steps: int = 0  # head: stop injecting at this optimizer step (0: never)
    checkpoint_every: int = 0  # 0: manifest
    probe_after: float = 4.0  # seconds a context may wait before its next hop is health-probed
    forward_deadline: float = 30.0  # seconds to find a replica that accepts a fwd
    use_amp: bool = False
    ban_flags_seconds: float = 60.0  # first ban for verifier flags (doubles per repeat ban)
    verify_threads: int = 1  # torch intra-op threads of the verifier's thread (the compute worker keeps its own)
    # after a neighbour answers "banned": fetch another replica's weights this often (seconds) until
    # our traffic is accepted again, so we do not come back with weights a whole ban old (0: off)
    resync_every: float = 10.0


class StageRuntime:
    """One stage: model, optimizer, look-ahead, compute worker, contexts, and the protocol handlers."""

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
        checkpointer: Callable[[int, dict, dict], None] | None = None,
        rng: random.Random | None = None,
    ):
        self.m = manifest
        self.index = index
        self.n_stages = manifest.n_stages
        self.is_head, self.is_tail = index == 0, index == manifest.n_stages - 1
        self.stage, self.optimizer = stage, optimizer
        self.transport, self.router, self.metrics, self.verifier = transport, router, metrics, verifier
        self.peer_id = peer_id
        self.device = torch.device(device)
        self.opt = options or RuntimeOptions()
        self.batches = batches
        self.averager = averager
        self.checkpointer = checkpointer
        self.rng = rng or random.Random()
        self.run_id = manifest.run.id
        self.mhash = manifest_hash(manifest)
        max_inflight = self.opt.max_inflight or manifest.train.max_inflight
        # architecture warm-up (papers.md §5, stages/warmup.py): this stage locks its own blocks
        # of the manifest's groups and unlocks them at the shared step schedule, counted in its
        # own optimizer steps (the schedule's clock, as for the learning rate)
        self.arch = ArchWarmup(manifest, stage) if manifest.warmup.enabled and manifest.warmup.groups else None
        self.la = LookaheadForward(stage, optimizer, mode=manifest.asyncmesh.mode,
                                   delay_ema=manifest.asyncmesh.delay_ema,
                                   target=manifest.asyncmesh.lookahead_target)
        # asyncmesh.lookahead_horizon = "pipeline": the head sends its τ̂ with every fwd, in seconds
        # (τ̂ × its step period), the other stages pass it on and keep an EMA of it; divided by
        # their own step period it is the floor of their extrapolation in their own steps
        # (la.horizon). A body replica that gets half of the microbatches steps half as often.
        self.pipeline_horizon = (manifest.asyncmesh.mode == "lookahead"
                                 and manifest.asyncmesh.lookahead_horizon == "pipeline")
        self.clock = StepClock(manifest.asyncmesh.delay_ema)
        self.horizon_s: float | None = None  # EMA of the received horizons (seconds)
        # the horizon in own steps is clamped here: in 1F1B the head's delay stays below the
        # number of microbatches it keeps in flight, so a peer cannot push this stage's
        # extrapolation further
        self.max_horizon = float(max_inflight)
        self.policy = StepPolicy(manifest.asyncmesh.mode, manifest.asyncmesh.gpipe_flush_every,
                                 max_inflight, manifest.train.grad_accum)
        self.checkpoint_every = self.opt.checkpoint_every or manifest.train.checkpoint_every
        self.state = "starting"
        self.contexts: dict[int, Context] = {}
        self.inflight = 0  # head: microbatches injected and not yet finished
        self._accum = 0  # gradients accumulated since the last step (worker thread)
        self._pending: set[int] = set()  # mbs accepted and queued for compute
        self._reserved = 0  # fwd slots held by requests under verification
        self._tasks: set[asyncio.Task] = set()
        self._probing: set[str] = set()
        self._downstream: dict[str, collections.deque] = {}  # next hop -> its recent outputs: refusal weight, 0 if delivered
        self._last_probe: dict[str, float] = {}
        self.banlist = BanList(flags_to_ban=manifest.sentinel.flags_to_ban, memory=max(20, manifest.sentinel.flags_to_ban),
                               base_s=self.opt.ban_flags_seconds)
        self._tokens_window: collections.deque = collections.deque()
        self.capacity_meter = CapacityMeter()  # tokens per busy second: what we announce (routing.py)
        self._tokens_total = 0
        self.step_log = None  # a text file: one JSON object per optimizer step (``--json-log``)
        self.status_cache: dict = {}
        # security.attacks.Attack per direction ("act": what we send forward, "grad": back), applied
        # to what we send (verifier tests only); one instance each, so stateful attacks (delayed)
        # never replay an activation as a gradient
        self.attacks: dict = {}
        self._window_lock = threading.Lock()
        self._loss_ema: float | None = None
        self.last_loss: float | None = None
        self.loss_history: list[tuple[int, float]] = []
        self.rtts: collections.deque = collections.deque(maxlen=2048)
        self._wake: asyncio.Event | None = None
        self._stopping = False
        self._banned_at: float | None = None  # when a neighbour last answered "banned"
        self._last_accepted = 0.0  # when a neighbour last accepted a fwd or a gradient of ours
        self._resync_task: asyncio.Task | None = None
        self.worker: ComputeWorker | None = None
        self._verify_pool = ThreadPoolExecutor(1, thread_name_prefix="verify")
        self._started = time.monotonic()
        self.data_step = 0
        self.max_batch = max_batch_for(manifest)
        k, L = manifest.k, manifest.model.seq_len
        self.expect_fwd = (Expect.fwd(self.run_id, self.mhash, index, k, self.max_batch, L)
                           if index > 0 else None)
        self.expect_bwd = (Expect.bwd(self.run_id, self.mhash, index, k, self.max_batch, L, self_peer=peer_id)
                           if index < self.n_stages - 1 else None)
        role = "head" if self.is_head else "tail" if self.is_tail else "body"
        metrics.set_stage(index, self.run_id, role=role)

    # ------------------------------------------------------------------ lifecycle

    @property
    def version(self) -> int:
        return self.la.version

    def set_state(self, state: str) -> None:
        self.state = state
        self.metrics.set_state(state)
        if self._wake is not None:
            self._wake.set()

    async def start(self) -> None:
        """Start the compute worker and serve our protocols (state stays as it is)."""
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        pin_torch_threads(self._verify_pool, self.opt.verify_threads)
        self.worker = ComputeWorker(loop, name=f"compute-stage{self.index}")
        self.metrics.attach_compute_busy(lambda: self.worker.busy_s)
        # per-protocol limits: a frame bigger than the largest valid one is refused before allocation
        def body_limit(expect) -> Limits:
            return Limits(max_body_bytes=expect.max_body_bytes() if expect is not None else 0, max_tensors=4)

        small = Limits(max_body_bytes=0, max_tensors=0)
        await self.transport.serve(FWD, self._on_fwd, limits=body_limit(self.expect_fwd))
        await self.transport.serve(BWD, self._on_bwd, limits=body_limit(self.expect_bwd))
        await self.transport.serve(HEALTH, self._on_health, limits=small)
        from node.net.state_sync import serve_state

        await self.transport.serve_stream(STATE, lambda frame, peer: serve_state(self, frame, peer), limits=small)
        self.metrics.version.set(self.version)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed: %r", task.exception(), exc_info=task.exception())

    async def stop(self) -> None:
        """Cancel background work and stop the worker (call after ``drain``)."""
        self._stopping = True
        await cancel_all(list(self._tasks))
        if self.worker is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)
        self._verify_pool.shutdown(wait=False, cancel_futures=True)

    async def drain(self, timeout: float) -> bool:
        """Stop taking new work and wait (at most ``timeout`` s) for in-flight microbatches to finish.
        Returns True when everything finished."""
        self.set_state("draining")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = self.contexts or self._pending or self.inflight
            if self.worker is not None:
                busy = busy or self.worker.depth("fwd") or self.worker.depth("bwd")
            if not busy:
                return True
            await asyncio.sleep(0.05)
        for mb in list(self.contexts):
            self._drop(mb, "draining")
        return False

    # ------------------------------------------------------------------ verification

    async def _verify(self, peer: str, direction: str, tensor: torch.Tensor, version: int,
                      ids: torch.Tensor | None, mb: int):
        """Run the verifier off the event loop; count the verdict; ban a sender whose recent
        tensors keep being flagged (``security.bans.BanList``: flags_to_ban of the last 20, each
        flag weighted by how far its score is over the fence, ``sentinel.ban_margin``)."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        call = functools.partial(self.verifier.verify, peer, direction, tensor, step=version, ids=ids, mb=mb)
        verdict = await loop.run_in_executor(self._verify_pool, call)
        self.metrics.verify_seconds.observe(time.perf_counter() - t0)
        label = "accept" if verdict.accept else "reject"
        self.metrics.verdicts.labels(direction=direction, verdict=label, reason=verdict.reason or "ok").inc()
        now = time.monotonic()
        mostly_ok = self.banlist.flag_rate(peer) < 0.5
        weight = ban_weight(verdict, self.m.sentinel.ban_margin)
        if self.banlist.record(peer, not verdict.accept, now, reason=str(verdict.reason or ""), weight=weight) \
                and mostly_ok and self._last_replica(peer):
            # A ban exists to route around a peer. With no other replica of its stage it would only
            # stop the pipeline, so a sender whose tensors mostly pass is spared (its flagged tensors
            # are still dropped one by one); one whose tensors mostly fail is banned all the same.
            self.banlist.spare(peer, now)
            log.warning("%s keeps failing verification (%s) but is the only replica of its stage: not banned; "
                        "its flagged tensors are dropped", peer[-8:], verdict.reason)
        elif self.banlist.is_banned(peer, now) and peer not in self.router.banned():
            self._ban_flagged(peer, now, "verifier", f"its {direction} tensors keep failing verification "
                                                     f"({verdict.reason})")
        elif not verdict.accept:
            log.warning("verifier rejected %s from %s: %s (score %.2f)", direction, peer[-8:], verdict.reason,
                        float(getattr(verdict, "score", 0.0) or 0.0))
        return verdict

    def _ban_flagged(self, peer: str, now: float, cause: str, why: str) -> None:
        """``peer`` collected enough flags (``self.banlist`` banned it): route around it for the
        ban's duration, and make the verifier forget it, so its references no longer vote in the
        stage's median (with two replicas, half of it) and its return after the ban is judged
        from its first tensor against the honest majority, as a newcomer."""
        until = self.banlist.banned(now).get(peer, now)
        self.router.ban(peer, until - now, cause)
        self.metrics.bans.labels(cause=cause).inc()
        forget = getattr(self.verifier, "forget", None)
        if forget is not None:  # on the verifier's thread, after the verdicts already queued there
            with contextlib.suppress(RuntimeError):  # the pool is shut down: we are stopping
                self._verify_pool.submit(forget, peer)
        log.warning("banned %s for %.0f s: %s", peer, until - now, why)

    def _downstream_outcome(self, peer: str, refused: bool, detail: str = "") -> None:
        """What became of the output of ``peer`` (our next hop): the next stage refused it (``peer``
        itself reports that with a direct ``skip: rejected-by-verifier``) or it got through (a
        gradient came back from ``peer``). Without this a replica whose activations are always
        refused never returns a gradient for us to judge, and we would keep routing work to it.

        Its own rule, not flags in ``banlist``: ban when the last ``flags_to_ban + 2`` outputs were
        ALL refused and those refusals weigh at least ``flags_to_ban``. A poisoner's are (it is
        banned after that many microbatches); an honest replica's are refused at the next stage's
        false-positive rate, a few percent, and mixing those into the 3-of-20 rule with our own
        false positives on its gradients banned an honest replica in a real run.

        Weights: the next stage's reject carries its verifier's score (``verdict_detail``) and a
        refusal counts ``refusal_weight`` of it, the next stage's own flag weight (a score of
        1 + ``ban_margin`` or more, a rule's rejection, or a ban there: 1; barely over the fence:
        0.25). Honest refusals are not independent: when a replica's statistics drift they come
        in bursts of marginal scores (six in a row at 1.08–1.14 in a clean real swarm, which
        banned an honest replica under the unweighted rule); those no longer ban here. A replica
        that keeps sending marginal tensors is still refused each time (nothing reaches the
        model) and is banned by the next stage's weighted flags, whose "banned by the next
        stage" refusals then count fully here. The last replica of a stage is never banned this
        way (nothing to route to instead; the next stage drops what it refuses anyway)."""
        recent = self._downstream.setdefault(peer, collections.deque(maxlen=self.m.sentinel.flags_to_ban + 2))
        recent.append(refusal_weight(detail, self.m.sentinel.ban_margin) if refused else 0.0)
        if not refused:
            return
        log.info("the next stage refused the output of %s (%s)", peer[-8:], detail)
        if len(recent) < recent.maxlen or not all(recent) or sum(recent) < self.m.sentinel.flags_to_ban \
                or peer in self.router.banned() or self._last_replica(peer):
            return
        recent.clear()
        now = time.monotonic()
        self.banlist.ban(peer, now, reason="downstream")
        self._ban_flagged(peer, now, "verifier-downstream",
                          f"the next stage refused its last {recent.maxlen} outputs ({detail})")

    def _last_replica(self, peer: str) -> bool:
        """True if ``peer`` is the only online, unbanned replica of its stage that we know of."""
        st = self.router.peers.get(peer)
        if st is None:
            return False
        return not [p for p in self.router.stage_peers(st.stage) if p.peer_id != peer]

    def is_banned_sender(self, peer: str) -> bool:
        return self.banlist.is_banned(peer, time.monotonic())

    # ------------------------------------------------------------------ inbound fwd

    def _busy(self, mb: int | None, detail: str, retry_ms: int = 200) -> list:
        return make_reject(Reason.BUSY, detail, mb=mb, retry_ms=retry_ms)

    async def _on_fwd(self, frame, peer: str):
        if self.expect_fwd is None:
            raise ProtocolError(Reason.WRONG_STAGE, "this node holds stage 0 (the head); it takes no fwd")
        self.expect_fwd.version = self.version
        try:
            fwd = validate_fwd(frame, self.expect_fwd, sender=peer)
        except ProtocolError as e:
            self.metrics.served.labels(protocol="fwd", result=e.reason.value).inc()
            raise
        if self.is_banned_sender(peer):
            self.metrics.served.labels(protocol="fwd", result="banned").inc()
            return make_reject(Reason.BANNED, "this peer is banned here", mb=fwd.mb)
        if self.state != "online":
            self.metrics.served.labels(protocol="fwd", result="busy").inc()
            return self._busy(fwd.mb, f"node is {self.state}", retry_ms=1000)
        if fwd.mb in self._pending or fwd.mb in self.contexts:
            return make_ack(fwd.mb, self.index, self.version, queue=self.worker.depth("fwd"))
        if self.worker.depth("fwd") + self._reserved >= self.opt.queue_size:
            self.metrics.served.labels(protocol="fwd", result="busy").inc()
            return self._busy(fwd.mb, "compute queue full")
        self.metrics.version_gap.observe(self.version - fwd.version)
        self._reserved += 1
        try:
            verdict = await self._verify(peer, "act", fwd.c, fwd.version, fwd.ids, fwd.mb)
        finally:
            self._reserved -= 1
        if not verdict.accept:
            self.metrics.served.labels(protocol="fwd", result="rejected-by-verifier").inc()
            return make_reject(Reason.REJECTED_BY_VERIFIER, verdict_detail(verdict), mb=fwd.mb)
        if self.pipeline_horizon and fwd.horizon_s is not None:
            self._note_head_horizon(fwd.horizon_s)
        try:
            fut = self.worker.submit("fwd", self._compute_fwd, fwd)
        except QueueFull:
            self.metrics.served.labels(protocol="fwd", result="busy").inc()
            return self._busy(fwd.mb, "compute queue full")
        self._pending.add(fwd.mb)
        self.spawn(self._after_fwd(fut, fwd))
        self.metrics.served.labels(protocol="fwd", result="ack").inc()
        self._update_queue_gauges()
        return make_ack(fwd.mb, self.index, self.version, queue=self.worker.depth("fwd"))

    def _note_head_horizon(self, h_s: float) -> None:
        """The head's horizon (seconds; validated by the protocol: finite, 0..MAX_HORIZON_S)
        arrived with a fwd: fold it into the EMA and refresh the floor of the extrapolation."""
        ema = self.la.delays.ema
        self.horizon_s = h_s if self.horizon_s is None else ema * self.horizon_s + (1 - ema) * h_s
        self._refresh_horizon()

    def _refresh_horizon(self) -> None:
        """la.horizon = the received horizon in this stage's own steps (the head's seconds over
        this stage's step period), at most ``max_horizon``; None until both are known. Used from
        the next optimizer version on (look-ahead weights are computed once per version)."""
        if self.horizon_s is None:  # the head never receives one
            return
        steps = self.clock.steps_in(self.horizon_s)
        self.la.horizon = None if steps is None else min(steps, self.max_horizon)

    def _horizon_to_send(self, ctx: Context) -> float | None:
        """What a fwd carries in ``horizon_s``: the head's τ̂ × its step period; others pass on
        what their microbatch came with."""
        if not self.is_head:
            return ctx.horizon_s
        return None if self.clock.period is None else self.la.delays.tau_hat * self.clock.period

    def _autocast(self):
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.opt.use_amp)

    def _compute_fwd(self, fwd):
        """Worker: body forward (store input) or tail forward+backward+step."""
        t0 = time.perf_counter()
        x = fwd.c.to(self.device, torch.float32)
        ids = fwd.ids.to(self.device, torch.int64)
        w = self.la.weights()
        version = self.la.version
        if self.is_tail:
            with self._autocast():
                out = self.la.backward(w, (x, ids), loss_fn=lambda logits: lm_loss(logits, ids))
            grad = out.input_grads[0]
            loss = float(out.loss)
            if not math.isfinite(loss):
                raise FloatingPointError(f"tail loss is {loss}")
            self._after_backward(out.delay, ids.numel(), loss=loss)
            self.metrics.compute_seconds.labels(kind="tail").observe(time.perf_counter() - t0)
            return grad.detach().to("cpu", torch.float32), loss, w, version
        with self._autocast():
            code = self.la.forward(w, x, ids)
        self.metrics.compute_seconds.labels(kind="fwd").observe(time.perf_counter() - t0)
        return code.detach().to("cpu", torch.float32), x, ids, w, version

    async def _after_fwd(self, fut: asyncio.Future, fwd) -> None:
        try:
            result = await fut
        except Exception as e:  # noqa: BLE001
            log.error("forward of mb %x failed: %r", fwd.mb, e)
            self._pending.discard(fwd.mb)
            self.metrics.microbatches.labels(outcome="failed").inc()
            await self._send_bwd(fwd.mb, fwd.route + (self.peer_id,), skip=Reason.INTERNAL, detail=str(e)[:200])
            return
        self._pending.discard(fwd.mb)
        self._update_queue_gauges()
        if self.is_tail:
            grad, loss, _, _ = result
            self.metrics.microbatches.labels(outcome="done").inc()
            await self._send_bwd(fwd.mb, fwd.route + (self.peer_id,), grad=grad)
            return
        code, x, ids, w, version = result
        ctx = Context(fwd.mb, fwd.route + (self.peer_id,), x, ids, fwd.ids.to(torch.int32), w, version,
                      horizon_s=fwd.horizon_s)
        self.contexts[fwd.mb] = ctx
        await self._send_fwd(ctx, code)

    # ------------------------------------------------------------------ outbound fwd

    async def _send_fwd(self, ctx: Context, code: torch.Tensor) -> bool:
        """Send ``code`` to a replica of the next stage: retry elsewhere on busy/failure, drop at the deadline."""
        if "act" in self.attacks:  # testing the verifier only (--attack, refused unless allowed)
            code = self.attacks["act"](code, self.version).contiguous()
        extra = {}
        if self.pipeline_horizon:
            h = self._horizon_to_send(ctx)
            if h is not None:
                extra["horizon_s"] = round(float(h), 6)
        frames = make_fwd(self.run_id, self.mhash, ctx.mb, self.index, self.version, ctx.route, code, ctx.ids_wire,
                          **extra)
        deadline = time.monotonic() + self.opt.forward_deadline
        tried: set[str] = set()
        backoff = 0.02
        while time.monotonic() < deadline and ctx.mb in self.contexts and not self._stopping:
            peer = self.router.choose(self.index + 1, exclude=tried)
            if peer is None and self._banned_by_next_stage():
                # the next stage has banned us for what we send: our output is refused there, say so
                # upstream now (it stops routing work to us) rather than at the deadline
                self._drop(ctx.mb, "banned-downstream", skip=Reason.REJECTED_BY_VERIFIER,
                           detail=f"{OUTPUT_REJECTED}: banned by the next stage")
                return False
            if peer is None:
                tried.clear()
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)
                continue
            t0 = time.monotonic()
            ctx.next_peer = peer
            self.router.on_sent(peer)
            try:
                reply = await self.transport.request(peer, FWD, frames, timeout=self.opt.request_timeout)
            except PeerBusy:
                self.router.on_done(peer)
                self.router.on_busy(peer)
                self.metrics.request("fwd", "busy", peer)
                tried.add(peer)
                continue
            except PeerRejected as e:
                self.router.on_done(peer)
                self.metrics.request("fwd", e.reason, peer)
                if e.reason == Reason.REJECTED_BY_VERIFIER.value:
                    # our own output was refused: do not push it elsewhere, tell upstream to skip it
                    # (and that it was our output, so upstream can stop routing work to a poisoner)
                    self._drop(ctx.mb, "rejected-downstream", skip=Reason.REJECTED_BY_VERIFIER,
                               detail=f"{OUTPUT_REJECTED}: {e.detail}"[:200])
                    return False
                log.warning("fwd mb %x rejected by %s: %s", ctx.mb, peer[-8:], e)
                if e.reason == Reason.BANNED.value:
                    self._note_banned()
                self.router.ban(peer, 30.0, e.reason)
                self.metrics.bans.labels(cause=e.reason).inc()
                tried.add(peer)
                continue
            except (asyncio.TimeoutError, PeerUnreachable, ConnectionError, OSError) as e:
                # one broken stream is not a dead peer: try another replica, and let a health
                # probe decide whether to ban this one and drop what we sent it
                self.router.on_done(peer)
                self.router.on_busy(peer)
                self.metrics.request("fwd", "failed", peer)
                log.info("fwd mb %x to %s failed: %r; probing it", ctx.mb, peer[-8:], e)
                self.suspect(peer)
                tried.add(peer)
                continue
            rtt = time.monotonic() - t0
            self.metrics.request_seconds.labels(protocol="fwd").observe(rtt)
            self.metrics.request("fwd", "ack", peer)
            self.router.on_ack(peer, rtt, reply.header.get("queue"))
            ctx.sent_at = self._last_accepted = time.monotonic()
            if ctx.mb not in self.contexts:  # dropped while the request was out (e.g. peer banned)
                return False
            return True
        if ctx.mb in self.contexts:
            self._drop(ctx.mb, "no-next-hop", skip=Reason.BUSY)
        return False

    # ------------------------------------------------------------------ re-sync after a ban

    def _note_banned(self) -> None:
        """A neighbour answered "banned": while nothing of ours is accepted, keep this replica's
        weights caught up with another replica of the stage (``_resync_while_banned``)."""
        self._banned_at = time.monotonic()
        if self.opt.resync_every > 0 and not self._stopping and (
                self._resync_task is None or self._resync_task.done()):
            self._resync_task = self.spawn(self._resync_while_banned())

    async def _resync_while_banned(self) -> None:
        """Every ``resync_every`` seconds, until a fwd or bwd of ours is accepted again (or four
        first-ban lengths have passed), fetch another replica's weights. A banned replica gets no
        work, so without this it came back with weights a whole ban old, was judged (as a
        newcomer) against the replica that kept training, and was banned again at once: in every
        clean real swarm that banned an honest replica (docs/SENTINEL.md)."""
        limit = time.monotonic() + 4 * self.opt.ban_flags_seconds
        while not self._stopping and time.monotonic() < limit:
            await asyncio.sleep(self.opt.resync_every)
            if self._stopping or (self._banned_at is not None and self._last_accepted > self._banned_at):
                return
            await self.resync_from_replica()

    async def resync_from_replica(self) -> bool:
        """Fetch this stage's current weights from another online replica and adopt them (between
        two compute jobs), with its optimizer version. Optimizer moments are kept (as a joiner
        rebuilds them, they are local statistics). False when no replica could give them."""
        from node.net.state_sync import StateSyncError, fetch_from_replicas

        peers = [p.peer_id for p in self.router.stage_peers(self.index)]
        try:
            version, tensors, src = await fetch_from_replicas(self.transport, peers, self.run_id, self.mhash,
                                                              self.index, self.stage, self.metrics,
                                                              timeout=self.opt.request_timeout)
        except StateSyncError as e:
            log.info("re-sync after a ban: %s", e)
            return False
        before = self.version
        await self.worker.submit("ctl", self._adopt_state, version, tensors)
        log.info("re-synced stage %d weights from %s after a ban (version %d -> %d)", self.index, src[-8:],
                 before, version)
        return True

    def _adopt_state(self, version: int, tensors: dict) -> None:
        """Compute-worker job: take a replica's weights and version."""
        from node.net.state_sync import copy_state

        copy_state(self.stage, tensors)
        self.set_version(version)
        self.la.invalidate()

    def _banned_by_next_stage(self) -> bool:
        """A replica of the next stage answered ``banned`` to us and its ban in our router (that
        answer's cause) still runs."""
        now = time.monotonic()
        return any(p.ban_cause == Reason.BANNED.value and p.banned_until > now
                   for p in self.router.stage_peers(self.index + 1, include_banned=True))

    def _peer_failed(self, peer: str, protocol: str, err: BaseException) -> None:
        seconds = self.router.on_failure(peer, "unreachable")
        self.metrics.request(protocol, "failed", peer)
        self.metrics.bans.labels(cause="unreachable").inc()
        log.warning("%s to %s failed (%s); banned for %.0f s", protocol, peer[-8:], type(err).__name__, seconds)
        self._lost_next_hop(peer)

    def _lost_next_hop(self, peer: str, sent_before: float | None = None) -> int:
        """Drop every microbatch sent to ``peer`` (before ``sent_before``, monotonic time, if given)
        whose gradient can no longer come back; returns how many."""
        lost = [mb for mb, ctx in self.contexts.items()
                if ctx.next_peer == peer and ctx.sent_at and (sent_before is None or ctx.sent_at < sent_before)]
        for mb in lost:
            self._drop(mb, "next-hop-lost", skip=Reason.INTERNAL)
        return len(lost)

    async def _health(self, peer: str) -> None:
        """Health-probe ``peer`` (raises what the transport raises). If it started after we sent it
        a microbatch (killed and restarted with the same identity), that microbatch died with its
        old process: drop it now rather than at the context TTL, or its in-flight slot stays
        taken. Its start is placed no later than ``asked − uptime`` (its uptime was read after we
        asked; status rounds it to 0.1 s, hence the margin), so only microbatches surely sent to
        the old process are dropped."""
        asked = time.monotonic()
        reply = await self.transport.request(peer, HEALTH, make_health_request(), timeout=3.0)
        try:
            uptime = float(parse_health(reply)["uptime_s"])
        except (ProtocolError, KeyError, TypeError, ValueError):
            return
        lost = self._lost_next_hop(peer, sent_before=asked - uptime - 0.1)
        if lost:
            log.info("%s restarted %.1f s ago: %d microbatch(es) sent to it before are lost", peer[-8:], uptime, lost)

    # ------------------------------------------------------------------ inbound bwd

    async def _on_bwd(self, frame, peer: str):
        if self.expect_bwd is None:
            raise ProtocolError(Reason.WRONG_STAGE, "this node holds the last stage; it takes no bwd")
        self.expect_bwd.version = self.version
        try:
            bwd = validate_bwd(frame, self.expect_bwd, sender=peer)
        except ProtocolError as e:
            self.metrics.served.labels(protocol="bwd", result=e.reason.value).inc()
            raise
        ctx = self.contexts.get(bwd.mb)
        if ctx is None:
            # expired, dropped or never ours: tell upstream at once so it frees its context too
            self.metrics.served.labels(protocol="bwd", result="stale").inc()
            if self.index > 0 and bwd.skip is None:
                self.spawn(self._send_bwd(bwd.mb, bwd.route[: self.index + 1], skip=Reason.STALE,
                                          detail="no context"))
            return make_reject(Reason.STALE, f"no in-flight microbatch {bwd.mb:x} here", mb=bwd.mb)
        if ctx.next_peer != peer:
            self.metrics.served.labels(protocol="bwd", result="bad-frame").inc()
            raise ProtocolError(Reason.BAD_FRAME, "this microbatch was not sent to you")
        if bwd.skip is not None:
            self.metrics.served.labels(protocol="bwd", result="skip").inc()
            if bwd.skip == Reason.REJECTED_BY_VERIFIER.value and bwd.detail.startswith(OUTPUT_REJECTED):
                self._downstream_outcome(peer, True, bwd.detail)
            detail = bwd.detail if bwd.detail.startswith(RELAYED) else f"{RELAYED}: {bwd.detail}"
            self._drop(bwd.mb, f"skip-{bwd.skip}", skip=bwd.skip, detail=detail[:200])
            return make_ack(bwd.mb, self.index, self.version)
        if self.is_banned_sender(peer):
            self.metrics.served.labels(protocol="bwd", result="banned").inc()
            self._drop(bwd.mb, "sender-banned", skip=Reason.BANNED)
            return make_reject(Reason.BANNED, "this peer is banned here", mb=bwd.mb)
        self._downstream_outcome(peer, False)  # a gradient came back: the next stage took its output
        verdict = await self._verify(peer, "grad", bwd.grad, bwd.version, ctx.ids_wire, bwd.mb)
        if not verdict.accept:
            self.metrics.served.labels(protocol="bwd", result="rejected-by-verifier").inc()
            self._drop(bwd.mb, "grad-rejected", skip=Reason.REJECTED_BY_VERIFIER)
            return make_reject(Reason.REJECTED_BY_VERIFIER, verdict_detail(verdict), mb=bwd.mb)
        if bwd.mb not in self.contexts:  # dropped while we verified
            return make_reject(Reason.STALE, "microbatch dropped meanwhile", mb=bwd.mb)
        del self.contexts[bwd.mb]
        self.router.on_done(peer)
        self._pending.add(bwd.mb)
        fut = self.worker.submit("bwd", self._compute_bwd, ctx, bwd.grad)
        self.spawn(self._after_bwd(fut, ctx, bwd))
        self.metrics.served.labels(protocol="bwd", result="ack").inc()
        self._update_queue_gauges()
        return make_ack(bwd.mb, self.index, self.version)

    def _compute_bwd(self, ctx: Context, grad: torch.Tensor):
        """Worker: recompute the forward with the stored weights, backpropagate, maybe step."""
        t0 = time.perf_counter()
        g = grad.to(self.device, torch.float32)
        with self._autocast():
            out = self.la.backward(ctx.weights, (ctx.x, ctx.ids), grad_output=g)
        self._after_backward(out.delay, ctx.tokens)
        self.metrics.compute_seconds.labels(kind="bwd").observe(time.perf_counter() - t0)
        gx = out.input_grads[0]
        return None if gx is None else gx.detach().to("cpu", torch.float32)

    async def _after_bwd(self, fut: asyncio.Future, ctx: Context, bwd) -> None:
        try:
            gx = await fut
        except Exception as e:  # noqa: BLE001
            log.error("backward of mb %x failed: %r", ctx.mb, e)
            self._pending.discard(ctx.mb)
            self._finish(ctx, "failed")
            await self._send_bwd(ctx.mb, bwd.route, skip=Reason.INTERNAL, detail=str(e)[:200])
            return
        self._pending.discard(ctx.mb)
        self._update_queue_gauges()
        self._finish(ctx, "done")
        if self.index > 0:
            await self._send_bwd(ctx.mb, bwd.route, grad=gx)

    def _finish(self, ctx: Context, outcome: str) -> None:
        self.metrics.microbatches.labels(outcome=outcome).inc()
        if self.is_head:
            self.inflight = max(0, self.inflight - 1)
            if outcome == "done" and ctx.sent_at:
                rtt = time.monotonic() - ctx.sent_at
                self.rtts.append(rtt)
                self.metrics.mb_rtt.observe(rtt)
            self._wake.set()
        self.metrics.inflight.set(len(self.contexts))

    # ------------------------------------------------------------------ steps (worker thread)

    def _after_backward(self, delay: int, tokens: int, loss: float | None = None) -> None:
        self._accum += 1
        self.metrics.staleness.observe(delay)
        self.metrics.tokens.inc(tokens)
        self._tokens_total += tokens
        with self._window_lock:
            self._tokens_window.append((time.monotonic(), tokens))
        # the worker's busy time so far leaves out this job: every point lags by one job alike
        self.capacity_meter.record(self._tokens_total, self.worker.busy_s if self.worker is not None else 0.0)
        if loss is not None:
            self.last_loss = loss
            self._loss_ema = loss if self._loss_ema is None else 0.9 * self._loss_ema + 0.1 * loss
            self.metrics.loss.set(loss)
            self.metrics.loss_ema.set(self._loss_ema)
            self.loss_history.append((self.la.version, loss))
            if len(self.loss_history) > 100_000:
                del self.loss_history[:50_000]
        if self.policy.backward_done():
            self._step()

    def _lookahead_record(self) -> dict:
        """For the per-step JSON log (``--json-log``): how far ahead the next forward looks (its
        own steps), the received horizon (seconds), this stage's step period, and ‖Ŵ − W‖ of the
        weights the next forward will use (computed here once per version, as that forward would;
        so it must run after everything that changes the weights at this step, averaging included)."""
        w = self.la.weights()
        dist = None
        if w.tensors is not None:
            live = dict(self.stage.named_parameters())
            sq = sum(float((t.float() - live[n].detach().float()).square().sum()) for n, t in w.tensors.items()
                     if n in live)
            dist = round(math.sqrt(sq), 6)
        return {"lookahead_steps": round(w.tau_hat, 4), "horizon_s": self.horizon_s,
                "period_s": self.clock.period, "lookahead_dist": dist}

    def _step(self) -> None:
        if self._accum == 0:
            return
        params = [p for p in self.stage.parameters() if p.requires_grad]
        if self._accum > 1:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(self._accum)
        set_lr(self.optimizer, lr_at(self.m.schedule, self.m.optim.lr, self.la.version))
        clip = self.m.optim.grad_clip if self.m.optim.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        if not torch.isfinite(norm):
            # one bad microbatch must not poison the weights: skip this step, keep training
            log.warning("gradient norm is %s at step %d: step skipped", float(norm), self.la.version)
            self.metrics.microbatches.labels(outcome="nonfinite-step").inc()
            self.optimizer.zero_grad(set_to_none=True)
            self._accum = 0
            return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.la.stepped()
        self.clock.tick(time.monotonic())
        if self.pipeline_horizon:
            self._refresh_horizon()
        self._accum = 0
        v = self.la.version
        if self.arch is not None:
            # before the next forward. Unlocking is function-preserving (output projections at
            # zero); the microbatches in flight across it (at most max_inflight) are recomputed
            # with the block active, exact until this stage's next step moves the projection
            unlocked = self.arch.apply(v, self.optimizer)
            if unlocked:
                log.info("architecture warm-up: unlocked layers %s at step %d", unlocked, v)
        self.metrics.steps.inc()
        self.metrics.version.set(v)
        if self.is_tail and self.last_loss is not None and (v == 1 or v % max(1, self.m.train.log_every) == 0):
            log.info("step %d loss %.4f (ema %.4f) %.0f tokens/s", v, self.last_loss, self._loss_ema,
                     self.tokens_per_s())
        if self.averager is not None:
            try:
                self.averager.maybe_average(v)
            except Exception as e:  # noqa: BLE001 - averaging is best effort, training goes on
                log.warning("averaging skipped at step %d: %r", v, e)
        if self.checkpointer is not None and self.checkpoint_every and v % self.checkpoint_every == 0:
            self.checkpointer(v, *self.checkpoint_state())
        if self.step_log is not None:  # last: the look-ahead weights it computes include any average applied above
            rec = {"step": v, "time": time.time(), "stage": self.index, "tokens": self._tokens_total,
                   "loss": self.last_loss if self.is_tail else None, **self._lookahead_record()}
            self.step_log.write(json.dumps(rec) + "\n")
            self.step_log.flush()

    def _dropped_step(self) -> None:
        """Worker: a microbatch will never bring a gradient; the step policy counts it (GPipe flush)."""
        if self.policy.dropped():
            self._step()

    def checkpoint_state(self) -> tuple[dict, dict]:
        """Worker (or when nothing runs): CPU copies of model + optimizer state, and the meta."""
        from node.ops.checkpoint import flatten_module, flatten_optimizer
        from stages.manifest import consensus_dict

        tensors = {k: v.detach().to("cpu").clone() for k, v in flatten_module(self.stage).items()}
        otensors, ometa = flatten_optimizer(self.optimizer)
        tensors.update({k: v.detach().to("cpu").clone() for k, v in otensors.items()})
        meta = {
            "kind": "node", "stage": self.index, "version": self.la.version, "run_id": self.run_id,
            "manifest_hash": self.mhash, "manifest": consensus_dict(self.m), "optim": ometa,
            "data_step": self.batches.step if self.batches is not None else 0, "peer_id": self.peer_id,
        }
        return tensors, meta

    def set_version(self, version: int) -> None:
        """This stage's optimizer step count after its weights were loaded (a checkpoint, a
        replica's state): the architecture warm-up's locks follow it without touching weights."""
        self.la.version = version
        if self.arch is not None:
            self.arch.sync(version)
        self.metrics.version.set(version)

    def restore(self, tensors: dict, meta: dict) -> None:
        """Load a checkpoint written by ``checkpoint_state`` (before ``start``)."""
        from node.ops.checkpoint import restore_module, restore_optimizer

        restore_module(self.stage, tensors)
        restore_optimizer(self.optimizer, tensors, meta["optim"])
        self.set_version(int(meta["version"]))
        if self.batches is not None:
            self.batches.step = int(meta.get("data_step", 0))

    # ------------------------------------------------------------------ dropping

    def _drop(self, mb: int, why: str, skip: Reason | str | None = None, detail: str = "") -> None:
        """Free a microbatch's context; tell upstream to skip it; let the step policy count it."""
        ctx = self.contexts.pop(mb, None)
        if ctx is None:
            return
        if ctx.next_peer and ctx.sent_at:
            self.router.on_done(ctx.next_peer)
        log.debug("dropped mb %x (%s)", mb, why)
        self._finish(ctx, "expired" if why == "expired" else "dropped")
        if self.worker is not None and not self._stopping:
            with contextlib.suppress(RuntimeError):
                self.worker.submit("ctl", self._dropped_step)
        if self.index > 0 and skip is not None:
            self.spawn(self._send_bwd(mb, ctx.route, skip=skip, detail=detail or why))

    # ------------------------------------------------------------------ outbound bwd

    async def _send_bwd(self, mb: int, route: tuple[str, ...], grad: torch.Tensor | None = None,
                        skip: Reason | str | None = None, detail: str = "") -> bool:
        """Gradient (or skip) to the stage before us on ``route``; a few retries on busy, then give up
        (upstream's TTL or probe frees its context)."""
        if self.index == 0 or len(route) < self.index:
            return False
        peer = route[self.index - 1]
        if grad is not None and "grad" in self.attacks:
            grad = self.attacks["grad"](grad, self.version).contiguous()
        frames = make_bwd(self.run_id, self.mhash, mb, self.index, self.version, route, grad,
                          skip=Reason(skip) if skip is not None else None, detail=detail)
        for attempt in range(6):
            t0 = time.monotonic()
            try:
                await self.transport.request(peer, BWD, frames, timeout=self.opt.request_timeout)
            except PeerBusy:
                self.metrics.request("bwd", "busy", peer)
                await asyncio.sleep(0.05 * 2**attempt)
                continue
            except PeerRejected as e:
                self.metrics.request("bwd", e.reason, peer)
                log.debug("bwd mb %x rejected by %s: %s", mb, peer[-8:], e)
                if e.reason == Reason.BANNED.value:
                    self._note_banned()
                return False
            except (PeerUnreachable, ConnectionError, OSError) as e:
                self.metrics.request("bwd", "failed", peer)
                if attempt < 2:  # a broken stream: the route is fixed, so retry the same peer
                    log.debug("bwd mb %x to %s failed: %r; retrying", mb, peer[-8:], e)
                    await asyncio.sleep(0.05 * 2**attempt)
                    continue
                log.info("bwd mb %x to %s failed: %r", mb, peer[-8:], e)
                return False
            except asyncio.TimeoutError:
                self.metrics.request("bwd", "timeout", peer)
                log.info("bwd mb %x to %s timed out", mb, peer[-8:])
                return False
            if grad is not None:  # a tensor of ours was accepted (an acked skip says nothing)
                self._last_accepted = time.monotonic()
            self.metrics.request_seconds.labels(protocol="bwd").observe(time.monotonic() - t0)
            self.metrics.request("bwd", "skip" if grad is None else "ack", peer)
            return True
        return False

    # ------------------------------------------------------------------ head driver

    def _new_mb(self) -> int:
        while True:
            mb = self.rng.getrandbits(63)
            if mb not in self.contexts and mb not in self._pending:
                return mb

    async def drive(self) -> None:
        """Head: inject microbatches from our data shard while the step policy allows."""
        assert self.is_head and self.batches is not None
        while not self._stopping:
            if self.opt.steps and self.version >= self.opt.steps:
                return
            ready = (
                self.state == "online"
                and self.policy.may_inject(self.inflight)
                and (self.is_tail or self.router.choose(1) is not None)
            )
            if not ready:
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.25)
                continue
            mb = self._new_mb()
            ids = next(self.batches)
            self.data_step = self.batches.step
            self.inflight += 1
            self.policy.injected()
            self._pending.add(mb)
            fut = self.worker.submit("fwd", self._compute_head, ids)
            self.spawn(self._after_head(fut, mb, ids))

    def _compute_head(self, ids_cpu: torch.Tensor):
        t0 = time.perf_counter()
        ids = ids_cpu.to(self.device, torch.int64)
        w = self.la.weights()
        version = self.la.version
        if self.is_tail:  # a one-stage run: the head is the tail
            with self._autocast():
                out = self.la.backward(w, (None, ids), loss_fn=lambda logits: lm_loss(logits, ids))
            self._after_backward(out.delay, ids.numel(), loss=float(out.loss))
            return None, ids, w, version
        with self._autocast():
            code = self.la.forward(w, None, ids)
        self.metrics.compute_seconds.labels(kind="fwd").observe(time.perf_counter() - t0)
        return code.detach().to("cpu", torch.float32), ids, w, version

    async def _after_head(self, fut: asyncio.Future, mb: int, ids_cpu: torch.Tensor) -> None:
        try:
            code, ids, w, version = await fut
        except Exception as e:  # noqa: BLE001
            log.error("head forward failed: %r", e)
            self._pending.discard(mb)
            self.inflight = max(0, self.inflight - 1)
            self._wake.set()
            return
        self._pending.discard(mb)
        ctx = Context(mb, (self.peer_id,), None, ids, ids_cpu.to(torch.int32), w, version)
        if self.is_tail:
            self._finish(ctx, "done")
            return
        self.contexts[mb] = ctx
        self.metrics.inflight.set(len(self.contexts))
        await self._send_fwd(ctx, code)

    # ------------------------------------------------------------------ health

    def status(self) -> dict:
        """The node at a glance (health protocol reply and the metrics server's ``/status``)."""
        out = {
            "peer": self.peer_id, "run": self.run_id, "manifest": self.mhash, "stage": self.index,
            "state": self.state, "version": self.version, "queue": self.worker.depth("fwd") if self.worker else 0,
            "inflight": len(self.contexts), "uptime_s": round(time.monotonic() - self._started, 1),
            "loss": self.last_loss, "tokens_per_s": round(self.tokens_per_s(), 2),
            "banned": len(self.router.banned()),
        }
        if self.pipeline_horizon:
            out["lookahead_horizon"] = round(self.la.extrapolation, 2)
        rtts = sorted(self.rtts)
        if rtts:
            out["mb_rtt_p50_ms"] = round(1000 * rtts[len(rtts) // 2], 2)
            out["mb_rtt_p99_ms"] = round(1000 * rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))], 2)
            out["mb_rtt_samples"] = len(rtts)
        return out

    async def _on_health(self, frame, peer: str):
        validate_health_request(frame)
        return make_health(self.status())

    def suspect(self, peer: str, cooldown: float = 2.0) -> None:
        """Something went wrong with ``peer``: health-probe it (one probe at a time, at most every
        ``cooldown`` s)."""
        now = time.monotonic()
        if peer in self._probing or self._stopping or now - self._last_probe.get(peer, -1e9) < cooldown:
            return
        self._probing.add(peer)
        self._last_probe[peer] = now
        self.spawn(self._probe(peer))

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
                        self._peer_failed(peer, "health", e)
        finally:
            self._probing.discard(peer)

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

    # ------------------------------------------------------------------ maintenance

    def tokens_per_s(self, window: float = 10.0) -> float:
        now = time.monotonic()
        with self._window_lock:
            while self._tokens_window and now - self._tokens_window[0][0] > window:
                self._tokens_window.popleft()
            total = sum(n for _, n in self._tokens_window)
        span = max(1.0, min(window, now - self._started))
        return total / span

    def capacity_tokens_per_s(self) -> float:
        """What we announce as ``capacity`` and routers weigh us by (``routing.CapacityMeter``);
        ``tokens_per_s`` is what we were sent."""
        return self.capacity_meter.tokens_per_s()

    def _update_queue_gauges(self) -> None:
        if self.worker is not None:
            self.metrics.queue_depth.labels(direction="fwd").set(self.worker.depth("fwd"))
            self.metrics.queue_depth.labels(direction="bwd").set(self.worker.depth("bwd"))
        self.metrics.inflight.set(len(self.contexts))

    def sweep(self) -> None:
        """TTL expiry of contexts and health probes of next hops that keep us waiting."""
        now = time.monotonic()
        waiting: dict[str, float] = {}
        for mb, ctx in list(self.contexts.items()):
            if now - ctx.created > self.opt.context_ttl:
                self.metrics.contexts_expired.inc()
                self._drop(mb, "expired", skip=Reason.STALE)
                continue
            if ctx.next_peer and ctx.sent_at:
                waiting[ctx.next_peer] = max(waiting.get(ctx.next_peer, 0.0), now - ctx.sent_at)
        for peer, age in waiting.items():
            if age > self.opt.probe_after:
                self.suspect(peer)
        self.metrics.tokens_per_s.set(self.tokens_per_s())
        self.metrics.capacity.set(self.capacity_tokens_per_s())
        self.metrics.banned_peers.set(len(self.router.banned()))
        if self.metrics.peer_rtt is not None:
            for p in list(self.router.peers.values()):
                if p.rtt_ema is not None:
                    self.metrics.peer_rtt.labels(peer=p.peer_id, stage=str(p.stage)).set(p.rtt_ema)
        self._update_queue_gauges()
        self.status_cache = self.status()  # read by the metrics server's thread (/status)

    async def maintain(self, beat: Callable[[], None] | None = None, period: float = 0.5) -> None:
        while not self._stopping:
            self.sweep()
            if beat is not None:
                beat()
            await asyncio.sleep(period)


async def cancel_all(tasks: list, timeout: float = 5.0) -> None:
    """Cancel ``tasks`` and wait for them, at most ``timeout`` s. (Python 3.11's ``wait_for`` can
    swallow a cancellation that races with its result, so loops also check a stop flag, and
    nothing here waits unboundedly on a task that ignored its cancel.)"""
    for t in tasks:
        t.cancel()
    if tasks:
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            log.warning("task %r did not stop within %.0f s", t.get_coro(), timeout)
        for t in done:
            if not t.cancelled():
                t.exception()  # retrieved, so asyncio does not log it again


def pin_torch_threads(pool: ThreadPoolExecutor, n: int) -> None:
    """Give the one thread of ``pool`` its own torch intra-op thread count ``n``, leaving every
    other thread's as it was. The verifier's many small ops gain nothing from more threads, and
    with OpenMP workers spinning on cores the compute worker needs they were 20x slower on a
    shared CPU (docs/SENTINEL.md). torch keeps the count per thread but seeds each thread's from
    the last ``set_num_threads`` anywhere, so the caller's count is set back afterwards."""
    if n <= 0:
        return
    own = torch.get_num_threads()

    def pin():
        torch.get_num_threads()  # torch's lazy per-thread init first, or it would undo the next line
        torch.set_num_threads(n)

    pool.submit(pin).result()
    torch.set_num_threads(own)


def max_batch_for(manifest: Manifest) -> int:
    """Largest microbatch (B) a stage accepts: batch size is a local choice of each head, so allow
    some room above our own."""
    return max(4 * manifest.data.batch_size, 64)


def new_microbatch_rng(seed: int) -> random.Random:
    return random.Random(seed) if seed else random.Random()
