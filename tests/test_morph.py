"""Morphing (stages/morph.py): the chain computes the same function after a morph, optimizer state
follows so that training commutes with a morph, the manifest refuses optimizers that cannot follow,
and transforms from a seed are deterministic and orthogonal."""

from __future__ import annotations

import copy

import pytest
import torch

from stages import (
    ManifestError,
    MorphError,
    MorphMaster,
    build_optimizer,
    build_stage,
    fold_input,
    fold_output,
    lm_loss,
    load_manifest,
    manifest_hash,
    morph_chain,
    morph_width,
    transform_from_seed,
)


def _morph_manifest(name: str, dense: bool = False, optim: str = "sgd", **morph):
    m = load_manifest(name)
    if dense:
        m = m.replace(subspace={"enabled": False, "token_table_scale": 0.0})
    o = {"name": optim}
    if optim in ("muon", "numuon"):
        o["aux_optimizer"] = "sgd"
    return m.replace(optim=o, morph={"every": 10, **morph})


def _chain(stages, ids):
    x = None
    for s in stages:
        x = s(x, ids)
    return x


def _ids(m, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, m.model.vocab_size, (batch, m.model.seq_len), generator=g)


# ------------------------------------------------------------------------------------------------
# Transforms


@pytest.mark.parametrize("kind", ["orthogonal", "conditioned"])
def test_transform_from_seed_is_deterministic(kind):
    a = transform_from_seed(b"agreed secret", 8, kind)
    b = transform_from_seed(b"agreed secret", 8, kind)
    c = transform_from_seed(b"another secret", 8, kind)
    assert a.dtype == torch.float64 and a.shape == (8, 8)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    # seeds of different types never collide by their text
    assert not torch.allclose(transform_from_seed(7, 8, kind), transform_from_seed("7", 8, kind))


def test_orthogonal_transform_is_orthogonal_and_haar_like():
    mats = [transform_from_seed(i, 16) for i in range(400)]
    for q in mats[:20]:
        assert torch.allclose(q.T @ q, torch.eye(16, dtype=torch.float64), atol=1e-12)
    # Haar on O(n): every entry has mean 0 and variance 1/n; determinants ±1 in equal shares
    entries = torch.stack(mats)
    assert abs(entries.mean().item()) < 0.01
    assert abs(entries.var().item() * 16 - 1) < 0.05
    dets = torch.stack([torch.linalg.det(q) for q in mats])
    assert torch.allclose(dets.abs(), torch.ones(400, dtype=torch.float64), atol=1e-9)
    assert 0.4 < (dets > 0).double().mean().item() < 0.6
    # without the sign fix QR of a Gaussian is not Haar: diag(R) would be >= 0 by convention; here
    # the diagonal of Q itself is symmetric around 0
    diag = torch.stack([q.diagonal() for q in mats])
    assert 0.4 < (diag > 0).double().mean().item() < 0.6


def test_conditioned_transform_condition_number():
    m = transform_from_seed(3, 8, "conditioned", epsilon=0.1)
    s = torch.linalg.svdvals(m)
    assert s.max() / s.min() <= torch.tensor(0.2).exp().item() + 1e-9
    assert not torch.allclose(m.T @ m, torch.eye(8, dtype=torch.float64), atol=1e-3)


def test_transform_rejects_bad_arguments():
    with pytest.raises(MorphError, match="kind"):
        transform_from_seed(1, 8, "shear")
    with pytest.raises(MorphError, match="dimension"):
        transform_from_seed(1, 0)


# ------------------------------------------------------------------------------------------------
# The function is unchanged


@pytest.mark.parametrize("name", ["test", "default"])
@pytest.mark.parametrize("dense", [False, True], ids=["subspace", "dense"])
@pytest.mark.parametrize("kind", ["orthogonal", "conditioned"])
def test_morph_keeps_chain_outputs(name, dense, kind):
    torch.set_num_threads(1)
    m = _morph_manifest(name, dense=dense, kind=kind)
    stages = [build_stage(m, i) for i in range(m.n_stages)]
    ids = _ids(m)
    with torch.no_grad():
        before = _chain(stages, ids)
        codes_before = stages[0](None, ids)
    masters = [MorphMaster(s) for s in stages]
    for epoch in range(3):
        morph_chain(stages, b"secret", epoch, kind=kind, masters=masters)
    with torch.no_grad():
        after = _chain(stages, ids)
        codes_after = stages[0](None, ids)
    scale = before.abs().max().item()
    assert (after - before).abs().max().item() <= 1e-5 * max(1.0, scale)
    # ... while what crosses the boundary and what the stages hold did change
    assert (codes_after - codes_before).abs().max().item() > 0.1 * codes_before.abs().max().item()
    fresh = build_stage(m, 1)
    w_new, w_old = stages[1].blocks[0].attn.qkv_proj.weight, fresh.blocks[0].attn.qkv_proj.weight
    assert (w_new - w_old).abs().max().item() > 0.1 * w_old.abs().max().item()


