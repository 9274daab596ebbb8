"""Unextractable weights: morph the basis between stages (docs/MORPH.md, docs/REFERENCES.md).

Between consecutive stages insert ``I = M·M⁻¹`` with a fresh random k×k transform M (k = the
boundary width: ``subspace.k``, or d_model for a dense run): the sender folds M into its output
side, the receiver M⁻¹ into its input side, both discard M. The chained stages compute the same
function, but weights taken at different morph epochs no longer fit together without the product
of the transforms in between, which nobody keeps.

How a fold works here (row vectors; torch weights are (out, in), ``y = x·Wᵀ``):

- Every stage but the head has a *code frame*: with z = (h − T[x])·U the k code coordinates of
  its residual stream h, the stage keeps its stream in coordinates ``z·F`` for an orthogonal F of
  its own. Changing the frame by an orthogonal R (k×k) is the d×d rotation
  ``Q = I − U·Uᵀ + U·R·Uᵀ`` of the whole stream (identity off span(U); ``Q = R`` for a dense run):
  readers (``qkv_proj``, ``gate_proj``, ``up_proj``, ``lm_head``) become ``W·Q``, constrained
  writers ``Z ↦ Rᵀ·Z`` (``W = U·Z``), dense writers ``W ↦ Qᵀ·W``. The model's only norms are
  weightless RMSNorms, and ``rmsnorm(h·Q) = rmsnorm(h)·Q`` for orthogonal Q, so nothing else
  changes; a parameter of any other kind (a norm gain, a bias) makes the fold refuse.
  The token table T is left out of span(U) in a morphing run (stages/subspace.py
  ``project_off``), so ``T[x]·Q = T[x]``.
- ``Stage.morph_in`` (A) and ``Stage.morph_out`` (B), k×k float64 buffers: the stage decodes
  ``c·A`` and sends ``encode(h)·B``.
- :func:`fold_output` (sender): ``B ← B·M``. Nothing else changes.
- :func:`fold_input` (receiver): ``A ← M⁻¹·A``, then the frame turns by the orthogonal polar
  factor of A, so that A is symmetric positive definite again (exactly I for orthogonal M's):
  ``A = P·W`` → ``A ← P``, every morphed weight and its optimizer state by ``R = Wᵀ``, ``B ← Rᵀ·B``.
  The head has no input side and never turns its frame.

So the weights themselves only ever see orthogonal changes of basis, also for the
``conditioned`` kind (whose non-orthogonal part stays in A and B): the optimizer must commute
with them (SGD-momentum, Muon, NuMuon; not Adam; ``stages.manifest.morph_optimizer_problem``).
First-moment state (``momentum_buffer``, ``exp_avg``) transforms like the weight, NuMuon's
warm-start right singular vectors ``v`` by ``Qᵀ·v`` for a right-multiplied weight. A second
moment (``exp_avg_sq``) makes the fold refuse.

Precision: folds run in float64 on a :class:`MorphMaster` (float64 copy of the weights that picks
up the training updates made in between, ``master += p − cast(master)``) and are then cast; the
rounding of one cast never accumulates. ``compute_dtype=torch.float32`` without a master is the
naive variant (for the benchmark).

Each side of a boundary folds on its own, in its own process, from the same M:
:func:`transform_from_seed` derives M deterministically from an agreed secret.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor, nn

__all__ = [
    "MORPH_KINDS",
    "MorphError",
    "MorphMaster",
    "transform_from_seed",
    "boundary_secret",
    "fold_output",
    "fold_input",
    "morph_chain",
    "morph_width",
    "private_init",
]

MORPH_KINDS = ("orthogonal", "conditioned")

# first-moment optimizer state: transforms exactly like the weight it belongs to
_LIKE_WEIGHT = ("momentum_buffer", "exp_avg")
# per-coordinate state that has no transformed counterpart
_NOT_EQUIVARIANT = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum")


class MorphError(ValueError):
    """A fold cannot be done (wrong side, wrong shape, a parameter or optimizer it cannot follow)."""


# ---------------------------------------------------------------------------------------------
# Transforms


def _seed_int(seed: int | bytes | str, purpose: str) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, bytes, bytearray, str)):
        raise MorphError(f"transform seed must be int, bytes or str, got {type(seed).__name__}")
    raw = seed.encode() if isinstance(seed, str) else bytes(seed) if not isinstance(seed, int) else str(seed).encode()
    kind = b"s" if isinstance(seed, str) else b"b" if not isinstance(seed, int) else b"i"
    digest = hashlib.sha256(b"swarm-node:morph:" + purpose.encode() + b":" + kind + raw).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _haar(dim: int, gen: torch.Generator) -> Tensor:
    g = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    return q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(torch.float64)


def transform_from_seed(seed: int | bytes | str, dim: int, kind: str = "orthogonal", *,
                        epsilon: float = 0.1) -> Tensor:
    """A random ``dim × dim`` transform (float64, CPU), the same on every machine for one seed.

    - ``"orthogonal"``: Haar-distributed on O(dim): QR of a Gaussian with the signs of diag(R)
      made positive (without the sign fix QR is not Haar, and depends on the LAPACK build).
    - ``"conditioned"``: ``U·diag(e^u)·Vᵀ`` with U, V Haar and ``u ~ U[−ε, ε]``: invertible with
      condition number ≤ e^{2ε}.

    ``seed`` is the secret both sides of a boundary agreed on (bytes, str or int); it is hashed
    with SHA-256, so any length works and nothing of it shows in the result's generator state.
    The Gaussian comes from torch's CPU generator (bit-identical across machines); QR and SVD
    in float64 may differ in the last bits between LAPACK builds, far below float32 rounding.
    """
    if kind not in MORPH_KINDS:
        raise MorphError(f"unknown transform kind {kind!r}; known: {', '.join(MORPH_KINDS)}")
    if not isinstance(dim, int) or dim < 1:
        raise MorphError(f"transform dimension must be a positive integer, got {dim!r}")
    if not 0 <= epsilon < 1:
        raise MorphError(f"epsilon must be in [0, 1), got {epsilon}")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_seed_int(seed, f"{kind}:{dim}"))
    q = _haar(dim, gen)
    if kind == "orthogonal":
        return q
    v = _haar(dim, gen)
    u = (torch.rand(dim, generator=gen, dtype=torch.float64) * 2 - 1) * epsilon
    return (q * u.exp()) @ v.T


def boundary_secret(secret: bytes | str | int, epoch: int, boundary: int) -> bytes:
    """The seed of boundary ``boundary`` (between stages b and b+1) at morph ``epoch``, derived
    from one run-local ``secret`` (for a single process that morphs a whole chain)."""
    s = secret.encode() if isinstance(secret, str) else str(secret).encode() if isinstance(secret, int) else bytes(secret)
    return hashlib.sha256(b"swarm-node:morph-boundary:" + s + f":{int(epoch)}:{int(boundary)}".encode()).digest()


def morph_width(stage: nn.Module) -> int:
    """The dimension of the transforms at this stage's boundaries (the code width k)."""
    return int(stage.codec.k)


