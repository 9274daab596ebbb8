"""Architecture warm-up (docs/REFERENCES.md §5): grow depth during training instead of training it all at once.

Preconditioned sharpness grows with depth and loss spikes follow it past the edge of stability,
so the run starts with only some blocks active and unlocks the others in groups at given steps
(``manifest.warmup``: ``groups`` of global layer indices and their ``unlock_steps``; layers in no
group are active from the start).

- A *locked* block is skipped exactly (``block.active = False``: its forward returns its input
  unchanged) and is out of the optimizer's effect: its parameters have ``requires_grad = False``
  and ``.grad = None``, and every optimizer in stages/optim.py (and torch's) skips a parameter
  without a gradient entirely, so neither momentum nor weight decay touches it. Its values stay
  bitwise those of the initialisation.
- At *unlock* the block is initialised normally (N(0, init_std²), seeded from the run seed and
  the global parameter name, so every replica of a stage draws the same values) with its output
  projections (the residual writers ``attn.out_proj`` and ``mlp.down_proj``) at zero. The branch
  then outputs exactly zero, so the network computes the same function at that step, but the
  writers receive gradient: the block is not a stationary point.

In a swarm every stage builds its own ``ArchWarmup`` over the blocks it holds; the groups name
global layers and the step schedule is shared, so each stage unlocks its own blocks at the same
steps with no coordination. After a restart from a checkpoint at step ``s`` build it with
``step=s``: groups due by then are taken as already unlocked (their trained weights come from the
checkpoint and are not touched).

Ramp (our addition, ``manifest.warmup.ramp_steps > 0``). The model normalises every branch output
(``h + rmsnorm(branch)``, papers §1). ``rmsnorm(0) = 0`` exactly, so unlocking is
function-preserving; but any non-zero branch output is renormalised to unit RMS, so without more
care a branch jumps to full strength at its first update after unlock, and the loss spikes one
step after every unlock. With a ramp the unlocked block's output is blended, ``h_out = h + s·(block(h) − h)``, with
``s = min(1, (t − t_unlock + 1)/ramp_steps)``: still exactly the identity at the unlock step
(the branch is zero), still a gradient for the writers (scaled by ``s``, which Adam-type and
Muon steps normalise away), and the block's influence grows linearly. ``h + s·Δ`` with ``Δ`` in
span(U) stays in the subspace, so the boundary codec stays exact. The blend is a forward hook on
the block, removed when ``s`` reaches 1 (a ``gate`` scalar in ``model.Block`` would be simpler).
"""

from __future__ import annotations

import torch
from torch import nn

from stages.subspace import derive_seed

__all__ = ["ArchWarmup", "default_warmup_schedule", "warmup_blocks"]


