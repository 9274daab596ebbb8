"""Architecture warm-up (stages/warmup.py): locked blocks are exact identities that never change,
unlocking preserves the function but makes the block trainable, per-stage operation, schedule."""

from __future__ import annotations

import pytest
import torch

from stages import (
    ArchWarmup,
    build_model,
    build_optimizer,
    build_stage,
    default_warmup_schedule,
    lm_loss,
    load_manifest,
    rope_tables,
)
from stages.warmup import warmup_blocks
from tests.helpers.warmup import trained_then_unlocked, warmup_ids, warmup_step


def _manifest(optim="adamw", groups=((1,), (2,)), unlock=(3, 5)):
    m = load_manifest("test")
    return m.replace(
        optim={"name": optim, "lr": 1e-2, "weight_decay": 0.5},  # large decay: would show at once
        warmup={"enabled": True, "groups": [list(g) for g in groups], "unlock_steps": list(unlock)},
    )


def _active(arch) -> list[int]:
    """The layers whose blocks run their branch (not skipped as locked)."""
    return sorted(layer for layer, block in arch.blocks.items() if block.active)


def test_locked_block_is_exact_identity():
    m = _manifest()
    model = build_model(m)
    arch = ArchWarmup(m, model)
    assert sorted(arch.locked) == [1, 2] and _active(arch) == [0]
    block = model.layers[1]
    assert block.active is False
    h = torch.randn(2, 16, m.model.d_model)
    rope = rope_tables(16, m.model.head_dim, m.model.rope_theta)
    assert torch.equal(block(h, rope, model.codec.U), h)
    # the whole model equals the model with those layers removed
    ids = warmup_ids(0)
    full = model(ids)
    model.layers = torch.nn.ModuleList([model.layers[0]])
    assert torch.equal(model(ids), full)


@pytest.mark.parametrize("optim", ["adamw", "nadam", "sgd", "muon", "numuon"])
def test_locked_params_never_change(optim):
    m = _manifest(optim)
    model = build_model(m)
    arch = ArchWarmup(m, model)
    opt = build_optimizer(m, model)
    locked = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith(("layers.1.", "layers.2."))}
    active = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("layers.0.")}
    for step in range(3):
        warmup_step(model, opt, arch, step)
    params = dict(model.named_parameters())
    for n, before in locked.items():
        assert torch.equal(params[n], before), n  # bitwise: no update, no weight decay
        assert params[n].grad is None and not params[n].requires_grad
    assert any(not torch.equal(params[n], before) for n, before in active.items())


