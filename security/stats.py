"""SENTINEL's per-payload statistics and fences: robust units (``normalize``), the residual scale's
per-position log norms, the ``Stats`` of one payload and the distances between two, and the Tukey
fences with their spread floors. Pure tensor arithmetic; the detector that keeps references and
judges senders is ``security.sentinel`` (its module docstring describes the method)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch
from torch import Tensor


# ----------------------------------------------------------------------------- statistics


def normalize(X: Tensor, grad: bool, clip: float, norms: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token vectors X (N, k) in robust units (clipped to ±clip), and log of the unit (see 1.);
    ``norms``: X's row norms if already computed."""
    n_tok, k = X.shape
    sigma = (X.norm(dim=1) if norms is None else norms).median() / math.sqrt(k)
    log_scale = torch.log(sigma.clamp_min(1e-35) * (n_tok if grad else 1.0))
    Xn = (X / sigma.clamp_min(1e-30)).clamp(-clip, clip)
    return Xn, log_scale


def position_lognorms(norms: Tensor, k: int, grad: bool) -> Tensor:
    """Each position's log(‖x_t‖ / √k) from its norm (gradients: plus log N, N = norms.numel(), as
    the scale in ``normalize``), so that their median is the payload's log scale.

    The token table keeps their mean per token (``TokenTable.lognorm``). Once it has rows for
    the batch, the scale a tensor is judged on is the *residual* scale, the median over positions
    of (log norm − its token's row), plus an offset (EMA over accepted tensors of log scale minus
    residual scale) that keeps it on the log scale's level. Honest batches dominated by tokens
    with small codes (runs of whitespace in source code) have a median token norm well below the
    usual, which the residual scale explains away."""
    out = (norms / math.sqrt(k)).clamp_min(1e-35).log()
    if grad:
        out = out + math.log(norms.numel())
    return out.clamp(-80.0, 80.0)


