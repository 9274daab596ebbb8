"""stages.robust_avg: what a replica-averaging round applies. A member far outside the group's
spread is dropped and counted, honest spread is kept, a pair is judged only against gross
poison, and a reducer's tampered range is refused by the receivers."""

from __future__ import annotations

import pytest
import torch

from stages import AveragingLayout, butterfly, chunk_elements, judge_contributions, refused_reducers, robust_mean
from stages.robust_avg import MAX_REL


def _honest(g: int, n: int = 2000, spread: float = 0.1, seed: int = 0) -> torch.Tensor:
    """g replicas' slices: one common weight vector plus each replica's own drift."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=gen)
    return torch.stack([base + spread * torch.randn(n, generator=gen) for _ in range(g)])


@pytest.mark.parametrize("g", [3, 4, 8])
def test_a_member_sending_its_slice_times_25_is_dropped_and_the_rest_averaged(g):
    x = _honest(g)
    poisoned = x.clone()
    poisoned[1] *= 25
    mean, kept = robust_mean(poisoned)
    assert kept.tolist() == [i != 1 for i in range(g)]
    torch.testing.assert_close(mean, x[[i for i in range(g) if i != 1]].mean(0))
    # judged by another member (its own contribution the reference): the same verdict
    assert judge_contributions(poisoned, own=0).tolist() == kept.tolist()


@pytest.mark.parametrize("g", [2, 3, 4, 8])
def test_honest_spread_is_kept(g):
    for seed in range(20):
        x = _honest(g, seed=seed)
        # one replica drifted further than the rest (it was offline for a while): still honest
        x[0] = x[1] + 2.0 * (x[0] - x[1])
        mean, kept = robust_mean(x, own=g - 1)
        assert bool(kept.all()), (seed, kept)
        torch.testing.assert_close(mean, x.mean(0))


def test_non_finite_contributions_are_dropped_and_a_non_finite_own_is_an_error():
    x = _honest(3)
    x[2, 5] = float("nan")
    assert judge_contributions(x).tolist() == [True, True, False]
    x[1, 0] = float("inf")
    mean, kept = robust_mean(x, own=0)  # one finite member left: its own
    assert kept.tolist() == [True, False, False] and torch.equal(mean, x[0])
    with pytest.raises(ValueError, match="own"):
        judge_contributions(x, own=2)


def test_a_pair_is_judged_only_against_gross_poison():
    """Two members: no majority. Both are equally far from their mean, so the spread test drops
    neither, even of a member twenty times further off than honest replicas are; only against
    its own values can a member refuse the other, and only beyond MAX_REL x their norm."""
    x = _honest(2)
    subtle = x.clone()
    subtle[1] = x[0] + 20 * (x[1] - x[0])  # far outside honest spread, within the gross bound
    assert bool(judge_contributions(subtle).all())  # no reference: nobody can be singled out
    assert bool(judge_contributions(subtle, own=0).all())  # within MAX_REL of the own: applied
    assert float((subtle[1] - subtle[0]).norm() / subtle[0].norm()) < MAX_REL
    for poison in (25 * x[1], -5 * x[1], 10 * torch.randn(x.shape[1])):
        pair = torch.stack([x[0], poison])
        assert judge_contributions(pair, own=0).tolist() == [True, False]
        mean, _ = robust_mean(pair, own=0)
        assert torch.equal(mean, x[0])


def test_parameters_and_moments_are_judged_apart():
    """A poisoned first moment is tiny next to the parameters: judged with them in one vector
    it would pass; per segment it is dropped."""
    g, n = 4, 1000
    params, moments = _honest(g, n), 1e-3 * _honest(g, n, spread=1.0, seed=1)
    moments[3] *= 50
    layout = AveragingLayout(2, n)
    packed = torch.stack([layout.pack([params[i], moments[i]]) for i in range(g)])
    assert bool(judge_contributions(packed).all())  # mixed: the moments' poison drowns
    assert judge_contributions(packed, segments=layout.segment_ids()).tolist() == [True, True, True, False]


def test_layout_round_trip_and_every_range_holds_every_segment():
    layout = AveragingLayout(2, 1001)
    a, b = torch.arange(1001.0), -torch.arange(1000.0)
    flat = layout.pack([a, b])
    assert flat.numel() == layout.total >= 2 * 1001
    back = layout.unpack(flat)
    assert torch.equal(back[0], a) and torch.equal(back[1][:1000], b) and back[1][1000] == 0
    seg = layout.segment_ids()
    assert torch.equal(flat[seg == 0].sort().values[-1001:], a)  # every element once, spread out
    assert int((flat[seg == 0][:64] != 0).sum()) >= 60  # the first block holds elements from all over
    assert float(flat[seg == 0][:64].max()) > 900
    for g in range(2, 17):  # a group's equal ranges each hold both segments
        for k in range(g):
            part = seg[k * layout.total // g:(k + 1) * layout.total // g]
            assert set(part.tolist()) == {0, 1}, (g, k)
    assert torch.equal(layout.segment_ids(100, 50), seg[100:150])
    with pytest.raises(ValueError):
        layout.pack([torch.zeros(1002), b])


def test_a_receiver_refuses_a_range_far_from_its_own_values():
    own = torch.randn(300)
    truth = own + 0.05 * torch.randn(300)  # the round's honest result
    ranges = [(0, 100), (100, 200), (200, 300)]  # three reducers; this receiver is 0
    assert refused_reducers(own, truth, ranges, 0) == set()
    tampered = truth.clone()
    tampered[200:] = own[200:] + 1.0  # reducer 2 returns its range shifted
    assert refused_reducers(own, tampered, ranges, 0) == {2}
    tampered[100:110] = float("nan")
    assert refused_reducers(own, tampered, ranges, 0) == {1, 2}


def test_butterfly_drops_the_poisoner_everywhere_and_refuses_its_range():
    g = 4
    layout = AveragingLayout(2, 3000)
    params, moments = _honest(g, 3000), 1e-2 * _honest(g, 3000, spread=1.0, seed=2)
    packed = torch.stack([layout.pack([params[i], moments[i]]) for i in range(g)])
    honest = butterfly(packed, layout=layout)
    assert honest.dropped_members == set() and all(not r for r in honest.refused.values())
    for res in honest.results:
        torch.testing.assert_close(res, packed.mean(0))
    poisoned = packed.clone()
    poisoned[3] *= 25
    out = butterfly(poisoned, layout=layout)
    assert all(out.dropped[k] == {3} for k in range(3)) and out.dropped[3] == set()
    assert all(out.refused[i] == {3} for i in range(3))  # the poisoner's own range comes back poisoned
    clean = packed[:3].mean(0)
    owner_3 = torch.zeros(packed.shape[1], dtype=torch.bool)
    chunk = chunk_elements(packed.shape[1], g)
    n_chunks = -(-packed.shape[1] // chunk)
    owner_3[(3 * n_chunks // g) * chunk:] = True
    for i in range(3):  # honest members: the mean of the honest ones, their own values on the refused range
        torch.testing.assert_close(out.results[i][~owner_3], clean[~owner_3])
        torch.testing.assert_close(out.results[i][owner_3], packed[i][owner_3])
    # a reducer that returns its range tampered with (it contributed honestly): refused by all
    tampered = butterfly(packed, layout=layout, returns=lambda k, part: part * 3 if k == 1 else part)
    assert tampered.dropped_members == set() and all(tampered.refused[i] == {1} for i in (0, 2, 3))
