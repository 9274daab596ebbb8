"""Preconditioned sharpness λ_max(P^{-1/2} H P^{-1/2}) by warm-started power iteration (papers §5).

Loss spikes follow the preconditioned sharpness crossing the adaptive edge-of-stability bound
``(2 + 2β1) / ((1 − β1)·η)`` (:func:`eos_bound`). ``H`` is the Hessian of the loss in the
parameters, ``P = diag(√v̂ + ε)`` the preconditioner of Adam (bias-corrected second moment) or the
identity for optimizers without one (Muon, SGD).

Power iteration needs only Hessian-vector products, one double-backward each:
``Hw = ∂(∇L·w)/∂θ``. The gradient graph is built once per measurement, then at most
``max_iters`` HVPs are taken (papers: ≤ 5). The estimate is kept between measurements (warm
start), so a slowly changing top eigenvector needs only a few products each time; this is what
makes measuring every N steps cheap.

By default (``method="lanczos"``) the products of the power iteration are not thrown away: the
estimate is the top Ritz value of the Krylov space they span (Lanczos with full
reorthogonalisation), for the same number of HVPs. Two reasons, both seen on our transformer:
plain power iteration converges to the eigenvalue of largest *magnitude*, which in the
preconditioned Hessian of a network in training is often a large negative one, while stability is about
the largest *positive* one; and with 5 products the Ritz value is much closer to λ_max.
``method="power"`` is the textbook iteration (Rayleigh quotient of the last iterate).

Double backward through attention needs the math SDPA kernel (the fused CPU / flash kernels
have no second derivative); :meth:`SharpnessTracker.measure` selects it while the loss is built.
On CUDA call it outside autocast, or accept bf16 noise in the estimate. Memory: the Lanczos
basis holds ``max_iters`` float32 copies of the measured parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["SharpnessTracker", "adam_preconditioner", "eos_bound"]


def eos_bound(lr: float, beta1: float) -> float:
    """Adaptive edge-of-stability bound ``(2 + 2β1)/((1 − β1)·η)`` (≈ 38/η for β1 = 0.9)."""
    return (2.0 + 2.0 * beta1) / ((1.0 - beta1) * lr)


@torch.no_grad()
def adam_preconditioner(optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> list[Tensor] | None:
    """``diag(√v̂ + ε)`` per parameter from an Adam-family optimizer's state (``exp_avg_sq``),
    bias-corrected with the optimizer's ``betas[1]`` and ``step``; None if any parameter has
    no second moment yet (before the first step, or an optimizer without one: then identity)."""
    lookup = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            lookup[p] = group
    out = []
    for p in params:
        state = optimizer.state.get(p)
        group = lookup.get(p)
        if not state or "exp_avg_sq" not in state or group is None:
            return None
        b2 = group["betas"][1]
        t = max(1, int(float(state["step"])))
        out.append((state["exp_avg_sq"] / (1 - b2**t)).sqrt().add_(group["eps"]))
    return out


class SharpnessTracker:
    """Estimate the top eigenvalue of ``P^{-1/2} H P^{-1/2}`` for a fixed list of parameters.

    ``measure(loss_fn, precond)`` builds the loss with ``loss_fn()`` (a closure that runs the
    forward pass on a fixed batch and returns a scalar), takes at most ``max_iters`` HVPs and
    returns the top Ritz value (``method="lanczos"``) or the Rayleigh quotient of the last
    power iterate (``method="power"``). ``precond`` is None (identity), a list of
    diagonal tensors aligned with ``params``, or an optimizer (its Adam second moments via
    :func:`adam_preconditioner`; identity if it has none). Parameters that do not require grad
    at measure time (e.g. locked warm-up blocks) are left out of the space; ones that do not
    reach the loss contribute zero.
    """

    def __init__(self, params: Sequence[Tensor], max_iters: int = 5, seed: int = 0, method: str = "lanczos"):
        if max_iters < 1:
            raise ValueError(f"SharpnessTracker: max_iters must be >= 1, got {max_iters}")
        if method not in ("lanczos", "power"):
            raise ValueError(f"SharpnessTracker: method must be 'lanczos' or 'power', got {method!r}")
        self.params = list(params)
        self.max_iters = max_iters
        self.method = method
        self._gen = torch.Generator().manual_seed(seed)
        self._v: dict[Tensor, Tensor] = {}  # warm start: last iterate, per parameter
        self.last: float | None = None
        self.hvps = 0  # total Hessian-vector products taken (cost accounting)

    def _start(self, params: list[Tensor]) -> list[Tensor]:
        vs = []
        for p in params:
            v = self._v.get(p)
            if v is None or v.shape != p.shape:
                v = torch.randn(p.shape, generator=self._gen, dtype=torch.float32).to(p.device)
            vs.append(v.to(device=p.device, dtype=torch.float32))
        return _normalise(vs)

    def measure(self, loss_fn: Callable[[], Tensor], precond=None) -> float:
        params = [p for p in self.params if p.requires_grad]
        if not params:
            raise ValueError("SharpnessTracker.measure: no parameter requires grad")
        if isinstance(precond, torch.optim.Optimizer):
            precond = adam_preconditioner(precond, params)
        elif precond is not None:
            precond = [d for d, p in zip(precond, self.params) if p.requires_grad]
            if len(precond) != len(params) or any(d.shape != p.shape for d, p in zip(precond, params)):
                raise ValueError("SharpnessTracker.measure: precond must be one tensor per parameter, same shapes")
        inv_sqrt = None if precond is None else [d.float().clamp_min(1e-30).rsqrt() for d in precond]

        from torch.nn.attention import SDPBackend, sdpa_kernel

        with torch.enable_grad(), sdpa_kernel([SDPBackend.MATH]):
            loss = loss_fn()
            if loss.ndim != 0:
                raise ValueError("SharpnessTracker.measure: loss_fn must return a scalar")
            grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        pairs = [(g, p) for g, p in zip(grads, params)]
        v = self._start(params)

        def apply(x: list[Tensor]) -> list[Tensor]:  # x ↦ P^{-1/2} H P^{-1/2} x, one HVP
            w = x if inv_sqrt is None else [a * s for a, s in zip(x, inv_sqrt)]
            hw = self._hvp(pairs, w)
            return hw if inv_sqrt is None else [a * s for a, s in zip(hw, inv_sqrt)]

        if self.method == "power":
            lam, v = _power(apply, v, self.max_iters)
        else:
            lam, v = _lanczos(apply, v, self.max_iters)
        for p, x in zip(params, v):
            self._v[p] = x.detach()
        self.last = lam
        return lam

    def _hvp(self, pairs: list[tuple[Tensor | None, Tensor]], w: list[Tensor]) -> list[Tensor]:
        live = [(i, g) for i, (g, _) in enumerate(pairs) if g is not None and g.requires_grad]
        out = [torch.zeros_like(x) for x in w]
        if live:
            hv = torch.autograd.grad(
                [g for _, g in live],
                [p for _, p in pairs],
                grad_outputs=[w[i].to(g.dtype) for i, g in live],
                retain_graph=True,
                allow_unused=True,
            )
            out = [torch.zeros_like(x) if h is None else h.detach().float() for h, x in zip(hv, w)]
        self.hvps += 1
        return out


def _dot(a: list[Tensor], b: list[Tensor]) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b)))


def _axpy(alpha: float, x: list[Tensor], y: list[Tensor]) -> list[Tensor]:
    return [b + alpha * a for a, b in zip(x, y)]


def _power(apply, v: list[Tensor], iters: int) -> tuple[float, list[Tensor]]:
    """Plain power iteration: Rayleigh quotient of the last iterate (largest-|λ| eigenvalue)."""
    lam = 0.0
    for _ in range(iters):
        av = apply(v)
        lam = _dot(v, av)
        n = _norm(av)
        if n == 0.0 or not math.isfinite(n):
            break
        v = [a / n for a in av]
    return lam, v


def _lanczos(apply, v: list[Tensor], iters: int) -> tuple[float, list[Tensor]]:
    """Lanczos on the power-iteration Krylov space {v, Av, …, A^{m−1}v} (m = iters HVPs), with full
    reorthogonalisation; returns the largest Ritz value and its Ritz vector (the next warm start).

    Same products as power iteration, but Rayleigh–Ritz over their whole span instead of the last
    iterate only: the estimate is at least the power iterate's Rayleigh quotient for the top
    eigenvalue, and it targets the largest *algebraic* eigenvalue (the one the stability bound is
    about) even when a negative eigenvalue has the larger magnitude."""
    basis = [v]
    alphas: list[float] = []
    betas: list[float] = []
    for j in range(iters):
        w = apply(basis[j])
        alphas.append(_dot(basis[j], w))
        for q in basis:  # full reorthogonalisation: m is tiny
            w = _axpy(-_dot(q, w), q, w)
        beta = _norm(w)
        if j == iters - 1 or beta <= 1e-10 * max(1.0, abs(alphas[-1])) or not math.isfinite(beta):
            break
        betas.append(beta)
        basis.append([x / beta for x in w])
    m = len(alphas)
    t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    for i, b in enumerate(betas[: m - 1]):
        t[i, i + 1] = t[i + 1, i] = b
    evals, evecs = torch.linalg.eigh(t)
    y = evecs[:, -1]
    ritz = [torch.zeros_like(x) for x in v]
    for coef, q in zip(y.tolist(), basis[:m]):
        ritz = _axpy(coef, q, ritz)
    return float(evals[-1]), _normalise(ritz)


def _norm(xs: list[Tensor]) -> float:
    return float(torch.sqrt(sum((x.double() ** 2).sum() for x in xs)))


def _normalise(xs: list[Tensor]) -> list[Tensor]:
    n = _norm(xs)
    return [x / n for x in xs] if n > 0 else xs
