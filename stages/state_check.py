"""Checking a stage's weights before trusting them: compare candidate weight sets from different
replicas in parameter space. Pure PyTorch.

A joining (or re-syncing) replica downloads its stage's weights from online replicas. Honest
replicas of a stage start from one state (a joiner copies a replica; the first replicas share the
run seed's initialisation) and then train asynchronously, each with its own optimizer, so their
weights move apart, but by similar amounts and never as far as unrelated weights. Two numbers
decide (``tests/test_state_check.py`` checks that honest replicas pass and poisoned states do not):

- the relative distance ``‖a − b‖ / mean(‖a‖, ‖b‖)``: ``STATE_TOLERANCE`` 1.25, between how far
  replicas trained apart drift and where another run's weights (same statistics, unrelated
  values) lie;
- the ratio of the two norms: ``NORM_RATIO_TOLERANCE`` 1.5, above honest replicas and below
  weights scaled ×3 or random values.

Early in training Adam moves small initial weights by a large fraction of themselves, so distance
alone cannot tell honest drift from a scale; outputs on a probe microbatch separate neither.
"""

from __future__ import annotations

import torch

# two replicas' weights agree when their relative distance and the ratio of their norms are within these
STATE_TOLERANCE = 1.25
NORM_RATIO_TOLERANCE = 1.5


def state_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """‖a − b‖ over the mean of ‖a‖ and ‖b‖, all parameters as one vector (symmetric; infinite for
    non-finite values or different parameter names or shapes)."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    diff = na = nb = 0.0
    for k in a:
        x, y = a[k].detach().float(), b[k].detach().float()
        if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            return float("inf")
        diff += float((x - y).square().sum())
        na += float(x.square().sum())
        nb += float(y.square().sum())
    scale = 0.5 * (na ** 0.5 + nb ** 0.5)
    return diff ** 0.5 / max(scale, 1e-12)


def norm_ratio(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The larger of ‖a‖/‖b‖ and ‖b‖/‖a‖ (all parameters as one vector); infinite for a zero norm."""
    na = sum(float(t.detach().float().square().sum()) for t in a.values()) ** 0.5
    nb = sum(float(t.detach().float().square().sum()) for t in b.values()) ** 0.5
    return float("inf") if min(na, nb) == 0 else max(na / nb, nb / na)


def states_agree(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tolerance: float = STATE_TOLERANCE) -> bool:
    return state_distance(a, b) <= tolerance and norm_ratio(a, b) <= NORM_RATIO_TOLERANCE


def agreeing(states: list[dict[str, torch.Tensor]], tolerance: float = STATE_TOLERANCE) -> list[int]:
    """Indices of the largest group of states that agree with one another (every pair,
    ``states_agree``) if it has at least two members and is a strict majority of all; else []:
    nothing can be trusted by agreement."""
    n = len(states)
    close = [[states_agree(states[i], states[j], tolerance) for j in range(n)] for i in range(n)]
    best: list[int] = []
    for i in range(n):  # n is at most a handful: grow a group greedily from each member
        group = [i]
        for j in range(n):
            if j != i and all(close[j][m] for m in group):
                group.append(j)
        if len(group) > len(best):
            best = sorted(group)
    return best if len(best) >= 2 and 2 * len(best) > n else []
