"""Subspace Networks (docs/REFERENCES.md §1): the exact boundary codec and the constants it is built on.

Every residual writer of a constrained stage has its column space in span(U), and the token
embedding is ``T[x] + U·Zemb[x]``, so at every layer ``h = T[x] + U·c`` with ``c`` of width
``k`` (the manifest's ``subspace.k``, coordinates per token). A stage boundary therefore sends
only ``c`` (plus the token ids, which the next stage needs anyway) and the receiver rebuilds
``h`` exactly:

    encode:  c = (h − T[x]) · U          (B, L, k)
    decode:  h = c · Uᵀ + T[x]           (B, L, d)

Backward is free: decoding inside the receiver's autograd graph makes ``∂L/∂c = ∂L/∂h · U``
(i.e. Uᵀ∂L/∂h per token), k values per token again.

U (d×k, orthonormal columns) and T (V×d, frozen random table) are never trained, averaged or
sent: every peer derives them from the run seed. They are generated on the CPU in float64 with
a seeded ``torch.Generator`` and only then cast to float32, so every machine and device gets the
same bits (the cast absorbs last-ulp differences of float64 LAPACK builds).
``codec_fingerprint`` hashes them so peers can check that claim at handshake time.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor, nn

__all__ = [
    "derive_seed",
    "make_basis",
    "make_token_table",
    "SubspaceCodec",
    "DenseCodec",
    "make_codec",
    "project_off",
    "codec_fingerprint",
    "id_bytes",
    "wire_bytes_per_token",
]


def derive_seed(seed: int, purpose: str) -> int:
    """A 63-bit seed for ``purpose`` derived from the run seed (stable across Python versions)."""
    digest = hashlib.sha256(f"swarm-node:{int(seed)}:{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _gaussian64(shape: tuple[int, ...], seed: int) -> Tensor:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64, device="cpu")


def make_basis(d: int, k: int, seed: int) -> Tensor:
    """Orthonormal basis U ∈ R^{d×k} (float32, CPU): QR of a seeded Gaussian, signs fixed.

    The sign fix (diag(R) > 0) makes the factorisation unique, so U depends on the Gaussian
    alone and not on the LAPACK build's sign convention.
    """
    if not 0 < k <= d:
        raise ValueError(f"make_basis: need 0 < k <= d, got d={d}, k={k}")
    g = _gaussian64((d, k), seed)
    q, r = torch.linalg.qr(g, mode="reduced")
    signs = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(torch.float64)
    return (q * signs).to(torch.float32).contiguous()


def make_token_table(vocab: int, d: int, seed: int, scale: float = 1.0) -> Tensor:
    """Frozen random token table T ∈ R^{V×d} (float32, CPU), entries N(0, scale²/d).

    A row therefore has norm ≈ ``scale``; it carries each token's identity in the d − k
    directions that the trained part of the residual stream cannot reach.
    """
    if vocab <= 0 or d <= 0:
        raise ValueError(f"make_token_table: need vocab > 0 and d > 0, got {vocab}, {d}")
    if scale < 0:
        raise ValueError(f"make_token_table: scale must be >= 0, got {scale}")
    t = _gaussian64((vocab, d), seed) * (scale / d**0.5)
    return t.to(torch.float32).contiguous()


def _no_autocast(device_type: str):
    return torch.autocast(device_type=device_type, enabled=False)


class SubspaceCodec(nn.Module):
    """Exact boundary codec: ``encode`` to k coordinates, ``decode`` back to the d-dim stream.

    U and T are non-persistent float32 buffers (derived from the seed, not part of a stage's
    state). Both directions compute in float32 even under bf16 autocast; the caller casts the
    code for the wire.
    """

    def __init__(self, U: Tensor, T: Tensor):
        super().__init__()
        if U.ndim != 2 or T.ndim != 2 or U.shape[0] != T.shape[1]:
            raise ValueError(f"SubspaceCodec: U {tuple(U.shape)} and T {tuple(T.shape)} do not match")
        self.register_buffer("U", U.to(torch.float32), persistent=False)
        self.register_buffer("T", T.to(torch.float32), persistent=False)
        self.d, self.k = U.shape
        self.vocab_size = T.shape[0]

    def encode(self, h: Tensor, ids: Tensor) -> Tensor:
        """c = (h − T[ids]) · U, float32 (B, L, k)."""
        with _no_autocast(h.device.type):
            return (h.float() - self.T[ids]) @ self.U

    def decode(self, c: Tensor, ids: Tensor) -> Tensor:
        """h = c · Uᵀ + T[ids], float32 (B, L, d); autograd gives ∂L/∂c = ∂L/∂h · U."""
        with _no_autocast(c.device.type):
            return c.float() @ self.U.T + self.T[ids]

    def extra_repr(self) -> str:
        return f"d={self.d}, k={self.k}, vocab={self.vocab_size}"


class DenseCodec(nn.Module):
    """Baseline with the same interface: the boundary is the full residual stream (k = d).

    It may carry the run's token table T (``T`` buffer, or None) for the dense model's embedding
    ``T[x] + E[x]``; encode/decode are the identity and never use it.
    """

    def __init__(self, d: int, T: Tensor | None = None):
        super().__init__()
        self.d = self.k = d
        self.register_buffer("T", None if T is None else T.to(torch.float32), persistent=False)

    def encode(self, h: Tensor, ids: Tensor) -> Tensor:
        return h.float()

    def decode(self, c: Tensor, ids: Tensor) -> Tensor:
        return c.float()

    def extra_repr(self) -> str:
        return f"d={self.d}"


def make_codec(manifest) -> SubspaceCodec | DenseCodec:
    """The codec of a run: Subspace when ``manifest.subspace.enabled``, else dense.

    Both carry the frozen token table T (scale ``subspace.token_table_scale``): the dense model
    uses it too, so that dense and subspace runs differ only in the constraint. A morphing run
    (``morph.every > 0``) gets T with its span(U) part removed (:func:`project_off`).
    """
    md, sub = manifest.model, manifest.subspace
    T = make_token_table(
        md.vocab_size, md.d_model, derive_seed(manifest.run.seed, "token_table"), sub.token_table_scale
    )
    if not sub.enabled:
        return DenseCodec(md.d_model, T)
    U = make_basis(md.d_model, manifest.k, derive_seed(manifest.run.seed, "basis"))
    if getattr(manifest, "morph", None) is not None and manifest.morph.enabled:
        T = project_off(T, U)
    return SubspaceCodec(U, T)


def project_off(T: Tensor, U: Tensor) -> Tensor:
    """``T − (T·U)·Uᵀ`` (float64, cast to float32): the table with its span(U) part removed.

    A morphing run (stages/morph.py) uses it: the morph rotates span(U), and a public table with a
    part there would be a fixed reference every stage's weights and activations could be aligned
    to; with it removed, span(U) holds only trained content (docs/MORPH.md)."""
    t, u = T.double(), U.double()
    return (t - (t @ u) @ u.T).to(torch.float32).contiguous()


def codec_fingerprint(codec: SubspaceCodec | DenseCodec) -> str:
    """Hex SHA-256 of the codec's constants (U and T bytes), for peers to compare."""
    h = hashlib.sha256()
    if isinstance(codec, SubspaceCodec):
        for t in (codec.U, codec.T):
            t = t.detach().to("cpu", torch.float32).contiguous()
            h.update(str(tuple(t.shape)).encode())
            h.update(t.numpy().tobytes())
    else:
        h.update(f"dense:{codec.d}".encode())
        if codec.T is not None:
            h.update(codec.T.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def id_bytes(vocab_size: int) -> int:
    """Bytes per token id on the wire: the smallest unsigned integer type holding the vocab."""
    for nbytes in (1, 2, 4):
        if vocab_size <= 1 << (8 * nbytes):
            return nbytes
    return 8


def wire_bytes_per_token(k: int, vocab_size: int, value_bytes: int = 2) -> dict[str, int]:
    """Bytes crossing one boundary per token: forward sends k values + the id, backward k values."""
    return {"fwd": k * value_bytes + id_bytes(vocab_size), "bwd": k * value_bytes}
