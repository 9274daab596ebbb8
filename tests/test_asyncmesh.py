"""AsyncMesh maths: delays, look-ahead weights, bitwise recompute, step policy, partitions, deltas."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from stages import (
    LookaheadForward, PartitionSchedule, StalenessCorrection, StepClock, StepPolicy, apply_average_delta,
    first_moments, snapshot,
)
from stages.asyncmesh import DelayTracker, lookahead_params, momentum_carry, update_direction
from stages.optim import Muon


# ----------------------------------------------------------------------------- delays


def test_delay_tracker_ema_and_histogram():
    d = DelayTracker(ema=0.5)
    assert d.tau_hat == 0.0
    assert d.record(3, 7) == 4
    assert d.tau_hat == 4.0  # the first measurement seeds the EMA
    assert d.record(5, 7) == 2
    assert d.tau_hat == pytest.approx(0.5 * 4 + 0.5 * 2)
    d.record(0, 500)
    assert d.histogram == {4: 1, 2: 1, 64: 1}  # clamped at max_bucket
    assert d.record(9, 7) == 0 and d.rolled_back == 1  # a version rolled back by a reload
    with pytest.raises(ValueError):
        DelayTracker(ema=1.0)


# ----------------------------------------------------------------------------- look-ahead


def _adam_by_hand(grads, lr, betas, eps, tau, w0):
    """Adam's moments from the gradient sequence, and Ŵ = W − τ·lr·m̂/(√v̂+eps), written out."""
    b1, b2 = betas
    m = torch.zeros_like(w0)
    v = torch.zeros_like(w0)
    w = w0.clone()
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        w = w - lr * m_hat / (v_hat.sqrt() + eps)
    t = len(grads)
    direction = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    return w, w - tau * lr * direction


def test_lookahead_weights_match_the_formula_for_adam():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    w0 = {n: p.detach().clone() for n, p in lin.named_parameters()}
    lr, betas, eps, tau = 0.01, (0.9, 0.99), 1e-8, 2.5
    opt = torch.optim.Adam(lin.parameters(), lr=lr, betas=betas, eps=eps)
    grads = {n: [torch.randn_like(p) for _ in range(3)] for n, p in lin.named_parameters()}
    for i in range(3):
        for n, p in lin.named_parameters():
            p.grad = grads[n][i].clone()
        opt.step()
    hat = lookahead_params(lin, opt, tau)
    for n, p in lin.named_parameters():
        w_ref, hat_ref = _adam_by_hand(grads[n], lr, betas, eps, tau, w0[n])
        torch.testing.assert_close(p.detach(), w_ref)
        torch.testing.assert_close(hat[n], hat_ref)
        assert not torch.equal(hat[n], p.detach())
        assert hat[n].data_ptr() != p.data_ptr()  # a snapshot, not a view of W
    # an explicit lr overrides the group's; τ̂ = 0 is W itself
    torch.testing.assert_close(
        lookahead_params(lin, opt, 1.0, lr=0.5)["weight"], lin.weight - 0.5 * update_direction(opt, lin.weight)
    )
    assert all(torch.equal(t, p) for t, p in zip(lookahead_params(lin, opt, 0.0).values(), lin.parameters()))


def test_lookahead_direction_adamw_sgd_and_no_state():
    torch.manual_seed(1)
    lin = nn.Linear(3, 2, bias=False)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, weight_decay=0.2)
    assert update_direction(opt, lin.weight) is None  # no state yet: Ŵ = W
    assert torch.equal(lookahead_params(lin, opt, 3.0)["weight"], lin.weight)
    lin.weight.grad = torch.randn(2, 3)
    opt.step()
    st = opt.state[lin.weight]
    b1, b2 = opt.param_groups[0]["betas"]
    adam_dir = (st["exp_avg"] / (1 - b1)) / ((st["exp_avg_sq"] / (1 - b2)).sqrt() + 1e-8)
    torch.testing.assert_close(update_direction(opt, lin.weight), adam_dir + 0.2 * lin.weight)  # decoupled decay

    sgd = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    lin.weight.grad = torch.ones(2, 3)
    sgd.step()
    lin.weight.grad = 2 * torch.ones(2, 3)
    sgd.step()
    torch.testing.assert_close(update_direction(sgd, lin.weight), torch.full((2, 3), 0.9 * 1 + 2.0))


