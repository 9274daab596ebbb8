"""Optimizers and learning-rate schedules, chosen by name in the manifest (docs/REFERENCES.md §2, §4).

``build_optimizer(manifest, module)`` returns ONE ``torch.optim.Optimizer`` for all parameters of
``module`` (one stage or a whole model):

- ``adamw`` / ``adam`` / ``nadam`` / ``sgd``: torch's own, with decay only on matrices that are
  not embeddings. ``nadam`` is the AsyncMesh pipeline default (papers §2: betas 0.99, 0.999,
  decoupled weight decay); its betas come from ``manifest.optim.betas``.
- ``muon`` / ``numuon``: :class:`Muon` / :class:`NuMuon` for the *hidden matrices* and AdamW
  (``manifest.optim.aux_lr``, ``betas``, ``eps``) for everything else (embeddings, LM head, gains,
  1-D parameters), as param groups of the same optimizer object (``use_muon`` per group), so
  ``set_lr``, schedules and state dicts see one optimizer. ``optim.aux_optimizer = "sgd"`` makes
  that auxiliary optimizer SGD with Nesterov momentum (``optim.momentum``) instead: a morphing run
  needs it (docs/MORPH.md), since Adam's per-coordinate second moment does not follow a rotation.

Hidden matrices (:func:`hidden_matrix_names`): parameters with ``ndim >= 2`` whose name does not
mark them as an embedding or output head. In the Subspace model a residual writer is
reparametrised ``W = U·Z`` with ``U`` a fixed orthonormal basis (a buffer) and ``Z`` trainable;
Muon orthogonalises ``Z``'s momentum. Because ``U`` has orthonormal columns,
``U·NS(Uᵀ G_W) = NS(U Uᵀ G_W)``: Muon on ``Z`` *is* Muon on ``W`` with the gradient projected onto
the subspace, and the spectral norm of the step is the same in both coordinates. The shape scale
``√max(1, m/n)`` uses the trained parameter's own shape (``Z``'s).

Every parameter is registered (also ones that are frozen now, e.g. blocks locked by the
architecture warm-up): a parameter whose ``.grad`` is None is skipped entirely by every optimizer
here (no momentum, no weight decay), and registering all of them keeps the parameter indices of
a state dict stable while blocks unlock.

The AsyncMesh look-ahead extrapolates along the optimizer's current update direction:
:meth:`Muon.direction` gives it for Muon / NuMuon (``stages.asyncmesh.update_direction`` computes
it for torch's optimizers and calls this for these).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from stages.manifest import Manifest, OptimConfig, ScheduleConfig

# Quintic Newton–Schulz coefficients (papers §4): fast growth of small singular values, output
# singular values land in a band around 1 rather than exactly at 1.
NS_COEFFS = (3.4445, -4.7750, 2.0315)

# Name fragments that mark a >=2-D parameter as NOT a hidden matrix (goes to AdamW under Muon).
_NOT_HIDDEN = ("embed", "lm_head", "unembed", "wte", "wpe", "tok_emb", "token_table")


# --------------------------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------------------------


def lr_at(schedule: ScheduleConfig, base_lr: float, step: int) -> float:
    """Learning rate at optimizer step ``step`` (0-based): linear warm-up, then the decay."""
    if schedule.warmup_steps and step < schedule.warmup_steps:
        return base_lr * (step + 1) / schedule.warmup_steps
    if schedule.kind == "constant":
        return base_lr
    span = max(1, schedule.total_steps - schedule.warmup_steps)
    t = min(1.0, max(0.0, (step - schedule.warmup_steps) / span))
    floor = base_lr * schedule.min_lr_frac
    if schedule.kind == "linear":
        return floor + (base_lr - floor) * (1.0 - t)
    return floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every group, keeping per-group multipliers (``lr_scale``)."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)


def rank_fraction(
    step: int,
    total_steps: int,
    rank_start: float = 1.0,
    rank_final: float = 0.25,
    hold_frac: float = 0.1,
    decay_end_frac: float = 0.8,
) -> float:
    """NuMuon's rank fraction r(t): held at ``rank_start`` for the first ``hold_frac`` of
    training, cosine-decayed to ``rank_final`` by ``decay_end_frac``, then held there."""
    t = step / max(1, total_steps)
    if t <= hold_frac:
        return rank_start
    if t >= decay_end_frac or decay_end_frac <= hold_frac:
        return rank_final
    x = (t - hold_frac) / (decay_end_frac - hold_frac)
    return rank_final + (rank_start - rank_final) * 0.5 * (1.0 + math.cos(math.pi * x))


# --------------------------------------------------------------------------------------------
# Orthogonalisation and top-k SVD (the maths, usable on their own)
# --------------------------------------------------------------------------------------------


def newton_schulz(g: Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype | None = None) -> Tensor:
    """Approximate ``U Vᵀ`` of ``g = U S Vᵀ`` by ``steps`` quintic Newton–Schulz iterations.

    ``g`` is normalised by its Frobenius norm first (so every singular value is <= 1), then each
    iteration maps singular values through ``p(x) = a x + b x³ + c x⁵``. With the coefficients
    above, after 5 steps the singular values of the result lie in roughly [0.68, 1.13] for any
    input whose normalised singular values are not tiny (not exactly 1: speed over precision).
    Computed in float32 (or ``dtype``, e.g. bfloat16 on CUDA); returned in ``g``'s dtype.
    The last two dims are the matrix; leading dims are a batch.
    """
    a, b, c = NS_COEFFS
    x = g.to(dtype or torch.float32)
    transposed = x.size(-2) > x.size(-1)
    if transposed:  # iterate on the wide side: X Xᵀ is the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    if transposed:
        x = x.mT
    return x.to(g.dtype)


def _orth(y: Tensor) -> Tensor:
    q, _ = torch.linalg.qr(y, mode="reduced")
    return q


def topk_svd(
    a: Tensor,
    k: int,
    *,
    iters: int = 2,
    oversample: int = 8,
    v0: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Top-``k`` singular triplets of ``a`` (m×n) by randomised block Krylov iteration.

    Block size ``s = k + oversample``; the start block is ``a·Ω`` with ``Ω`` (n×s) the warm start
    ``v0`` (previous right singular vectors, padded with Gaussian columns) or Gaussian. The
    Krylov space ``[aΩ, (aaᵀ)aΩ, …, (aaᵀ)^iters aΩ]`` is orthonormalised block by block, then
    ``a`` is projected onto it and the small matrix is decomposed exactly (Rayleigh–Ritz). When
    the Krylov space would cover ``min(m, n)`` anyway, an exact SVD is cheaper and is used.

    Returns ``(u (m×k), s (k,), v (n×s_used))``: note ``v`` holds ALL Ritz right vectors
    (``≥ k`` columns, best first) so the caller can warm-start the next call with them; the top
    ``k`` are ``v[:, :k]``. Computed in float32; results are float32.
    """
    if a.ndim != 2:
        raise ValueError(f"topk_svd: expected a matrix, got shape {tuple(a.shape)}")
    m, n = a.shape
    r = min(m, n)
    if not 1 <= k <= r:
        raise ValueError(f"topk_svd: k={k} must be in 1..{r} for a {m}x{n} matrix")
    a32 = a.float()
    s_block = min(k + oversample, r)
    if s_block * (iters + 1) >= r:
        u, s, vh = torch.linalg.svd(a32, full_matrices=False)
        return u[:, :k], s[:k], vh.mT[:, : max(s_block, k)]
    omega = torch.empty(n, s_block, device=a.device, dtype=torch.float32)
    have = 0
    if v0 is not None and v0.ndim == 2 and v0.shape[0] == n:
        have = min(s_block, v0.shape[1])
        omega[:, :have] = v0[:, :have].float()
    if have < s_block:
        rnd = torch.randn(n, s_block - have, generator=generator, dtype=torch.float32,
                          device="cpu" if generator is None else generator.device)
        omega[:, have:] = rnd.to(a.device)
    blocks = [_orth(a32 @ omega)]
    for _ in range(iters):
        blocks.append(_orth(a32 @ (a32.mT @ blocks[-1])))
    q = _orth(torch.cat(blocks, dim=1))  # m × s(iters+1), orthonormal basis of the Krylov space
    ub, s, vh = torch.linalg.svd(q.mT @ a32, full_matrices=False)
    u = q @ ub[:, :k]
    v = vh.mT[:, :s_block]
    return u, s[:k], v


