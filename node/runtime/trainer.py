"""The trainer side of a stage: forward and backward compute, optimizer steps, the look-ahead
horizon, and the state a checkpoint or a joining replica takes.

Everything marked *worker* runs on the stage's compute thread (``worker.ComputeWorker``); the rest
runs on the event loop and only reads what the worker publishes.

- **Steps**: each gradient is applied as it arrives (after ``grad_accum`` of them), no flush;
  every frame carries the sender's optimizer version and the staleness τ (own steps between a
  microbatch's forward and its gradient) is measured. ``asyncmesh.mode`` picks plain async,
  look-ahead or GPipe (``stages.asyncmesh.LookaheadForward``). After each step the replica
  averager (``node.net.averaging``), when configured, gets its chance to average in the background.
- **Look-ahead horizon**: with ``asyncmesh.lookahead_horizon = "pipeline"`` the head sends its τ̂
  with every fwd, in seconds (τ̂ × its step period); the other stages pass it on and keep an EMA
  of it; divided by their own step period it is the floor of their extrapolation in their own
  steps. A body replica that gets half of the microbatches steps half as often.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import threading
import time
from typing import Callable

import torch

from node.net import CapacityMeter, copy_state, parameters_of
from node.base import flatten_module, flatten_optimizer, restore_module, restore_optimizer
from node.runtime.failures import FailureLog
from node.runtime.options import Context, RuntimeOptions
from stages import (
    ArchWarmup,
    LookaheadForward,
    Manifest,
    StepClock,
    StepPolicy,
    consensus_dict,
    lm_loss,
    lr_at,
    manifest_hash,
    set_lr,
)

log = logging.getLogger("swarm_node.runtime")


class EpochChanged(Exception):
    """A compute job's microbatch belongs to another morph epoch than the stage is in now (a fold
    ran between the frame's check and its compute): the microbatch is dropped, never mixed."""

# a checkpoint callback: (step, tensors, meta), called on the worker thread after a step
Checkpointer = Callable[[int, dict, dict], None]