def test_muon_direction_and_unknown_optimizer():
    torch.manual_seed(2)
    lin = nn.Linear(4, 3, bias=False)
    opt = Muon(lin.parameters(), lr=0.5, weight_decay=0.1)
    assert update_direction(opt, lin.weight) is None  # no state yet: Ŵ = W
    lin.weight.grad = torch.randn(3, 4)
    opt.step()
    d = opt.direction(lin.weight)
    assert update_direction(opt, lin.weight) is d
    torch.testing.assert_close(lookahead_params(lin, opt, 3.0)["weight"], lin.weight - 3.0 * 0.5 * d)
    # not linear in the momentum: no carried share, the momentum target falls back to τ̂ · direction
    assert momentum_carry(opt, lin.weight, 3.0) is None
    torch.testing.assert_close(lookahead_params(lin, opt, 3.0, target="momentum")["weight"],
                               lin.weight - 3.0 * 0.5 * d)

    adagrad = torch.optim.Adagrad(lin.parameters())  # fresh: refused at start-up, before any state
    with pytest.raises(NotImplementedError, match="Adagrad.*asyncmesh.mode = 'none'"):
        LookaheadForward(lin, adagrad, mode="lookahead")
    LookaheadForward(lin, adagrad, mode="none")  # plain async needs no direction


def _momentum_opts(params):
    return {
        "adam": torch.optim.Adam(params, lr=0.01, betas=(0.9, 0.999)),
        "adamw": torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.999), weight_decay=0.1),
        "nadam": torch.optim.NAdam(params, lr=0.01, betas=(0.99, 0.999), decoupled_weight_decay=True,
                                   weight_decay=0.01),
        "sgd": torch.optim.SGD(params, lr=0.05, momentum=0.9),
        "sgd_nesterov": torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True),
    }


@pytest.mark.parametrize("name", ["adam", "adamw", "nadam", "sgd", "sgd_nesterov"])
def test_momentum_carry_is_where_the_weights_go_when_future_gradients_are_zero(name):
    """The carry is the part of the next τ steps that the optimizer state fixes: run τ more steps
    with zero gradients and the weights land at W − lr·carry (exactly for SGD; for the Adam
    family up to the slow drift of v̂ and the compounding of weight decay over τ steps)."""
    torch.manual_seed(3)
    w = nn.Parameter(torch.randn(6, 5))
    opt = _momentum_opts([w])[name]
    for _ in range(7):
        w.grad = torch.randn_like(w)
        opt.step()
    if not name.startswith("sgd"):
        # late in training: bias corrections ≈ 1, so τ steps with zero gradients leave v̂ nearly
        # where it is (β2^τ), as the carry assumes (future gradients zero-mean with v̂'s variance)
        st = opt.state[w]
        st["step"] = torch.tensor(10_000.0)
        if "mu_product" in st:
            st["mu_product"] = torch.tensor(0.0)
    tau = 4
    carry = momentum_carry(opt, w, float(tau))
    expected = w.detach() - opt.param_groups[0]["lr"] * carry
    before = w.detach().clone()
    for _ in range(tau):
        w.grad = torch.zeros_like(w)
        opt.step()
    moved = float((w.detach() - before).abs().max())
    tol = dict(rtol=0, atol=1e-6) if name.startswith("sgd") else dict(rtol=0, atol=0.01 * moved)
    torch.testing.assert_close(w.detach(), expected, **tol)
    assert not torch.allclose(before, w.detach())  # the state really did carry the weights on


