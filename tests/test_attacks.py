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
                            "bias", "invisible", "adaptive", "mixed",
                            "swap", "ctxswap", "rotate", "flip", "drift", "coherent", "fence"}
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
    ids = torch.randint(0, 4, x.shape[:2], generator=torch.Generator().manual_seed(0))
    assert torch.equal(atk(x, 4, ids=ids), x)
    out = atk(x, 5, ids=ids)
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


# ----------------------------------------------------------------------------- adaptive families


def rows(t):
    return t.reshape(-1, t.shape[-1])


def test_swap_moves_the_requested_share_and_keeps_the_multiset():
    x = honest(shape=(8, 64, 8))
    out = make_attack("swap", fraction=0.1, seed=1)(x, 0)
    assert torch.equal(torch.sort(rows(out), dim=0).values, torch.sort(rows(x), dim=0).values)
    moved = float((rows(out) != rows(x)).any(dim=1).float().mean())
    assert moved == pytest.approx(0.1, abs=0.01)


def test_coherent_keeps_every_norm_and_adds_noise_that_neighbours_share():
    """coherent: every token vector keeps its honest norm (as invisible does), and what it adds
    to neighbouring positions agrees (noise correlated along the row), where invisible's does not."""
    from security.token_table import centred_corr

    x = honest(shape=(4, 64, 8))
    out = make_attack("coherent", rel=1.0, seed=3)(x, 0)
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-4)
    d = out - x
    assert float(d.norm() / x.norm()) > 0.3
    iid = make_attack("invisible", rel=1.0, seed=3)(x, 0) - x
    assert centred_corr(rows(d[:, 1:]), rows(d[:, :-1])) > 0.5
    assert abs(centred_corr(rows(iid[:, 1:]), rows(iid[:, :-1]))) < 0.2
    for bad in ({"rho": 1.0}, {"rel": 0.0}):
        with pytest.raises(ValueError, match="coherent"):
            make_attack("coherent", **bad)


def test_ctxswap_only_exchanges_codes_between_positions_of_the_same_token():
    g = torch.Generator().manual_seed(3)
    x = honest(shape=(8, 64, 8))
    ids = torch.randint(0, 16, (8, 64), generator=g)
    out = make_attack("ctxswap", seed=2)(x, 0, ids=ids)
    X, Y, flat = rows(x), rows(out), ids.reshape(-1)
    moved = (Y != X).any(dim=1)
    assert float(moved.float().mean()) > 0.9  # (nearly) every position carries another one's code
    for i in torch.nonzero(moved).flatten().tolist():  # ... of a position with the same token id
        src = torch.nonzero((X == Y[i]).all(dim=1)).flatten()
        assert bool((flat[src] == flat[i]).any())
    for tok in flat.unique().tolist():  # so every per-token mean is exactly the honest one
        sel = flat == tok
        assert torch.allclose(Y[sel].mean(0), X[sel].mean(0), atol=1e-5)
    # without the ids it cannot know which positions share a token: it sends the honest tensor
    assert torch.equal(make_attack("ctxswap")(x, 0), x)


def test_rotate_and_flip_keep_channel_means_and_norms_about_them():
    x = honest(shape=(8, 64, 8))
    out = make_attack("rotate", angle=0.7, seed=4)(x, 0)
    mu = rows(x).mean(0)
    assert torch.allclose(rows(out).mean(0), mu, atol=1e-4)
    assert torch.allclose((rows(out) - mu).norm(dim=1), (rows(x) - mu).norm(dim=1), rtol=1e-4)
    assert float((out - x).norm() / x.norm()) > 0.1
    f = make_attack("flip", fraction=0.2, dims=2, seed=5)(x, 0)
    changed = (rows(f) != rows(x))
    assert int(changed.any(dim=0).sum()) == 2  # two coordinates
    assert float(changed.any(dim=1).float().mean()) == pytest.approx(0.2, abs=0.04)
    assert torch.allclose((rows(f) - mu).abs(), (rows(x) - mu).abs(), atol=1e-4)  # reflected about the mean


