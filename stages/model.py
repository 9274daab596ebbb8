"""The model: a LLaMA-style decoder, and its split into pipeline stages.

Read top to bottom: RMSNorm, RoPE, the residual writers, attention, SwiGLU, the block, the
unsplit ``Transformer``, then ``Stage`` (one contiguous range of blocks plus the boundary codec)
and ``split_model`` / ``build_stage``.

Subspace Networks (docs/REFERENCES.md §1). Each block is

    h ← h + rmsnorm(Attn(rmsnorm(h)))
    h ← h + rmsnorm(FFN(rmsnorm(h)))

with a weightless RMSNorm: applied to a branch output it only rescales each token, so a branch
whose output lies in span(U) adds a vector in span(U). In a *constrained* block the two residual
writers (attention ``out_proj``, FFN ``down_proj``) are reparametrised ``W = U·Z`` with Z
trainable, and the initial residual is ``h0 = T[x] + U·Zemb[x]``; hence at every layer of a
constrained stage ``h = T[x] + U·c`` and the boundary codec (stages/subspace.py) is exact. The
tail's blocks are constrained only if ``subspace.constrain_tail`` (nothing leaves the tail but a
loss). Positions enter only through RoPE, never through an additive table.

Pre-norm variant (``model.block_norm = "pre"``; the default is ``"peri"``, the block above):
the standard pre-norm block ``h ← h + Attn(rmsnorm(h))``, ``h ← h + FFN(rmsnorm(h))``. The
writers still output vectors in span(U), so the subspace invariant and the exact codec hold
unchanged; what changes is that a branch's contribution is no longer renormalised to RMS 1, so
the residual stream grows with depth and so does curvature. It exists as the setting of the
architecture warm-up benchmark (papers §5 studies standard pre-norm transformers; the peri-norm
model barely spikes at any lr we tried, scripts/bench_optim.py).

Post-norm variant (``model.block_norm = "post"``, dense runs only): the original Transformer's
post-LN block, ``h ← rmsnorm(h + Attn(h))``, ``h ← rmsnorm(h + FFN(h))``, and the embedding is
normalised too, ``h0 = rmsnorm(T[x] + E[x])``, so every block sees a stream of RMS 1. The norm
rescales the whole stream, T[x] included, so ``h − T[x]`` leaves span(U) and the Subspace codec
would not be exact: the manifest refuses "post" unless ``subspace.enabled = false``. It is the
canonical depth-unstable block (deep post-LN is reported to fail without LR warm-up; here a deep
one stalls at the unigram loss, docs/TRAINING.md), the setting of the warm-up benchmark.

Dense variant (``subspace.enabled = false``): unconstrained writers and a full-width learned
embedding on top of the same frozen table, ``h0 = T[x] + E[x]``, so dense and subspace differ
only in the constraint. (Equivalent to a learned embedding initialised at T whose T part is
exempt from weight decay. With post-branch RMSNorm every branch adds a vector of RMS 1 per
channel, and a plain embedding initialised at std 0.02 is drowned by them.)

The subspace constants U and T are buffers of one ``codec`` module per Transformer / Stage and
are passed down to the writers at call time, so they exist once per module tree. Every
projection that multiplies by U runs in float32 even under bf16 autocast: the branch outputs
then lie in span(U) to float32 precision and encode/decode stay exact.

Initialisation is per parameter, from a seed derived from (run seed, global parameter name),
so ``build_stage(m, i)`` creates exactly the parameters ``split_model(build_model(m), m)[i]``
holds without ever building the other stages.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stages.manifest import KNOWN_BLOCK_NORMS
from stages.subspace import SubspaceCodec, derive_seed, make_codec

__all__ = [
    "rmsnorm",
    "rope_tables",
    "WriterLinear",
    "TokenEmbedding",
    "Attention",
    "SwiGLU",
    "Block",
    "Transformer",
    "Stage",
    "build_model",
    "split_model",
    "build_stage",
    "lm_loss",
    "is_constrained_layer",
    "count_parameters",
]


# ---------------------------------------------------------------------------------------------
# Pieces


def rmsnorm(x: Tensor, eps: float) -> Tensor:
    """Weightless RMSNorm, computed in float32: x / sqrt(mean(x²) + eps), per token."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (seq_len, head_dim/2), float32, for rotary position embedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + hd/2) of x (B, H, L, hd) by position-dependent angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


