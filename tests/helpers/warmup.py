"""Architecture warm-up test helpers: a few locked-block training steps, then an unlock."""

from __future__ import annotations

import torch

from stages import ArchWarmup, build_model, build_optimizer, lm_loss


def warmup_ids(seed, b=2, L=16):
    return torch.randint(0, 256, (b, L), generator=torch.Generator().manual_seed(seed))


def warmup_step(model, opt, arch, step):
    arch.apply(step, opt)
    ids = warmup_ids(step)
    opt.zero_grad(set_to_none=True)
    lm_loss(model(ids), ids).backward()
    opt.step()

def trained_then_unlocked(m, ramp_steps=None):
    """Three steps with layers 1 and 2 locked, then the unlock at step 3: (model, arch, opt,
    ids, the output just before the unlock, the layers unlocked)."""
    model = build_model(m)
    arch = ArchWarmup(m, model, ramp_steps=ramp_steps)
    opt = build_optimizer(m, model)
    for step in range(3):
        warmup_step(model, opt, arch, step)
    ids = warmup_ids(100)
    with torch.no_grad():
        before = model(ids)
    return model, arch, opt, ids, before, arch.apply(3, opt)