def test_momentum_carry_fractional_tau_and_the_update_target_overshoot():
    torch.manual_seed(4)
    w = nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.NAdam([w], lr=0.01, betas=(0.99, 0.999))
    assert momentum_carry(opt, w, 2.0) is None  # no state yet
    for _ in range(20):
        w.grad = torch.randn_like(w)
        opt.step()
    c2, c3 = momentum_carry(opt, w, 2.0), momentum_carry(opt, w, 3.0)
    torch.testing.assert_close(momentum_carry(opt, w, 2.5), 0.5 * (c2 + c3))
    # early in NAdam's momentum-decay schedule (μ ≈ 0.5) and with m's bias correction at t = 20
    # (1 − 0.99^20 ≈ 0.18), τ̂ × the update direction is several times the carried share
    ratio = float((3.0 * update_direction(opt, w)).norm() / c3.norm())
    assert ratio > 3.0


def test_lookahead_params_momentum_target():
    torch.manual_seed(5)
    lin = nn.Linear(3, 3)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.02, weight_decay=0.1)
    assert all(torch.equal(t, p) for t, p in zip(lookahead_params(lin, opt, 3.0, target="momentum").values(),
                                                 lin.parameters()))  # no state: Ŵ = W
    for _ in range(5):
        for p in lin.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    hat = lookahead_params(lin, opt, 3.0, target="momentum")
    for n, p in lin.named_parameters():
        torch.testing.assert_close(hat[n], p.detach() - 0.02 * momentum_carry(opt, p, 3.0))
    with pytest.raises(ValueError, match="target"):
        lookahead_params(lin, opt, 3.0, target="velocity")
    with pytest.raises(ValueError, match="target"):
        LookaheadForward(lin, opt, target="velocity")


def test_step_clock_measures_the_step_period_and_converts_seconds_to_steps():
    clock = StepClock(ema=0.5, max_ratio=4.0)
    assert clock.period is None and clock.steps_in(10.0) is None
    clock.tick(100.0)
    assert clock.period is None  # one tick is no interval
    clock.tick(102.0)
    assert clock.period == 2.0 and clock.steps_in(10.0) == 5.0
    clock.tick(103.0)
    assert clock.period == 0.5 * 2.0 + 0.5 * 1.0
    # a pause (no traffic, a ban) counts as at most max_ratio × the current period
    clock.tick(1103.0)
    assert clock.period == 0.5 * 1.5 + 0.5 * (4.0 * 1.5)
    clock.tick(1103.0)  # two steps at the same instant: an interval of 0
    assert clock.period == 0.5 * 3.75
    with pytest.raises(ValueError, match="EMA"):
        StepClock(ema=1.0)
    with pytest.raises(ValueError, match="max_ratio"):
        StepClock(max_ratio=0.5)


def test_horizon_is_a_floor_under_the_measured_delay():
    """``horizon`` is the least extrapolation (the pipeline horizon: the head's τ̂); τ is still
    measured, a larger τ̂ wins, and without it the stage extrapolates by its own τ̂."""
    torch.manual_seed(6)
    lin = nn.Linear(3, 3)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.02)
    for _ in range(4):
        for p in lin.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    fixed = LookaheadForward(lin, opt, horizon=5.0)
    own = LookaheadForward(lin, opt)
    low = LookaheadForward(lin, opt, horizon=1.0)
    for la in (fixed, own, low):
        la.delays.record(0, 2)  # measured τ = 2
    wf, wo = fixed.weights(), own.weights()
    assert wf.tau_hat == 5.0 and wo.tau_hat == 2.0 and fixed.delays.tau_hat == 2.0
    assert low.weights().tau_hat == 2.0 == low.extrapolation  # own τ̂ above the floor wins
    assert LookaheadForward(lin, opt, mode="none", horizon=5.0).extrapolation == 0.0
    for n, t in lookahead_params(lin, opt, 5.0, target="momentum").items():
        assert torch.equal(wf.tensors[n], t)
    assert not torch.equal(wf.tensors["weight"], wo.tensors["weight"])
    with pytest.raises(ValueError, match="horizon"):
        LookaheadForward(lin, opt, horizon=-1.0)


