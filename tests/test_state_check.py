"""Verifying downloaded stage weights by agreement (stages/state_check.py): honest replicas agree
within the tolerance, poisoned states (scaled, random, another run's) do not, and the majority rule."""

from __future__ import annotations

import pytest
import torch

from security.attacks import STATE_ATTACKS, poison_state
from stages import (
    STATE_TOLERANCE, agreeing, build_optimizer, build_stage, load_manifest, output_distance, probe_inputs,
    probe_output,
)
from stages.model import lm_loss


def _params(stage):
    return {n: p.detach().clone() for n, p in stage.named_parameters()}


def _trained_replicas(m, index, steps=30, drift_steps=10):
    """Two replicas of stage ``index`` trained from one state, then apart on different data for
    ``drift_steps`` (as asynchronous replicas between averaging rounds are)."""
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
    twin_opt.load_state_dict(opt.state_dict())
    for _ in range(drift_steps):
        step(stage, opt)
        step(twin, twin_opt)
    return stage, _params(stage), _params(twin)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_honest_replicas_agree_and_poisoned_states_do_not(index):
    m = load_manifest("test")
    stage, a, b = _trained_replicas(m, index)
    probe = probe_inputs(stage, seed=7)
    honest = output_distance(probe_output(stage, a, probe), probe_output(stage, b, probe))
    assert honest < STATE_TOLERANCE, honest
    for attack in STATE_ATTACKS:
        bad = probe_output(stage, poison_state(attack, a, seed=3), probe)
        assert output_distance(bad, probe_output(stage, b, probe)) > 1.4 * STATE_TOLERANCE, attack
    assert agreeing([probe_output(stage, s, probe) for s in (a, poison_state("state-scaled", a), b)]) == [0, 2]


def test_the_majority_rule():
    t = [torch.ones(8), torch.ones(8) * 1.01, torch.ones(8) * 5, torch.ones(8) * 20]
    assert agreeing(t[:2]) == [0, 1]
    assert agreeing([t[0], t[2]]) == []  # two that disagree: nothing to trust
    assert agreeing([t[2], t[0], t[1]]) == [1, 2]
    assert agreeing([t[0], t[1], t[2], t[3]]) == []  # 2 of 4 is no majority
    assert agreeing([t[0], torch.full((8,), float("nan"))]) == []