def test_stitching_stages_from_different_epochs_breaks_the_chain():
    """Stages taken at different morph epochs do not fit together (no bridge), at the same epoch they do."""
    torch.set_num_threads(1)
    m = _morph_manifest("test")
    stages = [build_stage(m, i) for i in range(m.n_stages)]
    ids = _ids(m)
    with torch.no_grad():
        ref = _chain(stages, ids)
    morph_chain(stages, b"s", 0)
    old_head = copy.deepcopy(stages[0])
    morph_chain(stages, b"s", 1)
    with torch.no_grad():
        same = _chain(stages, ids)
        stitched = _chain([old_head, *stages[1:]], ids)
    assert torch.allclose(same, ref, atol=1e-5)
    assert (stitched - ref).abs().max() > 0.1 * ref.abs().max()


def test_morph_off_changes_nothing():
    m = load_manifest("test")
    s = build_stage(m, 1)
    assert s.morph_in is None and s.morph_out is None
    assert "morph_in" not in s.state_dict()
    with pytest.raises(MorphError, match="no input side"):
        fold_input(s, torch.eye(morph_width(s), dtype=torch.float64))
    mm = _morph_manifest("test")
    head, tail = build_stage(mm, 0), build_stage(mm, mm.n_stages - 1)
    with pytest.raises(MorphError, match="no input side"):
        fold_input(head, torch.eye(8, dtype=torch.float64))
    with pytest.raises(MorphError, match="no output side"):
        fold_output(tail, torch.eye(8, dtype=torch.float64))
    with pytest.raises(MorphError, match="8×8"):
        fold_output(head, torch.eye(4, dtype=torch.float64))


def test_morph_manifest_keeps_old_hashes_and_tables():
    m = load_manifest("default")
    assert manifest_hash(m) == manifest_hash(m.replace(morph={"every": 0}, optim={"aux_optimizer": "adamw"}))
    assert manifest_hash(m) != manifest_hash(m.replace(morph={"every": 100}, optim={"name": "sgd"}))
    mm = _morph_manifest("test")
    codec = build_stage(mm, 1).codec
    # a morphing run's token table has no part in span(U): nothing public to align the code frame to
    assert (codec.T @ codec.U).abs().max().item() < 1e-5 * codec.T.abs().max().item()


# ------------------------------------------------------------------------------------------------
# Training commutes with a morph


def _copy(stages, optims):
    """Deep copies of the stages and optimizers with their state (Muon keeps attributes that
    ``copy.deepcopy`` of a torch optimizer drops, so the copy is rebuilt from the state dict)."""
    new_stages = copy.deepcopy(stages)
    new_optims = []
    for s, o in zip(new_stages, optims):
        n = build_optimizer(s.manifest, s, total_steps=o.param_groups[0].get("total_steps"))
        n.load_state_dict(copy.deepcopy(o.state_dict()))
        new_optims.append(n)
    return new_stages, new_optims


def _step(stages, optims, ids):
    for o in optims:
        o.zero_grad(set_to_none=True)
    inputs, outputs, x = [], [], None
    for s in stages:
        if x is not None:
            x = x.detach().requires_grad_(True)
        inputs.append(x)
        x = s(x, ids)
        outputs.append(x)
    lm_loss(x, ids).backward()
    for i in range(len(stages) - 1, 0, -1):
        outputs[i - 1].backward(inputs[i].grad)
    for o in optims:
        o.step()


