"""Preconditioned sharpness λ_max(P^{-1/2} H P^{-1/2}) by warm-started power iteration (papers §5).

Loss spikes follow the preconditioned sharpness crossing the adaptive edge-of-stability bound
``(2 + 2β1) / ((1 − β1)·η)`` (:func:`eos_bound`). ``H`` is the Hessian of the loss in the
parameters, ``P = diag(√v̂ + ε)`` the preconditioner of Adam (bias-corrected second moment) or the
identity for optimizers without one (Muon, SGD).

Power iteration needs only Hessian-vector products, one double-backward each:
``Hw = ∂(∇L·w)/∂θ``. The gradient graph is built once per measurement, then at most
``max_iters`` HVPs are taken (papers: ≤ 5). The iterate is kept between measurements, so a
slowly changing top eigenvector needs only a few products each time; this is what makes
measuring every N steps cheap.

Double backward through attention needs the math SDPA kernel (the fused CPU / flash kernels
have no second derivative); :meth:`SharpnessTracker.measure` selects it while the loss is built.
Power iteration converges to the eigenvalue of largest *magnitude*; near a minimum that is
the top one. On CUDA call it outside autocast, or accept bf16 noise in the estimate.
"""

from __future__ import annotations

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
    returns the Rayleigh quotient of the last iterate. ``precond`` is None (identity), a list of
    diagonal tensors aligned with ``params``, or an optimizer (its Adam second moments via
    :func:`adam_preconditioner`; identity if it has none). Parameters that do not require grad
    at measure time (e.g. locked warm-up blocks) are left out of the space; ones that do not
    reach the loss contribute zero.
    """

    def __init__(self, params: Sequence[Tensor], max_iters: int = 5, seed: int = 0):
        if max_iters < 1:
            raise ValueError(f"SharpnessTracker: max_iters must be >= 1, got {max_iters}")
        self.params = list(params)
        self.max_iters = max_iters
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
        lam = 0.0
        for _ in range(self.max_iters):
            w = v if inv_sqrt is None else [x * s for x, s in zip(v, inv_sqrt)]
            hw = self._hvp(pairs, w)
            av = hw if inv_sqrt is None else [x * s for x, s in zip(hw, inv_sqrt)]
            lam = float(sum((a * b).sum() for a, b in zip(v, av)))
            norm = _norm(av)
            if norm == 0.0 or not torch.isfinite(torch.tensor(norm)):
                break
            v = [a / norm for a in av]
        for p, x in zip(params, v):
            self._v[p] = x.detach()
        del grads, pairs
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


def _norm(xs: list[Tensor]) -> float:
    return float(torch.sqrt(sum((x.double() ** 2).sum() for x in xs)))


def _normalise(xs: list[Tensor]) -> list[Tensor]:
    n = _norm(xs)
    return [x / n for x in xs] if n > 0 else xs