def test_damp_recomputes_a_refused_version_with_the_usual_extrapolation():
    """``damp``: the current version's weights looked further ahead than the EMA of earlier
    versions' (``usual``); the rest of that version forwards on weights extrapolated by
    ``usual``, the microbatches already forwarded keep theirs, and the next version looks
    ahead as before. Nothing to do for an older version, a usual one, or mode ``none``."""
    torch.manual_seed(7)
    lin = nn.Linear(3, 3)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.02)
    la = LookaheadForward(lin, opt, horizon=1.0)

    def step():
        for p in lin.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        la.stepped()

    for _ in range(6):
        assert la.weights().tau_hat == 1.0
        step()
    assert la.usual == pytest.approx(1.0)
    assert not la.damp(la.version)  # as far ahead as usual: nothing to do
    la.horizon = 3.0  # the step period fell: more of its own steps in the same horizon
    far = la.weights()
    assert far.tau_hat == 3.0 and la.usual == pytest.approx(1.2)
    kept = {n: t.clone() for n, t in far.tensors.items()}
    assert not la.damp(la.version - 1)  # an older version's refusal: it has stepped since
    assert la.damp(la.version)
    damped = la.weights()
    assert damped.version == far.version and damped.tau_hat == pytest.approx(1.2)
    for n, t in lookahead_params(lin, opt, la.usual, target="momentum").items():
        assert torch.equal(damped.tensors[n], t)
    assert all(torch.equal(far.tensors[n], kept[n]) for n in kept)  # in flight: unchanged
    assert la.weights() is damped and not la.damp(la.version)  # once per version
    step()
    assert la.weights().tau_hat == 3.0  # the next version looks ahead as measured
    none = LookaheadForward(lin, opt, mode="none")
    none.weights()
    assert not none.damp(none.version)


def _train_a_bit(stage, opt, steps, x, ids):
    for _ in range(steps):
        out = stage(x, ids)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_backward_recomputes_on_bitwise_the_same_weights(test_manifest):
    from stages import build_stage

    torch.manual_seed(0)
    stage = build_stage(test_manifest, 1)  # a body stage: code in, code out
    opt = torch.optim.NAdam(stage.parameters(), lr=1e-2, betas=(0.99, 0.999), decoupled_weight_decay=True)
    B, L, k = 2, 8, test_manifest.k
    ids = torch.randint(0, 256, (B, L))
    x = torch.randn(B, L, k)
    _train_a_bit(stage, opt, 3, x, ids)  # optimizer state exists: the look-ahead is not W
    la = LookaheadForward(stage, opt, mode="lookahead", initial_delay=2.0)

    seen = []  # weights of blocks.0.attn.qkv as the module sees them during each call
    target = stage.blocks[0].attn

    def hook(mod, args):
        seen.append({n: t.detach().clone() for n, t in mod.named_parameters(recurse=True)})

    target.register_forward_pre_hook(hook)
    w = la.weights()
    out_fwd = la.forward(w, x, ids)
    fwd_weights = seen.pop()
    live_at_forward = {n: p.detach().clone() for n, p in stage.named_parameters()}
    assert any(not torch.equal(w.tensors[n], live_at_forward[n]) for n in w.tensors)  # Ŵ ≠ W

    # two other microbatches step the optimizer while this one is in flight
    for _ in range(2):
        _train_a_bit(stage, opt, 1, torch.randn(B, L, k), ids)
        la.stepped()
    seen.clear()
    assert la.weights() is not w  # a new version gets new look-ahead weights

    stage.zero_grad()
    g = torch.randn_like(out_fwd)
    res = la.backward(w, (x, ids), grad_output=g)
    bwd_weights = seen.pop()
    assert fwd_weights.keys() == bwd_weights.keys()
    for n in fwd_weights:
        assert torch.equal(fwd_weights[n], bwd_weights[n]), n  # bitwise
    assert res.delay == 2 and la.delays.last == 2

    # the gradient w.r.t. Ŵ lands in W.grad, and it is the gradient of the forward that was sent
    ref = build_stage(test_manifest, 1)
    ref.load_state_dict({**stage.state_dict(), **w.tensors})
    xr = x.clone().requires_grad_(True)
    out_ref = ref(xr, ids)
    assert torch.equal(out_ref.detach(), out_fwd)
    out_ref.backward(g)
    for (n, p), (_, pr) in zip(stage.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, pr.grad, rtol=0, atol=0)
    torch.testing.assert_close(res.input_grads[0], xr.grad, rtol=0, atol=0)
    assert res.input_grads[1] is None  # ids