@pytest.mark.parametrize("optim", ["sgd", "muon", "numuon"])
def test_one_step_after_a_morph_equals_the_morphed_step(optim):
    torch.set_num_threads(1)
    m = _morph_manifest("test", optim=optim).replace(
        optim={"lr": 0.02, "aux_lr": 0.05, "momentum": 0.9, "weight_decay": 0.01})
    stages = [build_stage(m, i) for i in range(m.n_stages)]
    # numuon: a 4-step rank schedule, so after the warm-up steps it runs at rank 1/4 (top-k SVD)
    optims = [build_optimizer(m, s, total_steps=4) for s in stages]
    for j in range(4):  # build up momentum (and NuMuon's warm start) first
        _step(stages, optims, _ids(m, seed=10 + j))
    if optim == "numuon":
        assert optims[1].rank_fraction(optims[1].param_groups[0]) == pytest.approx(0.25)
    ids = _ids(m, seed=99)
    a_stages, a_optims = _copy(stages, optims)
    # A: morph, then step.   B: step, then the same morph.
    morph_chain(a_stages, b"k", 0, optimizers=a_optims)
    _step(a_stages, a_optims, ids)
    _step(stages, optims, ids)
    morph_chain(stages, b"k", 0, optimizers=optims)
    for sa, sb in zip(a_stages, stages):
        for (name, pa), (_, pb) in zip(sa.named_parameters(), sb.named_parameters()):
            assert torch.allclose(pa, pb, atol=2e-5, rtol=1e-4), (optim, sa.index, name)
    # and the optimizer state too: one more step keeps them together
    test_ids = _ids(m, seed=5)
    _step(a_stages, a_optims, test_ids)
    _step(stages, optims, test_ids)
    with torch.no_grad():
        ya, yb = _chain(a_stages, ids), _chain(stages, ids)
    assert torch.allclose(ya, yb, atol=1e-4)


def test_a_step_without_following_state_differs():
    """The equivariance test can fail: morphing weights but not the momentum breaks it."""
    torch.set_num_threads(1)
    m = _morph_manifest("test", optim="sgd").replace(optim={"lr": 0.05, "momentum": 0.9})
    stages = [build_stage(m, i) for i in range(m.n_stages)]
    optims = [build_optimizer(m, s) for s in stages]
    for j in range(3):
        _step(stages, optims, _ids(m, seed=j))
    a_stages, a_optims = _copy(stages, optims)
    morph_chain(a_stages, b"k", 0)  # optimizers not passed: momentum stays in the old basis
    ids = _ids(m, seed=99)
    _step(a_stages, a_optims, ids)
    _step(stages, optims, ids)
    morph_chain(stages, b"k", 0, optimizers=optims)
    diff = max((pa - pb).abs().max().item()
               for pa, pb in zip(a_stages[1].parameters(), stages[1].parameters()))
    assert diff > 1e-3


def test_fold_refuses_adam_state():
    torch.set_num_threads(1)
    m = _morph_manifest("test")
    stages = [build_stage(m, i) for i in range(m.n_stages)]
    adam = [torch.optim.AdamW(s.parameters(), lr=1e-3) for s in stages]
    _step(stages, adam, _ids(m))
    with pytest.raises(MorphError, match="second moment"):
        morph_chain(stages, b"k", 0, optimizers=adam)


# ------------------------------------------------------------------------------------------------
# The manifest refuses what cannot work


@pytest.mark.parametrize("name", ["adamw", "adam", "nadam"])
def test_manifest_refuses_adam_family_with_morphing(name):
    m = load_manifest("test")
    with pytest.raises(ManifestError, match=f"optim.name = '{name}'.*qkv_proj"):
        m.replace(optim={"name": name}, morph={"every": 100})


@pytest.mark.parametrize("name", ["muon", "numuon"])
def test_manifest_refuses_muon_with_adamw_aux(name):
    m = load_manifest("test")
    with pytest.raises(ManifestError, match=f"optim.name = '{name}'.*aux_optimizer.*lm_head.weight of stage 2"):
        m.replace(optim={"name": name}, morph={"every": 100})
    ok = m.replace(optim={"name": name, "aux_optimizer": "sgd"}, morph={"every": 100})
    assert ok.morph.enabled