class Trainer:
    """One stage's model, optimizer and look-ahead; the compute jobs the pipeline submits."""

    def __init__(self, manifest: Manifest, index: int, stage: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 *, metrics, peer_id: str, device: torch.device, options: RuntimeOptions,
                 busy_seconds: Callable[[], float], data_step: Callable[[], int] = lambda: 0,
                 averager=None, checkpointer: Checkpointer | None = None, step_log=None):
        self.manifest, self.index, self.peer_id = manifest, index, peer_id
        self.is_head, self.is_tail = index == 0, index == manifest.n_stages - 1
        self.stage, self.optimizer = stage, optimizer
        self.metrics, self.device, self.use_amp = metrics, device, options.use_amp
        self.busy_seconds, self.data_step = busy_seconds, data_step
        self.averager, self.checkpointer = averager, checkpointer
        self.failures = FailureLog(metrics, log)  # averaging attempts that raised
        self.step_log = step_log  # a text file: one JSON object per optimizer step (``--json-log``)
        self.checkpoint_every = options.checkpoint_every or manifest.train.checkpoint_every
        max_inflight = options.max_inflight or manifest.train.max_inflight
        am = manifest.asyncmesh
        # architecture warm-up (docs/REFERENCES.md §5, stages/warmup.py): this stage locks its own
        # blocks of the manifest's groups and unlocks them at the shared step schedule, counted in
        # its own optimizer steps (the schedule's clock, as for the learning rate)
        self.warmup = ArchWarmup(manifest, stage) if manifest.warmup.enabled and manifest.warmup.groups else None
        self.lookahead = LookaheadForward(stage, optimizer, mode=am.mode, delay_ema=am.delay_ema,
                                          target=am.lookahead_target)
        self.pipeline_horizon = am.mode == "lookahead" and am.lookahead_horizon == "pipeline"
        self.clock = StepClock(am.delay_ema)
        self.horizon_s: float | None = None  # EMA of the received horizons (seconds)
        # the horizon in own steps is clamped here: in 1F1B the head's delay stays below the
        # number of microbatches it keeps in flight, so a peer cannot push this stage's
        # extrapolation further
        self.max_horizon = float(max_inflight)
        self.policy = StepPolicy(am.mode, am.gpipe_flush_every, max_inflight, manifest.train.grad_accum)
        self.grads_accumulated = 0  # gradients accumulated since the last step (worker)
        self.capacity_meter = CapacityMeter()  # tokens per busy second: what we announce (routing.py)
        self.tokens_total = 0
        self._tokens_window: collections.deque = collections.deque()
        self._window_lock = threading.Lock()
        self._started = time.monotonic()
        self.loss_ema: float | None = None
        self.last_loss: float | None = None
        self.loss_history: list[tuple[int, float]] = []
        # morph epochs (docs/MORPH.md): the epoch this stage's weights are in, changed only by
        # ``fold`` and ``adopt_state`` on the worker; the float64 master copy the folds run on
        # (only a stage with an input side turns its weights: the head keeps none)
        self.morph = manifest.morph if manifest.morph.enabled else None
        self.epoch = 0
        self.master = None
        self._new_master()

    @property
    def version(self) -> int:
        return self.lookahead.version

    def _autocast(self):
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.use_amp)

    # ------------------------------------------------------------------ compute jobs (worker)

    def compute_head(self, ids_cpu: torch.Tensor):
        """Worker: the head's forward from token ids (forward + backward + step in a one-stage run)."""
        t0 = time.perf_counter()
        ids = ids_cpu.to(self.device, torch.int64)
        w = self.lookahead.weights()
        version, epoch = self.lookahead.version, self.epoch
        if self.is_tail:  # a one-stage run: the head is the tail
            with self._autocast():
                out = self.lookahead.backward(w, (None, ids), loss_fn=lambda logits: lm_loss(logits, ids))
            self._after_backward(out.delay, ids.numel(), loss=float(out.loss))
            return None, ids, w, version, epoch
        with self._autocast():
            code = self.lookahead.forward(w, None, ids)
        self.metrics.compute_seconds.labels(kind="fwd").observe(time.perf_counter() - t0)
        return code.detach().to("cpu", torch.float32), ids, w, version, epoch

    def compute_fwd(self, fwd):
        """Worker: body forward (store input) or tail forward+backward+step."""
        self._check_epoch(fwd.epoch, fwd.mb)
        t0 = time.perf_counter()
        x = fwd.c.to(self.device, torch.float32)
        ids = fwd.ids.to(self.device, torch.int64)
        w = self.lookahead.weights()
        version = self.lookahead.version
        if self.is_tail:
            with self._autocast():
                out = self.lookahead.backward(w, (x, ids), loss_fn=lambda logits: lm_loss(logits, ids))
            grad = out.input_grads[0]
            loss = float(out.loss)
            if not math.isfinite(loss):
                raise FloatingPointError(f"tail loss is {loss}")
            self._after_backward(out.delay, ids.numel(), loss=loss)
            self.metrics.compute_seconds.labels(kind="tail").observe(time.perf_counter() - t0)
            return grad.detach().to("cpu", torch.float32), loss, w, version
        with self._autocast():
            code = self.lookahead.forward(w, x, ids)
        self.metrics.compute_seconds.labels(kind="fwd").observe(time.perf_counter() - t0)
        return code.detach().to("cpu", torch.float32), x, ids, w, version

    def compute_bwd(self, ctx: Context, grad: torch.Tensor):
        """Worker: recompute the forward with the stored weights, backpropagate, maybe step."""
        self._check_epoch(ctx.epoch, ctx.mb)
        t0 = time.perf_counter()
        g = grad.to(self.device, torch.float32)
        with self._autocast():
            out = self.lookahead.backward(ctx.weights, (ctx.x, ctx.ids), grad_output=g)
        self._after_backward(out.delay, ctx.tokens)
        self.metrics.compute_seconds.labels(kind="bwd").observe(time.perf_counter() - t0)
        gx = out.input_grads[0]
        return None if gx is None else gx.detach().to("cpu", torch.float32)

    def _new_master(self) -> None:
        if self.morph is not None and not self.is_head:
            from stages import MorphMaster

            self.master = MorphMaster(self.stage)

    def _check_epoch(self, epoch: int, mb: int) -> None:
        if epoch != self.epoch:
            raise EpochChanged(f"microbatch {mb:x} is of morph epoch {epoch}, this stage is in epoch {self.epoch}")

    def fold(self, epoch: int, seed_in: bytes | None, seed_out: bytes | None) -> None:
        """Worker: enter morph epoch ``epoch``: fold the transform of the input boundary (drawn from
        ``seed_in``; None at the head) and of the output boundary (``seed_out``; None at the tail)
        into this stage and its optimizer state (``stages.morph``, on the float64 master copy).
        Gradients accumulated but not yet stepped on belong to the old basis: dropped. The
        look-ahead weights are recomputed for the next forward."""
        from stages import fold_input, fold_output, morph_width, transform_from_seed

        if epoch != self.epoch + 1:
            raise ValueError(f"fold to epoch {epoch} from epoch {self.epoch}: epochs are entered one at a time")
        k, kind, eps = morph_width(self.stage), self.morph.kind, self.morph.epsilon
        if self.grads_accumulated:
            self.optimizer.zero_grad(set_to_none=True)
            self.grads_accumulated = 0
        if seed_in is not None:
            fold_input(self.stage, transform_from_seed(seed_in, k, kind, epsilon=eps), optimizer=self.optimizer,
                       master=self.master)
        if seed_out is not None:
            fold_output(self.stage, transform_from_seed(seed_out, k, kind, epsilon=eps))
        self.epoch = epoch
        self.lookahead.invalidate()

    def dropped(self) -> None:
        """Worker: a microbatch will never bring a gradient; the step policy counts it (GPipe flush)."""
        if self.policy.dropped():
            self._step()

    # ------------------------------------------------------------------ steps (worker)

    def _after_backward(self, delay: int, tokens: int, loss: float | None = None) -> None:
        self.grads_accumulated += 1
        self.metrics.staleness.observe(delay)
        self.metrics.tokens.inc(tokens)
        self.tokens_total += tokens
        with self._window_lock:
            self._tokens_window.append((time.monotonic(), tokens))
        # the worker's busy time so far leaves out this job: every point lags by one job alike
        self.capacity_meter.record(self.tokens_total, self.busy_seconds())
        if loss is not None:
            self.last_loss = loss
            self.loss_ema = loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss
            self.metrics.loss.set(loss)
            self.metrics.loss_ema.set(self.loss_ema)
            self.loss_history.append((self.lookahead.version, loss))
            if len(self.loss_history) > 100_000:
                del self.loss_history[:50_000]
        if self.policy.backward_done():
            self._step()

    def _step(self) -> None:
        if self.grads_accumulated == 0:
            return
        params = [p for p in self.stage.parameters() if p.requires_grad]
        if self.grads_accumulated > 1:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(self.grads_accumulated)
        m = self.manifest
        set_lr(self.optimizer, lr_at(m.schedule, m.optim.lr, self.lookahead.version))
        clip = m.optim.grad_clip if m.optim.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        self.grads_accumulated = 0
        if not torch.isfinite(norm):
            # one bad microbatch must not poison the weights: skip this step, keep training
            log.warning("gradient norm is %s at step %d: step skipped", float(norm), self.lookahead.version)
            self.metrics.microbatches.labels(outcome="nonfinite-step").inc()
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lookahead.stepped()
        self.clock.tick(time.monotonic())
        if self.pipeline_horizon:
            self._refresh_horizon()
        v = self.lookahead.version
        if self.warmup is not None:
            # before the next forward. Unlocking is function-preserving (output projections at
            # zero); the microbatches in flight across it (at most max_inflight) are recomputed
            # with the block active, exact until this stage's next step moves the projection
            unlocked = self.warmup.apply(v, self.optimizer)
            if unlocked:
                log.info("architecture warm-up: unlocked layers %s at step %d", unlocked, v)
        self.metrics.steps.inc()
        self.metrics.version.set(v)
        if self.is_tail and self.last_loss is not None and (v == 1 or v % max(1, m.train.log_every) == 0):
            log.info("step %d loss %.4f (ema %.4f) %.0f tokens/s", v, self.last_loss, self.loss_ema,
                     self.tokens_per_s())
        if self.averager is not None:
            try:
                self.averager.maybe_average(v)
            except Exception as e:  # noqa: BLE001 - averaging is best effort, training goes on
                self.failures.record("average", e, f"step {v}")
        if self.checkpointer is not None and self.checkpoint_every and v % self.checkpoint_every == 0:
            self.checkpointer(v, *self.checkpoint_state())
        if self.step_log is not None:  # last: the look-ahead weights it computes include any average applied above
            rec = {"step": v, "time": time.time(), "stage": self.index, "tokens": self.tokens_total,
                   "loss": self.last_loss if self.is_tail else None, **self._lookahead_record()}
            self.step_log.write(json.dumps(rec) + "\n")
            self.step_log.flush()

    def _lookahead_record(self) -> dict:
        """For the per-step JSON log (``--json-log``): how far ahead the next forward looks (its
        own steps), the received horizon (seconds), this stage's step period, and ‖Ŵ − W‖ of the
        weights the next forward will use (computed here once per version, as that forward would;
        so it must run after everything that changes the weights at this step, averaging included)."""
        w = self.lookahead.weights()
        dist = None
        if w.tensors is not None:
            live = dict(self.stage.named_parameters())
            sq = sum(float((t.float() - live[n].detach().float()).square().sum()) for n, t in w.tensors.items()
                     if n in live)
            dist = round(math.sqrt(sq), 6)
        return {"lookahead_steps": round(w.tau_hat, 4), "horizon_s": self.horizon_s,
                "period_s": self.clock.period, "lookahead_dist": dist}

    # ------------------------------------------------------------------ look-ahead horizon (event loop)

    def output_refused(self, weights) -> None:
        """The next stage's verifier refused an output forwarded on ``weights``: if that version
        looks ahead further than usual, the rest of it looks ahead by the usual amount
        (``LookaheadForward.damp``)."""
        if self.lookahead.damp(weights.version):
            log.info("the next stage refused an output of version %d, forwarded looking %.2f steps ahead "
                     "(usual %.2f): the rest of this version looks ahead by the usual amount",
                     weights.version, weights.tau_hat, self.lookahead.usual)

    def note_head_horizon(self, h_s: float) -> None:
        """The head's horizon (seconds; validated by the protocol: finite, 0..MAX_HORIZON_S)
        arrived with a fwd: fold it into the EMA and refresh the floor of the extrapolation."""
        ema = self.lookahead.delays.ema
        self.horizon_s = h_s if self.horizon_s is None else ema * self.horizon_s + (1 - ema) * h_s
        self._refresh_horizon()

    def _refresh_horizon(self) -> None:
        """lookahead.horizon = the received horizon in this stage's own steps (the head's seconds
        over this stage's step period), at most ``max_horizon``; None until both are known. Used
        from the next optimizer version on (look-ahead weights are computed once per version)."""
        if self.horizon_s is None:  # the head never receives one
            return
        steps = self.clock.steps_in(self.horizon_s)
        self.lookahead.horizon = None if steps is None else min(steps, self.max_horizon)

    def horizon_to_send(self, ctx: Context) -> float | None:
        """What a fwd carries in ``horizon_s`` (None: nothing): the head's τ̂ × its step period;
        others pass on what their microbatch came with."""
        if not self.pipeline_horizon:
            return None
        if not self.is_head:
            return ctx.horizon_s
        return None if self.clock.period is None else self.lookahead.delays.tau_hat * self.clock.period

    # ------------------------------------------------------------------ state

    def checkpoint_state(self) -> tuple[dict, dict]:
        """Worker (or when nothing runs): CPU copies of model + optimizer state, and the meta."""
        tensors = {k: v.detach().to("cpu").clone() for k, v in flatten_module(self.stage).items()}
        otensors, ometa = flatten_optimizer(self.optimizer)
        tensors.update({k: v.detach().to("cpu").clone() for k, v in otensors.items()})
        meta = {
            "kind": "node", "stage": self.index, "version": self.lookahead.version,
            "run_id": self.manifest.run.id, "manifest_hash": manifest_hash(self.manifest),
            "manifest": consensus_dict(self.manifest), "optim": ometa, "data_step": self.data_step(),
            "peer_id": self.peer_id, "morph_epoch": self.epoch,
        }
        return tensors, meta

    def restore(self, tensors: dict, meta: dict) -> None:
        """Load a checkpoint written by ``checkpoint_state`` (before the stage starts)."""
        restore_module(self.stage, tensors)
        restore_optimizer(self.optimizer, tensors, meta["optim"])
        self.set_version(int(meta["version"]))
        self.epoch = int(meta.get("morph_epoch", 0))
        self._new_master()

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor], int]:
        """Worker: the current version, CPU copies of the stage's parameters (and morph basis maps)
        and the morph epoch they are in: what state sync serves, taken in one job."""
        with torch.no_grad():
            tensors = {n: p.detach().to("cpu", copy=True).contiguous() for n, p in parameters_of(self.stage).items()}
        return self.lookahead.version, tensors, self.epoch

    def adopt_state(self, version: int, tensors: dict, epoch: int = 0) -> None:
        """Worker: take a replica's weights, version and morph epoch (optimizer moments are kept;
        with morphing they are in the old basis, so they are cleared, like the master copy)."""
        copy_state(self.stage, tensors)
        self.set_version(version)
        if self.averager is not None:  # a round in flight averaged the weights just replaced
            self.averager.state_replaced()
        if self.morph is not None:
            if epoch != self.epoch:
                self.optimizer.state.clear()
                self.optimizer.zero_grad(set_to_none=True)
                self.grads_accumulated = 0
            self.epoch = epoch
            self._new_master()
        self.lookahead.invalidate()

    def set_version(self, version: int) -> None:
        """This stage's optimizer step count after its weights were loaded (a checkpoint, a
        replica's state): the architecture warm-up's locks follow it without touching weights."""
        self.lookahead.version = version
        if self.warmup is not None:
            self.warmup.sync(version)
        self.metrics.version.set(version)

    # ------------------------------------------------------------------ throughput

    def tokens_per_s(self, window: float = 10.0) -> float:
        """Tokens trained per second over the last ``window`` s (what we were sent)."""
        now = time.monotonic()
        with self._window_lock:
            while self._tokens_window and now - self._tokens_window[0][0] > window:
                self._tokens_window.popleft()
            total = sum(n for _, n in self._tokens_window)
        span = max(1.0, min(window, now - self._started))
        return total / span

    def capacity_tokens_per_s(self) -> float:
        """What we announce as ``capacity`` and routers weigh us by (``routing.CapacityMeter``)."""
        return self.capacity_meter.tokens_per_s()