def test_modes_none_and_gpipe(test_manifest):
    from stages import build_stage, lm_loss

    torch.manual_seed(0)
    tail = build_stage(test_manifest, 2)
    opt = torch.optim.AdamW(tail.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 8))
    x = torch.randn(2, 8, test_manifest.k)
    _train_a_bit(tail, opt, 2, x, ids)

    la = LookaheadForward(tail, opt, mode="none")
    w = la.weights()
    for n, p in tail.named_parameters():
        assert torch.equal(w.tensors[n], p) and w.tensors[n].data_ptr() != p.data_ptr()  # a stash
    _train_a_bit(tail, opt, 1, x, ids)
    la.stepped()
    res = la.backward(w, (x, ids), loss_fn=lambda logits: lm_loss(logits, ids))
    assert res.loss is not None and res.loss.requires_grad is False and res.delay == 1

    gp = LookaheadForward(tail, opt, mode="gpipe")
    w = gp.weights()
    assert w.tensors is None  # live weights: nothing stored
    tail.zero_grad()
    gp.backward(w, (x, ids), loss_fn=lambda logits: lm_loss(logits, ids))
    assert all(p.grad is not None for p in tail.parameters())
    w2 = gp.weights()
    gp.stepped()
    with pytest.raises(RuntimeError, match="flush"):
        gp.backward(w2, (x, ids), loss_fn=lambda logits: lm_loss(logits, ids))
    with pytest.raises(ValueError, match="mode"):
        LookaheadForward(tail, opt, mode="pipedream")


def test_step_policy_gpipe_flush_and_async_window():
    g = StepPolicy("gpipe", flush_every=3, max_inflight=8)
    injected = 0
    while g.may_inject(injected):
        g.injected()
        injected += 1
    assert injected == 3  # one flush group, then the head waits
    assert [g.backward_done() for _ in range(3)] == [False, False, True]
    assert g.may_inject(0)  # the step opened the next group
    a = StepPolicy("lookahead", flush_every=3, max_inflight=2, grad_accum=2)
    assert a.may_inject(1) and not a.may_inject(2)
    assert [a.backward_done(), a.dropped(), a.backward_done()] == [False, True, False]


# ----------------------------------------------------------------------------- partitions


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 1.0, 0.07])
def test_partitions_cover_every_element_once_within_ceil_1_over_p_rounds(p):
    shapes = [(17, 9), (31,), (4, 5, 6), (1,)]
    s = PartitionSchedule(shapes, p, seed=42)
    n_rounds = math.ceil(1 / p)
    assert s.n_partitions == n_rounds
    total = sum(math.prod(x) for x in shapes)
    for start in (0, 5):  # any ⌈1/p⌉ consecutive rounds
        flat = torch.cat([s.flat_indices(r) for r in range(start, start + n_rounds)])
        assert flat.numel() == total
        assert torch.equal(torch.sort(flat).values, torch.arange(total))  # disjoint and covering
    sizes = [s.flat_indices(r).numel() for r in range(n_rounds)]
    assert max(sizes) - min(sizes) <= 1 and max(sizes) == s.max_size
    # per-parameter indices are the same elements, local to each parameter
    per = s.indices(3)
    again = torch.cat([i + int(s.offsets[k]) for k, i in enumerate(per)])
    assert torch.equal(again, s.flat_indices(3))
    assert all(i.numel() == 0 or int(i.max()) < math.prod(sh) for i, sh in zip(per, shapes))
    assert torch.equal(s.flat_indices(1), s.flat_indices(1 + n_rounds))  # rotation


