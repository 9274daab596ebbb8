"""Sharpness tracking (stages/sharpness.py): power iteration with HVPs recovers known spectra."""

from __future__ import annotations

import math

import pytest
import torch

from stages import (
    SharpnessTracker,
    adam_preconditioner,
    build_model,
    build_optimizer,
    eos_bound,
    lm_loss,
    load_manifest,
)


def _quadratic(n=30, top=10.0, seed=0):
    """Two parameters (a vector and a matrix) and a loss 0.5·θᵀHθ with a known H."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    eig = torch.cat([torch.tensor([top, top / 2]), torch.linspace(0.1, 4.0, n - 2)]).double()
    h = (q * eig) @ q.T
    a = torch.nn.Parameter(torch.randn(10, generator=gen, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(4, 5, generator=gen, dtype=torch.float64))

    def loss_fn():
        theta = torch.cat([a, b.reshape(-1)])
        return 0.5 * theta @ h @ theta

    return [a, b], loss_fn, h


@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_quadratic_top_eigenvalue_recovered_with_warm_start(method):
    params, loss_fn, h = _quadratic()
    tracker = SharpnessTracker(params, max_iters=5, method=method)
    est = [tracker.measure(loss_fn) for _ in range(6)]
    assert tracker.hvps == 30  # 5 HVPs per measurement, no more
    assert abs(est[-1] - 10.0) < 1e-3
    # warm start: each measurement continues where the last stopped
    assert abs(est[-1] - 10.0) < abs(est[0] - 10.0)
    # the eigenvector found is H's top one
    v = torch.cat([tracker._v[params[0]], tracker._v[params[1]].reshape(-1)]).double()
    top = torch.linalg.eigh(h).eigenvectors[:, -1]
    assert abs(float(v @ top)) > 0.999


def test_lanczos_finds_top_positive_eigenvalue_under_larger_negative_one():
    params, loss_fn, h = _quadratic()
    q = torch.linalg.eigh(h).eigenvectors
    eig = torch.cat([torch.tensor([-40.0]), torch.linspace(0.1, 4.0, 27), torch.tensor([5.0, 10.0])]).double()
    h.copy_((q * eig) @ q.T)  # loss_fn closes over h
    lanczos = SharpnessTracker(params, max_iters=5)
    power = SharpnessTracker(params, max_iters=5, method="power")
    for _ in range(10):
        est_l, est_p = lanczos.measure(loss_fn), power.measure(loss_fn)
    assert abs(est_l - 10.0) < 1e-2  # what the stability bound is about
    assert est_p < 0  # plain power iteration locks onto the largest magnitude, -40


def test_preconditioned_sharpness_recovered():
    params, loss_fn, h = _quadratic(seed=1)
    gen = torch.Generator().manual_seed(5)
    precond = [torch.rand(p.shape, generator=gen, dtype=torch.float64) + 0.2 for p in params]
    d = torch.cat([x.reshape(-1) for x in precond])
    s = d.rsqrt()
    expect = float(torch.linalg.eigvalsh(s[:, None] * h * s[None, :]).max())
    tracker = SharpnessTracker(params, max_iters=5)
    for _ in range(10):
        est = tracker.measure(loss_fn, precond=precond)
    assert abs(est - expect) / expect < 1e-3


def test_frozen_params_are_left_out():
    params, loss_fn, h = _quadratic()
    params[1].requires_grad_(False)  # like a locked warm-up block
    tracker = SharpnessTracker(params, max_iters=5)
    for _ in range(10):
        est = tracker.measure(loss_fn)
    expect = float(torch.linalg.eigvalsh(h[:10, :10]).max())
    assert abs(est - expect) / expect < 1e-3


def test_adam_preconditioner_and_transformer_measurement():
    m = load_manifest("test").replace(optim={"name": "adamw", "lr": 3e-3})
    torch.manual_seed(0)
    model = build_model(m)
    opt = build_optimizer(m, model)
    params = list(model.parameters())
    assert adam_preconditioner(opt, params) is None  # no second moments before the first step
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        lm_loss(model(ids), ids).backward()
        opt.step()
    pre = adam_preconditioner(opt, params)
    st, g = opt.state[params[0]], opt.param_groups[-1]
    b2 = opt.param_groups[0]["betas"][1]
    assert torch.allclose(pre[0], (st["exp_avg_sq"] / (1 - b2**2)).sqrt() + g["eps"])
    tracker = SharpnessTracker(params, max_iters=3)
    # double backward through attention works (math SDPA kernel selected inside measure)
    plain = tracker.measure(lambda: lm_loss(model(ids), ids))
    pre_s = tracker.measure(lambda: lm_loss(model(ids), ids), precond=opt)
    assert math.isfinite(plain) and math.isfinite(pre_s) and plain > 0 and pre_s > 0
    assert tracker.hvps == 6


def test_bad_inputs():
    params, loss_fn, _ = _quadratic()
    with pytest.raises(ValueError, match="max_iters"):
        SharpnessTracker(params, max_iters=0)
    with pytest.raises(ValueError, match="one tensor per parameter"):
        SharpnessTracker(params).measure(loss_fn, precond=[torch.ones(3)])
    assert eos_bound(1e-3, 0.9) == pytest.approx(38_000.0)
