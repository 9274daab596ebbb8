"""One averaging round of ``node.net.averaging.ReplicaAverager``: its record (``Round``), the
counters rounds add to (``AveragingStats``), and its hivemind part, which runs on the averager's
worker thread (``run_round``): put the snapshot into hivemind's shared buffer, join the round's
clock slot (the slot's number is the matchmaking group key, ``scheduled_time`` its start),
all-reduce, and read back the average together with what every member of the group said about
its round, moments and morph epoch. What the group members said is a peer's input: anything
malformed fails the round (never a wrong average). Before the round the averager process is told
which peers may share its group (``Round.members``); the buffer holds the parameters and moments
interleaved as ``stages.robust_avg.AveragingLayout`` says, so that the averager can judge each apart.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from stages import AveragingLayout


@dataclass
class AveragingStats:
    """Counters for metrics. Bytes are all-reduce payload bytes (float32 slice), computed from
    hivemind's butterfly schedule with an equal split: each of g peers sends and receives
    2·(g−1)/g of the buffer per round; framing overhead is not included."""

    rounds_started: int = 0
    rounds_applied: int = 0
    rounds_failed: int = 0
    rounds_mismatched: int = 0
    rounds_epoch_discarded: int = 0  # rounds thrown away because they spanned morph epochs
    rounds_state_replaced: int = 0  # rounds thrown away because this replica adopted other weights meanwhile
    # contributions judged (docs/ASYNCMESH.md, "Who may average, and what is applied"), since start:
    contributions_dropped: int = 0  # members this replica's reducer left out of a round (outside the spread)
    parts_refused: int = 0  # ranges another reducer returned that this replica refused (kept its own values)
    strangers_refused: int = 0  # join requests from / leaders that were peers without this stage's record
    groups_refused: int = 0  # groups refused whole because they held such a peer
    skipped_alone: int = 0
    skipped_busy: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_group_size: int = 0
    last_moment_lambda: float = 0.0  # mean β^s applied to the moments' delta (0: not averaged)
    last_elapsed_steps: int = 0
    last_round: int = -1  # number of the last applied round (its slice: schedule.indices(last_round))
    last_snapshot_step: int = -1  # local step at which the last applied round took its snapshot
    last_delta_norm: float = 0.0
    last_round_seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Round:
    """A round in flight: its slot ``number``, the local step of its snapshot, the slice
    (``indices``) and the snapshot of the parameters (and moments) on it."""

    number: int
    start_step: int
    indices: list[torch.Tensor]
    snap: torch.Tensor
    moment_snap: torch.Tensor | None
    moment_mask: list[bool]
    started: float
    epoch: int = 0  # this replica's morph epoch at the snapshot
    replaced: bool = False  # the replica's weights were replaced (re-sync) after the snapshot
    find_until: float = 0.0  # unix time at which matchmaking gives up (set by _begin)
    future: concurrent.futures.Future | None = None
    control: object = None  # hivemind StepControl, set by the worker; close() cancels it
    members: frozenset[str] | None = None  # peer ids that may share the group (None: anyone)


def run_round(averager, rnd: Round, *, layout: AveragingLayout, period: float, lead: float, timeout: float,
              clock: Callable[[], float]) -> tuple[torch.Tensor, list[int], list[list[bool]], list[int]]:
    """Average ``rnd``'s snapshot (and its moments' snapshot, the layout's second segment) with
    the replicas that join its slot (``period`` seconds long); returns the averaged segments one
    after the other (``layout.size`` elements each) and, per group member, its round number,
    moment mask and morph epoch. Raises when no group forms."""
    parts = [rnd.snap] + ([rnd.moment_snap if rnd.moment_snap is not None else torch.zeros(0)]
                          if layout.segments > 1 else [])
    if hasattr(averager, "set_members"):
        averager.set_members(rnd.members)
    with averager.get_tensors() as (buf,):
        layout.pack(parts, out=buf)
    gather = {"round": rnd.number, "moments": rnd.moment_mask, "epoch": rnd.epoch}
    # the slot's number is the group key: only replicas joining the same slot meet
    averager.set_group_bits(format(rnd.number % (1 << 16), "016b"))
    start = rnd.number * period
    # matchmaking ends at ``find_until`` (before this replica's next slot), not after
    # avg_timeout_s: retrying that long held a replica that found no group busy through its
    # next slots, the ones where the others were (the all-reduce keeps avg_timeout_s)
    now = clock()
    find = max(rnd.find_until, max(start, now) + lead) - now  # at least lead after the start
    rnd.control = averager.step(gather=gather, scheduled_time=start, timeout=find, wait=False)
    gathered = rnd.control.result(timeout=find + timeout + 5)
    if not gathered:
        raise RuntimeError("no group")
    rounds, masks, epochs = _read_gathered(gathered.values(), len(rnd.moment_mask))
    with averager.get_tensors() as (buf,):
        averaged = torch.cat(layout.unpack(buf))
    return averaged, rounds, masks, epochs


def _read_gathered(infos, n_moments: int) -> tuple[list[int], list[list[bool]], list[int]]:
    """Each group member's round number, moment mask and morph epoch; RuntimeError for a member
    that sent anything else."""
    rounds, masks, epochs = [], [], []
    for info in infos:
        r = info.get("round") if isinstance(info, dict) else None
        mask = info.get("moments") if isinstance(info, dict) else None
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < 2**62:
            raise RuntimeError(f"bad round number from a peer: {str(info)[:100]}")
        if not isinstance(mask, list) or len(mask) != n_moments or not all(isinstance(x, bool) for x in mask):
            raise RuntimeError(f"bad moment mask from a peer: {str(info)[:100]}")
        epoch = info.get("epoch", 0)  # absent: a replica that does not morph
        if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch < 2**62:
            raise RuntimeError(f"bad morph epoch from a peer: {str(info)[:100]}")
        rounds.append(r)
        masks.append(mask)
        epochs.append(epoch)
    return rounds, masks, epochs
