"""The model and its stage split: the chained stages compute exactly the unsplit model."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

from stages import Stage, SubspaceCodec, Transformer, build_model, build_stage, lm_loss, split_model
from stages.model import Block, is_constrained_layer
from stages.subspace import DenseCodec


def _ids(m, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, m.model.vocab_size, (batch, m.model.seq_len), generator=g)


def _run_pipeline(stages: list[Stage], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward stage by stage with detached boundaries, then backward stage by stage, as the
    swarm does: each stage gets only the code from upstream and ∂L/∂c from downstream."""
    inputs, outputs = [], []
    x = None
    for stage in stages:
        if x is not None:
            x = x.detach().requires_grad_(True)
        inputs.append(x)
        x = stage(x, ids)
        outputs.append(x)
    loss = lm_loss(outputs[-1], ids)
    grad = None
    for i in reversed(range(len(stages))):
        if i == len(stages) - 1:
            loss.backward()
        else:
            outputs[i].backward(grad)
        if inputs[i] is not None:
            grad = inputs[i].grad
            assert grad.shape == stages[i].boundary_shape(*ids.shape)
    return outputs[-1], loss


def _variants(m):
    return {
        "subspace": m,
        "subspace-constrained-tail": m.replace(subspace={"constrain_tail": True}),
        "dense": m.replace(subspace={"enabled": False}),
        "single-stage": m.replace(stages={"layout": [[0, m.model.n_layers]]}),
        "pre-norm": m.replace(model={"block_norm": "pre"}),
        "pre-norm-dense": m.replace(model={"block_norm": "pre"}, subspace={"enabled": False}),
        "post-norm-dense": m.replace(model={"block_norm": "post"}, subspace={"enabled": False}),
    }


@pytest.mark.parametrize("variant", ["subspace", "subspace-constrained-tail", "dense", "single-stage",
                                     "pre-norm", "pre-norm-dense", "post-norm-dense"])
def test_chained_stages_equal_unsplit_model(test_manifest, variant):
    m = _variants(test_manifest)[variant]
    model = build_model(m)
    stages = split_model(model, m)
    ids = _ids(m)

    logits_ref = model(ids)
    lm_loss(logits_ref, ids).backward()
    logits, _ = _run_pipeline(stages, ids)

    assert logits.shape == (2, m.model.seq_len, m.model.vocab_size)
    assert (logits - logits_ref).abs().max().item() <= 1e-5
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    seen = set()
    for stage in stages:
        for local, p in stage.named_parameters():
            name = stage.global_name(local)
            seen.add(name)
            assert p.grad is not None, name
            assert ref_grads[name].abs().max() > 0, name  # every weight does receive gradient
            assert (p.grad - ref_grads[name]).abs().max().item() <= 1e-5, name
    assert seen == set(ref_grads)


def test_stage_roles_and_boundary(test_manifest):
    m = test_manifest
    stages = [build_stage(m, i) for i in range(m.n_stages)]
    assert [s.is_head for s in stages] == [True, False, False]
    assert [s.is_tail for s in stages] == [False, False, True]
    assert [list(s.layer_range) for s in stages] == [list(range(*r)) for r in m.stages.layout]
    ids = _ids(m)
    c = stages[0](None, ids)
    assert c.dtype == torch.float32 and c.shape == stages[0].boundary_shape(2, m.model.seq_len)
    assert c.shape[-1] == m.k
    c = stages[1](c, ids)
    assert c.shape == (2, m.model.seq_len, m.k)
    assert stages[2](c, ids).shape == (2, m.model.seq_len, m.model.vocab_size)
    with pytest.raises(ValueError, match="needs the incoming code"):
        stages[1](None, ids)
    with pytest.raises(ValueError, match="code shape"):
        stages[1](torch.zeros(2, m.model.seq_len, m.k + 1), ids)
    with pytest.raises(ValueError, match="out of range"):
        build_stage(m, m.n_stages)


def test_build_stage_equals_split_model(test_manifest, default_manifest):
    for m in (test_manifest, test_manifest.replace(subspace={"enabled": False}), default_manifest,
              test_manifest.replace(model={"block_norm": "pre"}),
              test_manifest.replace(model={"block_norm": "post"}, subspace={"enabled": False})):
        split = split_model(build_model(m), m)
        for i in range(m.n_stages):
            alone = build_stage(m, i)
            a, b = split[i].state_dict(), alone.state_dict()
            assert a.keys() == b.keys() and len(a) > 0
            for name in a:
                assert torch.equal(a[name], b[name]), (i, name)
            assert torch.equal(split[i].codec.U, alone.codec.U) if m.subspace.enabled else True


