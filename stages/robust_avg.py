"""What a replica-averaging round applies: contributions judged before they are averaged.

hivemind's averaging is a butterfly all-reduce: the buffer is cut into g ranges, member k reduces
range k for everyone (every member sends it its values there, over a stream libp2p
authenticates) and sends the result back. So the values a reducer sees come from the members
themselves, and what a member gets back for another's range is whatever that reducer returns.
The rule here has two halves, one for each end (docs/ASYNCMESH.md, "Who may average, and what is
applied"):

``robust_mean`` (at a reducer, per hivemind chunk of its range). Every member has weight one. A
member whose values are not finite is dropped. With three members or more, the centre is the
coordinate-wise median, each member's distance to it is measured per segment (parameters and
first moments are judged apart: their scales differ), and a member further from it than
``TAU`` × the median distance (never less than ``FLOOR_REL`` of the centre's norm) is dropped.
With two there is no majority: both are equally far from their mean, so neither can be shown to
be the odd one, and the spread test drops nobody. In every group a member whose values lie
further from the reducer's own than ``MAX_REL`` × the own's norm is dropped (gross poison: a
scaled copy, random values; honest first moments of two replicas are nearly uncorrelated, about
√2 of a norm apart, hence the margin). The reducer's own contribution is always kept (it trusts
itself). The kept members' plain mean is returned.

``refused_reducers`` (at a receiver, once every range has come back). Each member knows the
round's result on its own range, where it reduced honestly, and how far that lies from its own
values (per segment, the root mean square of the difference). A range returned by another
reducer that lies further from the receiver's values than ``RECEIVE_TAU`` × that reference
(floored at ``FLOOR_REL`` of the receiver's values) is refused: the receiver keeps its own
values there, and the rest of the round applies.

``AveragingLayout`` interleaves the segments block by block in the buffer and spreads each
segment's elements (which come tensor by tensor) over its blocks, so every member's range holds
both parameters and moments, each a like sample of every tensor, and a receiver's own range is a
fair reference for each. (Without the spread a range held whole tensors, an embedding's rows in
one, attention weights in another, and honest ranges differed by more than the bound.) ``butterfly`` runs a whole
round in one process (the benchmark's averaging part measures the rule with it).

Pure PyTorch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

TAU = 3.0  # a member further from the coordinate-wise median than TAU x the median distance is dropped
MAX_REL = 4.0  # ... and one further from the reducer's own values than MAX_REL x their norm
RECEIVE_TAU = 4.0  # a returned range further from the receiver's values than this x its own range's is refused
FLOOR_REL = 1e-2  # distances below this share of the centre's (own values') norm are never judged
BLOCKS = 64  # blocks per segment in AveragingLayout: every member's range of a group of up to 16 holds each segment
CHUNKS_PER_MEMBER = 4  # the reducer judges its range in about this many chunks
MAX_CHUNK = 1 << 17  # elements per chunk at most (hivemind's default part size, 512 KiB of float32)


@dataclass(frozen=True)
class AveragingLayout:
    """``segments`` vectors of ``size`` elements each, interleaved block by block in one flat
    buffer: block b of segment s sits at ``(b·segments + s)·block``. Every stretch of
    ``segments·block`` elements holds a block of each segment. Within a segment, element i sits
    at ``(i·stride) mod (blocks·block)`` (``stride`` coprime to it, near the golden section), so
    a slice's elements, which come tensor by tensor, are spread evenly over the blocks: every
    range of the buffer is a like sample of every parameter tensor, and a receiver's own range is
    a fair reference for the others'."""

    segments: int
    size: int
    blocks: int = BLOCKS

    def __post_init__(self):
        if self.segments < 1 or self.size < 1 or self.blocks < 1:
            raise ValueError(f"bad layout {self}")

    @property
    def block(self) -> int:
        return -(-self.size // self.blocks)

    @property
    def total(self) -> int:
        return self.segments * self.blocks * self.block

    @property
    def stride(self) -> int:
        n = self.blocks * self.block
        k = max(1, round(n * 0.6180339887))
        while math.gcd(k, n) != 1:
            k += 1
        return k

    def _positions(self, count: int) -> torch.Tensor:
        n = self.blocks * self.block
        return (torch.arange(count, dtype=torch.long) * self.stride) % n

    def pack(self, parts: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """One flat buffer of ``total`` elements holding ``parts`` (each at most ``size`` long,
        zero-padded)."""
        if len(parts) != self.segments or any(p.numel() > self.size for p in parts):
            raise ValueError("parts do not fit the layout")
        out = torch.zeros(self.total, dtype=torch.float32) if out is None else out
        view = out.view(self.blocks, self.segments, self.block)
        view.zero_()
        for s, p in enumerate(parts):
            spread = torch.zeros(self.blocks * self.block, dtype=out.dtype)
            spread[self._positions(p.numel())] = p.reshape(-1).to(out.dtype)
            view[:, s, :] = spread.view(self.blocks, self.block)
        return out

    def unpack(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The segments of ``flat`` (each ``size`` long)."""
        view = flat.reshape(self.blocks, self.segments, self.block)
        where = self._positions(self.size)
        return [view[:, s, :].reshape(-1)[where].clone() for s in range(self.segments)]

    def segment_ids(self, start: int = 0, length: int | None = None) -> torch.Tensor:
        """The segment of each element of ``flat[start : start + length]``."""
        length = self.total - start if length is None else length
        return (torch.arange(start, start + length) // self.block) % self.segments


def chunk_elements(total: int, group: int) -> int:
    """Elements per chunk for a group of ``group`` members (every member's range is cut into
    about ``CHUNKS_PER_MEMBER`` chunks; it must be the same on every member)."""
    return max(1, min(MAX_CHUNK, -(-total // (max(1, group) * CHUNKS_PER_MEMBER))))


def _median(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The median along ``dim`` (the mean of the middle two for an even count)."""
    s = x.sort(dim=dim).values
    n = x.shape[dim]
    return (s.select(dim, (n - 1) // 2) + s.select(dim, n // 2)) / 2


def judge_contributions(contribs: torch.Tensor, *, own: int | None = None, segments: torch.Tensor | None = None,
          tau: float = TAU, max_rel: float = MAX_REL) -> torch.Tensor:
    """Which of the g members' ``contribs`` (a [g, L] tensor) are kept (a [g] bool tensor); the
    rule is in the module docstring. ``own``: the index of the judging member's own contribution
    (always kept, the reference of the gross bound); ``segments``: each column's segment."""
    if contribs.dim() != 2:
        raise ValueError("contributions must be a [members, elements] tensor")
    x = contribs.to(torch.float32)
    kept = torch.isfinite(x).all(dim=1)
    if own is not None and not bool(kept[own]):
        raise ValueError("the judging member's own contribution is not finite")
    segs = torch.zeros(x.shape[1], dtype=torch.long) if segments is None else segments
    for s in torch.unique(segs).tolist():
        cols = x[:, segs == s]
        live = kept.nonzero().flatten()
        if live.numel() >= 3:
            centre = _median(cols[live])
            dist = (cols[live] - centre).norm(dim=1)
            scale = max(float(_median(dist)), FLOOR_REL * float(centre.norm()))
            kept[live[dist > tau * scale]] = False
        if own is not None:
            ref = cols[own]
            kept &= ~((cols - ref).norm(dim=1) > max_rel * float(ref.norm()))
    if own is not None:
        kept[own] = True
    return kept


def robust_mean(contribs: torch.Tensor, *, own: int | None = None, segments: torch.Tensor | None = None,
                tau: float = TAU, max_rel: float = MAX_REL) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mean of the kept members' contributions, the kept mask); ``judge_contributions`` decides."""
    kept = judge_contributions(contribs, own=own, segments=segments, tau=tau, max_rel=max_rel)
    if not bool(kept.any()):
        raise ValueError("no contribution is finite")
    return contribs[kept].to(torch.float32).mean(dim=0), kept


def refused_reducers(own_values: torch.Tensor, returned: torch.Tensor, ranges: list[tuple[int, int]], me: int, *,
                     layout: AveragingLayout | None = None, tau: float = RECEIVE_TAU) -> set[int]:
    """The reducers whose returned range the receiver ``me`` refuses. ``ranges[k]``: the
    elements ``[lo, hi)`` reducer k returned. Per segment (``layout``; one without it), the root
    mean square of ``returned − own_values`` on a reducer's range is compared with the same on
    ``me``'s own range (floored at ``FLOOR_REL`` × the root mean square of ``me``'s values
    there); further than ``tau`` times that is refused. A range with a non-finite value is
    refused. Where ``me``'s range holds none of a segment, only non-finite ranges are refused."""
    n_seg = layout.segments if layout is not None else 1

    def per_segment(k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """Squared differences summed per segment, squared own values, counts, finite."""
        lo, hi = ranges[k]
        diff = returned[lo:hi].to(torch.float32) - own_values[lo:hi].to(torch.float32)
        seg = layout.segment_ids(lo, hi - lo) if layout is not None else torch.zeros(hi - lo, dtype=torch.long)
        finite = bool(torch.isfinite(diff).all())
        sq = torch.bincount(seg, weights=diff.double().pow(2), minlength=n_seg)
        own_sq = torch.bincount(seg, weights=own_values[lo:hi].double().pow(2), minlength=n_seg)
        return sq, own_sq, torch.bincount(seg, minlength=n_seg).double(), finite

    mine_sq, mine_own, mine_n, _ = per_segment(me)
    ref = torch.maximum((mine_sq / mine_n.clamp(min=1)).sqrt(), FLOOR_REL * (mine_own / mine_n.clamp(min=1)).sqrt())
    refused: set[int] = set()
    for k in range(len(ranges)):
        if k == me or ranges[k][1] <= ranges[k][0]:
            continue
        sq, _, n, finite = per_segment(k)
        rms = (sq / n.clamp(min=1)).sqrt()
        judged = (mine_n > 0) & (n > 0)
        if not finite or bool((judged & (rms > tau * ref)).any()):
            refused.add(k)
    return refused


def _rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt()) if x.numel() else 0.0


@dataclass
class RoundOutcome:
    """What ``butterfly`` did: each member's result, the members dropped at each reducer and the
    reducers each receiver refused."""

    results: list[torch.Tensor]
    dropped: dict[int, set[int]] = field(default_factory=dict)  # reducer -> members it dropped
    refused: dict[int, set[int]] = field(default_factory=dict)  # receiver -> reducers it refused

    @property
    def dropped_members(self) -> set[int]:
        return set().union(*self.dropped.values()) if self.dropped else set()


def butterfly(contribs: torch.Tensor, *, layout: AveragingLayout | None = None, returns=None,
              tau: float = TAU, max_rel: float = MAX_REL, receive_tau: float = RECEIVE_TAU) -> RoundOutcome:
    """One averaging round of the g members' ``contribs`` ([g, N], laid out as ``layout`` says)
    as the swarm runs it, in one
    process: the buffer is cut into g equal ranges of chunks (``chunk_elements``), member k
    reduces range k chunk by chunk with ``robust_mean`` (its own contribution the reference, a
    member it dropped stays dropped for its later chunks), and every member checks what comes
    back with ``refused_reducers`` and keeps its own values on a refused range.

    ``returns`` (optional, a test's or benchmark's attacker): ``returns(k, honest_range)`` gives
    what reducer k sends back instead of its honest result."""
    g, n = contribs.shape
    x = contribs.to(torch.float32)
    chunk = chunk_elements(n, g)
    n_chunks = -(-n // chunk)
    reduced = torch.empty(n, dtype=torch.float32)
    out = RoundOutcome(results=[])
    returned = [None] * g
    for k in range(g):
        lo_c, hi_c = k * n_chunks // g, (k + 1) * n_chunks // g
        lo, hi = min(n, lo_c * chunk), min(n, hi_c * chunk)
        dropped: set[int] = set()
        for c0 in range(lo, hi, chunk):
            c1 = min(hi, c0 + chunk)
            live = [j for j in range(g) if j not in dropped]
            mean, kept = robust_mean(x[live, c0:c1], own=live.index(k), tau=tau, max_rel=max_rel,
                                     segments=None if layout is None else layout.segment_ids(c0, c1 - c0))
            dropped |= {live[i] for i in range(len(live)) if not bool(kept[i])}
            reduced[c0:c1] = mean
        out.dropped[k] = dropped
        returned[k] = (lo, hi)
    for i in range(g):
        got = reduced.clone()
        if returns is not None:
            for k in range(g):
                lo, hi = returned[k]
                if k != i:
                    got[lo:hi] = returns(k, reduced[lo:hi].clone())
        refused = refused_reducers(x[i], got, returned, i, layout=layout, tau=receive_tau)
        for k in refused:
            lo, hi = returned[k]
            got[lo:hi] = x[i, lo:hi]
        out.refused[i] = refused
        out.results.append(got)
    return out


__all__ = [
    "BLOCKS", "FLOOR_REL", "AveragingLayout", "MAX_REL", "RECEIVE_TAU", "RoundOutcome", "TAU", "butterfly",
    "chunk_elements", "judge_contributions", "refused_reducers", "robust_mean",
]
