"""SENTINEL (security/sentinel.py): distances, fences, warm-up, new senders, attacks, replays."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from security import ADAPTIVE_FAMILIES, ATTACKS, make_attack
from security.token_table import adjacent_agreement, context_agreement, context_keys, context_score, context_update
from security.sentinel import (
    DISTANCES,
    SINGLE,
    Sentinel,
    SentinelParams,
    Stats,
    TokenTable,
    compute_stats,
    distances,
    normalize,
    projections,
    tukey_fence,
)
from security.stats import SIGN_FLOOR

K = 8
# The averaged checks (tokc, ctxc, adjc, cum, edge) are tested here on four senders, the sender
# under test and three others; the default minimum of other voters is higher
# (test_averaged_checks_need_five_other_voters)
FEW_VOTERS = {"averaged_min_others": 3}


@pytest.fixture(autouse=True)
def one_thread():
    """The verifier's small ops are ~20x slower with spinning intra-op workers on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def stream(n, *, direction="act", B=8, L=64, vocab=64, seed=0, scale=1.0, noise=0.5, drift=None):
    """Synthetic boundary traffic with token structure: x_t = E[key_t] + noise, where the key is
    the token (activations) or the next token (gradients), like the real payloads."""
    E = torch.randn(vocab, K, generator=torch.Generator().manual_seed(1234)) + 0.7  # the "model"
    g = torch.Generator().manual_seed(seed)
    for t in range(n):
        ids = torch.randint(0, vocab, (B, L), generator=g)
        keys = ids if direction == "act" else torch.roll(ids, -1, dims=1)
        x = E[keys] + noise * torch.randn(B, L, K, generator=g)
        s = scale if drift is None else scale * drift(t)
        if direction == "grad":
            s = s / (B * L)  # gradients of a mean loss
        yield ids, x * s


def warm(sen, n=40, direction="act", senders=("a", "b", "c"), **kw):
    for t, (ids, x) in enumerate(stream(n, direction=direction, **kw)):
        j = sen.judge(senders[t % len(senders)], direction, x, ids, mb=("w", t))
        assert j.accept, (t, j)


def stats_of(mean, absmean, rms, quant, scale=0.0):
    f = torch.tensor
    return Stats(f(float(scale)), f(mean), f(absmean), f(rms), f(quant).reshape(-1, 1))


# ---------------------------------------------------------------------------- distances


def test_distances_on_hand_made_stats():
    r = stats_of([1.0, -2.0], [1.0, 2.0], [1.0, 2.0], [-1.0, 0.5, 2.0], scale=0.0)
    s = stats_of([1.0, 2.0], [1.0, 2.0], [1.5, 2.0], [-1.5, -0.5, 2.0], scale=math.log(3.0))
    d = distances(s, r)
    # moments differ in mean[1] by 4 and rms[0] by 0.5: 6 values
    assert d["l1"] == pytest.approx(4.5 / 6)
    assert d["l2"] == pytest.approx(math.sqrt((16 + 0.25) / 6))
    # signed: means [1, 2] vs [1, -2] and median quantile -0.5 vs 0.5: |s·r| = 1, 4, 0.25; flipped 4.25
    assert d["sign"] == pytest.approx(4.25 / 5.25)
    assert d["swd"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert d["scale"] == pytest.approx(math.log(3.0))
    assert distances(r, r) == {"l1": 0.0, "l2": 0.0, "sign": 0.0, "swd": 0.0, "scale": 0.0}


def test_sign_flips_of_statistics_that_hover_around_zero_are_not_a_full_flip():
    """Gradients' channel means lie ~0.05 robust units from zero, so their signs are noise, and
    the share of the weight on flipped components spanned 0-0.97 for honest gradients (isolated
    false flags in clean swarms). The share is of at least ``SIGN_FLOOR`` per component: all
    signs flipped at 0.05 is a small distance, at the activations' 0.5 a full flip, as before."""
    def signed(v, n=4):
        return stats_of([v] * n, [1.0] * n, [1.0] * n, [v, v, v])

    for size, want in ((0.5, 1.0), (0.05, 0.25), (0.0, 0.0)):
        assert distances(signed(-size), signed(size))["sign"] == pytest.approx(want), size
    assert distances(signed(0.05), signed(0.05))["sign"] == 0.0
    assert SIGN_FLOOR == 0.01


def test_normalize_and_stats_on_known_tensor():
    # every token vector has norm 2·sqrt(K): the robust unit is 2, values become ±1
    X = torch.full((100, K), 2.0)
    X[::2] *= -1
    Xn, log_scale = normalize(X, grad=False, clip=3.0)
    assert float(log_scale) == pytest.approx(math.log(2.0))
    assert torch.equal(Xn.abs(), torch.ones_like(Xn))
    s = compute_stats(Xn, log_scale, projections(K, 4, 0), n_quantiles=4, max_tokens=1000)
    assert torch.allclose(s.mean, torch.zeros(K)) and torch.allclose(s.rms, torch.ones(K))
    assert torch.allclose(s.absmean, torch.ones(K))
    # gradient scale drops the 1/N of a mean loss: N·σ
    _, g_scale = normalize(X / 100, grad=True, clip=3.0)
    assert float(g_scale) == pytest.approx(math.log(2.0))
    # clipping: one huge token does not move the unit and is capped at ±clip
    Y = X.clone()
    Y[0] *= 1000
    Yn, y_scale = normalize(Y, grad=False, clip=3.0)
    assert float(y_scale) == pytest.approx(math.log(2.0)) and float(Yn.abs().max()) == 3.0


def test_sliced_wasserstein_sees_a_shift_along_the_projections():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(4000, K, generator=g)
    P = projections(K, 16, 0)
    a = compute_stats(X, torch.tensor(0.0), P, 64, 10_000)
    b = compute_stats(X + 0.5, torch.tensor(0.0), P, 64, 10_000)
    # shifting every token by 0.5·1 shifts projection j by 0.5·sum(p_j): W1 per projection is that
    expected = float((0.5 * P.sum(0)).abs().mean())
    assert distances(b, a)["swd"] == pytest.approx(expected, rel=0.05)


def test_tukey_fence_and_spread_floors():
    assert tukey_fence([1, 2, 3, 4, 5], kappa=3.0, iqr_floor=0.0) == pytest.approx(4 + 3 * 2)
    # no spread at all: the floor relative to the median, then the absolute floor
    assert tukey_fence([2.0] * 10, kappa=3.0, iqr_floor=0.1) == pytest.approx(2.0 + 3 * 0.2)
    assert tukey_fence([0.0] * 10, kappa=3.0, iqr_floor=0.1, abs_floor=0.05) == pytest.approx(0.15)
    assert tukey_fence([], 3.0, 0.1) == math.inf


def test_token_table_agreement_and_shift():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 32, (4, 64), generator=g)
    E = torch.randn(32, K, generator=g)
    x = E[ids]
    tab = TokenTable(128, K, 0.9)
    noise = 0.1 * torch.randn(ids.numel(), K, generator=g)
    X, keys = TokenTable.keys(x, ids, "act", 128)
    tab.update(X, keys)
    assert tab.agreement(X, keys) == pytest.approx(1.0, abs=1e-5)
    assert tab.agreement(-X, keys) == pytest.approx(-1.0, abs=1e-5)
    perm = torch.randperm(X.shape[0], generator=g)
    assert abs(tab.agreement(X[perm], keys)) < 0.2
    # residuals are the noise: their mean is ~0; a constant bias makes it the whole residual
    assert tab.shift(X + noise, keys) < 0.1
    assert tab.shift(X + noise + 1.0, keys) == pytest.approx(1 / math.sqrt(1.01), abs=0.01)
    # gradients are keyed by the next token and drop the last position
    Xg, kg = TokenTable.keys(x, ids, "grad", 128)
    assert Xg.shape[0] == 4 * 63 and torch.equal(kg, ids[:, 1:].reshape(-1))