def test_partitions_are_seeded_random_and_pinned():
    shapes = [(100, 100)]
    a, b = PartitionSchedule(shapes, 0.05, 7), PartitionSchedule(shapes, 0.05, 7)
    assert torch.equal(a.flat_indices(2), b.flat_indices(2))  # same on every replica
    assert not torch.equal(a.flat_indices(2), PartitionSchedule(shapes, 0.05, 8).flat_indices(2))
    idx = a.flat_indices(0)
    assert idx.numel() == 500
    # spread over the tensor, not a contiguous block: every 10% of it gets some elements
    counts = torch.bincount(idx // 1000, minlength=10)
    assert int(counts.min()) >= 20
    # pinned values: changing the permutation would silently break averaging between versions
    assert idx[:6].tolist() == PINNED_FIRST_ELEMENTS


PINNED_FIRST_ELEMENTS = [17, 18, 35, 42, 50, 54]  # PartitionSchedule([(100, 100)], 0.05, 7), round 0


def test_partition_schedule_rejects_bad_input():
    with pytest.raises(ValueError):
        PartitionSchedule([(3,)], 0.0, 1)
    with pytest.raises(ValueError):
        PartitionSchedule([(0,)], 0.5, 1)


# ----------------------------------------------------------------------------- deltas


def test_delta_application_keeps_local_progress():
    theta = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([[10.0, 20.0]])]
    idx = [torch.tensor([1, 3]), torch.tensor([0])]
    snap = snapshot(theta, idx)
    assert snap.tolist() == [2.0, 4.0, 10.0]
    # local progress while the round runs
    theta[0] += torch.tensor([0.0, 0.5, 0.0, 0.5])
    theta[1] += torch.tensor([[1.0, 1.0]])
    other_replica_snap = torch.tensor([4.0, 6.0, 14.0])
    avg = (snap + other_replica_snap) / 2  # [3, 5, 12]
    norm = apply_average_delta(theta, idx, snap, avg, lam=1.0)
    # θ[S] = current + (avg − snap): 2.5 + 1 = 3.5, 4.5 + 1 = 5.5, 11 + 2 = 13; the rest untouched
    assert theta[0].tolist() == [1.0, 3.5, 3.0, 5.5]
    assert theta[1].tolist() == [[13.0, 21.0]]
    assert norm == pytest.approx(math.sqrt(1 + 1 + 4))
    theta2 = [torch.tensor([1.0, 2.5, 3.0, 4.5]), torch.tensor([[11.0, 21.0]])]
    apply_average_delta(theta2, idx, snap, avg, lam=0.5)
    assert theta2[0].tolist() == [1.0, 3.0, 3.0, 5.0] and theta2[1].tolist() == [[12.0, 21.0]]
    with pytest.raises(ValueError, match="finite"):
        apply_average_delta(theta2, idx, snap, torch.tensor([float("nan"), 0.0, 0.0]))
    with pytest.raises(ValueError, match="sizes"):
        apply_average_delta(theta2, idx, snap[:2], avg)
    # one λ per tensor; a None tensor (a moment that does not exist yet) is skipped
    theta3 = [torch.tensor([1.0, 2.5, 3.0, 4.5]), None]
    apply_average_delta(theta3, idx, snap, avg, [0.5, 1.0])
    assert theta3[0].tolist() == [1.0, 3.0, 3.0, 5.0]
    assert snapshot([None, theta[1]], idx).tolist() == [0.0, 0.0, 13.0]