@torch.no_grad()
def private_init(stage: nn.Module, secret: bytes | str | int) -> None:
    """Re-draw every parameter of ``stage`` from ``secret``: N(0, init_std²) as ``build_stage`` does,
    but from numbers nobody else can compute.

    The public initialisation (from the run seed) is a reference every stage's frame can be
    aligned to by Procrustes while the weights still resemble it (docs/MORPH.md, measured by
    scripts/bench_morph.py); a morphing run's non-head stages start from a private one instead.
    Replicas of one stage must share the secret (or take the state from the first replica).
    """
    std = stage.manifest.model.init_std
    name_of = getattr(stage, "global_name", lambda n: n)
    for name, p in stage.named_parameters():
        gen = torch.Generator(device="cpu")
        gen.manual_seed(_seed_int(secret, f"private-init:{name_of(name)}"))
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device, p.dtype) * std)


# ---------------------------------------------------------------------------------------------
# The high-precision master copy


class MorphMaster:
    """Float64 copy of a stage's parameters; folds run on it and are cast into the parameters.

    Training changes the float32 parameters in between; :meth:`sync` adds those changes
    (``p − cast(master)``, exact in float64) to the master before a fold, so the master keeps
    the bits below float32 and the rounding of the cast never accumulates over morphs. Costs
    8 bytes per parameter. Not checkpointed: after a restart a new master starts from the
    (float32) parameters, one rounding.
    """

    def __init__(self, stage: nn.Module):
        self.stage = stage
        self.tensors: dict[str, Tensor] = {n: p.detach().to(torch.float64).clone()
                                           for n, p in stage.named_parameters()}

    @torch.no_grad()
    def sync(self) -> None:
        """Pull the parameter changes made since the last fold into the master."""
        for name, p in self.stage.named_parameters():
            m = self.tensors[name]
            if m.shape != p.shape or m.device != p.device:
                raise MorphError(f"MorphMaster: parameter {name} changed shape or device")
            m.add_(p.detach().to(torch.float64) - m.to(p.dtype).to(torch.float64))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


# ---------------------------------------------------------------------------------------------
# Folding