def whitespace_traffic(seed: int, B: int = 4, L: int = 64, small: float = 0.5):
    """Endless honest activations where token 0 (a space) carries codes ``small`` times as large
    as the other 31 tokens', in runs: each row is either prose (a space in one position of eight)
    or indentation (three spaces in four), so the median token norm of a batch depends on how
    much indentation it holds."""
    E = torch.randn(32, K, generator=torch.Generator().manual_seed(11))
    E = E / E.norm(dim=1, keepdim=True) * math.sqrt(K)
    E[0] *= small
    g = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(1, 32, (B, L), generator=g)
        share = torch.where(torch.rand(B, 1, generator=g) < 0.5, 0.75, 0.125)
        ids[torch.rand(B, L, generator=g) < share] = 0
        yield ids, E[ids] * (1 + 0.05 * torch.randn(B, L, 1, generator=g))


def test_the_scale_a_batch_s_tokens_explain_is_not_held_against_it():
    """The table keeps each token's mean log norm; the residual scale (median over positions of
    log norm minus the token's row) of an indentation-heavy batch is that of a prose batch, though
    its median token norm is half as large. A lone sender alternating between the two is judged on
    the residual: none of its tensors is over the ``scale`` fence, and its scale distance has a
    median under 0.02, where the raw log scale moves by up to log 2 between batches (the channel
    moments do see the mix of tokens change); so the fence stays tight, and the same traffic
    scaled by 1.25 is rejected on ``scale``."""
    from security.sentinel import position_lognorms

    src = whitespace_traffic(1)
    tab = TokenTable(128, K, 0.9)
    for _ in range(3):
        ids, x = next(src)
        X, keys = TokenTable.keys(x, ids, "act", 128)
        norms = position_lognorms(x.norm(dim=-1), K, grad=False).unsqueeze(-1)
        tab.update(X, keys, norms=TokenTable.keys(norms, ids, "act", 128)[0])
        assert tab.lognorm_residual(keys, TokenTable.keys(norms, ids, "act", 128)[0]) is None  # rows too young
    for _ in range(3):
        ids, x = next(src)
        X, keys = TokenTable.keys(x, ids, "act", 128)
        tab.update(X, keys, norms=position_lognorms(x.norm(dim=-1), K, grad=False).reshape(-1))
    assert tab.lognorm[0] == pytest.approx(math.log(0.5), abs=0.05) and tab.lognorm[1:32].abs().max() < 0.05
    prose = torch.randint(1, 32, (4, 64), generator=torch.Generator().manual_seed(3))
    indent = prose.clone()
    indent[:, ::4] = indent[:, 1::4] = indent[:, 2::4] = 0
    for ids in (prose, indent):
        keys = ids.reshape(-1)
        norms = tab.lognorm[keys] + 0.02  # as large as each token usually is, and 2% more
        assert tab.lognorm_residual(keys, norms) == pytest.approx(0.02, abs=1e-5)

    sentinel = Sentinel(SentinelParams(warmup=20))
    src = whitespace_traffic(2)
    verdicts, raw = [], []
    for i in range(200):
        ids, x = next(src)
        raw.append(float(normalize(x.reshape(-1, K), False, 3.0)[1]))
        verdicts.append(sentinel.judge("a", "act", x, ids))
    assert max(raw) - min(raw) > 0.6  # the raw log scale swings by about log 2
    assert not [j for j in verdicts if "scale" in j.over]
    # judged on the raw log scale, its distance has a median of 0.077 and reaches 0.62, and the
    # fence widens to match, so that a 25% scaling passes
    assert sorted(j.distances["scale"] for j in verdicts[40:])[80] < 0.02
    scaled = [sentinel.judge("a", "act", x * 1.25, ids, commit=False) for ids, x in (next(src) for _ in range(10))]
    assert all("scale" in j.over and j.over["scale"] > 2 for j in scaled)


def test_position_outliers_see_a_few_swapped_positions():
    """pos: how far positions lie beyond pos_c times the batch's median residual (each contributes
    clamp(z − 1, 0, 3), mean times √N). Honest codes (row + noise): ~0; 5% of the positions
    carrying another token's code: far more, although every batch-wide statistic of the swap is
    unchanged; the same share in a quarter of the batch gives half of it (√N: a small batch shows
    less, its honest spread being as large)."""
    g = torch.Generator().manual_seed(3)
    E = 3 * torch.randn(32, K, generator=g)
    tab = TokenTable(128, K, 0.9)

    def batch(B=8):
        ids = torch.randint(0, 32, (B, 64), generator=g)
        return TokenTable.keys(E[ids] + torch.randn(B, 64, K, generator=g), ids, "act", 128)

    assert tab.outliers(*batch(), 6.0) is None  # no rows yet
    for _ in range(5):
        tab.update(*batch())

    def swapped(X, share):
        n = X.shape[0]
        pos = torch.randperm(n, generator=g)[: round(share * n)]
        Xs = X.clone()
        Xs[pos] = X[pos.roll(1)]
        return Xs

    X, keys = batch()
    honest = tab.outliers(X, keys, 6.0)
    assert honest < 0.3
    big = tab.outliers(swapped(X, 0.05), keys, 6.0)
    assert big > 1.5
    Xq, kq = batch(B=2)
    assert tab.outliers(swapped(Xq, 0.05), kq, 6.0) == pytest.approx(big / 2, rel=0.5)  # √(N/4) = √N / 2
    # a large edit of a few positions counts too
    Xe = X.clone()
    Xe[:20] = X[:20] * -1.0
    assert tab.outliers(Xe, keys, 6.0) > 1.0


def context_traffic(seed, V=16, B=8, f=1.0, noise=0.3, batch_seed=None):
    """(F, batch): codes that depend on the previous token too, x = E[id] + f·F[prev] + noise,
    E and F drawn from ``seed``, the batches from ``batch_seed`` (default: the same generator)."""
    g = torch.Generator().manual_seed(seed)
    E, F = 3 * torch.randn(V, K, generator=g), torch.randn(V, K, generator=g)
    gb = g if batch_seed is None else torch.Generator().manual_seed(batch_seed)

    def batch():
        ids = torch.randint(0, V, (B, 64), generator=gb)
        return ids, E[ids] + f * F[torch.roll(ids, 1, dims=1)] + noise * torch.randn(B, 64, K, generator=gb)

    return F, batch