# --------------------------------------------------------------------------------------------
# Muon and NuMuon
# --------------------------------------------------------------------------------------------


def _shape_scale(p: Tensor) -> float:
    m, n = p.shape[0], p[0].numel()
    return math.sqrt(max(1.0, m / n))


class Muon(torch.optim.Optimizer):
    """Muon for hidden matrices, AdamW for every group with ``use_muon=False``.

    Muon step for a matrix W (m×n, torch's (out, in) layout; higher-dim params are flattened to
    (shape[0], -1)) with gradient G:

        M ← β·M + G;   U = G + β·M (Nesterov) or M;   W ← (1 − ηλ)·W − η·√max(1, m/n)·NS(U)

    (papers §4; the sum form of momentum is the EMA form times a constant, and NS is
    scale-invariant, so both give the same step). Group options: ``lr``, ``momentum``,
    ``nesterov``, ``weight_decay``, ``ns_steps``, ``use_muon``; AdamW groups use ``betas``,
    ``eps``, ``weight_decay``. ``ns_dtype``: None = bfloat16 on CUDA, float32 elsewhere.
    Parameters without a gradient are skipped entirely (no decay, no momentum).
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        ns_dtype: torch.dtype | None = None,
        **extra_defaults,
    ):
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0 or ns_steps < 1:
            raise ValueError(f"Muon: bad hyperparameters lr={lr} momentum={momentum} "
                             f"weight_decay={weight_decay} ns_steps={ns_steps}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_steps=ns_steps, betas=tuple(betas), eps=eps, use_muon=True, aux="adamw",
                        **extra_defaults)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        self.global_step = 0  # optimizer steps taken; NuMuon's rank schedule reads it
        self._dir_cache: dict[Tensor, Tensor] = {}

    # -- the direction of a Muon step (overridden by NuMuon) --
    def _ns_dtype(self, p: Tensor) -> torch.dtype:
        if self.ns_dtype is not None:
            return self.ns_dtype
        return torch.bfloat16 if p.is_cuda else torch.float32

    def _orthogonalise(self, p: Tensor, u: Tensor, group: dict, state: dict, *, update_state: bool) -> Tensor:
        """Orthogonalised direction for momentum-like ``u`` (matrix-shaped), without the shape scale."""
        return newton_schulz(u, steps=group["ns_steps"], dtype=self._ns_dtype(p))

    def _muon_direction(self, p: Tensor, u: Tensor, group: dict, state: dict, *, update_state: bool) -> Tensor:
        mat = u.reshape(u.shape[0], -1)
        d = self._orthogonalise(p, mat, group, state, update_state=update_state)
        return d.reshape(p.shape).to(p.dtype).mul_(_shape_scale(p))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._dir_cache.clear()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group_step(group)
            elif group.get("aux", "adamw") == "sgd":
                self._sgd_group_step(group)
            else:
                self._adamw_group_step(group)
        self.global_step += 1
        return loss

    def _muon_group_step(self, group: dict) -> None:
        lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.ndim < 2:
                raise ValueError("Muon: a 1-D parameter is in a use_muon group; put it in an AdamW group")
            g = p.grad
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(beta).add_(g)
            u = g.add(buf, alpha=beta) if group["nesterov"] else buf
            state["step"] += 1
            d = self._muon_direction(p, u, group, state, update_state=True)
            if wd:
                p.mul_(1.0 - lr * wd)
            p.add_(d, alpha=-lr)

    def _sgd_group_step(self, group: dict) -> None:
        """Auxiliary SGD (``aux="sgd"``): ``M ← β·M + G``, ``W ← (1 − ηλ)·W − η·(G + β·M)`` (Nesterov)
        or ``− η·M``. Linear in (W, G, M), so it commutes with any fixed change of basis."""
        lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(beta).add_(g)
            state["step"] += 1
            u = g.add(buf, alpha=beta) if group["nesterov"] else buf
            if wd:
                p.mul_(1.0 - lr * wd)
            p.add_(u, alpha=-lr)

    def _adamw_group_step(self, group: dict) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            t = int(state["step"].item())
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v / (1 - b2**t)).sqrt_().add_(eps)
            if wd:
                p.mul_(1.0 - lr * wd)
            p.addcdiv_(m, denom, value=-lr / (1 - b1**t))

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        steps = [int(s["step"].item()) for s in self.state.values() if "step" in s]
        self.global_step = max(steps, default=0)
        self._dir_cache.clear()

    @torch.no_grad()
    def direction(self, p: Tensor) -> Tensor | None:
        """Per-unit-lr direction ``d`` of ``p``'s next step, about ``p ← p − lr_group·d`` (None
        before ``p``'s first step). Cached until the next ``step``: do not modify it in place.

        - Muon groups: ``√max(1, m/n)·NS(M)``, the orthogonalised momentum buffer; NuMuon: the
          rank-``k_t`` polar factor ``√max(1, m/n)·U_k V_kᵀ`` of M.
        - AdamW groups: ``m̂ / (√v̂ + eps)`` with bias-corrected moments; SGD groups: the momentum
          buffer.
        - Plus ``weight_decay·p`` (decay is decoupled in every group kind).
        """
        if p in self._dir_cache:
            return self._dir_cache[p]
        group = next((g for g in self.param_groups if any(q is p for q in g["params"])), None)
        if group is None:
            raise KeyError("parameter is not in this optimizer")
        state = self.state.get(p)
        if not state:
            return None
        wd = group["weight_decay"]
        if group["use_muon"]:
            d = self._muon_direction(p, state["momentum_buffer"], group, state, update_state=False)
        elif group.get("aux", "adamw") == "sgd":
            d = state["momentum_buffer"].clone()
        else:
            b1, b2 = group["betas"]
            t = max(1, int(state["step"].item()))
            d = (state["exp_avg"] / (1 - b1**t)) / ((state["exp_avg_sq"] / (1 - b2**t)).sqrt() + group["eps"])
        if wd:
            d = d + wd * p
        self._dir_cache[p] = d
        return d


class NuMuon(Muon):
    """Muon with a nuclear-norm budget: the step is the top-``k_t`` part of the momentum's polar factor.

    ``k_t = ⌈r(t)·min(m, n)⌉`` with ``r(t) = rank_fraction(global_step, total_steps, …)``; the
    update is ``−η·√max(1, m/n)·U_k V_kᵀ`` from :func:`topk_svd` of the (Nesterov) momentum,
    2 Krylov iterations, oversampling 8, warm-started from the previous step's right singular
    vectors (kept in state ``"v"``). At full rank the top-k polar factor is the whole polar
    factor, so NuMuon falls back to Newton–Schulz and takes exactly Muon's step.
    Extra group options: ``rank_start``, ``rank_final``, ``rank_hold_frac``,
    ``rank_decay_end_frac``, ``total_steps``, ``krylov_iters``, ``oversample``.
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        *,
        total_steps: int,
        rank_start: float = 1.0,
        rank_final: float = 0.25,
        rank_hold_frac: float = 0.1,
        rank_decay_end_frac: float = 0.8,
        krylov_iters: int = 2,
        oversample: int = 8,
        seed: int = 0,
        **kwargs,
    ):
        if total_steps <= 0 or not 0 < rank_final <= 1 or not 0 < rank_start <= 1:
            raise ValueError(f"NuMuon: bad rank schedule total_steps={total_steps} "
                             f"rank_start={rank_start} rank_final={rank_final}")
        super().__init__(params, lr=lr, total_steps=total_steps, rank_start=rank_start,
                         rank_final=rank_final, rank_hold_frac=rank_hold_frac,
                         rank_decay_end_frac=rank_decay_end_frac, krylov_iters=krylov_iters,
                         oversample=oversample, **kwargs)
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def rank_fraction(self, group: dict, step: int | None = None) -> float:
        """r(t) for ``group`` at ``step`` (default: the step about to be taken)."""
        return rank_fraction(self.global_step if step is None else step, group["total_steps"],
                             group["rank_start"], group["rank_final"], group["rank_hold_frac"],
                             group["rank_decay_end_frac"])

    def _generator(self, device: torch.device) -> torch.Generator:
        # padding columns of the Krylov start block; CPU generator, moved to the device by topk_svd
        if "cpu" not in self._generators:
            self._generators["cpu"] = torch.Generator().manual_seed(self._seed)
        return self._generators["cpu"]

    def _orthogonalise(self, p: Tensor, u: Tensor, group: dict, state: dict, *, update_state: bool) -> Tensor:
        r = min(u.shape)
        k = min(r, max(1, math.ceil(self.rank_fraction(group) * r - 1e-9)))
        if k >= r:
            return newton_schulz(u, steps=group["ns_steps"], dtype=self._ns_dtype(p))
        uk, _, v = topk_svd(u, k, iters=group["krylov_iters"], oversample=group["oversample"],
                            v0=state.get("v"), generator=self._generator(p.device))
        if update_state:
            state["v"] = v.to(p.dtype)
        return uk @ v[:, :k].mT