def _check_transform(stage: nn.Module, M: Tensor) -> Tensor:
    k = morph_width(stage)
    if not isinstance(M, Tensor) or M.shape != (k, k):
        raise MorphError(f"stage {getattr(stage, 'index', '?')}: transform must be a {k}×{k} tensor "
                         f"(the boundary width), got {tuple(M.shape) if isinstance(M, Tensor) else type(M).__name__}")
    if not torch.isfinite(M).all():
        raise MorphError("transform has non-finite entries")
    return M.detach().to(torch.float64)


@torch.no_grad()
def fold_output(stage: nn.Module, M: Tensor, *, optimizer=None, master: MorphMaster | None = None) -> None:
    """Sender side: from now on this stage's output code is multiplied by M (``B ← B·M``).

    Only the k×k output map changes; the stage's weights, optimizer state and master do not
    (the keyword arguments are accepted so that both sides can be called alike).
    """
    if getattr(stage, "morph_out", None) is None:
        raise MorphError(f"stage {getattr(stage, 'index', '?')} has no output side to morph "
                         "(the tail, or a run with morph.every = 0)")
    M = _check_transform(stage, M)
    B = stage.morph_out
    B.copy_(B.to(torch.float64) @ M.to(B.device))


def _polar(A: Tensor) -> tuple[Tensor, Tensor]:
    """``A = P·W`` with P symmetric positive definite and W orthogonal (float64)."""
    x, s, yh = torch.linalg.svd(A)
    return (x * s) @ x.T, x @ yh