def test_context_agreement_sees_codes_exchanged_between_positions_of_one_token():
    """ctx: codes that depend on the previous token as well (x = E[id] + F[prev] + noise) agree with
    the pair table; exchanging codes among positions of the same token keeps every per-token
    statistic (tok, shift, pos) and destroys that agreement."""
    _, batch = context_traffic(4)
    tab, ctx = TokenTable(64, K, 0.9), TokenTable(4096, K, 0.9)

    for _ in range(8):
        ids, x = batch()
        tab.update(*TokenTable.keys(x, ids, "act", 64))
        cX, _, pair = TokenTable.pair_keys(x, ids, "act", 4096)
        ctx.update(cX, pair)
    ids, x = batch()
    cX, ctok, pair = TokenTable.pair_keys(x, ids, "act", 4096)
    honest = context_agreement(tab, ctx, cX, ctok, pair)
    swapped = make_attack("ctxswap", seed=1)(x, 0, ids=ids)
    sX, _, _ = TokenTable.pair_keys(swapped, ids, "act", 4096)
    assert honest > 0.7 and context_agreement(tab, ctx, sX, ctok, pair) < 0.2
    X, keys = TokenTable.keys(x, ids, "act", 64)
    Xs, _ = TokenTable.keys(swapped, ids, "act", 64)
    assert tab.agreement(Xs, keys) == pytest.approx(tab.agreement(X, keys), abs=0.02)
    # pairs: activations keyed by (previous, current), gradients by (current, next)
    Xg, tg, pg = TokenTable.pair_keys(x, ids, "grad", 4096)
    assert torch.equal(Xg, x[:, :-1].reshape(-1, K)) and torch.equal(tg, ids[:, 1:].reshape(-1))
    assert torch.equal(pg, pair)


def test_activations_are_compared_with_what_their_previous_token_usually_adds():
    """Activations: the context table is keyed by the previous token alone and holds the residual
    x − T[id]; an honest batch agrees with it, one whose codes were exchanged between positions
    of the same token does not, though every per-token statistic is unchanged. Gradients keep the
    (token, label) pair keys."""
    V = 16
    F, batch = context_traffic(6, V)
    tab, ctx = TokenTable(64, K, 0.9), TokenTable(4096, K, 0.9)

    ids, x = batch()
    cX, ctok, key = context_keys(x, ids, "act", 4096)
    assert torch.equal(key, ids[:, :-1].reshape(-1)) and torch.equal(ctok, ids[:, 1:].reshape(-1))
    context_update(tab, ctx, cX, ctok, key, "act")  # no token rows yet: nothing to take a residual of
    assert ctx.count == 0 and context_score(tab, ctx, cX, ctok, key, "act") is None
    for _ in range(8):
        ids, x = batch()
        tab.update(*TokenTable.keys(x, ids, "act", 64))
        cX, ctok, key = context_keys(x, ids, "act", 4096)
        context_update(tab, ctx, cX, ctok, key, "act")
    # the rows hold what the previous token adds, F[prev], up to a constant
    rows = ctx.table[:V] - ctx.table[:V].mean(0)
    want = F - F.mean(0)
    assert float((rows * want).sum() / (rows.norm() * want.norm())) > 0.9
    ids, x = batch()
    cX, ctok, key = context_keys(x, ids, "act", 4096)
    swapped = make_attack("ctxswap", seed=1)(x, 0, ids=ids)
    sX, _, _ = context_keys(swapped, ids, "act", 4096)
    assert context_score(tab, ctx, cX, ctok, key, "act") > 0.8
    assert context_score(tab, ctx, sX, ctok, key, "act") < 0.2
    _, _, gkey = context_keys(x, ids, "grad", 4096)
    assert torch.equal(gkey, TokenTable.pair_keys(x, ids, "grad", 4096)[2])


# ---------------------------------------------------------------------------- the detector


def test_warmup_accepts_anything_then_verdicts_count():
    sen = Sentinel(SentinelParams(warmup=10))
    junk = make_attack("random")
    data = list(stream(30, seed=3))
    for t, (ids, x) in enumerate(data[:10]):  # even garbage is accepted during warm-up
        bad = junk(x, t) if t == 5 else x
        j = sen.judge("a", "act", bad, ids)
        assert j.accept and j.basis == "warmup"
    gids, gx = next(stream(1, direction="grad", seed=4))  # warm-up is per direction: gradients are in theirs
    assert sen.judge("a", "grad", junk(gx, 0), gids).basis == "warmup"
    for t, (ids, x) in enumerate(data[10:20], start=10):
        j = sen.judge("a", "act", x, ids)
        assert j.accept and j.basis != "warmup"
    ids, x = data[20]
    j = sen.judge("a", "act", x * 3, ids)
    assert not j.accept and j.basis == "reference" and j.reason == "sentinel:scale" and j.score > 1


def test_new_honest_peer_is_accepted_and_new_malicious_peer_rejected():
    sen = Sentinel(SentinelParams(warmup=10))
    warm(sen, 40, senders=("r0", "r1", "r2", "r3"), seed=4)
    fresh = iter(stream(200, seed=5))
    # a newcomer sending honest traffic passes from its first tensor on
    for t in range(5):
        ids, x = next(fresh)
        j = sen.judge("new-honest", "act", x, ids)
        assert j.accept, j
    # a newcomer that attacks from its first tensor never gets in (the established replicas keep
    # sending meanwhile: an honest majority is SENTINEL's premise)
    for name in ("scaling", "negation", "random", "adaptive", "bias"):
        atk = make_attack(name, seed=1)
        for t in range(5):
            ids, x = next(fresh)
            j = sen.judge(f"new-{name}", "act", atk(x, t), ids)
            assert not j.accept, (name, t, j)
            for r in ("r0", "r1", "r2", "r3", "new-honest"):
                ids, x = next(fresh)
                sen.judge(r, "act", x, ids)
    report = sen.peer_report("act")
    assert report["new-honest"]["rejected"] <= 1 and report["new-random"]["rejected"] == 5


@pytest.mark.parametrize("direction", ["act", "grad"])
def test_every_attack_is_flagged_after_warmup(direction):
    """The classic attacks at their default strengths (the adaptive families are swept in strength
    against harm by bench_sentinel --part harm, and their checks tested one by one below)."""
    data = list(stream(84, direction=direction, seed=6))
    for name in (a for a in ATTACKS if a not in ADAPTIVE_FAMILIES):
        sen = Sentinel(SentinelParams(warmup=10))
        atk = make_attack(name, start=45, seed=2, **({"delay": 20} if name == "delayed" else {}))
        flagged = honest_flags = 0
        for t, (ids, x) in enumerate(data):
            sender = "m" if t % 3 == 0 else f"h{t % 3}"
            sent = atk(x, t) if sender == "m" else x
            j = sen.judge(sender, direction, sent, ids, mb=t)
            if t >= 45 and sender == "m":
                flagged += not j.accept
            elif t >= 10:
                honest_flags += not j.accept
        assert flagged >= 12, (name, direction, flagged)  # of 13
        assert honest_flags <= 2, (name, direction, honest_flags)