@dataclass
class Stats:
    """Batch-size-independent summary of one payload (float32, on the CPU); see ``normalize``."""

    scale: Tensor  # () log σ
    mean: Tensor  # (k,)
    absmean: Tensor  # (k,)
    rms: Tensor  # (k,)
    quant: Tensor  # (Q, m)

    FIELDS = ("scale", "mean", "absmean", "rms", "quant")

    def ema_(self, other: Stats, beta: float) -> None:
        """self ← β·self + (1 − β)·other."""
        for name in self.FIELDS:
            getattr(self, name).mul_(beta).add_(getattr(other, name), alpha=1 - beta)

    def clone(self) -> Stats:
        return Stats(*(getattr(self, name).clone() for name in self.FIELDS))

    def moments(self) -> Tensor:
        return torch.cat([self.mean, self.absmean, self.rms])

    def signed(self) -> Tensor:
        """Location statistics whose signs a negation flips: channel means, projection medians."""
        return torch.cat([self.mean, self.quant[self.quant.shape[0] // 2]])


def projections(k: int, m: int, seed: int) -> Tensor:
    """m unit vectors in R^k (columns), a pure function of (k, m, seed)."""
    g = torch.Generator().manual_seed(seed)
    P = torch.randn(k, m, generator=g, dtype=torch.float64)
    return (P / P.norm(dim=0, keepdim=True)).float()


def compute_stats(Xn: Tensor, log_scale: Tensor, P: Tensor, n_quantiles: int, max_tokens: int,
                  generator: torch.Generator | None = None) -> Stats:
    """Stats of normalised token vectors Xn (N, k); P (k, m) on Xn's device."""
    n_tok = Xn.shape[0]
    mean = Xn.mean(0)
    absmean = Xn.abs().mean(0)
    rms = Xn.square().mean(0).sqrt()
    if n_tok > max_tokens:
        # a fresh random subset each call: a sender cannot know which tokens are looked at
        idx = torch.randperm(n_tok, generator=generator)[:max_tokens].to(Xn.device)
        Xn = Xn[idx]
    Y = Xn @ P
    n = Y.shape[0]
    levels = ((torch.arange(n_quantiles, dtype=torch.float64) + 0.5) / n_quantiles * n).long().clamp_(0, n - 1)
    quant = torch.sort(Y, dim=0).values[levels.to(Y.device)]
    out = (log_scale.clamp(-80.0, 80.0), mean, absmean, rms, quant)
    return Stats(*(t.detach().float().cpu() for t in out))


# ``sign``: the weight per component below which a flip is not evidence (robust units squared: both
# location statistics within ~0.1 of zero). Honest activations' channel means lie well away from
# zero; gradients' hover around it, so their signs are noise (docs/SENTINEL.md, "False flags in
# clean swarms").
SIGN_FLOOR = 0.01


def _weighted_sign_flip(s: Tensor, r: Tensor, floor: float = SIGN_FLOOR) -> float:
    """Share of Σ|s_i·r_i| on components whose signs disagree: 0 = same signs, 1 = all flipped.
    Weighting by |s_i·r_i| keeps components that hover around zero from flipping it; the share is
    of at least ``floor`` per component, so when *all* of them hover around zero (gradients'
    channel means) their flips count in proportion to their size, not as a full flip."""
    w = (s * r).abs()
    total = max(float(w.sum()), floor * w.numel())
    if total <= 0.0:
        return 0.0
    return float((w * (torch.sign(s) != torch.sign(r)).float()).sum()) / total


def distances(s: Stats, r: Stats) -> dict[str, float]:
    """The five payload distances of stats ``s`` from reference ``r`` (module docstring, 3.)."""
    diff = s.moments() - r.moments()
    return {
        "l1": float(diff.abs().mean()),
        "l2": float(diff.norm()) / math.sqrt(diff.numel()),
        "sign": _weighted_sign_flip(s.signed(), r.signed()),
        "swd": float((s.quant - r.quant).abs().mean()),
        "scale": abs(float(s.scale - r.scale)),
    }


# ----------------------------------------------------------------------------- fences


def excess_over(value: float, others: list[float], mads: float) -> float:
    """How far ``value`` lies above the median of ``others`` beyond ``mads`` times their median
    absolute deviation, floored at 0 (``tokc``, ``ctxc``). Honest replicas differ in these
    averages (own data, own progress): with two body replicas behind eight senders the other
    senders' averages form two groups, and a sender of the upper group lies above the median by
    about one MAD.

    The spread is the larger of the others' MAD and the MAD of all the values, ``value``
    included; the centre stays the median of the others. The others' MAD alone is degenerate
    with few of them: of three values one deviation from their median is always 0, so their MAD
    is the smaller of the other two, and two replicas that happen to agree make it near 0. One value cannot move a MAD far (it breaks down at half the values), so
    an outlier still lies many MADs out. The larger of the two, because adding a value to one of
    two groups can also pull the MAD of all below the others' (the harm part's two bodies)."""
    med = statistics.median(others)
    values = [*others, value]
    centre = statistics.median(values)
    mad = max(statistics.median(abs(o - med) for o in others), statistics.median(abs(v - centre) for v in values))
    return max(0.0, value - med - mads * mad)


# Smallest spread a fence assumes, per distance. The sign-flip ratio is zero most of the time for
# honest activations (IQR = 0), which would make one flipped near-zero channel a rejection.
# Likewise a scale that moves by less than 1% is no attack, however steady honest traffic is.
SPREAD_FLOOR = {"sign": 0.15, "scale": 0.01, "tokc": 0.02, "pos": 0.15, "ctx": 0.02, "ctxc": 0.02, "adj": 0.02, "adjc": 0.02, "cum": 0.1}


def tukey_fence(values, kappa: float, iqr_floor: float, abs_floor: float = 0.0) -> float:
    """Q3 + κ·max(IQR, iqr_floor·median, abs_floor) of ``values`` (linear-interpolated quartiles)."""
    v = sorted(values)
    if not v:
        return float("inf")

    def q(p):
        pos = p * (len(v) - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (pos - lo)

    q1, med, q3 = q(0.25), q(0.5), q(0.75)
    spread = max(q3 - q1, iqr_floor * abs(med), abs_floor)
    return q3 + kappa * spread


def median_stats(items: list[Stats]) -> Stats:
    """Coordinate-wise median (the lower middle for an even count) of several Stats."""
    if len(items) == 1:
        return items[0].clone()
    return Stats(*(torch.stack([getattr(x, f) for x in items]).median(dim=0).values for f in Stats.FIELDS))
