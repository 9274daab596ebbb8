"""The verifier the node calls on EVERY tensor it accepts, before using it.

``verify(sender, direction, tensor, *, step=None, ids=None, mb=None) -> Verdict``

- ``sender``: the peer id the tensor came from (the verifier keeps per-sender references).
- ``direction``: ``"act"`` for activations arriving on ``fwd``, ``"grad"`` for
  activation-gradients arriving on ``bwd``.
- ``tensor``: the decoded (B, L, k) payload.
- ``step``: the sender's version (frame header), kept for diagnostics only.
- ``ids``: the microbatch's token ids (B, L) if the node has them: the ``fwd`` frame carries them;
  for ``bwd`` the node has them in the microbatch's context. Strongly recommended: they enable the
  token-agreement distance, the only one that sees replayed or shuffled payloads.
- ``mb``: the microbatch id, so a retransmission of the same microbatch is not taken for a
  replay.

Two implementations: ``BasicVerifier`` (dtype, shape, finiteness — the daemon's baseline) and
``SentinelVerifier`` (the same checks, then SENTINEL, ``security/sentinel.py``). ``make_verifier``
picks one from the manifest's ``[sentinel]`` section. Both are pure (no I/O, no clock).

Threading: ``verify`` takes an internal lock, so calls from several threads are serialised and
safe; the intended use is one worker thread off the event loop, e.g.
``await loop.run_in_executor(verifier_pool, verifier.verify, ...)``, timing the call for metrics.

What the node does with a rejection (not done here): reply ``reject`` / ``rejected-by-verifier``,
drop the tensor (or, for a gradient, optionally use ``reference_tensor``), tell the next stage to
skip the microbatch, and ``security.bans.BanList.record(sender, flagged=not verdict.accept, now)``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from security.sentinel import DIRECTIONS, DISTANCES, Sentinel, SentinelParams

BASIC_REASONS = ("bad-dtype", "bad-shape", "non-finite")
SENTINEL_REASONS = ("replay",) + tuple(f"sentinel:{name}" for name in DISTANCES)
DEFAULT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Verdict:
    """``accept``; ``reason`` (one of BASIC_REASONS / SENTINEL_REASONS) when rejected; ``score``:
    the largest distance/fence ratio (> 1 rejects; 0 when not judged); ``distances``: name ->
    value; ``basis``: what it was judged against (basic for the basic checks; else
    ``sentinel.Judgement.basis``: warmup, reference, partner, shift, replay, retransmit);
    ``over``: every distance over its fence, name -> distance/fence, largest first."""

    accept: bool
    reason: str | None = None
    score: float = 0.0
    distances: dict[str, float] = field(default_factory=dict)
    basis: str = "basic"
    over: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Verifier(Protocol):
    def verify(self, sender: str, direction: str, tensor: Tensor, *, step: int | None = None,
               ids: Tensor | None = None, mb: object = None) -> Verdict: ...


class BasicVerifier:
    """Dtype allowlist, (B, L, k) shape, and every value finite.

    ``k``: boundary width; ``seq_len``: longest L allowed (None: any); ``max_batch``: largest B
    (None: any). ``ids``, when given, must be an integer (B, L) tensor.
    """

    def __init__(self, k: int, *, seq_len: int | None = None, max_batch: int | None = None,
                 dtypes: tuple[torch.dtype, ...] = DEFAULT_DTYPES):
        if k <= 0:
            raise ValueError(f"verifier: k must be positive, got {k}")
        self.k, self.seq_len, self.max_batch, self.dtypes = k, seq_len, max_batch, tuple(dtypes)
        self._lock = threading.Lock()

    def check(self, direction: str, tensor: Tensor, ids: Tensor | None = None) -> Verdict | None:
        """The rejection, or None if the tensor is well formed."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if not isinstance(tensor, Tensor) or tensor.dtype not in self.dtypes:
            return Verdict(False, "bad-dtype")
        if tensor.ndim != 3 or tensor.shape[-1] != self.k or tensor.numel() == 0:
            return Verdict(False, "bad-shape")
        B, L, _ = tensor.shape
        if (self.seq_len is not None and L > self.seq_len) or (self.max_batch is not None and B > self.max_batch):
            return Verdict(False, "bad-shape")
        if ids is not None:
            if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
                return Verdict(False, "bad-dtype")
            if tuple(ids.shape) != (B, L):
                return Verdict(False, "bad-shape")
        if not bool(torch.isfinite(tensor).all()):
            return Verdict(False, "non-finite")
        return None

    def verify(self, sender: str, direction: str, tensor: Tensor, *, step: int | None = None,
               ids: Tensor | None = None, mb: object = None) -> Verdict:
        with self._lock:
            return self.check(direction, tensor, ids) or Verdict(True)