def test_unlock_preserves_function_and_block_then_trains():
    m = _manifest("adamw")
    model, arch, opt, ids, before, new = trained_then_unlocked(m)
    assert new == [1] and _active(arch) == [0, 1] and arch.locked == {2}
    block = model.layers[1]
    assert block.active
    for proj in block.output_projections():
        assert torch.count_nonzero(proj.weight) == 0
    others = [p for n, p in block.named_parameters() if "out_proj" not in n and "down_proj" not in n]
    assert all(p.requires_grad and p.abs().sum() > 0 for p in others)  # initialised normally
    with torch.no_grad():
        after = model(ids)
    assert torch.equal(after, before)  # the function did not change at the unlock step
    # ... but the branch receives gradient (not a stationary point) and is updated
    opt.zero_grad(set_to_none=True)
    lm_loss(model(ids), ids).backward()
    grads = [proj.weight.grad for proj in block.output_projections()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    opt.step()
    assert all(torch.count_nonzero(proj.weight) > 0 for proj in block.output_projections())
    assert arch.apply(4, opt) == [] and arch.apply(5, opt) == [2] and not arch.locked


def test_unlock_draws_are_deterministic_across_replicas():
    m = _manifest()
    a, b = build_model(m), build_model(m)
    wa, wb = ArchWarmup(m, a), ArchWarmup(m, b)
    wa.apply(10)
    wb.apply(10)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n


def test_per_stage_warmup_matches_model():
    m = _manifest(groups=((1,), (2,)), unlock=(2, 4))
    model = build_model(m)
    full_arch = ArchWarmup(m, model)
    stages = [build_stage(m, i) for i in range(m.n_stages)]
    archs = [ArchWarmup(m, s) for s in stages]
    assert [sorted(a.locked) for a in archs] == [[], [1], [2]]  # each stage only its own blocks
    ids = warmup_ids(1)
    for step in (0, 2, 4):
        full_arch.apply(step)
        news = [a.apply(step) for a in archs]
        assert sorted(x for n in news for x in n) == sorted({2: [1], 4: [2]}.get(step, []))
        with torch.no_grad():
            x = None
            for s in stages:
                x = s(x, ids)
            assert torch.allclose(x, model(ids), atol=1e-5, rtol=1e-5)


def test_resume_does_not_reinitialise_due_groups():
    m = _manifest()
    model = build_model(m)
    with torch.no_grad():
        model.layers[1].attn.qkv_proj.weight.add_(1.0)  # "trained" weights from a checkpoint
    saved = model.layers[1].attn.qkv_proj.weight.detach().clone()
    arch = ArchWarmup(m, model, step=4)  # group (1,) was due at 3, (2,) at 5
    assert arch.locked == {2} and model.layers[1].active and not model.layers[2].active
    assert arch.apply(4) == []
    assert torch.equal(model.layers[1].attn.qkv_proj.weight, saved)


def test_disabled_warmup_locks_nothing():
    m = load_manifest("test")
    model = build_model(m)
    arch = ArchWarmup(m, model)
    assert not arch.locked and arch.apply(0) == []
    assert all(b.active for b in warmup_blocks(model).values())


def test_default_schedule():
    groups, steps = default_warmup_schedule(8, lr_warmup_steps=20, every=40)
    assert groups == ((1,), (3,), (5,), (7,)) and steps == (60, 100, 140, 180)
    groups, steps = default_warmup_schedule(24, 100, 500, n_groups=4)
    locked = sorted(x for g in groups for x in g)
    assert locked == list(range(1, 24, 2)) and len(groups) == 4 and steps[0] == 600
    assert all(len(g) == 3 for g in groups)
    m = load_manifest("test").replace(
        warmup={"enabled": True, "groups": [list(g) for g in default_warmup_schedule(3, 5, 10)[0]],
                "unlock_steps": list(default_warmup_schedule(3, 5, 10)[1])})
    assert m.warmup.groups == ((1,),)
    with pytest.raises(ValueError):
        default_warmup_schedule(0, 1, 1)
    # a shallower start: layers 0, 8, 16 active, the other 21 locked in 7 groups of 3
    groups, steps = default_warmup_schedule(24, 0, 20, n_groups=7, keep_every=8)
    locked = sorted(x for g in groups for x in g)
    assert locked == [i for i in range(24) if i not in (0, 8, 16)]
    assert groups[0] == (1, 9, 17) and all(len(g) == 3 for g in groups)
    assert steps == (20, 40, 60, 80, 100, 120, 140)
    assert default_warmup_schedule(24, 0, 20, keep_every=2) == default_warmup_schedule(24, 0, 20)
    assert default_warmup_schedule(4, 0, 5, keep_every=1) == ((), ())  # nothing locked
    with pytest.raises(ValueError):
        default_warmup_schedule(8, 0, 5, keep_every=0)


def test_ramp_blends_the_unlocked_block_in_linearly():
    m = _manifest("adamw")
    model, arch, opt, ids, before, new = trained_then_unlocked(m, ramp_steps=4)
    assert new == [1] and arch.gates == {1: 0.25}
    with torch.no_grad():
        assert torch.equal(model(ids), before)  # still exactly the identity at the unlock step
    opt.zero_grad(set_to_none=True)
    lm_loss(model(ids), ids).backward()
    assert all(proj.weight.grad.abs().sum() > 0 for proj in model.layers[1].output_projections())
    opt.step()
    # the block's output is h + s·(block(h) − h)
    block = model.layers[1]
    h = torch.randn(2, 16, m.model.d_model)
    rope = rope_tables(16, m.model.head_dim, m.model.rope_theta)
    with torch.no_grad():
        gated = block(h, rope, model.codec.U)
        arch.gates[1] = 1.0
        full = block(h, rope, model.codec.U)
        arch.gates[1] = 0.25
    assert torch.allclose(gated, h + 0.25 * (full - h), atol=1e-6)
    arch.apply(4, opt)
    assert arch.gates[1] == 0.5
    arch.apply(6, opt)  # s reaches 1: hook removed, plain block
    assert 1 not in arch.gates and not block._forward_hooks
    # resuming inside a ramp window re-creates the gate
    other = ArchWarmup(m, build_model(m), step=4, ramp_steps=4)
    assert other.gates == {1: 0.5} and other.locked == {2}


def test_ramp_steps_from_manifest_per_stage():
    """``warmup.ramp_steps`` in the manifest drives the ramp (train-local and swarm stages build
    ``ArchWarmup(m, stage)`` without arguments): at the unlock step every stage still computes
    exactly the old function, and mid-ramp the chained stages equal the whole gated model."""
    m = _manifest(groups=((1,), (2,)), unlock=(2, 4))
    m = m.replace(warmup={"ramp_steps": 3})
    assert m.warmup.ramp_steps == 3 and load_manifest("test").warmup.ramp_steps == 0
    model = build_model(m)
    full_arch = ArchWarmup(m, model)
    assert full_arch.ramp_steps == 3
    stages = [build_stage(m, i) for i in range(m.n_stages)]
    archs = [ArchWarmup(m, s) for s in stages]
    ids = warmup_ids(3)

    def chained():
        x = None
        for s in stages:
            x = s(x, ids)
        return x

    with torch.no_grad():
        before_full, before_chain = model(ids), chained()
    full_arch.apply(2)
    for a in archs:
        a.apply(2)
    assert full_arch.gates == {1: pytest.approx(1 / 3)} and archs[1].gates == full_arch.gates
    with torch.no_grad():
        assert torch.equal(model(ids), before_full)  # unlock: the function is unchanged
        assert torch.equal(chained(), before_chain)
        # make the unlocked branch non-zero so the gate matters, in both copies alike
        for blk in (model.layers[1], stages[1].blocks[0]):
            for proj in blk.output_projections():
                proj.weight.copy_(torch.randn(proj.weight.shape, generator=torch.Generator().manual_seed(5)))
        gated = model(ids)
        assert torch.allclose(chained(), gated, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(gated, before_full, atol=1e-3)
    full_arch.apply(3)
    for a in archs:
        a.apply(3)
    assert full_arch.gates == {1: pytest.approx(2 / 3)}
    with torch.no_grad():
        assert torch.allclose(chained(), model(ids), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="ramp_steps"):
        ArchWarmup(m.replace(warmup={"ramp_steps": -1}), build_model(m))


def test_pre_norm_unlock_preserves_function_and_trains():
    """The pre-norm block (``model.block_norm = "pre"``): unlock with zero writers is an exact
    identity, the writers get gradient, and after one update the branch is small (it grows with
    its writers instead of jumping to RMS 1 as a peri-norm branch does)."""
    m = _manifest("adamw").replace(model={"block_norm": "pre"})
    model, arch, opt, ids, before, new = trained_then_unlocked(m)
    assert new == [1]
    with torch.no_grad():
        assert torch.equal(model(ids), before)
    opt.zero_grad(set_to_none=True)
    lm_loss(model(ids), ids).backward()
    block = model.layers[1]
    assert all(proj.weight.grad.abs().sum() > 0 for proj in block.output_projections())
    opt.step()
    h = torch.randn(2, 16, m.model.d_model)
    rope = rope_tables(16, m.model.head_dim, m.model.rope_theta)
    with torch.no_grad():
        delta = block(h, rope, model.codec.U) - h
    rms = delta.pow(2).mean().sqrt().item()
    assert 0 < rms < 0.5  # peri-norm: every non-zero branch adds RMS ~1 per sub-layer