def test_initialisation_depends_on_seed_only(test_manifest):
    a, b = build_model(test_manifest), build_model(test_manifest)
    torch.manual_seed(123)  # global RNG state is irrelevant
    c = build_model(test_manifest)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r), n
    other = build_model(test_manifest.replace(run={"seed": 8}))
    assert not torch.equal(a.lm_head.weight, other.lm_head.weight)


def _hidden_states(model: Transformer, ids: torch.Tensor) -> list[torch.Tensor]:
    states = []
    hooks = [model.embed.register_forward_hook(lambda mod, inp, out: states.append(out))]
    hooks += [blk.register_forward_hook(lambda mod, inp, out: states.append(out)) for blk in model.layers]
    model(ids)
    for h in hooks:
        h.remove()
    return states  # h0, then after every block


def _off_subspace(h: torch.Tensor, ids: torch.Tensor, codec: SubspaceCodec) -> float:
    r = h - codec.T[ids]
    return ((r - (r @ codec.U) @ codec.U.T).norm() / r.norm()).item()


@pytest.mark.parametrize("block_norm", ["peri", "pre"])
@pytest.mark.parametrize("autocast", [False, True])
def test_residual_stays_in_affine_subspace(test_manifest, autocast, block_norm):
    m = test_manifest.replace(model={"block_norm": block_norm})
    model = build_model(m)
    # train-like weights, not just the init: perturb every parameter
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = _ids(m)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        states = _hidden_states(model, ids)
    assert len(states) == m.model.n_layers + 1
    for layer, h in enumerate(states):
        assert h.dtype == torch.float32
        constrained = layer == 0 or is_constrained_layer(m, layer - 1)
        err = _off_subspace(h, ids, model.codec)
        if constrained:
            assert err <= 1e-5, (layer, err)
        else:  # the unconstrained tail leaves the subspace at once (so the check can fail)
            assert err > 0.1, (layer, err)
    assert is_constrained_layer(m, 0) and not is_constrained_layer(m, m.model.n_layers - 1)
    assert is_constrained_layer(m.replace(subspace={"constrain_tail": True}), m.model.n_layers - 1)


def test_writers_are_U_times_Z(test_manifest):
    m = test_manifest
    model = build_model(m)
    head_block, tail_block = model.layers[0], model.layers[-1]
    assert head_block.constrained and not tail_block.constrained
    for proj in head_block.output_projections():
        assert proj.weight.shape[0] == m.k  # Z: (k, in)
    assert head_block.attn.out_proj is head_block.output_projections()[0]
    assert head_block.mlp.down_proj is head_block.output_projections()[1]
    for proj in tail_block.output_projections():
        assert proj.weight.shape[0] == m.model.d_model
    assert model.embed.weight.shape == (m.model.vocab_size, m.k)
    dense = build_model(m.replace(subspace={"enabled": False}))
    assert isinstance(dense.codec, DenseCodec)
    assert dense.embed.weight.shape == (m.model.vocab_size, m.model.d_model)
    assert all(not b.constrained for b in dense.layers)
    # dense h0 = T[x] + E[x]: same frozen table, full-width learned part
    ids = _ids(m)
    assert torch.equal(dense.codec.T, model.codec.T)
    h0 = dense.embed(ids, None, dense.codec.T)
    assert torch.allclose(h0 - dense.codec.T[ids], dense.embed.weight[ids], atol=1e-6)