def test_staleness_correction_scales_moment_deltas_by_beta_to_the_s():
    off = StalenessCorrection(False)
    assert off.moment_lambdas(7, [0.9, 0.95]) == [0.0, 0.0]
    on = StalenessCorrection(True, ema=0.5)
    assert on.moment_lambdas(3, [0.9, 0.5, 0.0]) == pytest.approx([0.729, 0.125, 0.0])
    on.observe(4)
    on.observe(8)
    assert on.s_hat == pytest.approx(6.0)


def test_moment_delta_equals_averaging_at_snapshot_time():
    """Two replicas' Adam first moments on S, averaged with λ_m = β^s, end exactly where they
    would be had the moments been averaged at the snapshot and then decayed for s steps."""
    beta = 0.9
    m_a, m_b = torch.tensor([4.0, -2.0, 1.0]), torch.tensor([0.0, 2.0, 5.0])
    idx = [torch.tensor([0, 2])]
    snap_a = snapshot([m_a], idx)
    avg = (snap_a + snapshot([m_b], idx)) / 2
    fresh = torch.tensor([0.3, 0.1, -0.2])  # what s = 2 steps of new gradients add
    s = 2
    now_a = beta**s * m_a + fresh
    apply_average_delta([now_a], idx, snap_a, avg, StalenessCorrection(True).moment_lambdas(s, [beta]))
    expected = beta**s * m_a + fresh
    expected[[0, 2]] = beta**s * avg + fresh[[0, 2]]
    torch.testing.assert_close(now_a, expected)


def test_first_moments_per_optimizer():
    lin = nn.Linear(3, 2)
    adam = torch.optim.AdamW(lin.parameters(), betas=(0.8, 0.99))
    assert first_moments(adam, list(lin.parameters())) == ([None, None], [0.0, 0.0])
    for p in lin.parameters():
        p.grad = torch.ones_like(p)
    adam.step()
    moments, decays = first_moments(adam, list(lin.parameters()))
    assert moments[0] is adam.state[lin.weight]["exp_avg"] and decays == [0.8, 0.8]
    sgd = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.7)
    sgd.step()
    moments, decays = first_moments(sgd, list(lin.parameters()))
    assert moments[1] is sgd.state[lin.bias]["momentum_buffer"] and decays == [0.7, 0.7]


# ----------------------------------------------------------------------------- benchmark


# scripts/bench_asyncmesh.py --quick and its figures: tests/test_bench_smoke.py


def test_bench_consensus_model_is_the_elementwise_mean_of_the_replicas():
    from tests.helpers.scripts import load_script

    bench = load_script("bench_asyncmesh")
    torch.manual_seed(0)
    reps = [nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)) for _ in range(3)]
    with torch.no_grad():
        for i, r in enumerate(reps):
            r[1].num_batches_tracked.fill_(7 + i)  # an integer buffer: not averaged, taken from replica 0
            for v in r.state_dict().values():  # every float parameter and buffer differs between replicas
                if v.is_floating_point():
                    v.add_(torch.randn_like(v))
    before = [{k: v.clone() for k, v in r.state_dict().items()} for r in reps]
    c = bench.consensus_model(reps)
    for k, v in c.state_dict().items():
        if v.is_floating_point():
            want = (before[0][k] + before[1][k] + before[2][k]) / 3
            assert torch.allclose(v, want, atol=1e-7), k
            assert not torch.equal(v, before[0][k]), k  # really averaged, not a copy of replica 0
        else:
            assert torch.equal(v, before[0][k]), k
    for r, b in zip(reps, before):  # the replicas are left untouched
        assert all(torch.equal(v, b[k]) for k, v in r.state_dict().items())
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(c.parameters(), reps[0].parameters()))
    # identical replicas: the consensus is that model, bitwise
    same = bench.consensus_model([reps[0], reps[0]]).state_dict()
    assert all(torch.equal(v, same[k]) for k, v in reps[0].state_dict().items())
