"""The judging half of replica averaging inside hivemind's butterfly all-reduce (hivemind 1.1.12):
a reducer that applies ``stages.robust_mean`` to each chunk of its range instead of a weighted
sum, and a runner whose receivers refuse returned ranges too far from their own
(``stages.refused_reducers``). ``node.net.hivemind_patches.SwarmAverager`` runs them; why each
override: its docstring and docs/ASYNCMESH.md ("Who may average, and what is applied").
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner
from hivemind.averaging.partition import TensorPartReducer

log = logging.getLogger("swarm.averaging")


def read_members(members_fn: Callable[[], Iterable]) -> frozenset[str]:
    """The peer ids ``members_fn()`` names (those that hold a live signed record for the stage);
    nobody (the round then finds no group) when reading it keeps failing."""
    for _ in range(3):
        try:
            return frozenset(str(p) for p in members_fn())
        except RuntimeError:  # the routing table changed while it was read: read it again
            continue
    log.warning("averaging: the stage's members could not be read; this round averages with nobody")
    return frozenset()


class Contributions:
    """Stands in for ``TensorPartReducer``'s accumulator of one chunk: keeps each sender's part
    (hivemind adds them with ``add_`` and divides by the total weight with ``div_``), and its
    ``div_`` returns the judged mean instead."""

    def __init__(self, reducer: JudgingReducer, part_index: int):
        self.reducer, self.part_index, self.parts = reducer, part_index, {}

    def add_(self, tagged, alpha=1.0):
        sender, part = tagged
        self.parts[sender] = part
        return self

    def div_(self, _denominator):
        return self.reducer.judge(self.part_index, self.parts)


class JudgingReducer(TensorPartReducer):
    """hivemind's reducer of this member's range, each chunk judged by ``robust_mean``; a member
    dropped on one chunk stays dropped for the rest of the range (``dropped``). A part of the
    wrong shape fails its sender (hivemind then excludes it from the round)."""

    def __init__(self, part_shapes, num_senders: int, *, own: int, segments):
        self.own, self.segments, self.dropped = own, segments, set()
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = Contributions(self, self.current_part_index)

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part, weight: float = 1.0):
        shape = self.part_shapes[part_index] if 0 <= part_index < self.num_parts else None
        if not isinstance(tensor_part, torch.Tensor) or shape is None or tensor_part.shape != shape:
            raise AllreduceException(f"sender {sender_index} sent a part of the wrong shape")
        # the sender's weight is ignored: every member counts once
        return await super().accumulate_part(sender_index, part_index, (sender_index, tensor_part.float()), 1.0)

    def judge(self, part_index: int, parts: dict):
        from stages import robust_mean

        if not parts:  # every sender failed before this chunk: nothing to average
            return torch.zeros(self.part_shapes[part_index])
        live = sorted(s for s in parts if s not in self.dropped)
        if self.own in parts and self.own not in live:
            live.append(self.own)
        stacked = torch.stack([parts[s] for s in live])
        own = live.index(self.own) if self.own in live else None
        segments = self.segments[part_index] if self.segments is not None else None
        try:
            mean, kept = robust_mean(stacked, own=own, segments=segments)
        except ValueError:  # no finite contribution at all: this chunk keeps everyone's own values
            return parts[self.own].clone() if self.own in parts else torch.zeros_like(stacked[0])
        self.dropped |= {s for s, k in zip(live, kept.tolist()) if not k}
        return mean


class JudgingRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce with a ``JudgingReducer`` for this member's range and a
    check of the ranges the others return (``refused``)."""

    def __init__(self, *, chunk: int, layout, **kwargs: Any):
        super().__init__(**kwargs)
        self.layout = layout  # stages.AveragingLayout, or None: one segment
        container = self.tensor_part_container
        self.me = self.ordered_peer_ids.index(self.peer_id)
        total = container.total_size
        # peer i reduces chunks [first[i], first[i+1]) of the one flat tensor, each ``chunk`` long
        first = [0]
        for n in container.num_parts_by_peer:
            first.append(first[-1] + n)
        self.ranges = [(min(total, first[i] * chunk), min(total, first[i + 1] * chunk))
                       for i in range(len(self.ordered_peer_ids))]
        segments = None
        if layout is not None:
            segments = [layout.segment_ids((first[self.me] + j) * chunk, part.numel())
                        for j, part in enumerate(self.parts_for_local_averaging)]
        old = self.tensor_part_reducer
        old.finished.set()  # never used: keeps it from logging "received 0%" when collected
        self.tensor_part_reducer = JudgingReducer(tuple(p.shape for p in self.parts_for_local_averaging),
                                                   len(self.sender_peer_ids), own=self.me, segments=segments)

    def refused(self, own: torch.Tensor, update: torch.Tensor) -> set[int]:
        """The reducers whose range this member refuses; their part of ``update`` is zeroed."""
        from stages import refused_reducers

        flat_own, flat_update = own.reshape(-1), update.reshape(-1)
        refused = refused_reducers(flat_own, flat_own + flat_update, self.ranges, self.me, layout=self.layout)
        for k in refused:
            lo, hi = self.ranges[k]
            flat_update[lo:hi] = 0.0
        return refused