def test_inactive_block_is_exact_identity(test_manifest):
    m = test_manifest
    model = build_model(m)
    block: Block = model.layers[1]
    h = torch.randn(2, m.model.seq_len, m.model.d_model)
    rope = (torch.ones(m.model.seq_len, m.model.head_dim // 2), torch.zeros(m.model.seq_len, m.model.head_dim // 2))
    assert not torch.equal(block(h, rope, model.codec.U), h)
    block.active = False
    assert block(h, rope, model.codec.U) is h
    ids = _ids(m)
    with_skip = model(ids)
    # Skipping block 1 equals running the model without it
    del model.layers[1]
    assert torch.equal(model(ids), with_skip)


def test_zeroed_output_projections_make_block_identity(test_manifest):
    """What warm-up does at unlock: zero out_proj/down_proj -> branch adds exactly zero."""
    m = test_manifest
    model = build_model(m)
    block = model.layers[0]
    with torch.no_grad():
        for proj in block.output_projections():
            proj.weight.zero_()
    h = torch.randn(2, 8, m.model.d_model)
    rope = (torch.ones(8, m.model.head_dim // 2), torch.zeros(8, m.model.head_dim // 2))
    assert torch.equal(block(h, rope, model.codec.U), h)


def test_functional_call_swaps_parameters(test_manifest):
    m = test_manifest
    stage = build_stage(m, 1)
    other = build_stage(m, 1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = _ids(m)
    c = torch.randn(2, m.model.seq_len, m.k)
    params = dict(other.named_parameters())
    out = functional_call(stage, params, (c, ids))
    assert torch.allclose(out, other(c, ids), atol=1e-6)
    assert not torch.allclose(out, stage(c, ids), atol=1e-3)


def test_lm_loss_is_next_token_cross_entropy():
    logits = torch.zeros(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    assert math.isclose(lm_loss(logits, ids).item(), math.log(7), rel_tol=1e-6)
    logits[0, 0, ids[0, 1]] = 100.0  # a confident correct prediction lowers the mean
    assert lm_loss(logits, ids).item() < math.log(7)
    logits[0, -1, :] = 1e4  # the last position predicts nothing
    assert lm_loss(logits, ids).item() < math.log(7)


def test_initial_loss_near_uniform(test_manifest):
    m = test_manifest
    model = build_model(m)
    loss = lm_loss(model(_ids(m)), _ids(m))
    assert abs(loss.item() - math.log(m.model.vocab_size)) < 0.5


def test_bf16_autocast_stage_chain_matches_float32_loosely(test_manifest):
    m = test_manifest
    stages = split_model(build_model(m), m)
    ids = _ids(m)
    x = None
    ref = None
    for s in stages:
        ref = s(ref, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for s in stages:
            x = s(x, ids)
            if not s.is_tail:
                assert x.dtype == torch.float32
    assert (x.float() - ref).abs().max().item() < 0.1 * ref.abs().max().item()


def test_block_norm_placement(test_manifest):
    """``model.block_norm``: "peri" (default) is h + rmsnorm(f(rmsnorm(h))) per branch, "pre" is
    the standard pre-norm h + f(rmsnorm(h)); same parameters, same initialisation."""
    from stages import ManifestError
    from stages.model import rmsnorm

    m = test_manifest
    assert m.model.block_norm == "peri"
    pre_m = m.replace(model={"block_norm": "pre"})
    peri, pre = build_model(m), build_model(pre_m)
    assert peri.layers[0].norm == "peri" and all(b.norm == "pre" for b in pre.layers)
    for (n, p), q in zip(peri.named_parameters(), pre.parameters()):
        assert torch.equal(p, q), n
    L, eps = m.model.seq_len, m.model.norm_eps
    rope = (torch.ones(L, m.model.head_dim // 2), torch.zeros(L, m.model.head_dim // 2))
    h = torch.randn(2, L, m.model.d_model)
    with torch.no_grad():
        for model in (peri, pre):
            for proj in model.layers[0].output_projections():
                proj.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        blk, U = pre.layers[0], pre.codec.U
        a = h + blk.attn(rmsnorm(h, eps), rope, U)
        want_pre = a + blk.mlp(rmsnorm(a, eps), U)
        a = h + rmsnorm(blk.attn(rmsnorm(h, eps), rope, U), eps)
        want_peri = a + rmsnorm(blk.mlp(rmsnorm(a, eps), U), eps)
        assert torch.allclose(pre.layers[0](h, rope, U), want_pre, atol=1e-6)
        assert torch.allclose(peri.layers[0](h, rope, U), want_peri, atol=1e-6)
        assert not torch.allclose(want_pre, want_peri, atol=1e-2)
        # a pre-norm branch scales with its writers (peri: renormalised to RMS 1 whatever they are)
        for proj in blk.output_projections():
            proj.weight.mul_(2)
        delta2 = pre.layers[0](h, rope, U) - h
        for proj in blk.output_projections():
            proj.weight.mul_(0.5)
        delta1 = pre.layers[0](h, rope, U) - h
        assert delta2.norm() > 1.5 * delta1.norm()
    with pytest.raises(ManifestError, match="block_norm"):
        m.replace(model={"block_norm": "post"})