@torch.no_grad()
def fold_input(stage: nn.Module, M: Tensor, *, optimizer=None, master: MorphMaster | None = None,
               compute_dtype: torch.dtype = torch.float64) -> Tensor:
    """Receiver side: the code this stage receives is from now on multiplied by M; fold ``M⁻¹``.

    ``A ← M⁻¹·A``; then the stage's code frame turns by ``R = Wᵀ``, the orthogonal polar factor of
    A (``A = P·W``), which leaves ``A = P``: every morphed weight, its gradient and its optimizer
    state (``optimizer``: the stage's own) transform by R, and ``B ← Rᵀ·B``. With ``master`` the
    weights are folded on the master copy (after :meth:`MorphMaster.sync`) and cast; without
    one they are folded from the parameters in ``compute_dtype``. Returns R (float64).
    """
    A = getattr(stage, "morph_in", None)
    if A is None:
        raise MorphError(f"stage {getattr(stage, 'index', '?')} has no input side to morph "
                         "(the head, or a run with morph.every = 0)")
    M = _check_transform(stage, M)
    roles = _parameter_roles(stage)
    if optimizer is not None:
        _check_optimizer(stage, optimizer)
    if master is not None:
        master.sync()  # before anything changes: a refusal leaves the stage as it was
    A_new = torch.linalg.solve(M.to(A.device), A.to(torch.float64))
    P, W = _polar(A_new)
    R = W.T.contiguous()
    A.copy_(P)
    if stage.morph_out is not None:
        stage.morph_out.copy_(R.T.to(stage.morph_out.device) @ stage.morph_out.to(torch.float64))
    U = getattr(stage.codec, "U", None)
    params = dict(stage.named_parameters())
    state_of = {}
    if optimizer is not None:
        state_of = {id(p): optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"]}
    if optimizer is not None and isinstance(getattr(optimizer, "_dir_cache", None), dict):
        optimizer._dir_cache.clear()  # Muon's cached update directions are in the old basis
    rots: dict = {}

    def rotation(device, dtype) -> _Rotation:
        key = (device, dtype)
        return rots.get(key) or rots.setdefault(key, _Rotation(R, U, device, dtype))

    for name, role in roles.items():
        p = params[name]
        rot = rotation(p.device, torch.float64)
        if master is not None:
            m = master.tensors[name]
            m.copy_(rot.apply(m, role))
            p.copy_(m.to(p.dtype))
        else:
            p.copy_(rotation(p.device, compute_dtype).apply(p.to(compute_dtype), role).to(p.dtype))
        if p.grad is not None:
            p.grad.copy_(rot.apply(p.grad, role).to(p.grad.dtype))
        st = state_of.get(id(p))
        if st:
            for key, value in st.items():
                if not isinstance(value, Tensor):
                    continue
                if key in _LIKE_WEIGHT and value.shape == p.shape:
                    value.copy_(rot.apply(value, role).to(value.dtype))
                elif key == "v" and value.ndim == 2:  # NuMuon warm start: right singular vectors
                    if role == "reader":
                        value.copy_(rot.right_t(value.to(torch.float64)).to(value.dtype))
    return R


class _Rotation:
    """The frame change ``Q = I − U·Uᵀ + U·R·Uᵀ`` (or ``Q = R`` without U) applied to weights."""

    def __init__(self, R: Tensor, U: Tensor | None, device, dtype=torch.float64):
        self.dtype = dtype
        self.R = R.to(device=device, dtype=dtype)
        self.U = None if U is None else U.to(device=device, dtype=dtype)

    def right(self, W: Tensor) -> Tensor:
        """``W·Q`` (W: (out, d))."""
        if self.U is None:
            return W @ self.R
        WU = W @ self.U
        return W + (WU @ self.R - WU) @ self.U.T

    def right_t(self, V: Tensor) -> Tensor:
        """``Qᵀ·V`` (V: (d, s)): how right singular vectors of W follow ``W ↦ W·Q``."""
        if self.U is None:
            return self.R.T @ V
        UV = self.U.T @ V
        return V + self.U @ (self.R.T @ UV - UV)

    def apply(self, W: Tensor, role: str) -> Tensor:
        W = W.to(self.dtype)
        if role == "reader":
            return self.right(W)
        if role == "writer_code":  # Z (k, in): Z ↦ Rᵀ·Z
            return self.R.T @ W
        if role == "writer_dense":  # W (d, in): W ↦ Qᵀ·W
            return self.right(W.T).T
        raise MorphError(f"unknown role {role}")


def _parameter_roles(stage: nn.Module) -> dict[str, str]:
    """Every parameter of a non-head stage and how a frame change acts on it; refuses unknowns."""
    roles: dict[str, str] = {}
    for i, block in enumerate(stage.blocks):
        pre = f"blocks.{i}."
        for lin in ("attn.qkv_proj", "mlp.gate_proj", "mlp.up_proj"):
            roles[pre + lin + ".weight"] = "reader"
        for w, writer in (("attn.out_proj", block.attn.out_proj), ("mlp.down_proj", block.mlp.down_proj)):
            roles[pre + w + ".weight"] = "writer_code" if writer.constrained else "writer_dense"
    if getattr(stage, "lm_head", None) is not None:
        roles["lm_head.weight"] = "reader"
    names = [n for n, _ in stage.named_parameters()]
    unknown = [n for n in names if n not in roles]
    if unknown:
        raise MorphError(f"stage {getattr(stage, 'index', '?')}: cannot morph parameter(s) {unknown[:4]}: only "
                         "readers, writers and the LM head under weightless RMSNorms are known to commute "
                         "with a change of basis (a norm gain or bias would need folding rules)")
    missing = [n for n in roles if n not in names]
    if missing:
        raise MorphError(f"stage {getattr(stage, 'index', '?')}: expected parameters missing: {missing[:4]}")
    return roles


def _check_optimizer(stage: nn.Module, optimizer) -> None:
    """Refuse an optimizer whose state cannot follow the frame change (named)."""
    own = {id(p): n for n, p in stage.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in own:
                continue
            st = optimizer.state.get(p) or {}
            bad = [k for k in st if k in _NOT_EQUIVARIANT]
            if bad or (not st and ("betas" in group and not group.get("use_muon", False)
                                   and group.get("aux", "adamw") != "sgd")):
                raise MorphError(
                    f"stage {getattr(stage, 'index', '?')}: optimizer {type(optimizer).__name__} keeps a "
                    f"per-coordinate second moment for {own[id(p)]} (group with lr {group.get('lr')}), which "
                    "does not follow a change of basis; morph with SGD-momentum, Muon or NuMuon "
                    "(optim.aux_optimizer = \"sgd\")"
                )


# ---------------------------------------------------------------------------------------------
# A whole chain in one process


def morph_chain(stages, secret: bytes | str | int, epoch: int, *, kind: str = "orthogonal",
                epsilon: float = 0.1, optimizers=None, masters=None,
                compute_dtype: torch.dtype = torch.float64) -> list[Tensor]:
    """Morph every boundary of a chain of stages once (one morph epoch), in one process.

    Boundary b (stages b → b+1) gets ``transform_from_seed(boundary_secret(secret, epoch, b), k,
    kind)``; stage b folds it into its output side, stage b+1 its inverse into its input side.
    ``optimizers`` / ``masters``: per stage (or None). Returns the transforms (for tests: a caller
    that wants the weights unextractable must not keep them, nor the secret).
    """
    n = len(stages)
    optimizers = list(optimizers) if optimizers is not None else [None] * n
    masters = list(masters) if masters is not None else [None] * n
    if len(optimizers) != n or len(masters) != n:
        raise MorphError("morph_chain: one optimizer and one master (or None) per stage")
    out = []
    for b in range(n - 1):
        M = transform_from_seed(boundary_secret(secret, epoch, b), morph_width(stages[b]), kind, epsilon=epsilon)
        fold_output(stages[b], M)
        fold_input(stages[b + 1], M, optimizer=optimizers[b + 1], master=masters[b + 1],
                   compute_dtype=compute_dtype)
        out.append(M)
    return out