def test_drift_grows_by_rate_per_tensor():
    x = honest()
    atk = make_attack("drift", rate=0.01, start=2, seed=6)
    rel = [float((atk(x, t) - x).norm() / x.norm()) for t in range(6)]
    assert rel[:2] == [0.0, 0.0]
    assert rel[2:] == pytest.approx([0.01, 0.02, 0.03, 0.04], rel=1e-3)


def test_fence_rider_stays_inside_the_oracles_fence_and_moves_as_far_as_it_may():
    """A white-box oracle whose score is the relative size of the edit over 0.2: the rider sends an
    edit with score <= margin, nearly at it (bisection), never an honest copy when an edit fits."""
    x = honest(shape=(4, 32, 8))
    score = lambda t: float((t - x).norm() / x.norm()) / 0.2  # noqa: E731
    for margin in (0.3, 0.9):
        out = make_attack("fence", margin=margin, oracle=score, seed=7)(x, 0)
        assert margin * 0.9 <= score(out) <= margin
    # an oracle that refuses everything but the honest tensor gets the honest tensor
    strict = make_attack("fence", oracle=lambda t: 0.0 if torch.equal(t, x) else 5.0)
    assert torch.equal(strict(x, 0), x)


def test_fence_rider_without_an_oracle_asks_a_shadow_sentinel_fed_its_own_outputs():
    g = torch.Generator().manual_seed(8)
    E = torch.randn(32, 8, generator=g)
    atk = make_attack("fence", margin=0.9, start=30, seed=9)
    for t in range(31):
        ids = torch.randint(0, 32, (4, 32), generator=g)
        x = E[ids] + 0.3 * torch.randn(4, 32, 8, generator=g)
        out = atk(x, t, ids=ids)
    assert atk._shadow is not None and not torch.equal(out, x)
    assert atk._shadow.judge("self", "act", out, ids=ids, commit=False).score <= 0.9


def test_attack_specs_carry_parameters():
    from security import parse_attack

    assert parse_attack("swap") == ("swap", {})
    assert parse_attack("rotate:angle=1.5,fraction=0.5") == ("rotate", {"angle": 1.5, "fraction": 0.5})
    assert parse_attack("flip:dims=3") == ("flip", {"dims": 3})
    check_attack_allowed("swap:fraction=0.3", True, False)
    with pytest.raises(ValueError, match="key=value"):
        parse_attack("swap:0.3")
    with pytest.raises(ValueError, match="must be a number"):
        parse_attack("swap:fraction=lots")
    with pytest.raises(ValueError, match="bad parameters"):
        check_attack_allowed("swap:fractoin=0.3", True, False)
    with pytest.raises(AttackNotAllowed):
        check_attack_allowed("swap:fraction=0.3", False, False)
    from node.daemon import make_attacks

    atk = make_attacks("swap:fraction=0.3", seed=1)
    assert set(atk) == {"act", "grad"} and atk["act"].fraction == 0.3


def test_ctxswap_on_gradients_keys_positions_by_the_next_token():
    """The verifier keys a gradient by the label (the next token), so a gradient ctxswap exchanges
    codes between positions with the same NEXT token, and never moves a row's last position."""
    g = torch.Generator().manual_seed(11)
    x = honest(shape=(4, 64, 8))
    ids = torch.randint(0, 8, (4, 64), generator=g)
    out = make_attack("ctxswap", seed=3, direction="grad")(x, 0, ids=ids)
    nxt = torch.cat([ids[:, 1:], torch.full((4, 1), -1)], dim=1).reshape(-1)
    X, Y = rows(x), rows(out)
    assert torch.equal(out[:, -1], x[:, -1])
    moved = torch.nonzero((Y != X).any(dim=1)).flatten()
    assert moved.numel() > 100
    for i in moved.tolist():
        src = torch.nonzero((X == Y[i]).all(dim=1)).flatten()
        assert bool((nxt[src] == nxt[i]).any())
    with pytest.raises(ValueError, match="direction"):
        make_attack("swap", direction="sideways")
