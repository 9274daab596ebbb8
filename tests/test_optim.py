"""Optimizers (stages/optim.py): Newton–Schulz, top-k SVD, Muon/NuMuon steps, build_optimizer,
update directions and state dict round trips; plus scripts/bench_optim.py's rules and settings."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stages import (
    asyncmesh,
    build_model,
    build_optimizer,
    hidden_matrix_names,
    lm_loss,
    load_manifest,
    lr_at,
    set_lr,
)
from stages.optim import (
    Muon,
    NuMuon,
    newton_schulz,
    rank_fraction,
    topk_svd,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def manifest():
    return load_manifest("test")


def _with(m, **optim):
    return m.replace(optim=optim)


def _train(m, steps=3, seed=0, total_steps=None):
    torch.manual_seed(seed)
    model = build_model(m)
    opt = build_optimizer(m, model, total_steps=total_steps)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ids = torch.randint(0, 256, (2, 16), generator=gen)
        set_lr(opt, lr_at(m.schedule, m.optim.lr, step))
        opt.zero_grad(set_to_none=True)
        lm_loss(model(ids), ids).backward()
        opt.step()
    return model, opt


# ------------------------------------------------------------------- Newton–Schulz, top-k


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (8, 96), (48, 48)])
def test_newton_schulz_is_close_to_orthogonal(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    if shape[0] == shape[1]:  # square Gaussians have tiny singular values: condition it
        u, _, vh = torch.linalg.svd(g)
        g = u @ torch.diag(torch.linspace(1.0, 0.05, shape[0])) @ vh
    x = newton_schulz(g)
    s = torch.linalg.svdvals(x)
    # the quintic maps every non-tiny singular value into a band around 1, ~[0.68, 1.13]
    assert s.min() > 0.6 and s.max() < 1.2, (s.min(), s.max())
    # and it is the polar factor's direction: same singular vectors as g
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh
    cos = (x * polar).sum() / (x.norm() * polar.norm())
    assert cos > 0.98
    # scale invariance: NS normalises by the Frobenius norm
    assert torch.allclose(newton_schulz(g * 1000.0), x, atol=1e-4)


def test_newton_schulz_batched_and_bf16():
    g = torch.randn(3, 16, 40)
    x = newton_schulz(g, dtype=torch.bfloat16)
    assert x.dtype == g.dtype and x.shape == g.shape
    s = torch.linalg.svdvals(x)
    assert s.min() > 0.5 and s.max() < 1.3


def test_topk_matches_torch_svd_decaying_spectrum():
    gen = torch.Generator().manual_seed(2)
    u0, _ = torch.linalg.qr(torch.randn(200, 120, generator=gen))
    v0, _ = torch.linalg.qr(torch.randn(120, 120, generator=gen))
    sv = 0.9 ** torch.arange(120.0)
    a = (u0 * sv) @ v0.T
    k = 10
    u, s, v = topk_svd(a, k, generator=gen)
    ut, st, vht = torch.linalg.svd(a, full_matrices=False)
    assert torch.allclose(s, st[:k], rtol=1e-4)
    # subspaces agree (projector distance)
    assert torch.linalg.matrix_norm(u @ u.T - ut[:, :k] @ ut[:, :k].T, ord=2) < 1e-3
    vk = v[:, :k]
    assert torch.linalg.matrix_norm(vk @ vk.T - vht[:k].T @ vht[:k], ord=2) < 1e-3
    assert torch.allclose(u.T @ u, torch.eye(k), atol=1e-5)


def test_topk_random_matrix_and_warm_start_converges():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(160, 130, generator=gen)  # flat spectrum: the hard case for 2 Krylov steps
    k = 8
    st = torch.linalg.svdvals(a)[:k]
    u, s, v = topk_svd(a, k, generator=gen)
    assert ((s - st).abs() / st).max() < 0.1
    first = ((s - st).abs() / st).max()
    for _ in range(8):  # warm start from the previous right vectors: keeps converging
        u, s, v = topk_svd(a, k, v0=v, generator=gen)
    assert ((s - st).abs() / st).max() < min(1e-3, float(first))
    # values are the Ritz values: u^T a v = diag(s)
    assert torch.allclose(u.T @ a @ v[:, :k], torch.diag(s), atol=1e-3)


def test_topk_small_matrix_uses_exact_svd_and_validates():
    a = torch.randn(20, 12)
    u, s, v = topk_svd(a, 3)
    assert torch.allclose(s, torch.linalg.svdvals(a)[:3], atol=1e-5)
    with pytest.raises(ValueError, match="k=13"):
        topk_svd(a, 13)
    with pytest.raises(ValueError, match="matrix"):
        topk_svd(torch.randn(3, 4, 5), 1)


def test_rank_fraction_schedule():
    kw = dict(total_steps=100, rank_start=1.0, rank_final=0.25, hold_frac=0.1, decay_end_frac=0.8)
    assert rank_fraction(0, **kw) == 1.0 and rank_fraction(10, **kw) == 1.0
    assert rank_fraction(80, **kw) == 0.25 and rank_fraction(100, **kw) == 0.25
    mid = rank_fraction(45, **kw)
    assert abs(mid - 0.625) < 1e-9  # cosine midpoint
    vals = [rank_fraction(t, **kw) for t in range(101)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


# ------------------------------------------------------------------- Muon / NuMuon steps


def test_muon_step_formula():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(24, 8))
    g = torch.randn(24, 8)
    w0 = w.detach().clone()
    opt = Muon([w], lr=0.1, momentum=0.9, weight_decay=0.5)
    w.grad = g.clone()
    opt.step()
    # M = G, U = G + 0.9 M = 1.9 G; NS is scale-invariant; scale sqrt(24/8)
    expect = w0 * (1 - 0.1 * 0.5) - 0.1 * math.sqrt(3.0) * newton_schulz(g)
    assert torch.allclose(w.detach(), expect, atol=1e-6)


def test_numuon_full_rank_equals_muon():
    torch.manual_seed(0)
    shapes = [(32, 16), (16, 48), (20, 20)]
    ws_a = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    ws_b = [torch.nn.Parameter(w.detach().clone()) for w in ws_a]
    a = Muon(ws_a, lr=0.05, weight_decay=0.1)
    b = NuMuon(ws_b, lr=0.05, weight_decay=0.1, total_steps=10, rank_start=1.0, rank_final=1.0)
    for _ in range(5):
        for wa, wb in zip(ws_a, ws_b):
            g = torch.randn(wa.shape)
            wa.grad, wb.grad = g.clone(), g.clone()
        a.step()
        b.step()
        for wa, wb in zip(ws_a, ws_b):
            assert torch.equal(wa, wb)


def test_numuon_low_rank_update_is_topk_polar_factor():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(40, 30))
    # rank fraction already at its final 0.25 at step 0: k = ceil(0.25 * 30) = 8
    opt = NuMuon([w], lr=0.1, momentum=0.0, nesterov=False, total_steps=10,
                 rank_start=0.25, rank_final=0.25)
    g = torch.randn(40, 30)
    w0 = w.detach().clone()
    w.grad = g
    opt.step()
    delta = (w0 - w.detach()) / (0.1 * math.sqrt(40 / 30))  # lr and shape scale
    s = torch.linalg.svdvals(delta)
    assert (s[:8] - 1.0).abs().max() < 1e-4 and s[8:].max() < 1e-4  # exactly rank 8, unit values
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    assert torch.allclose(delta, u[:, :8] @ vh[:8], atol=1e-3)
    assert opt.state[w]["v"].shape[0] == 30  # warm start kept


def test_numuon_rank_follows_schedule():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64))
    opt = NuMuon([w], lr=0.01, total_steps=10, rank_start=1.0, rank_final=0.25,
                 rank_hold_frac=0.2, rank_decay_end_frac=0.5)
    ranks = []
    for _ in range(8):
        w0 = w.detach().clone()
        w.grad = torch.randn(64, 64)
        opt.step()
        s = torch.linalg.svdvals(w0 - w.detach())
        ranks.append(int((s > 1e-3 * s[0]).sum()))
    assert ranks[0] == 64 and ranks[-1] == 16
    assert all(a >= b for a, b in zip(ranks, ranks[1:]))


def test_param_without_grad_is_untouched():
    w = torch.nn.Parameter(torch.randn(8, 8))
    b = torch.nn.Parameter(torch.randn(8))
    frozen = torch.nn.Parameter(torch.randn(8, 8))
    w0 = frozen.detach().clone()
    opt = Muon([{"params": [w, frozen], "weight_decay": 0.5}, {"params": [b], "use_muon": False, "weight_decay": 0.5}])
    for _ in range(3):
        w.grad, b.grad = torch.randn(8, 8), torch.randn(8)
        opt.step()
    assert torch.equal(frozen.detach(), w0) and frozen not in opt.state


def test_muon_rejects_vector_in_muon_group():
    v = torch.nn.Parameter(torch.randn(5))
    opt = Muon([v])
    v.grad = torch.randn(5)
    with pytest.raises(ValueError, match="1-D"):
        opt.step()


# ------------------------------------------------------------------- build_optimizer


def test_build_optimizer_groups_for_muon(manifest):
    m = _with(manifest, name="muon", lr=0.02, aux_lr=3e-3)
    model = build_model(m)
    opt = build_optimizer(m, model)
    assert isinstance(opt, Muon) and not isinstance(opt, NuMuon)
    names = {id(p): n for n, p in model.named_parameters()}
    seen = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(names.values())  # every parameter exactly once
    muon = [names[id(p)] for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    assert set(muon) == set(hidden_matrix_names(model))
    assert all(".attn.qkv_proj." in n or ".out_proj." in n or "_proj." in n for n in muon)
    assert "embed.weight" not in muon and "lm_head.weight" not in muon
    set_lr(opt, 0.01)
    for g in opt.param_groups:
        assert g["lr"] == pytest.approx(0.01 if g["use_muon"] else 0.01 * 3e-3 / 0.02)
    numuon = build_optimizer(_with(manifest, name="numuon"), build_model(m))
    assert isinstance(numuon, NuMuon) and numuon.param_groups[0]["total_steps"] == m.schedule.total_steps


@pytest.mark.parametrize("name,cls", [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam),
                                      ("nadam", torch.optim.NAdam), ("sgd", torch.optim.SGD)])
def test_build_optimizer_torch_ones(manifest, name, cls):
    m = _with(manifest, name=name)
    model = build_model(m)
    opt = build_optimizer(m, model)
    assert type(opt) is cls
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    decay = [g for g in opt.param_groups if g["weight_decay"] > 0]
    embed = dict(model.named_parameters())["embed.weight"]
    assert all(all(p is not embed for p in g["params"]) for g in decay)


# ------------------------------------------------------------------- update direction


def test_muon_direction_predicts_next_step_with_zero_grad(manifest):
    for name in ("muon", "numuon"):
        m = _with(manifest, name=name, lr=0.02, rank_start=0.5, rank_final=0.5)
        model, opt = _train(m, steps=3)
        muon_group = next(g for g in opt.param_groups if g["use_muon"])
        steps = {p: opt.direction(p) * muon_group["lr"] for p in muon_group["params"]}
        assert all(d is not None for d in steps.values())
        before = {p: p.detach().clone() for p in steps}
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        for p, d in steps.items():  # zero gradient: U = β²M, same orthogonal direction
            assert torch.allclose(before[p] - p.detach(), d, atol=2e-5, rtol=1e-3), name


@pytest.mark.parametrize("aux", ["adamw", "sgd"])
def test_muon_direction_of_the_auxiliary_groups(manifest, aux):
    model, opt = _train(_with(manifest, name="muon", aux_optimizer=aux), steps=2)
    g = next(g for g in opt.param_groups if not g["use_muon"] and g["weight_decay"])
    p = g["params"][0]
    st = opt.state[p]
    if aux == "adamw":  # m̂/(√v̂+eps) + wd·W by hand
        b1, b2 = g["betas"]
        hand = (st["exp_avg"] / (1 - b1**2)) / ((st["exp_avg_sq"] / (1 - b2**2)).sqrt() + g["eps"])
    else:
        hand = st["momentum_buffer"]
    torch.testing.assert_close(opt.direction(p), hand + g["weight_decay"] * p)
    assert asyncmesh.update_direction(opt, p) is opt.direction(p)  # the look-ahead asks the optimizer
    with pytest.raises(KeyError, match="not in this optimizer"):
        opt.direction(torch.nn.Parameter(torch.zeros(2, 2)))


# ------------------------------------------------------------------- state round trip


@pytest.mark.parametrize("name", ["adamw", "nadam", "sgd", "muon", "numuon"])
def test_state_dict_round_trip_continues_identically(manifest, name):
    m = _with(manifest, name=name, lr=0.01, rank_start=0.5, rank_final=0.5)
    model_a, opt_a = _train(m, steps=3, total_steps=10)
    saved = copy.deepcopy(opt_a.state_dict())

    torch.manual_seed(123)
    model_b = build_model(m)
    model_b.load_state_dict(model_a.state_dict())
    opt_b = build_optimizer(m, model_b, total_steps=10)
    opt_b.load_state_dict(saved)
    if isinstance(opt_a, Muon):  # NuMuon's rank schedule reads the step count back from the state
        assert opt_b.global_step == opt_a.global_step == 3
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(9))
    for model, opt in ((model_a, opt_a), (model_b, opt_b)):
        set_lr(opt, 0.005)  # the lr is the trainer's (schedule), not part of the state
        opt.zero_grad(set_to_none=True)
        lm_loss(model(ids), ids).backward()
        opt.step()
    for (n, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), (name, n)


# ------------------------------------------------------------------------------ benchmark


# the --quick run and its figures: tests/test_bench_smoke.py


def _bench_optim():
    from tests.helpers.scripts import load_script

    return load_script("bench_optim")


def test_bench_failure_rule_tells_a_hard_batch_from_a_blow_up():
    b = _bench_optim()
    falling = [5.0 - 0.01 * i for i in range(300)]
    # one hard batch: the loss jumps for one step and is back at once -> a spike event, no failure
    hard = list(falling)
    hard[120] = hard[119] + 1.5
    assert b.spike_steps(hard) == [120]
    assert b.spike_events(hard) == [(120, 1)]
    assert not b.unrecovered(hard)
    # a blow-up: the loss jumps by 1 nat and stays there -> unrecovered, the run failed
    blown = falling[:60] + [falling[59] + 1.0] * 240
    assert b.spike_steps(blown) == [60]
    assert b.unrecovered(blown)
    summary = {"diverged": False, "stalled": False, "unrecovered_spike": b.unrecovered(blown)}
    assert b.failed(summary)
    assert not b.failed(dict(summary, unrecovered_spike=False))
    assert b.failed(dict(summary, unrecovered_spike=False, stalled=True))
    # the same jump 20 steps before the end cannot be judged yet
    late = falling[:280] + [falling[279] + 1.0] * 20
    assert b.spike_steps(late) == [280] and not b.unrecovered(late)
    # recovered, but only after more than RECOVER_STEPS steps: a failure
    slow = falling[:60] + [falling[59] + 1.0] * (b.RECOVER_STEPS + 5) + falling[60:160]
    assert b.spike_events(slow)[0] == (60, b.RECOVER_STEPS + 5)
    assert b.unrecovered(slow)
    # a non-finite loss is a divergence
    assert b.unrecovered(falling[:30] + [float("nan")])


def test_bench_warmup_preset_sets_defaults_that_flags_override():
    b = _bench_optim()
    ap = b.build_parser()
    # every preset value names one of the bench's own options (a typo would add a dead attribute)
    dests = {a.dest for a in ap._actions}
    assert set(b.WARMUP_PRESETS["wide"]) <= dests
    plain = b.parse_with_preset(ap, [])
    assert plain.warmup_d_model == 32 and plain.seq_len == 64
    wide = b.parse_with_preset(b.build_parser(), ["--warmup-preset", "wide"])
    assert wide.warmup_d_model == 256 and wide.seq_len == 128 and wide.warmup_lr_warmup == 50
    mixed = b.parse_with_preset(b.build_parser(), ["--warmup-preset", "wide", "--warmup-d-model", "64"])
    assert mixed.warmup_d_model == 64 and mixed.seq_len == 128


@pytest.mark.timeout(120)
def test_bench_warmup_stop_at_ends_runs_early_on_the_full_schedule():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_optim.py"), "--quick", "--only", "warmup",
                           "--high-lr", "0.1", "--seeds", "0", "--warmup-stop-at", "6"],
                          capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    w = json.loads(proc.stdout)["warmup"]
    assert w["settings"]["steps"] == 12 and w["settings"]["stopped_at"] == 6
    assert len(w["loss_first_12_steps"]["baseline"]["0"]) == 6
    # sharpness every 4 steps (quick): one measurement in 6 steps, with the EoS bound at that step's lr
    (trace,) = w["sharpness_trace"]["baseline"].values()
    assert [row[0] for row in trace] == [4]
    step, sharp, bound = trace[0]
    assert sharp > 0 and bound >= w["eos_bound_at_peak_lr"] - 0.1


def test_bench_tail_energy_is_the_share_the_truncation_removes():
    b = _bench_optim()
    torch.manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(16, 8))
    v, _ = torch.linalg.qr(torch.randn(12, 8))
    s = torch.tensor([8.0, 4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    w = (u * s) @ v.T  # 16 x 12, singular values s (rank 8)
    # f = 0.25 keeps ceil(3) = 3 of min(16, 12) = 12: the removed share is 5 / (64 + 16 + 4 + 5)
    assert b.tail_energy(w, 0.25) == pytest.approx(5 / 89, rel=1e-4)
    # f = 0.5 keeps 6: two unit singular values left out
    assert b.tail_energy(w, 0.5) == pytest.approx(2 / 89, rel=1e-4)
    assert b.tail_energy(w[:, :3] @ torch.randn(3, 12), 0.25) == pytest.approx(0.0, abs=1e-6)
    assert b.matrix_kind("layers.3.attn.qkv_proj.weight") == "qkv_proj"


def test_bench_truncated_loss_puts_the_weights_back():
    b = _bench_optim()
    args = b.build_parser().parse_args(["--d-model", "32", "--layers", "3", "--k", "4", "--seq-len", "16"])
    m = b.base_manifest(args)
    from stages import build_model

    model = build_model(m)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, 256, (2, 16))
    full = b.truncated_loss(model, [x], 1.0)
    low = b.truncated_loss(model, [x], 0.25, only=["layers.0.attn.qkv_proj.weight"])
    assert math.isfinite(full) and math.isfinite(low) and low != full
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