def test_without_ids_permutation_is_invisible_but_scaling_is_not():
    """Why ``tok`` exists: a shuffle keeps every payload statistic exactly."""
    data = list(stream(60, seed=7))
    sen = Sentinel(SentinelParams(warmup=10))
    for ids, x in data[:40]:
        sen.judge("h", "act", x)
    shuffle = make_attack("adaptive", seed=3)
    ids, x = data[40]
    assert sen.judge("m", "act", shuffle(x, 0), commit=False).accept
    assert not sen.judge("m", "act", x * 3, commit=False).accept


def test_fences_follow_a_drifting_honest_distribution():
    """Gradients shrink 100x and get noisier over the run: (almost) no honest rejections, the
    fence grows with the noise, and a x3 scaling at the end is still caught."""
    n = 240
    sen = Sentinel(SentinelParams(warmup=10, window=32))
    fences, rejected = [], 0
    g = torch.Generator().manual_seed(0)  # (it drew from the global generator: 5 rejections after some other tests)
    for t, (ids, x) in enumerate(stream(n, direction="grad", seed=8, drift=lambda t: 0.98 ** t)):
        if t % 80 == 0 and t:
            fences.append(sen.fences("grad")["tok"])
        # honest noise grows over time: mix in more of a fresh sample
        x = x + (t / n) * 2.0 * x.std() * torch.randn(x.shape, generator=g)
        rejected += not sen.judge(f"r{t % 4}", "grad", x, ids).accept
    assert rejected <= 0.02 * n
    assert fences[-1] > fences[0]
    j = sen.judge("r0", "grad", x * 3, ids, commit=False)
    assert not j.accept and j.reason == "sentinel:scale"


def test_an_abrupt_honest_change_is_followed_not_locked_out():
    """All honest senders change together (a learning-rate step): they are rejected for a while,
    then the reference catches up and they are accepted again."""
    sen = Sentinel(SentinelParams(warmup=10))
    warm(sen, 40, seed=9)
    accepted_after = []
    for t, (ids, x) in enumerate(stream(200, seed=10)):
        j = sen.judge(f"r{t % 3}", "act", x * 1.5, ids)
        accepted_after.append(j.accept)
    assert not all(accepted_after[:3])  # the jump is seen
    assert all(accepted_after[-50:])  # and absorbed


@pytest.mark.parametrize("senders", [("solo",), ("a", "b")])
def test_one_or_two_senders_follow_an_abrupt_honest_change(senders):
    """With one or two replicas upstream there is no majority; when every one of them leaves
    the fences together the stage's distribution has moved, and it is followed within a few
    tensors instead of every tensor being dropped for good (measured before: an honest lone
    replica locked out in a real swarm)."""
    sen = Sentinel(SentinelParams(warmup=10))
    warm(sen, 40, senders=senders, seed=9)
    verdicts = [sen.judge(senders[t % len(senders)], "act", x * 1.5, ids).accept
                for t, (ids, x) in enumerate(stream(60, seed=10))]
    assert not verdicts[0]  # the jump is seen
    assert sum(verdicts[-40:]) >= 36  # and followed (without: all 60 rejected)


def test_two_replicas_are_each_judged_against_their_own_history():
    """With two established replicas there is no majority: each is judged against its own EMA.
    One replica's output scale drifting away from the other's (0.3% per tensor; two replicas
    train on their own data at their own pace and average only a slice) is followed. Judged
    against the median of the two (per coordinate one of them, the lower), the replica that
    drifted up was judged against the other one: 83 of its 100 tensors rejected (measured
    before the change; in clean real swarms such replicas were banned)."""
    sen = Sentinel(SentinelParams(warmup=10))
    rejected = {"a": 0, "b": 0}
    for t, (ids, x) in enumerate(stream(200, seed=9)):
        r = "ab"[t % 2]
        rejected[r] += not sen.judge(r, "act", x * (1.0 + 0.003 * t if r == "b" else 1.0), ids).accept
    assert rejected == {"a": 0, "b": 0}



def _partner_scenario(b_after):
    """Two established replicas; a's output scale moves up 0.3% per tensor of its own for 100
    tensors (followed by its own reference), b's stays; then b sends ``b_after(x)``. Returns
    how many of b's next 10 tensors were rejected, and the other rejections (a's, and b's
    before it moved: marginal false positives)."""
    sen = Sentinel(SentinelParams(warmup=10))
    warm(sen, 40, senders=("a", "b"), seed=9)
    fresh = iter(stream(400, seed=10))
    a_rejected = 0
    for t in range(100):
        ids, x = next(fresh)
        a_rejected += not sen.judge("a", "act", x * (1.0 + 0.003 * t), ids).accept
        ids, x = next(fresh)
        a_rejected += not sen.judge("b", "act", x, ids).accept
    b_rejected = 0
    for t in range(10):
        ids, x = next(fresh)
        b_rejected += not sen.judge("b", "act", b_after(x), ids).accept
        ids, x = next(fresh)
        a_rejected += not sen.judge("a", "act", x * 1.3, ids).accept
    return b_rejected, a_rejected


def test_a_replica_catching_up_with_its_partner_is_accepted():
    """A stage-wide move reaches two replicas at different times. The first follows it
    gradually (its own reference keeps up); the second jumps to where the first already is.
    Judged only against its own EMA it was flagged in a burst and banned in clean real swarms;
    it is within the fences of its partner's reference, so it passes (basis ``partner``)."""
    b_rejected, a_rejected = _partner_scenario(lambda x: x * 1.3)
    assert b_rejected == 0 and a_rejected <= 2  # a marginal flag or so before b moves


@pytest.mark.parametrize("attack", ["down", "scaling", "random"])
def test_a_replica_jumping_where_no_partner_is_still_rejected(attack):
    """The partner reference admits only what looks like another established replica's current
    output: the same size of jump in another direction, or an attack, is still rejected."""
    atk = {"down": lambda x: x / 1.3, "scaling": lambda x: make_attack("scaling", factor=3.0)(x, 0),
           "random": lambda x: make_attack("random", seed=1)(x, 0)}[attack]
    b_rejected, a_rejected = _partner_scenario(atk)
    assert b_rejected >= 8 and a_rejected <= 2, (b_rejected, a_rejected)

