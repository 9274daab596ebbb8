"""Verifying downloaded stage weights by agreement (stages/state_check.py): honest replicas agree
within the tolerance on the test and default runs, poisoned states (scaled, random, another
run's) do not, and the majority rule."""

from __future__ import annotations

import pytest
import torch

from security.attacks import STATE_ATTACKS, poison_state
from stages import (
    NORM_RATIO_TOLERANCE, STATE_TOLERANCE, agreeing, build_optimizer, build_stage, load_manifest, norm_ratio,
    state_distance,
)
from stages.model import lm_loss


def _params(stage):
    return {n: p.detach().clone() for n, p in stage.named_parameters()}


def _trained_replicas(m, index, steps=30, drift_steps=10):
    """Two replicas of stage ``index``: one state after ``steps`` shared steps, then each with its
    own fresh optimizer (a joiner does not get the moments) trained apart on different data for
    ``drift_steps``, as a swarm's replicas are."""
    torch.manual_seed(0)
    stage = build_stage(m, index)
    opt = build_optimizer(m, stage)
    g = torch.Generator().manual_seed(1)

    def step(stage, opt):
        ids = torch.randint(0, m.model.vocab_size, (4, 32), generator=g)
        x = None if stage.is_head else torch.randn(stage.boundary_shape(4, 32), generator=g)
        out = stage(x, ids)
        loss = lm_loss(out, ids) if stage.is_tail else out.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(steps):
        step(stage, opt)
    twin = build_stage(m, index)
    twin.load_state_dict(stage.state_dict())
    twin_opt = build_optimizer(m, twin)
    for _ in range(drift_steps):
        step(stage, opt)
        step(twin, twin_opt)
    return stage, _params(stage), _params(twin)


@pytest.mark.parametrize("run,index,steps,drift", [("test", 1, 0, 60), ("test", 2, 20, 20), ("default", 1, 0, 60),
                                                  ("default", 2, 20, 20)])
def test_honest_replicas_agree_and_poisoned_states_do_not(run, index, steps, drift):
    """Replicas trained apart from one state with their own optimizers, on uncorrelated data (the
    worst case for honest drift), agree; scaled, random and another run's weights do not."""
    m = load_manifest(run)
    stage, a, b = _trained_replicas(m, index, steps=steps, drift_steps=drift)
    assert 0 < state_distance(a, b) < STATE_TOLERANCE and norm_ratio(a, b) < NORM_RATIO_TOLERANCE
    assert norm_ratio(poison_state("state-scaled", a, seed=3), b) > 1.5 * NORM_RATIO_TOLERANCE
    assert norm_ratio(poison_state("state-random", a, seed=3), b) > 10 * NORM_RATIO_TOLERANCE
    assert state_distance(poison_state("state-foreign", a, seed=3), b) > 1.1 * STATE_TOLERANCE
    for attack in STATE_ATTACKS:
        assert agreeing([a, poison_state(attack, a, seed=3), b]) == [0, 2], attack


def test_distance_edge_cases():
    a = {"w": torch.ones(4, 4), "b": torch.zeros(4)}
    assert state_distance(a, a) == 0.0
    assert state_distance(a, {"w": torch.ones(4, 4)}) == float("inf")  # a missing tensor
    assert state_distance(a, {"w": torch.ones(4, 3), "b": torch.zeros(4)}) == float("inf")
    assert state_distance(a, {"w": torch.full((4, 4), float("nan")), "b": torch.zeros(4)}) == float("inf")
    assert state_distance(a, {"w": 2 * torch.ones(4, 4), "b": torch.zeros(4)}) == pytest.approx(4 / 6)


def test_the_majority_rule():
    t = [{"w": torch.ones(8) * v} for v in (1.0, 1.01, 5.0, -20.0)]
    assert agreeing(t[:2]) == [0, 1]
    assert agreeing([t[0], t[2]]) == []  # two that disagree: nothing to trust
    assert agreeing([t[2], t[0], t[1]]) == [1, 2]
    assert agreeing([t[0], t[1], t[2], t[3]]) == []  # 2 of 4 is no majority
    assert agreeing([t[0], {"w": torch.full((8,), float("nan"))}]) == []
