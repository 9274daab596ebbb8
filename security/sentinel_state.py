"""SENTINEL's settings and what it keeps per direction and sender: the tuning (``SentinelParams``,
mirrored by ``[sentinel]`` of the run manifest), the verdict (``Judgement``), a sender's record
(``SenderRecord``) and a direction's state (``DirectionState``). The detector that reads and
updates them is ``security.sentinel.Sentinel``; the method, docs/SENTINEL.md. Pure data, no I/O."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from security.stats import Stats
from security.token_table import TokenTable

DIRECTIONS = ("act", "grad")
DISTANCES = ("l1", "l2", "sign", "swd", "scale", "tok", "shift", "tokc", "pos", "ctx", "ctxc", "adj", "adjc", "cum", "edge")
# the distances of one tensor on its own (``cum`` averages their fence ratios over a sender's tensors)
AVERAGED = ("tok", "ctx", "adj")  # distances also judged averaged over a sender's own tensors: tokc, ctxc, adjc
SINGLE = ("l1", "l2", "sign", "swd", "scale", "tok", "shift", "pos", "ctx", "adj")
TABLE = ("tok", "shift", "pos", "ctx", "adj")  # distances to the shared token tables, not to the sender's own reference


@dataclass(frozen=True)
class SentinelParams:
    """Tuning of the detector. The first six mirror ``[sentinel]`` of the run manifest."""

    beta_act: float = 0.9  # EMA decay of the activation reference (paper: 0.9)
    beta_grad: float = 0.8  # ... of the gradient reference (paper: 0.8)
    n_projections: int = 16  # random projections for the sliced Wasserstein distance
    warmup: int = 10  # tensors of a direction accepted unconditionally to seed references/fences
    window: int = 64  # a sender is active (votes) if heard from in this many tensors; fallback fence window
    kappa: float = 3.0  # Tukey fence Q3 + κ·IQR
    seed: int = 0  # seeds the projections (public: knowing them does not help an attacker)
    n_quantiles: int = 32  # quantile levels per projection
    iqr_floor: float = 0.1  # the IQR used is at least this fraction of the window median
    clip: float = 3.0  # normalised values are clipped to ±clip robust units
    beta_tok: float = 0.9  # EMA decay of a token-table row (per batch the token occurs in)
    beta_cum: float = 0.7  # tokc: EMA decay of a sender's own tok distance, per tensor of its own
    averaged_mad: float = 2.0  # tokc, ctxc: only the excess beyond this many MADs of the other voters' averages
    # tokc, ctxc, adjc, cum, edge judge a sender against the other voters only with at least this
    # many of them (6+ replicas of a stage): the spread of fewer is poorly known, and honest replicas
    # were flagged and banned with three others (security/sentinel.py, Sentinel._others_enough)
    averaged_min_others: int = 5
    token_buckets: int = 4096  # table rows; token id -> id % token_buckets
    max_tokens: int = 8192  # tokens sorted for quantiles (a fresh random subset beyond this)
    replay_window: int = 4096  # payload hashes remembered per direction for exact-replay checks
    reject_weight: float = 0.1  # rejected tensors move the references at this fraction of the rate
    shift_horizon: int = 32  # senders heard from in this many tensors vote on a stage-wide shift
    shift_reach: float = 10.0  # during a shift, scores up to this are accepted and followed
    # a sender whose tensor left the fences counts as out in a shift vote for this many more
    # tensors of the direction, even if its latest is back inside (``Sentinel._shifted``)
    shift_memory: int = 4
    pos_c: float = 6.0  # pos (activations): a position is an outlier when its squared residual is > pos_c x the batch median
    ctx_buckets: int = 16384  # context table rows: (previous, current) token pair -> hash % ctx_buckets
    beta_ratio: float = 0.85  # cum: EMA decay of a sender's own fence ratios, per tensor of its own
    # edge: a sender's single-tensor score above the other voters' level, beyond edge_allow and
    # at most edge_step per tensor, summed over its accepted tensors (a CUSUM, never below 0),
    # is fenced at edge_limit (``Sentinel._edge``)
    edge_allow: float = 0.05
    edge_step: float = 0.15
    edge_limit: float = 0.3
    beta_edge: float = 0.5  # edge: EMA decay of a voter's own single-tensor score (the others' level)
    # distances not judged (ablations: bench_sentinel --harm-off). pos by default: it flags a lone
    # sender's honest activations too often (docs/SENTINEL.md, "Harm and the adaptive adversary")
    off: tuple = ("pos",)
    sender_window: int = 12  # a sender's own recent accepted distances (its fence)
    sender_min: int = 5  # ... counted once it holds this many
    max_senders: int = 1024  # per-sender records kept (least recently seen dropped)
    min_window: int = 8  # a distance counts once its window holds this many values
    # with one or two voters: a voter's token-table distances are fenced by its own accepted ones,
    # up to this many times the direction's fence (``Sentinel._own_table_fences``)
    own_fence_cap: float = 1.5

    def __post_init__(self):
        if not (0 < self.beta_act < 1 and 0 < self.beta_grad < 1 and 0 < self.beta_tok < 1
                and 0 <= self.beta_cum < 1 and 0 <= self.beta_ratio < 1 and 0 <= self.beta_edge < 1):
            raise ValueError("sentinel: beta_act, beta_grad, beta_tok must be in (0, 1), "
                             "beta_cum, beta_ratio and beta_edge in [0, 1)")
        if self.edge_allow < 0 or self.edge_step <= 0 or self.edge_limit <= 0:
            raise ValueError("sentinel: edge_allow must be >= 0, edge_step and edge_limit > 0")
        if self.pos_c <= 1:
            raise ValueError(f"sentinel: pos_c must be > 1, got {self.pos_c}")
        if self.warmup < 2:
            raise ValueError(f"sentinel: warmup must be >= 2 (a fence needs distances), got {self.warmup}")
        if self.window < 4:
            raise ValueError(f"sentinel: window must be >= 4, got {self.window}")
        if self.kappa <= 0 or self.iqr_floor < 0 or self.clip <= 0 or self.shift_reach < 1:
            raise ValueError("sentinel: kappa and clip must be > 0, iqr_floor >= 0, shift_reach >= 1")
        for name in ("n_projections", "n_quantiles", "token_buckets", "ctx_buckets", "max_tokens", "max_senders", "min_window",
                     "shift_horizon", "sender_window", "sender_min"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sentinel: {name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.reject_weight <= 1:
            raise ValueError(f"sentinel: reject_weight must be in [0, 1], got {self.reject_weight}")
        if self.averaged_mad < 0:
            raise ValueError(f"sentinel: averaged_mad must be >= 0, got {self.averaged_mad}")
        if self.averaged_min_others < 2:
            raise ValueError(f"sentinel: averaged_min_others must be >= 2 (of two replicas neither is the odd one), "
                             f"got {self.averaged_min_others}")
        if self.own_fence_cap < 1:
            raise ValueError(f"sentinel: own_fence_cap must be >= 1, got {self.own_fence_cap}")
        if self.replay_window < 0 or self.shift_memory < 0:
            raise ValueError("sentinel: replay_window and shift_memory must be >= 0")
        unknown = set(self.off) - set(DISTANCES)
        if unknown:
            raise ValueError(f"sentinel: off names unknown distances {sorted(unknown)}")

    def beta(self, direction: str) -> float:
        return self.beta_act if direction == "act" else self.beta_grad


@dataclass(frozen=True)
class Judgement:
    """What ``Sentinel.judge`` decided. ``basis``: warmup | reference | partner | shift | replay |
    retransmit (``partner``: over its own reference's fences but within a partner replica's,
    ``Sentinel._partners``). ``over``: every distance over its fence, name -> distance/fence,
    largest first (``reason`` names the first): a tensor is often out on several, and the worst
    alone hides what else caught it."""

    accept: bool
    reason: str | None
    score: float
    distances: dict[str, float]
    basis: str
    over: dict[str, float] = field(default_factory=dict)


@dataclass
class SenderRecord:
    """Per (sender, direction): the EMA of the Stats of what it sends (the paper's per-sender
    momentum), the windows of its accepted distances, and counts."""

    ema: Stats
    windows: dict
    last: int = 0  # index in the direction's stream of its latest tensor
    out_at: int = -(10**9)  # index in the direction's stream of its latest tensor outside the fences
    seen: int = 0
    rejected: int = 0
    averaged: dict = field(default_factory=dict)  # EMA of its tok and ctx distances over all its tensors (tokc, ctxc)
    ratio_ema: dict | None = None  # EMA of its single-tensor fence ratios, capped at 1 (for cum)
    score_ema: float | None = None  # EMA of its single-tensor score, capped at 1 (the others' level for edge)
    edge: float = 0.0  # its edge sum

    @property
    def out(self) -> bool:
        """Its latest tensor was outside the fences."""
        return self.out_at == self.last


class DirectionState:
    """One direction (act or grad) of one stage: token tables, fence windows, replay hashes,
    per-sender records, and the direction's clock."""

    def __init__(self, params: SentinelParams):
        self.table: TokenTable | None = None
        self.ctx: TokenTable | None = None  # rows keyed by (previous, current) token pair
        # EMA over accepted tensors of their log scale minus their residual scale (``position_lognorms``)
        self.scale_offset: float | None = None
        self.windows = {name: deque(maxlen=params.window) for name in DISTANCES}  # all senders
        self.hashes: OrderedDict[bytes, object] = OrderedDict()
        self.senders: OrderedDict[str, SenderRecord] = OrderedDict()
        self.accepted = 0
        self.seen = 0  # tensors judged (the direction's clock)
        self.ref: Stats | None = None  # cached reference
        self.ref_version = -1