class WriterLinear(nn.Module):
    """A weight that writes into the residual stream, ``in_features -> d``.

    Constrained: ``weight`` is Z of shape (k, in) and the map is x ↦ U·(Z·x), i.e. W = U·Z; the
    product with U runs in float32. Unconstrained: ``weight`` is the ordinary (d, in) matrix.
    Either way ``weight`` is the only parameter, and zeroing it zeroes the branch.
    """

    def __init__(self, in_features: int, d: int, k: int | None):
        super().__init__()
        self.constrained = k is not None
        self.in_features, self.d = in_features, d
        self.weight = nn.Parameter(torch.empty(k if self.constrained else d, in_features))

    def forward(self, x: Tensor, U: Tensor | None) -> Tensor:
        y = F.linear(x, self.weight)
        if not self.constrained:
            return y
        with torch.autocast(device_type=y.device.type, enabled=False):
            return y.float() @ U.T

    def extra_repr(self) -> str:
        shape = "U·Z" if self.constrained else "dense"
        return f"in={self.in_features}, d={self.d}, {shape}, weight={tuple(self.weight.shape)}"


class TokenEmbedding(nn.Module):
    """Initial residual: ``T[x] + U·Zemb[x]`` (subspace; weight = Zemb (V, k)), ``T[x] + E[x]`` (dense).

    T is the frozen table (None: no table, h0 = E[x]).
    """

    def __init__(self, vocab_size: int, d: int, k: int | None):
        super().__init__()
        self.constrained = k is not None
        self.weight = nn.Parameter(torch.empty(vocab_size, k if self.constrained else d))

    def forward(self, ids: Tensor, U: Tensor | None, T: Tensor | None) -> Tensor:
        z = F.embedding(ids, self.weight).float()
        if self.constrained:
            with torch.autocast(device_type=z.device.type, enabled=False):
                z = z @ U.T
        return z if T is None else T[ids] + z


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE (``F.scaled_dot_product_attention``)."""

    def __init__(self, d: int, n_heads: int, k: int | None):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d // n_heads
        self.qkv_proj = nn.Linear(d, 3 * d, bias=False)
        self.out_proj = WriterLinear(d, d, k)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], U: Tensor | None) -> Tensor:
        B, L, d = x.shape
        qkv = self.qkv_proj(x).view(B, L, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, H, L, hd)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, L, d), U)


class SwiGLU(nn.Module):
    """FFN: down(silu(gate(x)) * up(x))."""

    def __init__(self, d: int, hidden: int, k: int | None):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = WriterLinear(hidden, d, k)

    def forward(self, x: Tensor, U: Tensor | None) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x), U)


class Block(nn.Module):
    """One decoder layer; ``norm`` says where its weightless RMSNorms sit:

    - ``"peri"`` (default): input and branch output, ``h + rmsnorm(f(rmsnorm(h)))`` (keeps h in
      T[x] + span(U));
    - ``"pre"``: the standard pre-norm layer ``h + f(rmsnorm(h))`` (no norm on the branch output);
    - ``"post"``: the original Transformer's post-norm layer ``rmsnorm(h + f(h))`` per sublayer
      (rescales the whole stream, so only for dense runs; the manifest enforces it).

    ``active = False`` makes the block an exact identity (architecture warm-up skips it,
    norms included). ``constrained`` says whether its writers are ``U·Z``.

    Zeroing ``output_projections()`` also makes the block an identity (rmsnorm(0) = 0), but in
    the peri-norm block not a gentle one: the post-branch norm's Jacobian at 0 is I/sqrt(eps),
    so the first update gives the branch its full RMS-1 output at once (Adam's step is
    sign-like, so it stays finite). In the pre-norm block the branch grows with its writers. In
    the post-norm block zero writers give ``rmsnorm(rmsnorm(h))``: the identity up to a relative
    ``eps / mean(h²)`` when h is already normalised (the output of a post-norm block, or the
    post-norm model's normalised embedding).
    """

    def __init__(self, d: int, n_heads: int, ffn_dim: int, eps: float, k: int | None, layer: int,
                 norm: str = "peri"):
        super().__init__()
        if norm not in KNOWN_BLOCK_NORMS:
            raise ValueError(f"Block: unknown norm placement {norm!r}")
        self.layer = layer  # global layer index
        self.eps = eps
        self.norm = norm
        self.constrained = k is not None
        self.active: bool = True
        self.attn = Attention(d, n_heads, k)
        self.mlp = SwiGLU(d, ffn_dim, k)

    def output_projections(self) -> list[WriterLinear]:
        """The residual writers ``[attn.out_proj, mlp.down_proj]`` (each has one param, ``weight``)."""
        return [self.attn.out_proj, self.mlp.down_proj]

    def forward(self, h: Tensor, rope: tuple[Tensor, Tensor], U: Tensor | None = None) -> Tensor:
        if not self.active:
            return h
        if self.norm == "pre":
            h = h + self.attn(rmsnorm(h, self.eps), rope, U)
            return h + self.mlp(rmsnorm(h, self.eps), U)
        if self.norm == "post":
            h = rmsnorm(h + self.attn(h, rope, U), self.eps)
            return rmsnorm(h + self.mlp(h, U), self.eps)
        h = h + rmsnorm(self.attn(rmsnorm(h, self.eps), rope, U), self.eps)
        h = h + rmsnorm(self.mlp(rmsnorm(h, self.eps), U), self.eps)
        return h

    def extra_repr(self) -> str:
        return f"layer={self.layer}, norm={self.norm}, constrained={self.constrained}, active={self.active}"


# ---------------------------------------------------------------------------------------------
# Layout rules and initialisation


def is_constrained_layer(manifest, layer: int) -> bool:
    """Whether global layer ``layer`` writes only into span(U) under this manifest."""
    sub = manifest.subspace
    if not sub.enabled:
        return False
    tail_start = manifest.stages.layout[-1][0]
    return sub.constrain_tail or layer < tail_start


def _make_block(manifest, layer: int) -> Block:
    md = manifest.model
    k = manifest.k if is_constrained_layer(manifest, layer) else None
    return Block(md.d_model, md.n_heads, md.ffn_dim, md.norm_eps, k, layer, norm=md.block_norm)


def _make_embedding(manifest) -> TokenEmbedding:
    md = manifest.model
    return TokenEmbedding(md.vocab_size, md.d_model, manifest.k if manifest.subspace.enabled else None)


def _init_params(module: nn.Module, manifest, global_name=lambda name: name) -> None:
    """Fill every parameter with N(0, init_std²) drawn from a seed of (run seed, global name)."""
    std = manifest.model.init_std
    with torch.no_grad():
        for name, p in module.named_parameters():
            gen = torch.Generator(device="cpu")
            gen.manual_seed(derive_seed(manifest.run.seed, f"init:{global_name(name)}"))
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def _initial_residual(embed: TokenEmbedding, ids: Tensor, U: Tensor | None, T: Tensor | None,
                      manifest) -> Tensor:
    """h0 = the embedding, normalised (weightless RMSNorm) in the post-norm model: every post-norm
    block then receives a stream of RMS 1, as it outputs one, so a block with zero writers (a
    just-unlocked one) is the identity up to eps also at the first layer."""
    h = embed(ids, U, T)
    md = manifest.model
    return rmsnorm(h, md.norm_eps) if md.block_norm == "post" else h


def _constants(codec) -> tuple[Tensor | None, Tensor | None]:
    """(U, T) of the run; U is None for a dense run."""
    if isinstance(codec, SubspaceCodec):
        return codec.U, codec.T
    return None, codec.T


# ---------------------------------------------------------------------------------------------
# The unsplit model


class Transformer(nn.Module):
    """The whole decoder, ids (B, L) -> logits (B, L, V). Never goes through the codec.

    ``codec`` only holds the run's constants U, T (non-persistent buffers).
    """

    def __init__(self, manifest):
        super().__init__()
        md = manifest.model
        self.manifest = manifest
        self.eps, self.head_dim, self.rope_theta = md.norm_eps, md.head_dim, md.rope_theta
        self.codec = make_codec(manifest)
        self.embed = _make_embedding(manifest)
        self.layers = nn.ModuleList(_make_block(manifest, i) for i in range(md.n_layers))
        self.lm_head = nn.Linear(md.d_model, md.vocab_size, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        U, T = _constants(self.codec)
        rope = rope_tables(ids.shape[1], self.head_dim, self.rope_theta, ids.device)
        h = _initial_residual(self.embed, ids, U, T, self.manifest)
        for block in self.layers:
            h = block(h, rope, U)
        return self.lm_head(rmsnorm(h, self.eps))


def build_model(manifest, device: torch.device | str | None = None) -> Transformer:
    """The unsplit model with its deterministic initialisation (from ``manifest.run.seed``)."""
    model = Transformer(manifest)
    _init_params(model, manifest)
    return model.to(device) if device is not None else model


# ---------------------------------------------------------------------------------------------
# Pipeline stages


class Stage(nn.Module):
    """Layers ``layer_range`` of the model plus the boundary codec.

    - head (index 0): ``forward(None, ids)`` embeds, runs its blocks, returns the code c (B, L, k)
    - body: ``forward(c, ids)`` decodes, runs its blocks, returns the next code
    - tail (last): ``forward(c, ids)`` decodes, runs its blocks, returns logits (B, L, V)
    A single-stage layout is head and tail at once: ids -> logits. Codes are float32.
    In a run that morphs (``manifest.morph.every > 0``) a stage also holds the k×k float64
    buffers ``morph_in`` (not the head: it decodes ``c·morph_in``) and ``morph_out`` (not the tail:
    it sends ``encode(h)·morph_out``), identity until stages/morph.py folds transforms into them.
    """

    def __init__(self, manifest, index: int):
        super().__init__()
        md, layout = manifest.model, manifest.stages.layout
        if not 0 <= index < len(layout):
            raise ValueError(f"stage index {index} out of range: the layout has {len(layout)} stages")
        self.manifest = manifest
        self.index, self.n_stages = index, len(layout)
        self.is_head, self.is_tail = index == 0, index == len(layout) - 1
        self.layer_range = range(*layout[index])
        self.eps, self.head_dim, self.rope_theta = md.norm_eps, md.head_dim, md.rope_theta
        self.codec = make_codec(manifest)
        self.embed = _make_embedding(manifest) if self.is_head else None
        self.blocks = nn.ModuleList(_make_block(manifest, i) for i in self.layer_range)
        self.lm_head = nn.Linear(md.d_model, md.vocab_size, bias=False) if self.is_tail else None
        # morphing (stages/morph.py): the k×k maps between the boundary codes and this stage's own
        # code frame, float64 (folded in float64); identity until the first morph. Only in a run
        # that morphs, so that other runs' state dicts are unchanged.
        morph = getattr(manifest, "morph", None)
        morphing = morph is not None and morph.enabled
        eye = torch.eye(self.codec.k, dtype=torch.float64)
        self.register_buffer("morph_in", eye.clone() if morphing and not self.is_head else None)
        self.register_buffer("morph_out", eye.clone() if morphing and not self.is_tail else None)

    @property
    def k(self) -> int:
        return self.codec.k

    def boundary_shape(self, batch: int, seq_len: int) -> tuple[int, int, int]:
        """Shape of the code this stage sends / receives: (B, L, k)."""
        return (batch, seq_len, self.codec.k)

    def global_name(self, local_name: str) -> str:
        """Name of a parameter in the unsplit Transformer (``blocks.0.x`` -> ``layers.2.x``)."""
        if local_name.startswith("blocks."):
            _, i, rest = local_name.split(".", 2)
            return f"layers.{self.layer_range[int(i)]}.{rest}"
        return local_name

    def forward(self, x: Tensor | None, ids: Tensor) -> Tensor:
        U, T = _constants(self.codec)
        rope = rope_tables(ids.shape[1], self.head_dim, self.rope_theta, ids.device)
        if self.is_head:
            h = _initial_residual(self.embed, ids, U, T, self.manifest)
        else:
            if x is None:
                raise ValueError(f"stage {self.index} is not the head: it needs the incoming code")
            if tuple(x.shape) != self.boundary_shape(*ids.shape):
                raise ValueError(
                    f"stage {self.index}: code shape {tuple(x.shape)} != expected "
                    f"{self.boundary_shape(*ids.shape)} for ids {tuple(ids.shape)}"
                )
            if self.morph_in is not None:
                x = _morph_code(x, self.morph_in)
            h = self.codec.decode(x, ids)
        for block in self.blocks:
            h = block(h, rope, U)
        if self.is_tail:
            return self.lm_head(rmsnorm(h, self.eps))
        c = self.codec.encode(h, ids)
        return c if self.morph_out is None else _morph_code(c, self.morph_out)

    def extra_repr(self) -> str:
        role = "head" if self.is_head else "tail" if self.is_tail else "body"
        if self.is_head and self.is_tail:
            role = "head+tail"
        return f"index={self.index}/{self.n_stages}, {role}, layers={list(self.layer_range)}"


def _morph_code(c: Tensor, M: Tensor) -> Tensor:
    """``c·M`` in float32 (autocast off): a boundary code through a stage's k×k morph map."""
    with torch.autocast(device_type=c.device.type, enabled=False):
        return c.float() @ M.to(torch.float32)


def split_model(model: Transformer, manifest) -> list[Stage]:
    """Stages holding copies of ``model``'s parameters; chained they compute exactly ``model``."""
    stages = []
    for index in range(manifest.n_stages):
        stage = Stage(manifest, index)
        if stage.is_head:
            stage.embed = copy.deepcopy(model.embed)
        stage.blocks = nn.ModuleList(copy.deepcopy(model.layers[i]) for i in stage.layer_range)
        if stage.is_tail:
            stage.lm_head = copy.deepcopy(model.lm_head)
        stage.to(next(model.parameters()).device)
        stages.append(stage)
    return stages


def build_stage(manifest, index: int, device: torch.device | str | None = None) -> Stage:
    """Stage ``index`` alone, initialised exactly as ``split_model(build_model(m), m)[index]``."""
    stage = Stage(manifest, index)
    _init_params(stage, manifest, stage.global_name)
    return stage.to(device) if device is not None else stage


def lm_loss(logits: Tensor, ids: Tensor) -> Tensor:
    """Mean next-token cross-entropy: logits[:, :-1] predict ids[:, 1:] (computed in float32)."""
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1))


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())

