"""Optimizers and learning-rate schedules, chosen by name in the manifest.

``build_optimizer(manifest, module)`` returns a ``torch.optim.Optimizer`` for the parameters of
``module`` (one stage or a whole model). ``lr_at(schedule, base_lr, step)`` is the schedule.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from stages.manifest import Manifest, ScheduleConfig


def lr_at(schedule: ScheduleConfig, base_lr: float, step: int) -> float:
    """Learning rate at optimizer step ``step`` (0-based): linear warm-up, then the decay."""
    if schedule.warmup_steps and step < schedule.warmup_steps:
        return base_lr * (step + 1) / schedule.warmup_steps
    if schedule.kind == "constant":
        return base_lr
    span = max(1, schedule.total_steps - schedule.warmup_steps)
    t = min(1.0, max(0.0, (step - schedule.warmup_steps) / span))
    floor = base_lr * schedule.min_lr_frac
    if schedule.kind == "linear":
        return floor + (base_lr - floor) * (1.0 - t)
    return floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def _param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(manifest: Manifest, module: nn.Module) -> torch.optim.Optimizer:
    o = manifest.optim
    groups = _param_groups(module, o.weight_decay)
    if o.name == "adamw":
        return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)
    if o.name == "adam":
        return torch.optim.Adam(groups, lr=o.lr, betas=o.betas, eps=o.eps)
    if o.name == "nadam":
        return torch.optim.NAdam(groups, lr=o.lr, betas=o.betas, eps=o.eps, decoupled_weight_decay=True)
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.momentum > 0)
    raise NotImplementedError(f"optimizer {o.name!r} is not built yet")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every group, keeping per-group multipliers (``lr_scale``)."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
