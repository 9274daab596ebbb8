"""An averaging round's parameter delta spread over the replica's next local steps.

A sparse round removes the disagreement that the replicas built up on one slice since that slice
was last averaged (``asyncmesh.avg_fraction`` of the weights, averaged once every 1/p rounds), so
it is many local steps' worth of change at once. Applied at once, it makes the replica's outputs
jump, and the next stage's SENTINEL judges every sender against recent traffic, so the replica's
tensors right after its own round are the likeliest to be refused (docs/ASYNCMESH.md, "Blended
deltas").

``BlendedDelta`` applies θ[S] ← θ[S] + (avg − θ^snap[S]) in ``steps`` equal parts: one when the
round is applied, one after each of the next ``steps`` − 1 local steps. The total is the round's
delta exactly (what the replica learned since the snapshot is kept, as with
``apply_average_delta``). Pure PyTorch, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stages.asyncmesh import apply_average_delta


@dataclass
class _Part:
    indices: list[torch.Tensor]
    snap: torch.Tensor
    avg: torch.Tensor
    left: int  # parts not yet applied
    partition: int  # the schedule partition the round averaged (its slice)
    epoch: int  # the morph epoch of the weights it applies to


class BlendedDelta:
    """At most one round's delta in flight over ``tensors`` (the averaged parameters).

    - ``add`` validates a round like ``apply_average_delta`` (sizes, finite values), applies the
      first part and returns ‖avg − θ^snap‖; a delta still in flight is applied in full first,
      so no round is ever lost or applied twice.
    - ``step`` applies the next part (call once per local step).
    - ``flush`` applies what is left; ``before_snapshot`` does so when the snapshot about to be
      taken is of the same slice, so that it sees the whole earlier round (slices of consecutive
      rounds are disjoint, so this is rare).
    - ``drop`` forgets what is left (the weights were replaced, or re-based by a morph epoch:
      the rest of the delta belongs to weights that are gone).
    """

    def __init__(self, steps: int):
        if int(steps) != steps or steps < 1:
            raise ValueError(f"averaging blend steps must be an integer >= 1, got {steps!r}")
        self.steps = int(steps)
        self._part: _Part | None = None

    @property
    def pending(self) -> int:
        """Parts of the delta in flight not yet applied (0: none)."""
        return 0 if self._part is None else self._part.left

    @property
    def epoch(self) -> int | None:
        return None if self._part is None else self._part.epoch

    def add(self, tensors: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], snapshot_vals: torch.Tensor,
            averaged_vals: torch.Tensor, *, partition: int = -1, epoch: int = 0) -> float:
        self.flush(tensors)
        n = snapshot_vals.numel()
        avg = averaged_vals[:n].detach().clone()
        norm = apply_average_delta(tensors, indices, snapshot_vals, avg, 1.0 / self.steps)
        if self.steps > 1:
            self._part = _Part(list(indices), snapshot_vals.detach().clone(), avg, self.steps - 1, partition, epoch)
        return norm

    def step(self, tensors: Sequence[torch.Tensor]) -> None:
        part = self._part
        if part is None:
            return
        apply_average_delta(tensors, part.indices, part.snap, part.avg, 1.0 / self.steps)
        part.left -= 1
        if part.left <= 0:
            self._part = None

    def flush(self, tensors: Sequence[torch.Tensor]) -> None:
        part, self._part = self._part, None
        if part is not None and part.left > 0:
            apply_average_delta(tensors, part.indices, part.snap, part.avg, part.left / self.steps)

    def before_snapshot(self, tensors: Sequence[torch.Tensor], partition: int) -> None:
        """Flush if the round still blending averaged ``partition``, the slice about to be snapshot."""
        if self._part is not None and self._part.partition == partition:
            self.flush(tensors)

    def drop(self) -> int:
        """Forget the parts in flight; returns how many were left."""
        left, self._part = self.pending, None
        return left
