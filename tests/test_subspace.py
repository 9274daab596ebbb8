"""The Subspace codec: derived constants, exact encode/decode, backward, and wire sizes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from stages import SubspaceCodec, wire_bytes_per_token
from stages.subspace import (
    DenseCodec,
    codec_fingerprint,
    derive_seed,
    id_bytes,
    make_basis,
    make_codec,
    make_token_table,
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_basis_is_orthonormal_seeded_float32():
    U = make_basis(256, 8, 11)
    assert U.dtype == torch.float32 and U.shape == (256, 8)
    eye = U.double().T @ U.double()
    assert (eye - torch.eye(8, dtype=torch.float64)).abs().max() < 1e-6
    assert torch.equal(U, make_basis(256, 8, 11))
    assert not torch.equal(U, make_basis(256, 8, 12))


def test_basis_and_table_reject_bad_shapes():
    with pytest.raises(ValueError, match="0 < k <= d"):
        make_basis(16, 0, 1)
    with pytest.raises(ValueError, match="0 < k <= d"):
        make_basis(16, 17, 1)
    with pytest.raises(ValueError, match="scale"):
        make_token_table(4, 16, 1, scale=-1.0)


def test_token_table_scale_sets_row_norm():
    T = make_token_table(512, 256, 3, scale=2.0)
    assert T.dtype == torch.float32 and T.shape == (512, 256)
    norms = T.norm(dim=1)
    assert abs(norms.mean().item() - 2.0) < 0.05


def test_derive_seed_separates_purposes():
    assert derive_seed(1, "basis") == derive_seed(1, "basis")
    assert derive_seed(1, "basis") != derive_seed(1, "token_table")
    assert derive_seed(1, "basis") != derive_seed(2, "basis")
    assert 0 <= derive_seed(1, "basis") < 2**63


_CHILD = """
import sys
from stages import load_manifest
from stages.subspace import make_codec, codec_fingerprint
print(codec_fingerprint(make_codec(load_manifest(sys.argv[1]))))
"""


@pytest.mark.timeout(60)
def test_constants_bitwise_identical_in_another_process(default_manifest):
    """U and T come out with the same bytes in a separate interpreter (fresh RNG state)."""
    torch.manual_seed(999)  # the global RNG must not matter
    here = codec_fingerprint(make_codec(default_manifest))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, "default"], capture_output=True, text=True, timeout=50, check=True
    )
    assert out.stdout.strip() == here
    other_seed = default_manifest.replace(run={"seed": default_manifest.run.seed + 1})
    assert codec_fingerprint(make_codec(other_seed)) != here


def _codec(test_manifest) -> SubspaceCodec:
    codec = make_codec(test_manifest)
    assert isinstance(codec, SubspaceCodec)
    return codec


def test_encode_decode_exact_on_the_subspace(test_manifest):
    codec = _codec(test_manifest)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, codec.vocab_size, (3, 17), generator=g)
    c = torch.randn(3, 17, codec.k, generator=g) * 10
    h = c @ codec.U.T + codec.T[ids]  # a point of T[x] + span(U)
    c2 = codec.encode(h, ids)
    assert c2.shape == (3, 17, codec.k) and c2.dtype == torch.float32
    assert _rel(c2, c) <= 1e-5
    assert _rel(codec.decode(c2, ids), h) <= 1e-5


def test_encode_is_lossy_off_the_subspace(test_manifest):
    """Sanity: the codec is exact only because the model keeps h in the subspace."""
    codec = _codec(test_manifest)
    ids = torch.randint(0, codec.vocab_size, (2, 5))
    h = torch.randn(2, 5, codec.d)
    assert _rel(codec.decode(codec.encode(h, ids), ids), h) > 0.5


def test_decode_gradient_is_U_transpose_dL_dh(test_manifest):
    codec = _codec(test_manifest)
    ids = torch.randint(0, codec.vocab_size, (2, 9))
    c = torch.randn(2, 9, codec.k, requires_grad=True)
    dL_dh = torch.randn(2, 9, codec.d)
    (codec.decode(c, ids) * dL_dh).sum().backward()
    expected = torch.einsum("dk,bld->blk", codec.U, dL_dh)
    assert c.grad.shape == (2, 9, codec.k)
    assert (c.grad - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_codec_stays_float32_under_bf16_autocast(test_manifest):
    codec = _codec(test_manifest)
    ids = torch.randint(0, codec.vocab_size, (2, 4))
    c = torch.randn(2, 4, codec.k)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = codec.decode(c, ids)
        c2 = codec.encode(h, ids)
    assert h.dtype == torch.float32 and c2.dtype == torch.float32
    assert _rel(c2, c) <= 1e-5


def test_constants_are_not_state(test_manifest):
    """U and T are derived, never checkpointed, averaged or sent."""
    codec = _codec(test_manifest)
    assert codec.state_dict() == {}
    assert {n for n, _ in codec.named_buffers()} == {"U", "T"}
    assert list(codec.parameters()) == []


def test_dense_codec_and_make_codec_switch(test_manifest):
    dense_m = test_manifest.replace(subspace={"enabled": False})
    codec = make_codec(dense_m)
    assert isinstance(codec, DenseCodec) and codec.k == test_manifest.model.d_model
    h = torch.randn(2, 3, codec.k, dtype=torch.float64)
    ids = torch.zeros(2, 3, dtype=torch.long)
    assert torch.equal(codec.decode(codec.encode(h, ids), ids), h.float())
    assert codec_fingerprint(codec) != codec_fingerprint(make_codec(test_manifest))
    sub = make_codec(test_manifest)
    assert sub.k == test_manifest.k == test_manifest.subspace.k == 8


def test_wire_bytes():
    assert id_bytes(256) == 1 and id_bytes(257) == 2 and id_bytes(65536) == 2 and id_bytes(65537) == 4
    assert wire_bytes_per_token(8, 256) == {"fwd": 17, "bwd": 16}
    assert wire_bytes_per_token(256, 256) == {"fwd": 513, "bwd": 512}
    assert wire_bytes_per_token(40, 32000, value_bytes=4) == {"fwd": 162, "bwd": 160}


# scripts/bench_subspace.py --quick and its figures: tests/test_bench_smoke.py
