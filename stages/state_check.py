"""Checking a stage's weights before trusting them: run one probe microbatch through the stage with
each candidate set of weights and compare the outputs. Pure PyTorch.

A joining (or re-syncing) replica downloads its stage's weights from online replicas. Honest
replicas of a stage train asynchronously and average, so their weights differ a little and their
outputs on the same input differ a little; weights scaled, randomised or taken from another run
give outputs far from theirs. ``STATE_TOLERANCE`` separates the two (measured: docs/THREAT_MODEL.md).
"""

from __future__ import annotations

import copy

import torch

# largest relative output distance between two candidates that still counts as agreement:
# replicas of the test run trained apart for 5-30 steps measure 0.08-0.32, poisoned states 0.76-1.94
STATE_TOLERANCE = 0.5


def probe_inputs(stage: torch.nn.Module, seed: int, batch: int = 4, seq_len: int = 32):
    """A fixed probe microbatch for ``stage`` (a ``stages.model.Stage``): token ids, and for a stage
    other than the head a boundary code drawn at the scale codes have (unit normal)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, stage.manifest.model.vocab_size, (batch, seq_len), generator=g)
    x = None if stage.is_head else torch.randn(stage.boundary_shape(batch, seq_len), generator=g)
    return x, ids


@torch.no_grad()
def probe_output(stage: torch.nn.Module, state: dict[str, torch.Tensor], probe) -> torch.Tensor:
    """What a copy of ``stage`` (on the CPU, float32) holding ``state``'s parameters computes on
    ``probe``: its output code, less the incoming code for a middle stage (the code passes through
    the residual stream unchanged, so the stage's own contribution is the difference; comparing
    whole outputs would dilute it), or its logits at the tail."""
    twin = copy.deepcopy(stage).to("cpu", torch.float32)
    params = dict(twin.named_parameters())
    for name, value in state.items():
        params[name].copy_(value.to(torch.float32))
    x, ids = probe
    out = twin(x, ids).float()
    return out - x if x is not None and not twin.is_tail else out


def output_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative distance of two outputs: ‖a − b‖ over the mean of their norms (symmetric; a
    non-finite output is infinitely far)."""
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    scale = 0.5 * (a.norm() + b.norm())
    return float((a - b).norm() / scale.clamp_min(1e-12))


def agreeing(outputs: list[torch.Tensor], tolerance: float = STATE_TOLERANCE) -> list[int]:
    """Indices of the largest group of outputs that agree with one another (every pair within
    ``tolerance``) if it has at least two members and is a strict majority of all; else []:
    nothing can be trusted by agreement."""
    n = len(outputs)
    close = [[output_distance(outputs[i], outputs[j]) <= tolerance for j in range(n)] for i in range(n)]
    best: list[int] = []
    for i in range(n):  # n is at most a handful: grow a group greedily from each member
        group = [i]
        for j in range(n):
            if j != i and all(close[j][m] for m in group):
                group.append(j)
        if len(group) > len(best):
            best = sorted(group)
    return best if len(best) >= 2 and 2 * len(best) > n else []
