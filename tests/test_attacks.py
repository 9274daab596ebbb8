"""Attack models (security/attacks.py): each does what it says, only from its start step."""

from __future__ import annotations

import pytest
import torch

from security import ATTACKS, AttackNotAllowed, check_attack_allowed, make_attack


def honest(seed=0, shape=(4, 32, 8)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 3 + 1


def rms(x):
    return float(x.square().mean().sqrt())


def test_registry_and_errors():
    assert set(ATTACKS) == {"constant", "zeros", "random", "scaling", "negation", "sign_flip", "delayed",
                            "bias", "invisible", "adaptive", "mixed"}
    with pytest.raises(ValueError, match="unknown attack 'nope'"):
        make_attack("nope")
    with pytest.raises(ValueError, match="bad parameters"):
        make_attack("scaling", fctor=2)
    with pytest.raises(ValueError, match="fraction"):
        make_attack("sign_flip", fraction=0)
    with pytest.raises(ValueError, match="mode"):
        make_attack("adaptive", mode="clever")


def test_check_attack_allowed():
    check_attack_allowed(None, False, False)  # no attack: nothing to allow
    check_attack_allowed("zeros", True, False)
    check_attack_allowed("zeros", False, True)
    with pytest.raises(AttackNotAllowed, match="--allow-attacks"):
        check_attack_allowed("zeros", False, False)
    with pytest.raises(ValueError, match="unknown attack"):
        check_attack_allowed("zero", True, True)


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_inactive_before_start_and_keeps_shape_and_dtype(name):
    atk = make_attack(name, start=5, seed=1)
    x = honest().to(torch.bfloat16)
    assert torch.equal(atk(x, 4), x)
    out = atk(x, 5)
    assert out.shape == x.shape and out.dtype == x.dtype
    if name not in ("delayed",):  # a delayed attack replays the oldest it has, here x itself
        assert not torch.equal(out, x), name


def test_simple_attacks_do_what_they_say():
    x = honest()
    r = rms(x)
    assert torch.allclose(make_attack("constant")(x, 0), torch.full_like(x, r))
    assert torch.equal(make_attack("constant", value=2.5)(x, 0), torch.full_like(x, 2.5))
    assert torch.equal(make_attack("zeros")(x, 0), torch.zeros_like(x))
    rnd = make_attack("random", seed=3)(x, 0)
    assert rms(rnd) == pytest.approx(r, rel=0.1) and abs(float(torch.corrcoef(torch.stack([rnd.flatten(), x.flatten()]))[0, 1])) < 0.1
    assert torch.equal(make_attack("scaling", factor=-2.0)(x, 0), -2 * x)
    assert torch.equal(make_attack("negation")(x, 0), -x)
    assert torch.allclose(make_attack("bias", scale=0.5)(x, 0), x + 0.5 * r)


def test_sign_flip_flips_the_requested_fraction():
    x = honest()
    out = make_attack("sign_flip", fraction=0.3, seed=2)(x, 0)
    assert torch.equal(out.abs(), x.abs())
    assert float((out != x).float().mean()) == pytest.approx(0.3, abs=0.05)
    assert torch.equal(make_attack("sign_flip", fraction=1.0)(x, 0), -x)


def test_delayed_replays_the_tensor_from_n_calls_ago():
    atk = make_attack("delayed", delay=3, start=0)
    xs = [honest(seed=i) for i in range(8)]
    outs = [atk(x, i) for i, x in enumerate(xs)]
    for i in range(3, 8):
        assert torch.equal(outs[i], xs[i - 3])
    assert torch.equal(outs[1], xs[0])  # before it has 3 calls of history: the oldest
    noisy = make_attack("delayed", delay=2, noise=0.05, seed=1)
    for i, x in enumerate(xs):
        out = noisy(x, i)
    d = out - xs[-3]
    assert 0 < rms(d) < 0.1 * rms(xs[-3])


def test_invisible_keeps_every_token_norm_but_replaces_content():
    x = honest()
    out = make_attack("invisible", rel=1.0, seed=4)(x, 0)
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    cos = torch.nn.functional.cosine_similarity(out.reshape(-1, 8), x.reshape(-1, 8)).mean()
    assert 0.4 < float(cos) < 0.9


def test_adaptive_matches_statistics_but_not_positions():
    x = honest()
    perm = make_attack("adaptive", seed=5)(x, 0)
    rows = lambda t: t.reshape(-1, 8)  # noqa: E731
    # the same multiset of token vectors (so every permutation-invariant statistic is identical)
    assert torch.equal(torch.sort(rows(perm), dim=0).values, torch.sort(rows(x), dim=0).values)
    assert float((rows(perm) != rows(x)).any(dim=1).float().mean()) > 0.9
    big = honest(shape=(16, 128, 8))
    mimic = make_attack("adaptive", mode="mimic", seed=6)(big, 0)
    # moments match to sampling error (2048 tokens, per-channel std 3: SE of a mean ≈ 0.07)
    assert torch.allclose(rows(mimic).mean(0), rows(big).mean(0), atol=0.3)
    assert torch.allclose(torch.cov(rows(mimic).T), torch.cov(rows(big).T), atol=1.2)


def test_mixed_uses_several_attacks():
    atk = make_attack("mixed", seed=7)
    x = honest()
    outs = {tuple(atk(x, i).flatten()[:4].tolist()) for i in range(30)}
    assert len(outs) > 5