def test_a_newcomer_is_judged_against_the_established_replicas():
    """The own-history reference is for established voters only: a newcomer beside two honest
    replicas is judged against them, so it cannot join with scaled or random traffic."""
    sen = Sentinel(SentinelParams(warmup=10))
    warm(sen, 40, senders=("a", "b"), seed=9)
    fresh = iter(stream(200, seed=10))
    for name in ("scaling", "random", "zeros"):
        atk = make_attack(name, seed=1)
        for t in range(6):
            ids, x = next(fresh)
            assert not sen.judge(f"new-{name}", "act", atk(x, t), ids).accept, (name, t)
            for r in ("a", "b"):
                ids, x = next(fresh)
                assert sen.judge(r, "act", x, ids).accept


def test_a_newcomer_attacker_cannot_trigger_shift_mode_beside_one_honest_replica():
    sen = Sentinel(SentinelParams(warmup=10))
    warm(sen, 40, senders=("h",), seed=23)
    atk = make_attack("scaling", factor=3.0)
    bad = honest_rejected = 0
    for t, (ids, x) in enumerate(stream(60, seed=24)):
        if t % 2:
            bad += not sen.judge("m", "act", atk(x, t), ids).accept
        else:
            honest_rejected += not sen.judge("h", "act", x, ids).accept
    assert bad == 30 and honest_rejected <= 1


def test_rejected_garbage_does_not_drag_the_reference():
    sen = Sentinel(SentinelParams(warmup=10))
    warm(sen, 40, seed=11)
    data = list(stream(200, seed=12))
    zeros, big = make_attack("zeros"), make_attack("scaling", factor=1000.0)
    honest_rejected = 0
    for t, (ids, x) in enumerate(data):
        if t % 2 == 0:  # half of the traffic is garbage from one sender
            j = sen.judge("m", "act", (zeros if t % 4 else big)(x, t), ids)
            assert not j.accept
        else:
            honest_rejected += not sen.judge(f"h{t % 3}", "act", x, ids).accept
    assert honest_rejected <= 3
    assert sen.peer_report("act")["m"]["rejected"] == 100


def test_a_rejected_newcomer_gets_no_vote_in_the_reference():
    """With two honest replicas, an attacker's EMA in the median would pick the reference (median
    of three). A newcomer votes only after ``sender_min`` accepted tensors, so its rejected
    tensors leave the honest senders' judgement exactly as it was; an honest newcomer that has
    been accepted ``sender_min`` times does vote."""
    sen = Sentinel(SentinelParams(warmup=10))
    warm(sen, 40, senders=("a", "b"), seed=21)
    data = list(stream(40, seed=22))
    probe_ids, probe = data[0]
    before = sen.judge("a", "act", probe, probe_ids, commit=False).distances
    atk = make_attack("scaling", factor=3.0)
    for t, (ids, x) in enumerate(data[1:6]):
        assert not sen.judge("m", "act", atk(x, t), ids).accept
    assert sen.judge("a", "act", probe, probe_ids, commit=False).distances == before
    # an honest newcomer, once accepted sender_min times, is a voter: the reference now moves
    for ids, x in data[6:6 + sen.params.sender_min]:
        assert sen.judge("c", "act", x, ids).accept
    assert sen.judge("a", "act", probe, probe_ids, commit=False).distances != before


@pytest.mark.parametrize("direction", ["act", "grad"])
def test_persistent_noise_is_caught_by_the_cumulative_tok_distance(direction):
    """An insider that mixes noise of 0.7 x the payload's RMS into every tensor, keeping each
    token's norm, stays inside the single-tensor fences (before tokc: 29-30 of 30 accepted); its
    tok distance averaged over its own tensors (tokc, against the median of the other senders'
    averages) adds up and is flagged, while the honest senders are not."""
    sen = Sentinel(SentinelParams(warmup=10, **FEW_VOTERS, off=("pos", "edge")))  # tokc alone
    warm(sen, 60, direction=direction, senders=("a", "b", "c", "m"), seed=31, noise=1.5)
    g = torch.Generator().manual_seed(5)

    def half_noise(x):
        n = x + 0.7 * x.std() * torch.randn(x.shape, generator=g)
        return n * (x.norm(dim=-1, keepdim=True) / n.norm(dim=-1, keepdim=True))

    flagged, honest_rejected = [], 0
    for t, (ids, x) in enumerate(stream(120, direction=direction, seed=32, noise=1.5)):
        sender = "abcm"[t % 4]
        if sender == "m":
            j = sen.judge("m", direction, half_noise(x), ids)
            flagged.append(j.reason)
        else:
            honest_rejected += not sen.judge(sender, direction, x, ids).accept
    assert flagged.count("sentinel:tokc") >= 24, flagged
    assert honest_rejected <= 4


def test_tokc_averages_the_per_position_agreement_so_loud_positions_cannot_hide_noise():
    """A tenth of every batch's positions carry codes six times larger (content); an insider adds
    norm-kept noise of half a position's RMS to all the *other* positions on every tensor. The
    pooled agreement (``tok``) is ruled by the loud positions and barely moves; ``tokc`` averages
    the per-position agreement (``TokenTable.position_agreement``), which counts every position
    alike, and flags the insider; no honest sender is flagged on it. Averaging the pooled one
    instead (the code before): 4–7 of the 25 flagged on ``tokc`` over four seeds, 20–22 now."""
    sen = Sentinel(SentinelParams(warmup=10, **FEW_VOTERS, off=("pos", "edge")))  # tokc alone
    g = torch.Generator().manual_seed(9)
    flagged, honest_rejected = [], []
    for t, (ids, x) in enumerate(stream(160, seed=42, noise=0.8)):
        loud = torch.rand(x.shape[:2], generator=g) < 0.1
        x = x * torch.where(loud, 6.0, 1.0).unsqueeze(-1)
        sender = "abcm"[t % 4]
        if sender == "m" and t >= 60:
            n = x + 0.5 * x.norm(dim=-1, keepdim=True) / math.sqrt(K) * torch.randn(x.shape, generator=g)
            n = n * (x.norm(dim=-1, keepdim=True) / n.norm(dim=-1, keepdim=True))
            flagged.append(sen.judge("m", "act", torch.where(loud.unsqueeze(-1), x, n), ids).reason)
        else:
            j = sen.judge(sender, "act", x, ids)
            if t >= 60 and not j.accept:
                honest_rejected.append(j.reason)
    assert flagged.count("sentinel:tokc") >= 16, flagged
    assert len(honest_rejected) <= 2 and "sentinel:tokc" not in honest_rejected, honest_rejected


def insider_run(batch, attack, n, start, watch_from, distance):
    """Senders a, b, c honest and m an insider that applies ``attack`` from tensor ``start`` on,
    in turn, on ``batch()`` traffic: (m's verdict reasons, the honest senders' rejection reasons
    from ``start`` on, {"honest"|"m": ``distance`` of every verdict from ``watch_from`` on})."""
    sen = Sentinel(SentinelParams(warmup=10, **FEW_VOTERS))
    flagged, honest_rejected, seen = [], [], {"honest": [], "m": []}
    for t in range(n):
        ids, x = batch()
        sender = "abcm"[t % 4]
        if sender == "m" and t >= start:
            j = sen.judge("m", "act", attack(x, t, ids=ids), ids)
            flagged.append(j.reason)
        else:
            j = sen.judge(sender, "act", x, ids)
            if t >= start and not j.accept:
                honest_rejected.append(j.reason)
        if t >= watch_from:
            seen["m" if sender == "m" else "honest"].append(j.distances.get(distance, 0.0))
    return flagged, honest_rejected, seen


