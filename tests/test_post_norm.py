"""Post-norm blocks (``model.block_norm = "post"``, dense runs only): the block's formula, the
stage split, and the architecture warm-up properties (locked = exact identity with no update,
unlock preserves the function, also for the first block). The chained stages equal the unsplit
model in tests/test_model.py (variant "post-norm-dense")."""

from __future__ import annotations

import pytest
import torch

from stages import (
    ArchWarmup,
    ManifestError,
    build_model,
    build_optimizer,
    lm_loss,
    load_manifest,
    rope_tables,
)
from stages.model import rmsnorm
from stages.subspace import DenseCodec
from tests.helpers.warmup import trained_then_unlocked, warmup_ids, warmup_step


def _post(**warmup):
    m = load_manifest("test").replace(model={"block_norm": "post"}, subspace={"enabled": False},
                                      optim={"name": "adamw", "lr": 1e-2, "weight_decay": 0.5})
    if warmup:
        m = m.replace(warmup=dict(enabled=True, **warmup))
    return m


def test_manifest_refuses_post_norm_with_the_subspace_codec():
    m = load_manifest("test")
    assert m.subspace.enabled
    with pytest.raises(ManifestError, match=r"model\.block_norm: 'post'.*subspace\.enabled = false"):
        m.replace(model={"block_norm": "post"})
    # a dense run accepts it; unknown placements are still refused
    assert _post().model.block_norm == "post"
    with pytest.raises(ManifestError, match="unknown placement"):
        m.replace(model={"block_norm": "sandwich"}, subspace={"enabled": False})


def test_post_norm_block_formula_and_normalised_embedding():
    m = _post()
    model = build_model(m)
    assert isinstance(model.codec, DenseCodec) and all(b.norm == "post" for b in model.layers)
    L, eps = m.model.seq_len, m.model.norm_eps
    rope = rope_tables(L, m.model.head_dim, m.model.rope_theta)
    h = 3.0 * torch.randn(2, L, m.model.d_model)
    blk = model.layers[0]
    with torch.no_grad():
        a = rmsnorm(h + blk.attn(h, rope, None), eps)
        want = rmsnorm(a + blk.mlp(a, None), eps)
        out = blk(h, rope, None)
        assert torch.allclose(out, want, atol=1e-6)
        assert torch.allclose(out.pow(2).mean(-1), torch.ones(2, L), atol=1e-4)  # RMS 1 per token
        # the post-norm model's embedding is normalised too: with every block locked the model
        # is lm_head(rmsnorm(rmsnorm(T[x] + E[x])))
        ids = warmup_ids(0, L=L)
        for b in model.layers:
            b.active = False
        h0 = rmsnorm(model.embed(ids, None, model.codec.T), eps)
        assert torch.allclose(model(ids), model.lm_head(rmsnorm(h0, eps)), atol=1e-6)
        assert not torch.allclose(h0, model.embed(ids, None, model.codec.T), atol=1e-2)


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_post_norm_locked_block_is_identity_and_never_changes(optim):
    m = _post(groups=[[1], [2]], unlock_steps=[3, 5]).replace(optim={"name": optim})
    model = build_model(m)
    arch = ArchWarmup(m, model)
    opt = build_optimizer(m, model)
    assert arch.locked == {1, 2}
    rope = rope_tables(16, m.model.head_dim, m.model.rope_theta)
    h = 5.0 * torch.randn(2, 16, m.model.d_model)  # not normalised: a skipped block skips its norms too
    assert torch.equal(model.layers[1](h, rope, None), h)
    locked = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith(("layers.1.", "layers.2."))}
    active = model.layers[0].attn.qkv_proj.weight.detach().clone()
    for step in range(3):
        warmup_step(model, opt, arch, step)
    params = dict(model.named_parameters())
    for n, before in locked.items():
        assert torch.equal(params[n], before), n
        assert params[n].grad is None and not params[n].requires_grad
    assert not torch.equal(params["layers.0.attn.qkv_proj.weight"], active)  # the active block trains
    ids = warmup_ids(9)
    with torch.no_grad():
        full = model(ids)
        model.layers = torch.nn.ModuleList([model.layers[0]])
        assert torch.equal(model(ids), full)  # exactly the model without the locked layers


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_post_norm_unlock_preserves_function_then_trains(layer):
    """Unlocking a post-norm block (writers at zero) leaves the function unchanged up to eps at
    any depth: the first block too, because the post-norm model normalises its embedding."""
    model, arch, opt, ids, before, unlocked = trained_then_unlocked(_post(groups=[[layer]], unlock_steps=[3]))
    assert unlocked == [layer] and not arch.locked
    block = model.layers[layer]
    assert all(torch.count_nonzero(p.weight) == 0 for p in block.output_projections())
    with torch.no_grad():
        after = model(ids)
    assert torch.allclose(after, before, atol=1e-5, rtol=1e-5)
    # the writers get gradient and move
    opt.zero_grad(set_to_none=True)
    lm_loss(model(ids), ids).backward()
    assert all(p.weight.grad is not None and p.weight.grad.abs().sum() > 0 for p in block.output_projections())
    opt.step()
    with torch.no_grad():
        assert not torch.allclose(model(ids), before, atol=1e-4)


def test_post_norm_without_embedding_norm_would_not_preserve_the_first_unlock():
    """Why the embedding is normalised: a zero-writer post-norm block is rmsnorm(h), which is the
    identity only on a stream of RMS 1; the raw embedding T[x] + E[x] is not one."""
    m = _post()
    model = build_model(m)
    ids = warmup_ids(2)
    with torch.no_grad():
        raw = model.embed(ids, None, model.codec.T)
        assert (raw.pow(2).mean(-1).sqrt() - 1).abs().max() > 0.1
        rope = rope_tables(16, m.model.head_dim, m.model.rope_theta)
        blk = model.layers[0]
        for p in blk.output_projections():
            p.weight.zero_()
        assert not torch.allclose(blk(raw, rope, None), raw, atol=1e-3)
        # rmsnorm(raw) has RMS sqrt(ms / (ms + eps)), 1 up to eps / ms (here ~1e-4 relative)
        h0 = rmsnorm(raw, m.model.norm_eps)
        assert torch.allclose(blk(h0, rope, None), h0, atol=1e-5, rtol=1e-4)