# --------------------------------------------------------------------------------------------
# Building from the manifest
# --------------------------------------------------------------------------------------------


def hidden_matrix_names(module: nn.Module) -> list[str]:
    """Names of the parameters Muon/NuMuon orthogonalise: ``ndim >= 2`` and not an embedding or
    output head (names containing one of ``embed``, ``lm_head``, ``unembed``, ``wte``, ``wpe``,
    ``tok_emb``, ``token_table``, or whose last module is called ``head``)."""
    out = []
    for name, p in module.named_parameters():
        low = name.lower()
        parts = low.split(".")
        if p.ndim < 2 or any(f in low for f in _NOT_HIDDEN) or "head" in parts[:-1][-1:]:
            continue
        out.append(name)
    return out


def _adam_groups(module: nn.Module, weight_decay: float, exclude: set[str] = frozenset()) -> list[dict]:
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if name in exclude:
            continue
        (decay if p.ndim >= 2 and "embed" not in name.lower() else no_decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(
    manifest: Manifest, module: nn.Module, *, total_steps: int | None = None
) -> torch.optim.Optimizer:
    """One optimizer for every parameter of ``module`` as ``manifest.optim`` says.

    ``total_steps`` (default ``manifest.schedule.total_steps``) sets NuMuon's rank schedule.
    Groups carry ``lr_scale`` so ``set_lr(opt, lr_at(schedule, manifest.optim.lr, step))``
    gives the AdamW groups of Muon/NuMuon ``aux_lr`` scaled by the same schedule.
    """
    o: OptimConfig = manifest.optim
    if o.name in ("adamw", "adam", "nadam", "sgd"):
        groups = _adam_groups(module, o.weight_decay)
        if o.name == "adamw":
            return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)
        if o.name == "adam":
            return torch.optim.Adam(groups, lr=o.lr, betas=o.betas, eps=o.eps)
        if o.name == "nadam":
            return torch.optim.NAdam(groups, lr=o.lr, betas=o.betas, eps=o.eps, decoupled_weight_decay=True)
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.momentum > 0)
    if o.name not in ("muon", "numuon"):
        raise ValueError(f"optim.name: unknown optimizer {o.name!r}")
    params = dict(module.named_parameters())
    hidden = hidden_matrix_names(module)
    groups: list[dict] = []
    if hidden:
        groups.append({"params": [params[n] for n in hidden], "use_muon": True, "lr": o.lr,
                       "weight_decay": o.weight_decay, "lr_scale": 1.0})
    for g in _adam_groups(module, o.weight_decay, exclude=set(hidden)):
        g.update(use_muon=False, aux=o.aux_optimizer, lr=o.aux_lr, lr_scale=o.aux_lr / o.lr)
        groups.append(g)
    common = dict(lr=o.lr, momentum=o.momentum, betas=o.betas, eps=o.eps)
    if o.name == "muon":
        return Muon(groups, **common)
    return NuMuon(groups, **common, total_steps=total_steps or manifest.schedule.total_steps,
                  rank_start=o.rank_start, rank_final=o.rank_final, rank_hold_frac=o.rank_hold_frac,
                  rank_decay_end_frac=o.rank_decay_end_frac, seed=manifest.run.seed)
