"""Verified state downloads: a joining or re-syncing replica takes a stage's weights only when
another replica's weights agree with them.

``fetch_verified`` downloads the stage's state from up to ``max_sources`` online replicas, compares
them in parameter space (``stages.state_check``: relative distance and norm ratio), and accepts a
state from the largest group that agrees. Sources whose state disagrees with
that group are returned as ``refused``: the caller bans them and counts them. The outcomes:

- two or more sources, a majority agrees: the first of them is taken; the others are refused;
- exactly one replica online: its state is taken unverified, and that is logged (there is no one
  to compare with; SENTINEL still judges what the replica then sends);
- no agreeing majority (two sources that disagree, say): ``StateSyncError``; the node cannot tell
  which one is honest, says so, and tries again later, when more replicas may be online.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from node.net.state_sync import StateSyncError, fetch_from_replicas
from stages import STATE_TOLERANCE, agreeing, norm_ratio, state_distance

log = logging.getLogger("swarm_node.state_sync")


@dataclass
class Verified:
    version: int
    tensors: dict[str, torch.Tensor]
    source: str
    verified: bool  # False: only one replica was online to download from
    refused: list[str] = field(default_factory=list)  # sources whose state disagreed with the majority
    distances: dict[str, float] = field(default_factory=dict)  # source -> parameter distance to the taken state
    epoch: int = 0  # the morph epoch (basis) of the state


async def fetch_verified(transport, peers: list[str], run: str, mhash: str, stage_index: int,
                         module: torch.nn.Module, metrics=None, *, timeout: float = 30.0,
                         max_sources: int = 3, tolerance: float = STATE_TOLERANCE) -> Verified:
    """Download ``stage_index``'s state from up to ``max_sources`` of ``peers`` and keep one that
    the majority of them agree on (module docstring). ``module`` is this node's own stage: the
    names, dtypes and shapes every download is checked against."""
    got: list[tuple[int, dict, str]] = []
    epochs: list[int] = []
    remaining = list(peers)
    busy: StateSyncError | None = None
    while remaining and len(got) < max_sources:
        try:
            version, tensors, src, epoch = await fetch_from_replicas(transport, remaining, run, mhash, stage_index,
                                                                     module, metrics, timeout=timeout)
        except StateSyncError as e:
            busy = e if e.busy else None
            break
        got.append((version, tensors, src))
        epochs.append(epoch)
        remaining = remaining[remaining.index(src) + 1:]
    if not got:
        raise busy or StateSyncError("no online replica gave us the stage state")
    if len(set(epochs)) > 1:
        # a morphing swarm: states of different epochs are in different bases and never agree;
        # compare (and take) only those of the latest epoch, blaming no one for the others
        latest = max(epochs)
        log.info("stage %d state: replicas in morph epochs %s; comparing those in epoch %d", stage_index,
                 sorted(set(epochs)), latest)
        got = [g for g, e in zip(got, epochs) if e == latest]
        epochs = [latest] * len(got)
    epoch = epochs[0]
    if len(got) == 1:
        version, tensors, src = got[0]
        log.warning("only one replica (%s) gave us stage %d's state: taken unverified, nothing to compare it with",
                    src[-8:], stage_index)
        return Verified(version, tensors, src, verified=False, epoch=epoch)
    states = [tensors for _, tensors, _ in got]
    group = agreeing(states, tolerance)
    if not group:
        pairs = ", ".join(f"{got[i][2][-8:]}~{got[j][2][-8:]} distance {state_distance(states[i], states[j]):.3f} "
                          f"norm ratio {norm_ratio(states[i], states[j]):.2f}"
                          for i in range(len(got)) for j in range(i + 1, len(got)))
        raise StateSyncError(f"the {len(got)} replicas we downloaded stage {stage_index} from disagree ({pairs}); "
                             "cannot tell which is honest")
    keep = group[0]
    version, tensors, src = got[keep]
    distances = {got[i][2]: state_distance(states[i], states[keep]) for i in range(len(got))}
    refused = [got[i][2] for i in range(len(got)) if i not in group]
    for peer in refused:
        i = [g[2] for g in got].index(peer)
        log.warning("replica %s served stage %d weights that disagree with %d other replica(s) (distance %.3f, norm "
                    "ratio %.2f): refused", peer[-8:], stage_index, len(group), distances[peer],
                    norm_ratio(states[i], states[keep]))
    log.info("stage %d state from %s verified against %d replica(s) (distances %s)", stage_index, src[-8:],
             len(group) - 1, ", ".join(f"{d:.3f}" for p, d in distances.items() if p != src))
    return Verified(version, tensors, src, verified=True, refused=refused, distances=distances, epoch=epoch)