def test_codes_exchanged_within_a_token_on_every_tensor_are_caught_by_the_averaged_ctx():
    """An insider that exchanges codes between positions of the same token on every tensor keeps
    every per-token statistic; its ``ctx`` (how well a position's code agrees with its token
    pair's) rises toward 1 on each tensor, and averaged over its own tensors (ctxc, against the
    median of the other senders' averages) it is flagged, while the honest senders are not."""
    # the previous token moves the code too, weakly: honest ctx ≈ 0.74
    _, batch = context_traffic(1234, V=32, B=4, f=0.4, noise=1.2, batch_seed=7)
    flagged, honest_rejected, ctxc = insider_run(batch, make_attack("ctxswap", seed=3), 200, 80, 120, "ctxc")
    assert sum(r in ("sentinel:ctxc", "sentinel:ctx") for r in flagged) >= 27, flagged
    assert "sentinel:ctxc" in flagged
    assert len(honest_rejected) <= 2
    assert min(ctxc["m"]) > 0.15 and max(ctxc["honest"]) < 0.05, ctxc


def state_traffic(seed, V=16, B=8, L=64, rho=0.9, state=1.0, noise=0.3):
    """batch(): codes that carry a context state shared by neighbours, x_t = E[id_t] + c_t + noise,
    c_t = ρ·c_{t−1} + √(1−ρ²)·η_t (what a row has read so far), the previous token alone saying
    nothing about it."""
    g = torch.Generator().manual_seed(seed)
    E = 3 * torch.randn(V, K, generator=g)

    def batch():
        ids = torch.randint(0, V, (B, L), generator=g)
        c = torch.empty(B, L, K)
        c[:, 0] = torch.randn(B, K, generator=g)
        for t in range(1, L):
            c[:, t] = rho * c[:, t - 1] + math.sqrt(1 - rho * rho) * torch.randn(B, K, generator=g)
        return ids, E[ids] + state * c + noise * torch.randn(B, L, K, generator=g)

    return batch


def test_adjacent_agreement_sees_codes_moved_away_from_their_neighbours():
    """adj: what neighbouring positions carry beyond their tokens' rows agrees (they share their
    context); codes exchanged between positions of one token (every per-token statistic kept) or
    blended with other positions' codes lose that agreement; too few known positions -> None."""
    batch = state_traffic(5)
    tab = TokenTable(64, K, 0.9)
    ids, x = batch()
    assert adjacent_agreement(tab, x, ids) is None  # an empty table
    for _ in range(8):
        ids, x = batch()
        tab.update(*TokenTable.keys(x, ids, "act", 64))
    ids, x = batch()
    honest = adjacent_agreement(tab, x, ids)
    swapped = make_attack("ctxswap", seed=1)(x, 0, ids=ids)
    perm = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(2))
    blended = 0.7 * x + 0.3 * x.reshape(-1, K)[perm].reshape(x.shape)
    assert honest > 0.6
    assert adjacent_agreement(tab, swapped, ids) < 0.15
    assert adjacent_agreement(tab, blended, ids) < honest - 0.2
    X, keys = TokenTable.keys(x, ids, "act", 64)
    Xs, _ = TokenTable.keys(swapped, ids, "act", 64)
    assert tab.agreement(Xs, keys) == pytest.approx(tab.agreement(X, keys), abs=0.02)
    # positions whose token has no row do not count: with most of them unknown, no answer
    fresh = ids.clone()
    fresh[:, : ids.shape[1] * 15 // 16] = 63  # a token id the table has not seen
    assert adjacent_agreement(tab, x, fresh) is None


def test_codes_exchanged_within_a_token_are_caught_by_the_averaged_adjacency():
    """Codes that carry a context the previous token does not predict: exchanging them between
    positions of one token on every tensor keeps every per-token statistic, and ``ctx`` (by the
    previous token) cannot see it; the averaged adjacency (adjc) flags the sender, and no honest
    one. Before adj: the exchange was accepted on every tensor."""
    batch = state_traffic(7, V=16, B=4)
    flagged, honest_rejected, adjc = insider_run(batch, make_attack("ctxswap", seed=3), 160, 60, 100, "adjc")
    assert flagged.count("sentinel:adjc") >= 18, flagged
    # the synthetic stream's marginal flags on the batch statistics, never the adjacency
    assert len(honest_rejected) <= 2 and not {"sentinel:adj", "sentinel:adjc"} & set(honest_rejected), honest_rejected
    assert min(adjc["m"]) > 0.3 and max(adjc["honest"]) < 0.05, adjc


def test_cumulative_tok_needs_other_voters():
    """Of two senders that differ persistently, neither is the odd one: tokc stays 0 for both
    (with more senders it flags the noisy one, as above); the single-tensor distances still
    judge every tensor."""
    sen = Sentinel(SentinelParams(warmup=10))
    warm(sen, 40, direction="grad", senders=("a", "m"), seed=31, noise=1.5)
    g = torch.Generator().manual_seed(5)

    def half_noise(x):
        n = x + 0.7 * x.std() * torch.randn(x.shape, generator=g)
        return n * (x.norm(dim=-1, keepdim=True) / n.norm(dim=-1, keepdim=True))

    tokc, tok, reasons = [], [], []
    for t, (ids, x) in enumerate(stream(60, direction="grad", seed=32, noise=1.5)):
        j = sen.judge("am"[t % 2], "grad", half_noise(x) if t % 2 else x, ids)
        tokc.append(j.distances.get("tokc"))
        tok.append(j.distances.get("tok"))
        reasons.append(j.reason)
    assert set(tokc) == {0.0} and "sentinel:tokc" not in reasons
    assert all(v is not None and v > 0 for v in tok)  # the single-tensor tok is still measured


def _replicas(n: int, min_others: int, rel: float) -> dict[str, list]:
    """``n`` senders, the last persistently a little different from the others, which agree (an
    honest replica with its own data and progress): every verdict's reason and averaged distances."""
    names = "abcdefgh"[:n]
    sen = Sentinel(SentinelParams(warmup=10, averaged_min_others=min_others))
    if n == 3:
        warm(sen, 40, direction="grad", senders=tuple(names), seed=61, noise=1.5)
    else:  # honest traffic from more senders: a newcomer now and then marginally out while few are established
        for t, (ids, x) in enumerate(stream(14 * n, direction="grad", seed=61, noise=1.5)):
            sen.judge(names[t % n], "grad", x, ids, mb=("w", t))
    g = torch.Generator().manual_seed(7)
    out = {"reasons": [], "tokc": [], "cum": [], "edge": []}
    for t, (ids, x) in enumerate(stream(30 * n, direction="grad", seed=62, noise=1.5)):
        sender = names[t % n]
        if sender == names[-1]:
            v = x + rel * x.std() * torch.randn(x.shape, generator=g)
            x = v * (x.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True))
        j = sen.judge(sender, "grad", x, ids)
        out["reasons"].append((sender, j.reason))
        for k in ("tokc", "cum", "edge"):
            out[k].append(j.distances.get(k))
    return out


