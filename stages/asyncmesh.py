"""AsyncMesh (docs/REFERENCES.md §2): the maths of asynchronous pipeline and data parallelism.

Pipeline axis. A stage applies each gradient when it arrives, so a microbatch's gradient was
computed on weights that are τ optimizer steps old. ``DelayTracker`` measures τ and keeps an
EMA τ̂; ``lookahead_params`` extrapolates the weights along the optimizer's current update
direction, ``Ŵ = W − τ̂·η·m̂``, so the gradient is taken where the weights will be when it is
applied. ``LookaheadForward`` runs a stage's forward on Ŵ and its backward (a recomputed
forward, only the stage input being stored) on bitwise the same Ŵ, and accumulates the gradient
w.r.t. Ŵ into W's ``.grad``. ``StepPolicy`` tells the runtime when to step and, for the
synchronous GPipe baseline, when the head may inject the next microbatch.

Data-parallel axis. Replicas of a stage average a rotating fraction p of their parameter
elements every H local steps. ``PartitionSchedule`` is a seeded bijection of all elements cut
into ⌈1/p⌉ partitions; round r averages partition r mod ⌈1/p⌉. The average is applied as a
delta against the snapshot taken when the round started (``apply_average_delta``), so local
progress made while the round ran is kept, scaled by λ from ``StalenessCorrection``.

Pure torch: no I/O here; node/net/averaging.py moves the bytes.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from stages.manifest import KNOWN_LOOKAHEAD_TARGETS, KNOWN_OPTIMIZERS
from stages.optim import Muon

MODES = ("lookahead", "none", "gpipe")


# --------------------------------------------------------------------------- delays


class DelayTracker:
    """Measured delay τ (own optimizer steps between a microbatch's forward and its gradient).

    ``tau_hat`` is an EMA of the measured delays (the first measurement seeds it, so there is no
    bias toward ``initial``); ``histogram`` counts delays, clamped at ``max_bucket``, for metrics.
    """

    def __init__(self, ema: float = 0.9, initial: float = 0.0, max_bucket: int = 64):
        if not 0 <= ema < 1:
            raise ValueError(f"delay EMA must be in [0, 1), got {ema}")
        if initial < 0:
            raise ValueError(f"initial delay must be >= 0, got {initial}")
        self.ema = ema
        self.tau_hat = float(initial)
        self.count = 0
        self.last = 0
        self.rolled_back = 0
        self.max_bucket = max_bucket
        self.histogram: Counter[int] = Counter()

    def record(self, forward_version: int, now_version: int) -> int:
        """Record one delay; a negative one (the version was rolled back by a state reload while
        the microbatch was in flight) counts as 0 in ``rolled_back`` rather than failing a step."""
        tau = now_version - forward_version
        if tau < 0:
            self.rolled_back += 1
            tau = 0
        self.tau_hat = float(tau) if self.count == 0 else self.ema * self.tau_hat + (1 - self.ema) * tau
        self.count += 1
        self.last = tau
        self.histogram[min(tau, self.max_bucket)] += 1
        return tau


class StepClock:
    """EMA of the wall time between this stage's optimizer steps (its step period), so that a
    look-ahead horizon can travel in seconds and be used in each stage's own steps.

    The pipeline horizon is the head's τ̂, a count of the head's optimizer steps. A body replica
    that gets half of the microbatches steps half as often, and one that gets a fifth, a fifth
    as often: looking ahead by the head's count of its *own* steps, it would extrapolate two or
    five times as far into the future as the head, and the further a stage extrapolates the more
    its output swings from version to version (docs/ASYNCMESH.md, where SENTINEL flagged such
    swings). So the head sends
    τ̂ × its period (seconds) and every stage divides by its own period (``steps_in``). With one
    replica per stage every stage steps once per microbatch and nothing changes.

    Intervals are passed in (``tick(now)``), so this stays free of clocks and I/O. One interval
    longer than ``max_ratio`` × the current estimate (a pause: no traffic, a ban) counts as
    ``max_ratio`` × it: a real slow-down is still learned within a few steps, one pause does not
    stop the stage from looking ahead for the next ten.
    """

    def __init__(self, ema: float = 0.9, max_ratio: float = 4.0):
        if not 0 <= ema < 1:
            raise ValueError(f"step clock EMA must be in [0, 1), got {ema}")
        if max_ratio < 1:
            raise ValueError(f"step clock max_ratio must be >= 1, got {max_ratio}")
        self.ema, self.max_ratio = ema, max_ratio
        self.period: float | None = None  # seconds per optimizer step; None before two ticks
        self._last: float | None = None

    def tick(self, now: float) -> None:
        """Call once per optimizer step with a monotonic time in seconds."""
        if self._last is not None:
            dt = max(0.0, now - self._last)
            if self.period is None:
                self.period = dt
            else:
                dt = min(dt, self.max_ratio * self.period) if self.period > 0 else dt
                self.period = self.ema * self.period + (1 - self.ema) * dt
        self._last = now

    def steps_in(self, seconds: float) -> float | None:
        """How many of this stage's steps fit in ``seconds`` (None before the period is known)."""
        if self.period is None or self.period <= 0:
            return None
        return seconds / self.period


# --------------------------------------------------------------------------- look-ahead


def update_direction(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor | None:
    """The optimizer's current per-unit-lr update direction m̂ for ``param`` (None: no state yet).

    The next step moves ``param`` by about ``-lr · m̂``. Muon / NuMuon compute their own
    (``Muon.direction`` in stages/optim.py); for torch's optimizers:

    - Adam, AdamW, NAdam: ``m̂/(√v̂ + eps)`` with the bias corrections ``1 − β^t`` (for NAdam we use
      the same ``1 − β1^t`` correction, not its momentum-decay product: the direction of travel
      is what matters, and it differs only in the first few hundred steps), plus ``wd · W`` when
      weight decay is decoupled (AdamW, NAdam with ``decoupled_weight_decay``).
    - SGD with momentum: the momentum buffer (plain and Nesterov steps both average to it);
      plain SGD has no direction without a fresh gradient (None).
    """
    if isinstance(optimizer, Muon):
        return optimizer.direction(param)
    found = _state_of(optimizer, param, "update direction")
    if found is None:
        return None
    state, group = found
    if not isinstance(optimizer, torch.optim.SGD):
        adam = _adam_step_denom(state, group)
        if adam is None:
            return None
        step, denom = adam
        direction = (state["exp_avg"] / (1 - group["betas"][0] ** step)) / denom
        wd = _decoupled_decay(optimizer, group)
        return direction + wd * param.detach() if wd else direction
    buf = state.get("momentum_buffer")
    return None if buf is None else buf.clone()


_KNOWN = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.SGD)


def _state_of(optimizer: torch.optim.Optimizer, param: torch.Tensor, what: str) -> tuple[dict, dict] | None:
    """(state, group) of ``param`` in one of the optimizers look-ahead knows; None before its
    first step; unknown optimizers are refused (they need ``mode = 'none'``)."""
    if not isinstance(optimizer, _KNOWN):
        raise NotImplementedError(
            f"look-ahead does not know the {what} of {type(optimizer).__name__}; give it an "
            f"build it from the manifest ({', '.join(KNOWN_OPTIMIZERS)}) or run with asyncmesh.mode = 'none'"
        )
    state = optimizer.state.get(param)
    return (state, _group_of(optimizer, param)) if state else None


def _adam_step_denom(state: dict, group: dict) -> tuple[float, torch.Tensor] | None:
    """Adam / AdamW / NAdam: (step t, √v̂_t + eps) as the optimizer divides by; None before a step."""
    if "exp_avg" not in state:
        return None
    step = float(state["step"])
    if step <= 0:
        return None
    v = state.get("max_exp_avg_sq") if group.get("amsgrad") else state["exp_avg_sq"]
    return step, (v / (1 - group["betas"][1] ** step)).sqrt() + group["eps"]


def _decoupled_decay(optimizer: torch.optim.Optimizer, group: dict) -> float:
    """The weight decay applied to W directly each step (AdamW, decoupled NAdam), else 0."""
    decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
    return group.get("weight_decay", 0.0) if decoupled else 0.0



def _check_target(target: str) -> None:
    if target not in KNOWN_LOOKAHEAD_TARGETS:
        raise ValueError(f"look-ahead target must be one of {KNOWN_LOOKAHEAD_TARGETS}, got {target!r}")


def _horizon_weights(tau_hat: float) -> list[tuple[int, float]]:
    """(k, weight) for the future steps k = 1 … ⌈τ̂⌉; the last one weighted by τ̂'s fraction."""
    n = math.ceil(tau_hat)
    return [(k, min(1.0, tau_hat - (k - 1))) for k in range(1, n + 1)]


def momentum_carry(optimizer: torch.optim.Optimizer, param: torch.Tensor, tau_hat: float) -> torch.Tensor | None:
    """The part of the next τ̂ steps' movement of ``param`` that the optimizer state already
    fixes, per unit lr (so ``W − η·carry`` is where W will be if the future gradients average to
    zero): the current first moment m decays as β1^k into each later step's update, and
    decoupled weight decay is deterministic. None when the optimizer has no such state yet, and
    for Muon / NuMuon (the orthogonalisation of a future momentum is not linear in m), which the
    caller then extrapolates with ``τ̂ · update_direction``.

    - Adam / AdamW: step t+k moves by ``m_{t+k}/(1−β1^{t+k})/(√v̂+eps)`` with
      ``m_{t+k} = β1^k m_t + (new gradients)``, so ``carry = Σ_k β1^k/(1−β1^{t+k}) · m_t/(√v̂+eps)``.
    - NAdam (torch's, with its momentum-decay schedule μ_s): step s moves by
      ``[(1−μ_s)/(1−Π_s)·g_s + μ_{s+1}/(1−Π_s·μ_{s+1})·m_s]/(√v̂+eps)``; only the m_s term carries,
      ``carry = Σ_k μ_{t+k+1} β1^k/(1−Π_{t+k+1}) · m_t/(√v̂+eps)``.
    - SGD with momentum β (dampening d): ``b_{t+k} = β^k b_t + …``; plain steps move by b, Nesterov
      steps by ``g + β·b``, so ``carry = Σ_k β^k b_t`` (plain) or ``Σ_k β^{k+1} b_t`` (Nesterov).

    The current v̂ stands in for the future ones (v moves slowly: β2 ≥ 0.95). Why not ``τ̂ ·
    update_direction``: with small batches most of a step is the fresh gradient's noise, which
    no state predicts; extrapolating the whole bias-corrected direction overshoots
    (docs/ASYNCMESH.md).
    """
    if isinstance(optimizer, Muon):
        return None
    found = _state_of(optimizer, param, "momentum")
    if found is None:
        return None
    state, group = found
    horizon = _horizon_weights(tau_hat)
    if isinstance(optimizer, torch.optim.SGD):
        buf = state.get("momentum_buffer")
        beta = group.get("momentum", 0.0)
        if buf is None or not beta:
            return None
        shift = 1 if group.get("nesterov") else 0
        return sum(w * beta ** (k + shift) for k, w in horizon) * buf
    adam = _adam_step_denom(state, group)
    if adam is None:
        return None
    t, denom = int(adam[0]), adam[1]
    beta1 = group["betas"][0]
    if isinstance(optimizer, torch.optim.NAdam):
        psi = group["momentum_decay"]
        prod = float(state["mu_product"])

        def mu(s: int) -> float:
            return beta1 * (1.0 - 0.5 * 0.96 ** (s * psi))

        coef = 0.0
        for k, w in horizon:
            prod *= mu(t + k)  # Π up to step t+k
            coef += w * mu(t + k + 1) * beta1**k / (1.0 - prod * mu(t + k + 1))
    else:
        coef = sum(w * beta1**k / (1.0 - beta1 ** (t + k)) for k, w in horizon)
    carry = coef * state["exp_avg"] / denom
    wd = _decoupled_decay(optimizer, group)
    return carry + (tau_hat * wd) * param.detach() if wd else carry


def _group_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict:
    for g in optimizer.param_groups:
        if any(p is param for p in g["params"]):
            return g
    raise KeyError("parameter is not in the optimizer")


def _trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


@torch.no_grad()
def lookahead_params(
    module: nn.Module, optimizer: torch.optim.Optimizer, tau_hat: float, lr: float | None = None,
    target: str = "update",
) -> dict[str, torch.Tensor]:
    """Ŵ = W − τ̂·η·m̂ for every trainable parameter, as fresh tensors (a stable snapshot).

    ``target`` says what m̂ is: ``"update"``, the optimizer's current update direction
    (``update_direction``: Ŵ = W − τ̂·η·update_direction); ``"momentum"``, the share of the next
    τ̂ steps the optimizer state already fixes (``momentum_carry``: Ŵ = W − η·carry, i.e. m̂ =
    carry/τ̂), falling back to ``"update"`` for Muon / NuMuon.
    ``lr`` None takes each parameter's group lr (so per-group lr scales are respected). A
    parameter without optimizer state yet, or τ̂ = 0, gets Ŵ = W (copied).
    """
    if tau_hat < 0:
        raise ValueError(f"tau_hat must be >= 0, got {tau_hat}")
    _check_target(target)
    out = {}
    for name, p in _trainable(module).items():
        d, steps = None, tau_hat  # Ŵ = W − (steps·η)·d
        if tau_hat > 0 and target == "momentum":
            d, steps = momentum_carry(optimizer, p, tau_hat), 1.0
        if d is None and tau_hat > 0:
            d, steps = update_direction(optimizer, p), tau_hat
        if d is None:
            out[name] = p.detach().clone()
        else:
            eta = _group_of(optimizer, p)["lr"] if lr is None else lr
            out[name] = p.detach() - (steps * eta) * d.to(p.dtype)
    return out


@dataclass(eq=False)
class StageWeights:
    """The weights one microbatch was forwarded with; keep it in the microbatch context.

    ``tensors`` None means the live parameters (GPipe: nothing steps while a microbatch is in
    flight, so nothing needs storing). Otherwise a snapshot shared by every microbatch forwarded
    at this ``version``: memory is one copy of the stage's trainable parameters per optimizer
    version still in flight (≤ max_inflight copies; one more for a version recomputed by
    ``LookaheadForward.damp`` while its first weights are still in flight).
    """

    version: int
    tau_hat: float
    tensors: dict[str, torch.Tensor] | None


class Backward(NamedTuple):
    input_grads: tuple[torch.Tensor | None, ...]  # one per input; None for ids / non-float inputs
    loss: torch.Tensor | None  # detached loss when a loss_fn was given (the tail)
    delay: int  # measured τ for this microbatch


USUAL_EMA = 0.9  # per version: the extrapolation ``LookaheadForward.damp`` falls back to


class LookaheadForward:
    """Forward on Ŵ, recompute-backward on the same Ŵ, gradient accumulated into W.

    Runtime wiring, per stage::

        la = LookaheadForward(stage, optimizer, mode=m.asyncmesh.mode, delay_ema=m.asyncmesh.delay_ema,
                             target=m.asyncmesh.lookahead_target)
        # forward of microbatch j (store only its inputs and `w`)
        w = la.weights(); out = la.forward(w, x, ids)
        # when its gradient arrives
        grads = la.backward(w, (x, ids), grad_out).input_grads   # adds to p.grad
        # after optimizer.step()
        la.stepped()

    ``version`` counts this stage's optimizer steps; τ = version at backward − version at
    forward. Modes: ``lookahead`` (Ŵ extrapolated by τ̂), ``none`` (Ŵ = a stashed copy of W:
    plain asynchronous, still a consistent recompute), ``gpipe`` (live W; stepping while a
    microbatch is in flight is a runtime bug and raises).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        mode: str = "lookahead",
        delay_ema: float = 0.9,
        initial_delay: float = 0.0,
        target: str = "momentum",
        horizon: float | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"asyncmesh mode must be one of {MODES}, got {mode!r}")
        _check_target(target)
        if horizon is not None and horizon < 0:
            raise ValueError(f"look-ahead horizon must be >= 0, got {horizon}")
        self.module, self.optimizer, self.mode, self.target = module, optimizer, mode, target
        # a floor under the extrapolation: the stage looks ahead by max(τ̂, horizon) (the runtime's
        # pipeline horizon sets it to the head's τ̂; the bench fixes it); τ is still measured
        self.horizon = horizon
        self.delays = DelayTracker(delay_ema, initial_delay)
        self.version = 0
        self._cached: StageWeights | None = None
        # EMA over versions of the extrapolation their weights used, and the version whose
        # weights ``damp`` asked to recompute with it
        self.usual: float | None = None
        self._damp_version = -1
        if mode == "lookahead":  # fail at start-up, not at the first look-ahead
            p = next(iter(_trainable(module).values()), None)
            if p is not None:
                update_direction(optimizer, p)

    @property
    def extrapolation(self) -> float:
        """How many steps ahead the next look-ahead weights are: max(τ̂, horizon); 0 unless in
        ``lookahead`` mode."""
        if self.mode != "lookahead":
            return 0.0
        return self.delays.tau_hat if self.horizon is None else max(self.delays.tau_hat, self.horizon)

    def weights(self) -> StageWeights:
        """The weights to forward the next microbatch with (computed once per optimizer version,
        and once more if ``damp`` asks)."""
        cached = self._cached
        if cached is None or cached.version != self.version:
            tau = self.extrapolation
            if self.mode == "lookahead":
                self.usual = tau if self.usual is None else USUAL_EMA * self.usual + (1 - USUAL_EMA) * tau
            self._cached = self._compute(tau)
        elif self._damp_version == self.version and self.usual is not None and cached.tau_hat > self.usual:
            self._cached = self._compute(self.usual)
        return self._cached

    def damp(self, version: int) -> bool:
        """The next stage refused an output this stage forwarded on its weights of ``version``.
        If that is still the current version and its weights extrapolate further than usual
        (``usual``: an EMA over versions), the rest of this version's forwards use weights
        extrapolated by the usual amount; returns whether that happens. Safe to call from
        another thread than ``weights``' (it only leaves a request).

        A replica whose step period has just fallen (a burst of steps after a stall) looks
        ahead by more of its own steps than usual, and its outputs move with it; refused, it
        gets no gradient back and cannot step off that version, so every later output of it is
        refused too (docs/SENTINEL.md, "False flags in clean swarms"). The
        microbatches already forwarded keep the weights they were forwarded with."""
        cached = self._cached
        if (self.mode != "lookahead" or version != self.version or cached is None or cached.version != version
                or self.usual is None or cached.tau_hat <= self.usual):
            return False
        self._damp_version = version
        return True

    def _compute(self, tau: float) -> StageWeights:
        if self.mode == "gpipe":
            tensors = None
        elif self.mode == "none":
            tensors = {n: p.detach().clone() for n, p in _trainable(self.module).items()}
        else:
            tensors = lookahead_params(self.module, self.optimizer, tau, target=self.target)
        return StageWeights(self.version, tau, tensors)

    def _call(self, weights: StageWeights, inputs: Sequence, params: dict | None):
        if params is None:
            return self.module(*inputs)
        return functional_call(self.module, params, tuple(inputs), strict=False)

    def forward(self, weights: StageWeights, *inputs):
        """The stage output for ``inputs`` on ``weights``, without a graph (backward recomputes)."""
        with torch.no_grad():
            return self._call(weights, inputs, weights.tensors)

    def backward(
        self,
        weights: StageWeights,
        inputs: Sequence,
        grad_output: torch.Tensor | None = None,
        loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Backward:
        """Recompute the forward on ``weights`` and backpropagate ``grad_output`` (or ``loss_fn``).

        The gradient w.r.t. Ŵ is added to W's ``.grad``; returns the gradients w.r.t. the float
        inputs (what goes upstream) and records the delay.
        """
        if (grad_output is None) == (loss_fn is None):
            raise ValueError("give exactly one of grad_output (inner stage) or loss_fn (tail)")
        live = _trainable(self.module)
        if weights.tensors is None:
            if weights.version != self.version:
                raise RuntimeError(
                    f"gpipe: the optimizer stepped (version {self.version}) while a microbatch forwarded "
                    f"at version {weights.version} was in flight; the flush policy was not respected"
                )
            leaves = dict(live)
        else:
            leaves = {n: t.detach().requires_grad_(True) for n, t in weights.tensors.items()}
        xs = [
            x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in inputs
        ]
        with torch.enable_grad():
            out = self._call(weights, xs, None if weights.tensors is None else leaves)
            loss = loss_fn(out) if loss_fn is not None else None
            target, seed = (loss, None) if loss is not None else (out, grad_output)
            wrt_x = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
            names = list(leaves)
            grads = torch.autograd.grad(
                target, [leaves[n] for n in names] + wrt_x, seed, allow_unused=True
            )
        for name, g in zip(names, grads[: len(names)]):
            if g is None:
                continue
            p = live[name]
            if p.grad is None:
                p.grad = g.to(p.dtype)
            else:
                p.grad.add_(g)
        gx = iter(grads[len(names):])
        input_grads = tuple(
            next(gx) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in xs
        )
        delay = self.delays.record(weights.version, self.version)
        return Backward(input_grads, None if loss is None else loss.detach(), delay)

    def stepped(self) -> None:
        """Call after every ``optimizer.step()`` of this stage."""
        self.version += 1

    def invalidate(self) -> None:
        """Forget the cached look-ahead weights (the weights were replaced, e.g. by a re-sync)."""
        self._cached = None


@dataclass
class StepPolicy:
    """When a stage steps its optimizer, and when the head may start a new microbatch.

    Async modes (``lookahead``, ``none``): step after every ``grad_accum`` backward passes; the
    head keeps up to ``max_inflight`` microbatches in flight. ``gpipe``: the head injects
    ``flush_every`` microbatches, then waits; every stage steps after its ``flush_every``-th
    backward of the group (the head's is the last, which opens the next group). A dropped
    microbatch counts as done (``dropped()``) so a flush can never wait forever.
    """

    mode: str = "lookahead"
    flush_every: int = 4
    max_inflight: int = 4
    grad_accum: int = 1
    _injected: int = field(default=0, repr=False)
    _done: int = field(default=0, repr=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"asyncmesh mode must be one of {MODES}, got {self.mode!r}")
        if min(self.flush_every, self.max_inflight, self.grad_accum) < 1:
            raise ValueError("flush_every, max_inflight and grad_accum must be >= 1")

    @property
    def group(self) -> int:
        return self.flush_every if self.mode == "gpipe" else self.grad_accum

    def may_inject(self, inflight: int) -> bool:
        """Head only: may a new microbatch start now (``inflight`` = microbatches not yet back)?"""
        if self.mode == "gpipe":
            return self._injected < self.flush_every
        return inflight < self.max_inflight

    def injected(self) -> None:
        self._injected += 1

    def backward_done(self) -> bool:
        """Count one finished backward; True means: step the optimizer now."""
        self._done += 1
        if self._done < self.group:
            return False
        self._done = 0
        self._injected = 0
        return True

    def dropped(self) -> bool:
        """A microbatch of this stage was dropped; same contract as ``backward_done``."""
        return self.backward_done()


# --------------------------------------------------------------------------- sparse averaging


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _mix(r: np.ndarray, key: int, mask: int) -> np.ndarray:
    # a 64-bit multiply-xorshift hash (uint64 arithmetic wraps mod 2^64)
    x = r ^ np.uint64(key)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(29)
    return x & np.uint64(mask)


class PartitionSchedule:
    """A seeded permutation of all parameter elements, cut into ⌈1/p⌉ disjoint partitions.

    Round r averages partition ``r mod n_partitions``; any ⌈1/p⌉ consecutive rounds cover every
    element exactly once. The permutation is a 4-round Feistel network on the element index with
    cycle walking, keyed by ``seed`` through splitmix64: it is identical on every replica and
    every platform (it depends on no library's RNG stream), costs no memory, and a round's
    indices are computed in O(N/P).

    Elements are numbered in the order of ``shapes`` (each parameter flattened), so replicas
    must list parameters in the same order (``named_parameters()`` order of the same stage).
    """

    def __init__(self, shapes: Sequence[torch.Size | Sequence[int] | int], p: float, seed: int):
        if not 0 < p <= 1:
            raise ValueError(f"averaging fraction p must be in (0, 1], got {p}")
        self.numels = [s if isinstance(s, int) else math.prod(s) for s in shapes]
        if any(n < 0 for n in self.numels):
            raise ValueError("negative parameter size")
        self.total = sum(self.numels)
        if self.total == 0:
            raise ValueError("nothing to average: no parameter elements")
        if self.total >= 1 << 62:
            raise ValueError("too many parameter elements for the partition permutation")
        self.p = p
        self.n_partitions = max(1, math.ceil(1.0 / p - 1e-9))
        self.offsets = torch.tensor([0] + list(_cumsum(self.numels)), dtype=torch.int64)
        bits = max(2, (self.total - 1).bit_length())
        self._half = (bits + 1) // 2
        self._mask = (1 << self._half) - 1
        k, self._keys = seed & 0xFFFFFFFFFFFFFFFF, []
        for _ in range(4):
            k = _splitmix64(k)
            self._keys.append(k)

    @property
    def max_size(self) -> int:
        """Largest partition, in elements (the size of an averaging buffer)."""
        return -(-self.total // self.n_partitions)

    def partition(self, round: int) -> int:
        return round % self.n_partitions

    def bounds(self, partition: int) -> tuple[int, int]:
        base, extra = divmod(self.total, self.n_partitions)
        start = partition * base + min(partition, extra)
        return start, start + base + (1 if partition < extra else 0)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self._half)
        left, right = x >> half, x & np.uint64(self._mask)
        for key in self._keys:
            left, right = right, left ^ _mix(right, key, self._mask)
        return (left << half) | right

    def permute(self, positions: torch.Tensor) -> torch.Tensor:
        """π(positions): the element index at each position of the permutation."""
        return torch.from_numpy(self._permute(positions.numpy().astype(np.uint64)).astype(np.int64))

    def _permute(self, positions: np.ndarray) -> np.ndarray:
        x = self._feistel(positions)
        out_of_range = np.flatnonzero(x >= self.total)
        while out_of_range.size:  # cycle walking: π is a bijection of [0, 2^bits)
            x[out_of_range] = self._feistel(x[out_of_range])
            out_of_range = out_of_range[x[out_of_range] >= self.total]
        return x

    def flat_indices(self, round: int) -> torch.Tensor:
        """Sorted flat element indices (over all parameters) averaged in ``round``."""
        start, end = self.bounds(self.partition(round))
        x = np.sort(self._permute(np.arange(start, end, dtype=np.uint64)))
        return torch.from_numpy(x.astype(np.int64))

    def indices(self, round: int) -> list[torch.Tensor]:
        """Per-parameter flat indices (into ``param.view(-1)``) averaged in ``round``."""
        flat = self.flat_indices(round)
        cuts = torch.searchsorted(flat, self.offsets).tolist()
        return [flat[cuts[i] : cuts[i + 1]] - self.offsets[i] for i in range(len(self.numels))]


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("averaged tensors must be contiguous")
    return t.detach().view(-1)


@torch.no_grad()
def snapshot(tensors: Sequence[torch.Tensor | None], indices: Sequence[torch.Tensor]) -> torch.Tensor:
    """θ^snap[S]: the values at ``indices`` (from ``PartitionSchedule.indices``), as one float32
    vector (zeros for a None tensor)."""
    if len(tensors) != len(indices):
        raise ValueError(f"{len(tensors)} tensors but {len(indices)} index tensors")
    parts = [
        torch.zeros(i.numel()) if t is None else _flat(t)[i.to(t.device)].float().cpu()
        for t, i in zip(tensors, indices)
    ]
    return torch.cat(parts) if parts else torch.zeros(0)


@torch.no_grad()
def apply_average_delta(
    tensors: Sequence[torch.Tensor | None],
    indices: Sequence[torch.Tensor],
    snapshot_vals: torch.Tensor,
    averaged_vals: torch.Tensor,
    lam: float | Sequence[float] = 1.0,
) -> float:
    """θ[S] ← θ[S] + λ·(avg − θ^snap[S]), in place; returns ‖avg − θ^snap‖₂.

    What the replica learned on S since the snapshot (θ[S] − θ^snap[S]) is kept; only the
    disagreement with the other replicas at snapshot time is removed. ``lam`` is one number or
    one per tensor; a None tensor (e.g. a moment that does not exist yet) is skipped.
    """
    lams = [float(lam)] * len(tensors) if isinstance(lam, (int, float)) else [float(x) for x in lam]
    if len(lams) != len(tensors):
        raise ValueError(f"{len(lams)} lambdas for {len(tensors)} tensors")
    n = sum(int(i.numel()) for i in indices)
    if snapshot_vals.numel() != n or averaged_vals.numel() < n:
        raise ValueError(
            f"average/snapshot sizes ({averaged_vals.numel()}, {snapshot_vals.numel()}) do not match "
            f"the {n} averaged elements"
        )
    delta = averaged_vals[:n].float() - snapshot_vals.float()
    if not bool(torch.isfinite(delta).all()):
        raise ValueError("averaged values are not finite; round rejected")
    pos = 0
    for t, i, lam_t in zip(tensors, indices, lams):
        k = int(i.numel())
        if k and t is not None and lam_t != 0.0:
            _flat(t).index_add_(0, i.to(t.device), (lam_t * delta[pos : pos + k]).to(t.device, t.dtype))
        pos += k
    return float(delta.norm())


def first_moments(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor | None], list[float]]:
    """Each parameter's first-moment tensor and its per-step decay β.

    Adam family: ``exp_avg`` with β1; SGD and Muon/NuMuon: ``momentum_buffer`` with the group's
    momentum. None (decay 0) where the optimizer has no state for the parameter yet.
    """
    moments: list[torch.Tensor | None] = []
    decays: list[float] = []
    for p in params:
        state = optimizer.state.get(p) or {}
        m, beta = None, 0.0
        if isinstance(state.get("exp_avg"), torch.Tensor):
            m, beta = state["exp_avg"], float(_group_of(optimizer, p)["betas"][0])
        elif isinstance(state.get("momentum_buffer"), torch.Tensor):
            m, beta = state["momentum_buffer"], float(_group_of(optimizer, p).get("momentum", 0.0))
        ok = m is not None and m.shape == p.shape
        moments.append(m if ok else None)
        decays.append(beta if ok else 0.0)
    return moments, decays


class StalenessCorrection:
    """How the delta of a sparse average that arrives s local steps after its snapshot is scaled.

    Design and measurement: docs/ASYNCMESH.md. With the correction on, the replicas average the
    optimizer's first moments on the same slice as the parameters, and each delta is scaled by
    how much of the snapshotted quantity still lives in the current one after s steps:

    - parameters do not decay (a step adds to W), so their disagreement at snapshot time is
      still all there: λ = 1 (a larger λ over-relaxes, a smaller one leaves disagreement);
    - a first moment decays by β per step (``m ← β·m + …``), so only β^s of the snapshotted
      moment, and of its disagreement, is left: λ_m = β^s.

    s is the round's own elapsed step count (known exactly where the delta is applied); ŝ, an
    EMA of it, is kept for metrics. ``enabled=False``: parameters only, λ = 1.
    """

    def __init__(self, enabled: bool, ema: float = 0.9):
        self.enabled = enabled
        self.ema = ema
        self.s_hat: float | None = None

    def observe(self, elapsed_steps: int) -> None:
        if elapsed_steps < 0:
            raise ValueError("elapsed steps must be >= 0")
        s = float(elapsed_steps)
        self.s_hat = s if self.s_hat is None else self.ema * self.s_hat + (1 - self.ema) * s

    def moment_lambdas(self, elapsed_steps: int, decays: Sequence[float]) -> list[float]:
        """λ_m = β^s per moment tensor (0 when the correction is off: moments untouched)."""
        if not self.enabled:
            return [0.0] * len(decays)
        return [float(b) ** elapsed_steps for b in decays]