class SentinelVerifier(BasicVerifier):
    """Basic checks, then SENTINEL. Rejections by the basic checks teach SENTINEL nothing."""

    def __init__(self, k: int, *, seq_len: int | None = None, max_batch: int | None = None,
                 params: SentinelParams | None = None, dtypes: tuple[torch.dtype, ...] = DEFAULT_DTYPES):
        super().__init__(k, seq_len=seq_len, max_batch=max_batch, dtypes=dtypes)
        self.sentinel = Sentinel(params)

    @classmethod
    def from_config(cls, cfg, *, k: int, seq_len: int | None = None, max_batch: int | None = None,
                    seed: int = 0, **overrides) -> SentinelVerifier:
        """Build from a ``[sentinel]`` section (any object with beta_act, beta_grad,
        n_projections, warmup, window, kappa); ``seed``: the run seed; ``overrides``: other
        ``SentinelParams`` fields."""
        params = SentinelParams(
            beta_act=cfg.beta_act, beta_grad=cfg.beta_grad, n_projections=cfg.n_projections,
            warmup=cfg.warmup, window=cfg.window, kappa=cfg.kappa, seed=seed, **overrides,
        )
        return cls(k, seq_len=seq_len, max_batch=max_batch, params=params)

    def verify(self, sender: str, direction: str, tensor: Tensor, *, step: int | None = None,
               ids: Tensor | None = None, mb: object = None) -> Verdict:
        with self._lock:
            bad = self.check(direction, tensor, ids)
            if bad is not None:
                return bad
            j = self.sentinel.judge(sender, direction, tensor, ids=ids, mb=mb)
            return Verdict(j.accept, j.reason, j.score, j.distances, j.basis, j.over)

    def reference_tensor(self, direction: str, ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor | None:
        """E[payload | token] from accepted traffic, a stand-in for a rejected gradient (None
        until references exist). Note it carries none of the microbatch's context."""
        return self.sentinel.reference_tensor(direction, ids, dtype)

    def forget(self, sender: str) -> None:
        """Drop a sender's own references (it left the swarm)."""
        self.sentinel.forget(sender)


def describe_rejection(verdict) -> str:
    """One line for the log: the reason, the score, and every distance over its fence, e.g.
    ``sentinel:scale (score 1.50; over: scale 1.50, tok 1.31)``; a rule's rejection is its
    reason alone (``non-finite``)."""
    score = float(getattr(verdict, "score", 0.0) or 0.0)
    if not score > 1.0:
        return str(verdict.reason)
    over = getattr(verdict, "over", None) or {}
    tail = "; over: " + ", ".join(f"{name} {ratio:.2f}" for name, ratio in over.items()) if over else ""
    return f"{verdict.reason} (score {score:.2f}{tail})"


def make_verifier(cfg, *, k: int, seq_len: int | None = None, max_batch: int | None = None,
                  seed: int = 0) -> BasicVerifier:
    """SentinelVerifier if ``cfg.enabled`` else BasicVerifier (``cfg``: the manifest's
    ``[sentinel]`` section or any object with its fields)."""
    if getattr(cfg, "enabled", True):
        return SentinelVerifier.from_config(cfg, k=k, seq_len=seq_len, max_batch=max_batch, seed=seed)
    return BasicVerifier(k, seq_len=seq_len, max_batch=max_batch)