AVERAGED_REASONS = ("sentinel:tokc", "sentinel:cum", "sentinel:edge", "sentinel:ctxc", "sentinel:adjc")


def test_averaged_checks_need_five_other_voters():
    """Replicas that differ a little all along: against few others the spread is poorly known
    (two others: one difference; three: a MAD of three values, one of whose deviations is always
    0), so the averaged checks flag the odd replica (three replicas, averaged_min_others = 2:
    `edge`, 9 of its 30 tensors; four replicas at 3: `edge`, 17 of 30; in clean real swarms of
    four body replicas at 3, honest bans in two of five runs, docs/SENTINEL.md). With the
    default of five, three or four replicas are not judged on them (tokc 0, no cum or edge);
    the single-tensor fences still are (a loud third is refused on `shift`, the token-table
    distance); six are."""
    assert SentinelParams().averaged_min_others == 5
    for n, old_min in ((3, 2), (4, 3)):  # the odd replica against two others, then three
        before = _replicas(n, old_min, 0.5)
        flagged = [r for s, r in before["reasons"] if s == "abcd"[n - 1] and r in AVERAGED_REASONS]
        assert len(flagged) >= 5, before["reasons"]
    for n in (3, 4):
        now = _replicas(n, 5, 0.5)
        assert not [r for _, r in now["reasons"] if r in AVERAGED_REASONS], now["reasons"]
        assert set(now["tokc"]) == {0.0} and set(now["cum"]) == {None} and set(now["edge"]) == {None}
        assert sum(r is not None for _, r in now["reasons"]) <= 3, now["reasons"]
    # a sender far off is still refused tensor by tensor
    loud = _replicas(3, 5, 3.0)
    assert sum(r is not None for s, r in loud["reasons"] if s == "c") >= 20, loud["reasons"]
    # six replicas: judged (five others)
    six = _replicas(6, 5, 0.5)
    assert any(v is not None for v in six["edge"]) and any(v is not None for v in six["cum"])
    with pytest.raises(ValueError, match="averaged_min_others"):
        SentinelParams(averaged_min_others=1)


def test_replay_is_rejected_and_retransmission_is_not():
    sen = Sentinel(SentinelParams(warmup=4))
    data = list(stream(20, seed=13))
    for t, (ids, x) in enumerate(data[:15]):
        assert sen.judge("a", "act", x, ids, mb=t).accept
    ids, x = data[3]
    assert sen.judge("a", "act", x.clone(), ids, mb=3).basis == "retransmit"  # same microbatch
    j = sen.judge("b", "act", x.clone(), data[15][0], mb=99)
    assert not j.accept and j.reason == "replay"
    # a replay with a little noise is not bit-identical: the token agreement catches it
    noisy = make_attack("delayed", delay=10, noise=0.01)
    for t, (ids, x) in enumerate(data):
        out = noisy(x, t)
    j = sen.judge("b", "act", out, data[19][0], mb=100)
    assert not j.accept and j.reason in ("sentinel:tok", "sentinel:tokc", "sentinel:shift", "sentinel:pos"), j


def test_commit_false_learns_nothing_and_reference_tensor():
    sen = Sentinel(SentinelParams(warmup=4))
    data = list(stream(12, direction="grad", seed=14))
    for ids, x in data[:10]:
        sen.judge("a", "grad", x, ids)
    before = sen.fences("grad")
    ids, x = data[10]
    sen.judge("a", "grad", x * 50, ids, commit=False)
    assert sen.fences("grad") == before
    assert sen.judge("a", "grad", x, ids).accept  # not taken for a replay of the uncommitted call
    ref = sen.reference_tensor("grad", ids)
    assert ref.shape == x.shape and torch.isfinite(ref).all()
    # the stand-in carries the gradient's scale (1/N of a mean loss), within a factor of a few
    assert 0.2 < float(ref.norm() / x.norm()) < 5
    assert sen.reference_tensor("act", ids) is None


def test_params_are_validated():
    with pytest.raises(ValueError, match="warmup"):
        SentinelParams(warmup=1)
    with pytest.raises(ValueError, match="beta"):
        SentinelParams(beta_act=1.0)
    with pytest.raises(ValueError, match="direction"):
        Sentinel().judge("a", "sideways", torch.zeros(1, 2, K))
    assert set(DISTANCES) >= {"l1", "l2", "sign", "swd", "tok"}


# scripts/bench_sentinel.py --quick (detection, damage, harm) and its figures: tests/test_bench_smoke.py


def test_bench_clean_summary_counts_false_positives_per_node():
    """``--part clean`` (a real swarm with no attacker) reports every rejection as a false
    positive and every ban as a false ban, per node and over the swarm, from /metrics samples."""
    from tests.helpers.scripts import load_script

    bench = load_script("bench_sentinel")
    v = bench.VERDICTS
    metrics = {
        "tail": {f'{v}{{direction="act",verdict="accept",reason="ok"}}': 97.0,
                 f'{v}{{direction="act",verdict="reject",reason="sentinel:swd"}}': 2.0,
                 f'{v}{{direction="act",verdict="reject",reason="sentinel:tok"}}': 1.0,
                 'swarm_node_bans_total{cause="verifier"}': 1.0, "swarm_node_steps_total": 300.0},
        "head": {f'{v}{{direction="grad",verdict="accept",reason="ok"}}': 100.0,
                 'swarm_node_bans_total{cause="verifier-downstream"}': 0.0},
        "body0": {},  # a node that answered no /metrics scrape judged nothing
    }
    out = bench.clean_summary(metrics)
    assert out["judged"] == 200 and out["rejected"] == 3 and out["fpr"] == 0.015 and out["false_bans"] == 1
    tail = out["per_node"]["tail"]
    assert tail == {"steps": 300.0, "judged": 100, "rejected": 3, "fpr": 0.03,
                    "reject_reasons": {"sentinel:swd": 2.0, "sentinel:tok": 1.0}, "bans": 1}
    assert out["per_node"]["head"]["fpr"] == 0.0 and out["per_node"]["body0"]["fpr"] is None


