"""Verified state downloads: a joining or re-syncing replica takes a stage's weights, morph epoch and
optimizer version only where sources it chose agree on them, and never on one source's word alone.

``fetch_verified`` downloads the stage's state from up to ``max_sources`` online replicas. What a
source *says* about its state (its optimizer version, its morph epoch) is checked first, against
the run's signed records (every peer's DHT announcement, signed with its own key,
``node.net.membership``) and the run's manifest:

- with morphing off every state is in epoch 0: a source declaring another epoch is refused;
- its declared epoch must be the one its own signed record announces, or the next one (it entered
  the next epoch since it last announced: the legitimate window of a morph switch);
- its declared epoch may not be ahead of the epoch most of the run's signed records show (their
  lower median) by more than one: a new epoch starts at the head and reaches every stage within one;
- its declared version must lie within ``version_slack`` of its own record's (a record is a few
  seconds old; a replica trains on in between).

A source whose claims fail is refused (returned in ``refused``: the caller bans it with cause
``poisoned-state`` and counts it) and another one is asked instead, up to ``2 * max_sources``
downloads in all. A record without an epoch field (the announcements carry none yet) is checked on
its version only; the epoch is then judged by the manifest, the run's records that have one, and
the other sources.

Then the weights: the sources are grouped by morph epoch (states of different epochs are in
different bases and are compared only by their norms, which the basis turns keep), and within an
epoch compared in parameter space (``stages.state_check``: relative distance and norm ratio). The
group taken is the largest that agrees, a strict majority of its epoch's sources; between epochs
with equally large groups, the one more of the run's signed records announce, then the later. The
outcomes:

- two or more sources agree (``verified``): their state is taken; the version adopted is the lower
  median of their declared versions (so no one source sets it: one liar among three cannot move
  it, and in a group of two it can only lower it to its own record-bounded claim); sources of the
  same epoch that disagree are refused;
- one source (``unconfirmed``): a stage of one replica, or one that answered. Its claims passed the
  record checks above, and its state and version are taken with a WARNING that says it is
  unconfirmed (the runtime also counts it and shows it in ``/status``); SENTINEL still judges what
  the replica then sends;
- sources of another epoch than the one taken are not blamed for being there (a switch in
  progress), unless the norm of their weights is off by more than ``NORM_RATIO_TOLERANCE`` from
  the taken state's: then they are refused like poisoned weights;
- no agreeing majority in any epoch (two sources of one epoch that disagree, say): ``StateSyncError``
  (``untrusted``); the node cannot tell which one is honest, says so, and tries again later, when
  more replicas may be online.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from node.net.state_sync import MORPH_BUFFERS, StateSyncError, fetch_from_replicas
from stages import NORM_RATIO_TOLERANCE, STATE_TOLERANCE, agreeing, norm_ratio, state_distance

log = logging.getLogger("swarm_node.state_sync")

# a source's declared version may differ from its signed record's by this many steps plus this
# fraction of the record's: the record is refreshed every announce period and read up to a period
# later, and the replica trains on in between
VERSION_SLACK_STEPS = 256
VERSION_SLACK_FRACTION = 0.25


def version_slack(recorded: int) -> int:
    """How far a source's declared version may be from ``recorded``, its signed record's."""
    return VERSION_SLACK_STEPS + int(VERSION_SLACK_FRACTION * max(0, recorded))


def record_epoch(rec) -> int | None:
    """The morph epoch a signed record announces; None where it has no such field."""
    epoch = getattr(rec, "epoch", None)
    return None if epoch is None else int(epoch)


def majority_epoch(epochs: list[int]) -> int | None:
    """The epoch most of the run's signed records show: their lower median (None without any)."""
    if not epochs:
        return None
    s = sorted(int(e) for e in epochs)
    return s[(len(s) - 1) // 2]


def claim_problem(peer: str, version: int, epoch: int, *, records: dict | None, run_epoch: int | None,
                  morphing: bool | None) -> str | None:
    """Why ``peer``'s declared (version, epoch) cannot be believed, or None (module docstring)."""
    if morphing is False and epoch != 0:
        return f"declares morph epoch {epoch}; this run does not morph"
    if run_epoch is not None and epoch > run_epoch + 1:
        return f"declares morph epoch {epoch}; the run's signed records are in epoch {run_epoch}"
    if records is None:
        return None
    rec = records.get(peer)
    if rec is None:
        return "has no signed record in this stage"
    announced = record_epoch(rec)
    if announced is not None and not announced <= epoch <= announced + 1:
        return f"declares morph epoch {epoch}; its signed record says {announced}"
    recorded = int(getattr(rec, "version", 0))
    if abs(version - recorded) > version_slack(recorded):
        return f"declares version {version}; its signed record says {recorded}"
    return None


def weights_only(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters without the basis maps: what a morph turns orthogonally (norms kept)."""
    return {n: t for n, t in tensors.items() if n not in MORPH_BUFFERS}


@dataclass
class Verified:
    version: int
    tensors: dict[str, torch.Tensor]
    source: str
    verified: bool  # False: only one source's state was there to take (``outcome`` "unconfirmed")
    refused: list[str] = field(default_factory=list)  # sources whose state or claims were refused: ban them
    # source -> parameter distance to the taken state (the taken group and the refused; inf where
    # not compared: refused for its claims, or in another morph epoch)
    distances: dict[str, float] = field(default_factory=dict)
    epoch: int = 0  # the morph epoch (basis) of the state
    agreed: list[str] = field(default_factory=list)  # the sources whose states agreed on what was taken
    ignored: list[str] = field(default_factory=list)  # downloaded, another epoch, not taken and not blamed
    reasons: dict[str, str] = field(default_factory=dict)  # refused or ignored source -> why

    @property
    def outcome(self) -> str:
        return "verified" if self.verified else "unconfirmed"


@dataclass
class _Source:
    peer: str
    version: int
    tensors: dict[str, torch.Tensor]
    epoch: int


def _lower_median(values: list[int]) -> int:
    s = sorted(values)
    return s[(len(s) - 1) // 2]


async def fetch_verified(transport, peers: list[str], run: str, mhash: str, stage_index: int,
                         module: torch.nn.Module, metrics=None, *, timeout: float = 30.0,
                         max_sources: int = 3, tolerance: float = STATE_TOLERANCE, records: dict | None = None,
                         run_epochs: list[int] | None = None, morphing: bool | None = None) -> Verified:
    """Download ``stage_index``'s state from up to ``max_sources`` of ``peers`` and keep what the
    sources agree on (module docstring). ``module`` is this node's own stage: the names, dtypes and
    shapes every download is checked against. ``records``: peer id -> its signed record (with
    ``version`` and, where announced, ``epoch``); ``run_epochs``: the epochs the run's signed
    records announce; ``morphing``: whether the run morphs (None: not known). Without ``records``
    the sources' claims are checked against the manifest and ``run_epochs`` only."""
    run_epoch = majority_epoch(list(run_epochs or []))
    cands: list[_Source] = []
    refused: dict[str, str] = {}
    ignored: dict[str, str] = {}
    remaining = list(peers)
    busy: StateSyncError | None = None
    downloads = 0
    while remaining and len(cands) < max_sources and downloads < 2 * max_sources:
        try:
            version, tensors, src, epoch = await fetch_from_replicas(transport, remaining, run, mhash, stage_index,
                                                                     module, metrics, timeout=timeout)
        except StateSyncError as e:
            busy = e if e.busy else None
            break
        downloads += 1
        remaining = remaining[remaining.index(src) + 1:]
        why = claim_problem(src, version, epoch, records=records, run_epoch=run_epoch, morphing=morphing)
        if why:
            refused[src] = why
            log.warning("replica %s %s: its stage %d state is refused", src[-8:], why, stage_index)
            continue
        if run_epoch is not None and epoch < run_epoch - 1:
            ignored[src] = f"in morph epoch {epoch}, behind the run's records (epoch {run_epoch})"
            log.info("replica %s is %s: its state is not taken", src[-8:], ignored[src])
            continue
        cands.append(_Source(src, version, tensors, epoch))

    def fail(message: str, untrusted: bool) -> StateSyncError:
        return StateSyncError(message, untrusted=untrusted, refused=list(refused))

    if not cands:
        if refused:
            raise fail(f"no replica's state for stage {stage_index} could be believed: "
                       + "; ".join(f"{p[-8:]} {why}" for p, why in refused.items()), True)
        if ignored:
            raise fail(f"the replicas that gave us stage {stage_index}'s state are behind the run's morph epoch", False)
        raise busy or fail("no online replica gave us the stage state", False)

    # group by epoch; in each, the largest agreeing group (a lone source is its own group)
    epochs = sorted({c.epoch for c in cands})
    groups: dict[int, list[int]] = {}  # an epoch whose sources disagree with no majority has none
    for e in epochs:
        members = [i for i, c in enumerate(cands) if c.epoch == e]
        if len(members) == 1:
            groups[e] = members
            continue
        g = agreeing([cands[i].tensors for i in members], tolerance)
        if g:
            groups[e] = [members[j] for j in g]
    if not groups:
        pairs = ", ".join(
            f"{a.peer[-8:]}~{b.peer[-8:]} distance {state_distance(a.tensors, b.tensors):.3f} "
            f"norm ratio {norm_ratio(a.tensors, b.tensors):.2f}"
            for i, a in enumerate(cands) for b in cands[i + 1:] if a.epoch == b.epoch)
        raise fail(f"the {len(cands)} replicas we downloaded stage {stage_index} from disagree ({pairs}); "
                   "cannot tell which is honest", True)
    support = {e: sum(1 for x in (run_epochs or []) if int(x) == e) for e in groups}
    if len(epochs) > 1:
        log.info("stage %d state: replicas in morph epochs %s", stage_index, epochs)
    epoch = max(groups, key=lambda e: (len(groups[e]), support[e], e))
    group = groups[epoch]
    keep = group[0]
    taken = cands[keep]
    distances: dict[str, float] = {}
    for i, c in enumerate(cands):
        if i in group:
            distances[c.peer] = state_distance(c.tensors, taken.tensors)
        elif c.epoch == epoch:
            distances[c.peer] = d = state_distance(c.tensors, taken.tensors)
            refused[c.peer] = (f"served weights that disagree with {len(group)} other replica(s) (distance {d:.3f}, "
                               f"norm ratio {norm_ratio(c.tensors, taken.tensors):.2f})")
        else:
            ratio = norm_ratio(weights_only(c.tensors), weights_only(taken.tensors))
            if ratio > NORM_RATIO_TOLERANCE or not math.isfinite(ratio):
                refused[c.peer] = (f"served epoch-{c.epoch} weights whose norm is {ratio:.2f} times the taken "
                                   f"epoch-{epoch} state's")
            else:
                ignored[c.peer] = f"in morph epoch {c.epoch}, not the taken {epoch} (norm ratio {ratio:.2f})"
    for peer in refused:
        distances.setdefault(peer, math.inf)
    for peer, why in refused.items():
        if peer in (c.peer for c in cands):
            log.warning("replica %s %s: refused", peer[-8:], why)
    agreed = [cands[i].peer for i in group]
    version = _lower_median([cands[i].version for i in group])
    if len(group) == 1:
        log.warning("stage %d state taken UNCONFIRMED from %s alone (version %d, morph epoch %d): its claims match "
                    "its signed record, but no other replica's state confirms it", stage_index, taken.peer[-8:],
                    version, epoch)
    else:
        log.info("stage %d state from %s verified against %d replica(s) (distances %s); version %d (declared %s)",
                 stage_index, taken.peer[-8:], len(group) - 1,
                 ", ".join(f"{distances[p]:.3f}" for p in agreed if p != taken.peer), version,
                 sorted(cands[i].version for i in group))
    return Verified(version, taken.tensors, taken.peer, verified=len(group) > 1, refused=list(refused),
                    distances=distances, epoch=epoch, agreed=agreed, ignored=list(ignored),
                    reasons={**ignored, **refused})