def default_warmup_schedule(
    n_layers: int, lr_warmup_steps: int, every: int, n_groups: int = 4, keep_every: int = 2
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """The default schedule (papers §5): half the depth active until the LR warm-up ends, then
    one more group every ``every`` steps.

    The locked half is the odd layers (1, 3, 5, …): spread over the depth, so every pipeline
    stage keeps work from the start and grows evenly. It is cut into ``n_groups`` groups, each
    again spread over the depth (``locked[j::n_groups]``); group j unlocks at
    ``lr_warmup_steps + (j + 1)·every``. Returns ``(groups, unlock_steps)`` ready for
    ``manifest.replace(warmup={"enabled": True, "groups": ..., "unlock_steps": ...})``.

    ``keep_every = k`` generalises the start: layers 0, k, 2k, … are active from step 0 and all
    others locked (k = 2, the default, is the half-depth start above; a larger k starts
    shallower, e.g. 3 of 24 layers at k = 8).
    """
    if n_layers < 1 or n_groups < 1 or every < 1 or lr_warmup_steps < 0 or keep_every < 1:
        raise ValueError(
            f"default_warmup_schedule: need n_layers >= 1, n_groups >= 1, every >= 1, lr_warmup_steps >= 0, "
            f"keep_every >= 1; got {n_layers}, {n_groups}, {every}, {lr_warmup_steps}, {keep_every}"
        )
    locked = [i for i in range(n_layers) if i % keep_every]
    groups = [tuple(locked[j::n_groups]) for j in range(n_groups)]
    groups = [g for g in groups if g]
    steps = tuple(lr_warmup_steps + (j + 1) * every for j in range(len(groups)))
    return tuple(groups), steps


def warmup_blocks(module: nn.Module) -> dict[int, nn.Module]:
    """The blocks of a model or stage by global layer index (modules with ``layer``, ``active``
    and ``output_projections()``)."""
    out: dict[int, nn.Module] = {}
    for m in module.modules():
        if hasattr(m, "output_projections") and hasattr(m, "active") and hasattr(m, "layer"):
            if m.layer in out:
                raise ValueError(f"two blocks claim global layer {m.layer}")
            out[int(m.layer)] = m
    return out


class ArchWarmup:
    """Locks and unlocks the blocks of one model or stage on the manifest's schedule.

    ``ArchWarmup(manifest, module, step=0)`` locks every block whose group is not yet due at
    ``step``; call ``apply(step, optimizer)`` before each optimizer step's forward: it unlocks
    the groups that are due and returns the newly unlocked global layers (sorted). Pass the
    optimizer so any state it might hold for those parameters is dropped (they start fresh).
    With ``manifest.warmup.enabled = false`` nothing is ever locked. ``manifest.warmup.ramp_steps
    > 0`` blends each unlocked block in over that many steps (module docstring; ``gates`` holds
    the current factors); the ``ramp_steps`` argument overrides the manifest (tests, sweeps).
    In an asynchronous pipeline a recomputed backward sees the gate of the step it runs at,
    which may be one ramp increment past its forward's; use ``ramp_steps = 0`` where that
    matters.
    """

    def __init__(self, manifest, module: nn.Module, step: int = 0, ramp_steps: int | None = None):
        if ramp_steps is None:
            ramp_steps = manifest.warmup.ramp_steps
        if ramp_steps < 0:
            raise ValueError(f"ArchWarmup: ramp_steps must be >= 0, got {ramp_steps}")
        self.manifest = manifest
        self.module = module
        self.ramp_steps = ramp_steps
        self.blocks = warmup_blocks(module)
        self.gates: dict[int, float] = {}  # layer -> blend factor s < 1 while ramping
        self._hooks: dict[int, torch.utils.hooks.RemovableHandle] = {}
        w = manifest.warmup
        self.unlock_at: dict[int, int] = {}
        if w.enabled:
            if len(w.groups) != len(w.unlock_steps):
                raise ValueError(f"warmup: {len(w.groups)} groups but {len(w.unlock_steps)} unlock_steps")
            for group, at in zip(w.groups, w.unlock_steps):
                for layer in group:
                    if layer in self.blocks:  # a stage only handles its own blocks
                        self.unlock_at[int(layer)] = int(at)
        self.locked: set[int] = set()
        self.sync(step)  # lock what is not due yet; resuming inside a ramp window re-creates the gate

    @staticmethod
    def _lock(block: nn.Module) -> None:
        block.active = False
        for p in block.parameters():
            p.requires_grad_(False)
            p.grad = None

    def apply(self, step: int, optimizer: torch.optim.Optimizer | None = None) -> list[int]:
        """Unlock every locked block whose unlock step is ``<= step``; return their layers.

        Also re-asserts the lock on the blocks still locked (``.grad`` cleared), so a gradient
        that reached them by some other path can never move them."""
        due = sorted(layer for layer in self.locked if self.unlock_at[layer] <= step)
        for layer in due:
            block = self.blocks[layer]
            self._unlock(layer, block)
            if optimizer is not None:
                for p in block.parameters():
                    optimizer.state.pop(p, None)
            self.locked.discard(layer)
        for layer in self.locked:
            for p in self.blocks[layer].parameters():
                p.grad = None
        self._update_gates(step)
        return due

    def sync(self, step: int) -> None:
        """Put the lock state at ``step`` without touching any weight: after the module's weights
        were loaded from a checkpoint or another replica at ``step`` (a restore, a joiner's state
        download). Blocks due by then are unlocked as they are (their trained weights came with
        the state), the others locked; optimizer state is left alone."""
        for layer, at in self.unlock_at.items():
            block = self.blocks[layer]
            if at <= step and layer in self.locked:
                self._activate(block)
                self.locked.discard(layer)
            elif at > step and layer not in self.locked:
                self._lock(block)
                self.locked.add(layer)
        self._update_gates(step)

    def _update_gates(self, step: int) -> None:
        if not self.ramp_steps:
            return
        for layer, at in self.unlock_at.items():
            if layer in self.locked or at <= 0:
                continue
            s = min(1.0, (step - at + 1) / self.ramp_steps)
            if s >= 1.0:
                self.gates.pop(layer, None)
                handle = self._hooks.pop(layer, None)
                if handle is not None:
                    handle.remove()
                continue
            self.gates[layer] = s
            if layer not in self._hooks:
                self._hooks[layer] = self.blocks[layer].register_forward_hook(self._blend(layer), with_kwargs=True)

    def _blend(self, layer: int):
        def hook(module, args, kwargs, output):
            s = self.gates.get(layer)
            if s is None:
                return output
            h = args[0] if args else kwargs["h"]
            return h + s * (output - h)

        return hook

    @torch.no_grad()
    def _unlock(self, layer: int, block: nn.Module) -> None:
        std = self.manifest.model.init_std
        seed = self.manifest.run.seed
        for name, p in block.named_parameters():
            gen = torch.Generator(device="cpu")
            gen.manual_seed(derive_seed(seed, f"unlock:layers.{layer}.{name}"))
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
        for proj in block.output_projections():
            for p in proj.parameters():
                p.zero_()
        self._activate(block)

    @staticmethod
    def _activate(block: nn.Module) -> None:
        for p in block.parameters():
            p.requires_grad_(True)
            p.grad = None
        block.active = True