def test_a_sender_riding_just_inside_the_fences_is_caught_by_cum():
    """A white-box insider that reads the fences and scales every tensor up as far as every
    single-tensor check allows (score <= 0.9, by bisection) passes them all; its fence ratio
    averaged over its own tensors sits near 0.9 while the honest senders' averages sit far
    lower, so ``cum`` flags it after a few tensors, and no honest sender (``edge`` off: it
    flags the same rider sooner, ``test_edge_flags_a_rider_within_a_few_tensors``)."""
    sen = Sentinel(SentinelParams(warmup=10, **FEW_VOTERS, off=("pos", "edge")))
    warm(sen, 60, senders=("a", "b", "c", "m"), seed=41)

    def single_score(t, ids):  # the verdict without cum and without learning
        j = sen.judge("m", "act", t, ids, commit=False)
        f = sen.fences("act")
        return max(v / f[k] for k, v in j.distances.items() if k not in ("cum", "edge"))

    single, reasons, honest_rejected = [], [], 0
    for t, (ids, x) in enumerate(stream(80, seed=42)):
        sender = "abcm"[t % 4]
        if sender != "m":
            honest_rejected += not sen.judge(sender, "act", x, ids).accept
            continue
        lo, hi = 0.0, 0.2
        for _ in range(12):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if single_score(x * math.exp(mid), ids) <= 0.9 else (lo, mid)
        ride = x * math.exp(lo)
        single.append(single_score(ride, ids))
        reasons.append(sen.judge("m", "act", ride, ids).reason)
    assert max(single) <= 0.9 and min(single) > 0.85  # inside every single-tensor fence, every time
    assert reasons[:2] == [None, None]  # it takes a few tensors to add up ...
    assert reasons[5:].count("sentinel:cum") >= 13, reasons  # ... then it is flagged (of 15)
    assert honest_rejected <= 2


def _ride(sen, sender, x, ids, skip=("cum", "edge"), margin=0.9, hi=0.2):
    """The largest log-scale lift of ``x`` whose verdict score, without the distances in
    ``skip`` and without learning, stays <= ``margin`` (bisection), and the lifted tensor."""
    def score(t):
        j = sen.judge(sender, "act", t, ids, commit=False)
        f = sen.fences("act")
        return max((v / f[k] for k, v in j.distances.items() if k not in skip), default=0.0)

    lo = 0.0
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if score(x * math.exp(mid)) <= margin else (lo, mid)
    return lo, x * math.exp(lo)


def test_edge_flags_a_rider_within_a_few_tensors():
    """The rider of ``test_a_sender_riding_just_inside_the_fences_is_caught_by_cum`` (every
    tensor scaled up to 0.9 of the tightest single-tensor fence), ``cum`` off: its score sits
    near 0.9 on every tensor, far above the honest senders' level, so the edge sum passes its
    limit within a few tensors (each adds at most ``edge_step``) and it stays flagged; no
    honest tensor is."""
    p = SentinelParams(warmup=10, **FEW_VOTERS, off=("pos", "cum"))
    sen = Sentinel(p)
    warm(sen, 60, senders=("a", "b", "c", "m"), seed=41)
    reasons, honest = [], []
    for t, (ids, x) in enumerate(stream(80, seed=42)):
        sender = "abcm"[t % 4]
        if sender != "m":
            honest.append(sen.judge(sender, "act", x, ids).reason)
            continue
        _, ride = _ride(sen, "m", x, ids)
        reasons.append(sen.judge("m", "act", ride, ids).reason)
    first = reasons.index("sentinel:edge")
    assert math.ceil(p.edge_limit / p.edge_step) <= first + 1 <= 6, reasons  # not one tensor: a few
    assert reasons[first:].count("sentinel:edge") >= len(reasons[first:]) - 1, reasons
    assert "sentinel:edge" not in honest and sum(r is not None for r in honest) <= 2, honest


def test_a_rider_that_obeys_edge_is_held_near_the_honest_level():
    """A rider that asks the full verdict (edge included) sends only what passes, and what passes
    is bounded: once its sum is full, its single-tensor score averages within ``edge_allow``
    (and the noise of the level) of the honest senders' instead of 0.9, and it lifts less than
    the single-tensor fences alone allow it (here little less: in this synthetic stream the
    honest score is set by the token-table distances, about 0.77, not by ``scale``, which the
    lift moves). It is refused only where even its unedited tensor does not pass."""
    lifts, scores = {}, {}
    for off in (("pos", "cum", "edge"), ("pos", "cum")):
        sen = Sentinel(SentinelParams(warmup=10, **FEW_VOTERS, off=off))
        warm(sen, 60, senders=("a", "b", "c", "m"), seed=41)
        mine, single, honest, reasons = [], [], [], []
        for t, (ids, x) in enumerate(stream(160, seed=42)):
            sender = "abcm"[t % 4]
            if sender != "m":
                honest.append(sen.judge(sender, "act", x, ids).score)
                continue
            lo, ride = _ride(sen, "m", x, ids, skip=())
            mine.append(lo)
            f = sen.fences("act")
            j = sen.judge("m", "act", ride, ids)
            single.append(max(v / f[k] for k, v in j.distances.items() if k in SINGLE and k not in off))
            reasons.append((j.reason, lo))
        # refused only where even its unedited tensor does not pass (its sum full, or out anyway)
        assert all(lo == 0 for reason, lo in reasons if reason), reasons
        assert sum(reason is not None for reason, _ in reasons) <= 2, reasons
        lifts[off], scores[off] = statistics.mean(mine[10:]), statistics.mean(single[10:])
    free, held = ("pos", "cum", "edge"), ("pos", "cum")
    assert scores[free] > 0.85 and scores[held] < statistics.median(honest) + 0.15, (scores, statistics.median(honest))
    assert lifts[held] < lifts[free], lifts


def test_edge_leaves_honest_senders_alone_and_needs_other_voters():
    """Four honest senders, one a little noisier than the rest (another replica's output
    differs a little): no edge flag in 300 tensors. A tensor refused for another reason adds
    nothing to its sender's sum. With two senders there is no edge (of two, neither is the odd
    one)."""
    sen = Sentinel(SentinelParams(warmup=10, **FEW_VOTERS))
    warm(sen, 40, senders=("a", "b", "c", "d"), seed=51)
    reasons = []
    for t, (ids, x) in enumerate(stream(300, seed=52)):
        sender = "abcd"[t % 4]
        if sender == "d":
            x = x + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(t))
        j = sen.judge(sender, "act", x, ids)
        assert "edge" in j.distances
        reasons.append(j.reason)
    assert "sentinel:edge" not in reasons and sum(r is not None for r in reasons) <= 3, reasons

    rec = sen._dirs["act"].senders["d"]
    rec.edge = 0.2
    for ids, x in stream(3, seed=53):
        j = sen.judge("d", "act", x * 5, ids)
        assert not j.accept and j.distances["edge"] > 0.2  # refused on scale; it would have added
    assert rec.edge == 0.2

    two = Sentinel(SentinelParams(warmup=10, **FEW_VOTERS))
    warm(two, 60, senders=("a", "b"), seed=54)
    for ids, x in stream(20, seed=55):
        assert "edge" not in two.judge("a", "act", x, ids).distances


def test_edge_parameters_are_checked():
    for bad in (dict(edge_allow=-0.1), dict(edge_step=0), dict(edge_limit=0), dict(beta_edge=1.0)):
        with pytest.raises(ValueError):
            SentinelParams(**bad)