def test_manifest_morph_fields():
    m = load_manifest("test")
    assert not m.morph.enabled
    assert m.replace(optim={"name": "sgd"}, morph={"every": 5}).morph.every == 5
    with pytest.raises(ManifestError, match="morph.kind"):
        m.replace(optim={"name": "sgd"}, morph={"every": 5, "kind": "shear"})
    with pytest.raises(ManifestError, match="morph.every"):
        m.replace(morph={"every": -1})
    with pytest.raises(ManifestError, match="token_table_scale = 0"):
        m.replace(optim={"name": "sgd"}, subspace={"enabled": False}, morph={"every": 5})
    with pytest.raises(ManifestError, match="one-stage"):
        m.replace(optim={"name": "sgd"}, stages={"layout": [[0, 3]]}, morph={"every": 5})
    with pytest.raises(ManifestError, match="aux_optimizer"):
        m.replace(optim={"aux_optimizer": "lion"})


# ------------------------------------------------------------------------------------------------
# The reference trainer


def test_train_local_morphs_and_trains_like_without(tmp_path):
    """train-local with morph.every = 10 trains (loss falls), morphs on schedule, and follows the
    same trajectory as the same model trained without morphs (the optimizer is equivariant)."""
    torch.set_num_threads(1)
    from node.ops import train

    m = _morph_manifest("test", optim="muon").replace(
        optim={"lr": 0.02, "aux_lr": 0.3, "momentum": 0.9}, schedule={"total_steps": 40},
        train={"steps": 40, "val_every": 40})
    log = tmp_path / "log.jsonl"
    with_morph = train(m.replace(morph={"every": 10}), steps=40, quiet=True, json_log=log, log_every=10,
                       morph_secret=b"same init")
    without = train(m.replace(morph={"every": 1000}), steps=40, quiet=True, morph_secret=b"same init")
    assert with_morph["morphs"] == 4 and without["morphs"] == 0
    assert with_morph["loss_end"] < with_morph["loss_start"] - 0.5
    assert abs(with_morph["loss_end"] - without["loss_end"]) < 1e-3
    assert abs(with_morph["val_loss"] - without["val_loss"]) < 1e-3
    # the stages really were morphed: the body's weights differ from the unmorphed run's
    w1 = with_morph["stages"][1].blocks[0].attn.qkv_proj.weight
    w0 = without["stages"][1].blocks[0].attn.qkv_proj.weight
    assert (w1 - w0).abs().max() > 0.1 * w0.abs().max()
    import json

    epochs = [json.loads(line).get("morph_epoch") for line in log.read_text().splitlines()]
    assert epochs == [1, 2, 3, 4]


def test_private_init_is_deterministic_per_secret_and_differs_from_the_public_one():
    m = _morph_manifest("test")
    public = build_stage(m, 1)
    a, b, c = build_stage(m, 1), build_stage(m, 1), build_stage(m, 1)
    from stages import private_init

    private_init(a, b"x")
    private_init(b, b"x")
    private_init(c, b"y")
    for (name, pa), pb, pc, pp in zip(a.named_parameters(), b.parameters(), c.parameters(), public.parameters()):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc) and not torch.equal(pa, pp), name
        assert abs(pa.std().item() - m.model.init_std) < 0.2 * m.model.init_std, name


def test_train_local_resumes_a_morphing_run(tmp_path):
    """The morph maps are in the checkpoint and the master is rebuilt: a run stopped and resumed
    across morph epochs ends where the uninterrupted run ends."""
    torch.set_num_threads(1)
    from node.ops import train

    m = _morph_manifest("test", optim="muon").replace(
        optim={"lr": 0.02, "aux_lr": 0.3, "momentum": 0.9}, schedule={"total_steps": 30},
        morph={"every": 10}, train={"steps": 30, "val_every": 30, "checkpoint_every": 15})
    full = train(m, steps=30, quiet=True, morph_secret=b"r")
    train(m, steps=15, quiet=True, checkpoint_dir=tmp_path, morph_secret=b"r")
    resumed = train(m, steps=30, quiet=True, checkpoint_dir=tmp_path, resume=True, morph_secret=b"r")
    assert resumed["start_step"] == 15 and resumed["morphs"] == 2
    assert abs(resumed["val_loss"] - full["val_loss"]) < 1e-4
    assert not torch.allclose(resumed["stages"][0].morph_out, torch.eye(8, dtype=torch.float64))


def test_diff_names_only_the_morph_fields_that_differ():
    from stages import diff_manifests

    m = load_manifest("test")
    assert diff_manifests(m, m.replace(optim={"name": "sgd"}, morph={"every": 50})) == ["morph.every", "optim.name"]
