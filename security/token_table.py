"""SENTINEL's per-token references: ``TokenTable`` keeps an EMA of the code each token id (or
token pair) usually gets, so a receiver can compare a position with what its token predicts, and
``context_agreement`` / ``residual_agreement`` score how well a tensor agrees with what its
positions' contexts usually carry (``context_keys``, ``context_score``, ``context_update``: the
previous token for activations, the (token, label) pair for gradients); ``adjacent_agreement``
scores how well neighbouring positions' residuals agree (they share their context). Used by ``security.sentinel`` (the ``tok``, ``tokc``, ``pos``, ``ctx`` and ``adj``
distances); see docs/SENTINEL.md."""

from __future__ import annotations

import math

import torch
from torch import Tensor


class TokenTable:
    """EMA of the payload's mean vector per token id (hashed into ``buckets`` rows), and of its
    positions' mean log norm (``lognorm``, when ``update`` is given the norms).

    Activations are keyed by the token at the same position; gradients by the next token (the
    label of the loss at that position), the last position of each row having none.
    """

    def __init__(self, buckets: int, k: int, beta: float):
        self.buckets, self.k, self.beta = buckets, k, beta
        self.table = torch.zeros(buckets, k)
        self.lognorm = torch.zeros(buckets)
        self.hits = torch.zeros(buckets, dtype=torch.long)  # batches that updated a row
        self.seen = torch.zeros(buckets, dtype=torch.bool)
        self.last = torch.zeros(buckets, dtype=torch.long)  # ``count`` at a row's latest update
        self.count = 0

    @staticmethod
    def keys(x: Tensor, ids: Tensor, direction: str, buckets: int) -> tuple[Tensor, Tensor]:
        """Token vectors (N, k) and their bucket keys (N,) for this direction."""
        ids = ids.to(x.device)
        if direction == "grad":
            x, ids = x[:, :-1], ids[:, 1:]
        return x.reshape(-1, x.shape[-1]), ids.reshape(-1).long().remainder(buckets)

    @staticmethod
    def pair_keys(x: Tensor, ids: Tensor, direction: str, buckets: int) -> tuple[Tensor, Tensor, Tensor]:
        """Token vectors (N', k) with two keys each: the token key of ``keys`` and a key of the
        (previous, current) token pair -- activations: position t keyed by (id_{t−1}, id_t);
        gradients: by (id_t, id_{t+1}), the input token and the label. The first position of
        a row (activations) or the last (gradients) has no pair and is left out."""
        ids = ids.to(x.device).long()
        pair = (ids[:, :-1] * 65599 + ids[:, 1:]).remainder(buckets)
        X = x[:, 1:] if direction == "act" else x[:, :-1]
        return X.reshape(-1, x.shape[-1]), ids[:, 1:].reshape(-1), pair.reshape(-1)

    def _to(self, device: torch.device) -> None:
        if self.table.device != device:
            self.table, self.seen, self.last = self.table.to(device), self.seen.to(device), self.last.to(device)
            self.lognorm, self.hits = self.lognorm.to(device), self.hits.to(device)

    def outliers(self, X: Tensor, keys: Tensor, c: float, fresh: int = 4) -> float | None:
        """How much of the batch lies far off its rows: z_t = ‖x_t − row‖² over c times the
        batch's median of it; each position contributes clamp(z_t − 1, 0, 3) (nothing while
        within c times the typical residual); the mean times √N. Positions carrying another token's
        code, or a large edit of a few positions, which batch-wide statistics average away. The
        √N makes the honest spread the same for any batch size (a binomial share's spread is
        ∝ 1/√N), so one fence suits them all. None while too few of the batch's rows have a
        residual scale."""
        if self.count == 0 or X.shape[0] == 0:
            return None
        self._to(X.device)
        # rows updated within the last few batches only: a rare token's row is stale while the
        # model changes fast, and its positions would all look far off (a lone honest replica of
        # the test model was flagged 36 times in its first 200 steps before this)
        known = self.seen[keys] & (self.count - self.last[keys] <= fresh)
        n = int(known.sum())
        if n < max(8, X.shape[0] // 4):
            return None
        r2 = (X[known] - self.table[keys[known]]).square().sum(1)
        # relative to this batch's median: while the model changes fast every residual grows
        # against the lagging rows, which is no attack; a few outlying positions do not move it.
        # (Not per-row residual scales: rows seen a few times have noisy ones.)
        z = r2 / (c * r2.median().clamp_min(1e-30))
        return float((z - 1.0).clamp(0.0, 3.0).mean()) * math.sqrt(n)

    def _seen_rows(self, X: Tensor, keys: Tensor) -> Tensor | None:
        """The positions whose key has a row, or None while too few of the batch's have one."""
        if self.count == 0 or X.shape[0] == 0:
            return None
        self._to(X.device)
        known = self.seen[keys]
        return known if int(known.sum()) >= max(8, X.shape[0] // 4) else None

    def agreement(self, X: Tensor, keys: Tensor) -> float | None:
        """Cosine between the centred token vectors and their ids' centred table rows (a
        correlation: blind to shifts and scale, which the other distances judge); None while
        too few of the batch's tokens have been seen."""
        known = self._seen_rows(X, keys)
        return None if known is None else centred_corr(X[known], self.table[keys[known]])

    def position_agreement(self, X: Tensor, keys: Tensor) -> float | None:
        """The mean over the batch's positions of the cosine between a token vector and its id's
        table row, each centred over the batch; None while too few of the batch's tokens have
        been seen (``tokc`` averages this one, see ``security.sentinel``)."""
        known = self._seen_rows(X, keys)
        if known is None:
            return None
        A, B = X[known], self.table[keys[known]]
        return float(torch.nn.functional.cosine_similarity(A - A.mean(0), B - B.mean(0), dim=1, eps=1e-12).mean())

    def shift(self, X: Tensor, keys: Tensor) -> float | None:
        """|mean residual| / RMS residual of the token vectors against their ids' rows."""
        known = self._seen_rows(X, keys)
        if known is None:
            return None
        R = X[known] - self.table[keys[known]]
        den = R.square().sum(1).mean().sqrt()
        if float(den) <= 0.0:
            return 0.0
        return float(R.mean(0).norm() / den)

    def lognorm_residual(self, keys: Tensor, norms: Tensor, min_hits: int = 4) -> float | None:
        """The median over the batch's positions of their log norm (``norms``, (N,)) minus their
        token's row of ``lognorm``: how large the batch's codes are *for its tokens*. A batch of
        tokens that usually carry small codes (runs of whitespace) is not small by this measure.
        Only rows that ``min_hits`` batches have updated count (a row from one or two batches is
        as noisy as the position compared with it); None while too few positions have one."""
        if self.count == 0 or keys.numel() == 0:
            return None
        self._to(keys.device)
        known = self.seen[keys] & (self.hits[keys] >= min_hits)
        if int(known.sum()) < max(8, keys.numel() // 4):
            return None
        return float((norms.reshape(-1).to(self.lognorm.device)[known] - self.lognorm[keys[known]]).median())

    def update(self, X: Tensor, keys: Tensor, weight: float = 1.0, norms: Tensor | None = None) -> None:
        """Move the rows of the batch's keys toward the batch's per-key means (and ``lognorm``
        toward the per-key mean of ``norms``, (N,) log norms of the same positions); ``weight``
        scales the step (rejected tensors move it less)."""
        if X.shape[0] == 0:
            return
        self._to(X.device)
        if norms is not None:
            X = torch.cat([X, norms.to(X.device, X.dtype).reshape(-1, 1)], dim=1)
        sums = torch.zeros(self.buckets, X.shape[1], device=X.device).index_add_(0, keys, X)
        counts = torch.bincount(keys, minlength=self.buckets)
        present = counts > 0
        means = sums[present] / counts[present].unsqueeze(1).float()
        old = self.table[present]
        if norms is not None:
            old = torch.cat([old, self.lognorm[present].unsqueeze(1)], dim=1)
        fresh = ~self.seen[present]
        a = (1 - self.beta) * weight
        new = torch.where(fresh.unsqueeze(1), means, (1 - a) * old + a * means)
        if weight < 1.0:  # a rejected tensor never creates a row, it only nudges existing ones
            new = torch.where(fresh.unsqueeze(1), old, new)
            present = present & self.seen
            new = new[~fresh]
        if norms is not None:
            self.lognorm[present] = new[:, -1]
            new = new[:, :-1]
        self.table[present] = new
        self.hits[present] += 1
        self.seen |= present
        self.count += 1
        self.last[present] = self.count

    def expected(self, ids: Tensor, direction: str, fill: Tensor) -> Tensor:
        """E[x | token] for every position of ``ids`` (B, L) -> (B, L, k); ``fill`` where unknown."""
        keys = ids.long().remainder(self.buckets)
        if direction == "grad":
            keys = torch.cat([keys[:, 1:], keys[:, -1:]], dim=1)
        self._to(ids.device)
        out = self.table[keys].clone()
        unknown = ~self.seen[keys]
        out[unknown] = fill.to(out.device)
        if direction == "grad":
            out[:, -1] = fill.to(out.device)
        return out


def context_agreement(table: TokenTable | None, ctx: TokenTable | None, X: Tensor, tok: Tensor,
                      pair: Tensor) -> float | None:
    """Correlation between what a position carries beyond its token's row, x_t − T[id_t], and
    what its token *pair* usually carries beyond it, C[pair_t] − T[id_t] (``ctx`` is an EMA
    table keyed by the token pair, ``TokenTable.pair_keys``). Honest codes depend on their
    context; codes exchanged between positions of the same token (every per-token statistic
    unchanged) lose that dependence. None while too few positions have both rows."""
    return _residual_corr(table, ctx, X, tok, pair, residual_rows=False)


def residual_agreement(table: TokenTable | None, ctx: TokenTable | None, X: Tensor, tok: Tensor,
                       key: Tensor) -> float | None:
    """Correlation between what a position carries beyond its token's row, x_t − T[id_t], and the
    EMA of that residual over the positions with the same context key (``ctx`` holds residuals,
    ``context_update``). None while too few positions have both rows."""
    return _residual_corr(table, ctx, X, tok, key, residual_rows=True)


def _residual_corr(table, ctx, X: Tensor, tok: Tensor, key: Tensor, residual_rows: bool) -> float | None:
    if table is None or ctx is None or table.count == 0 or ctx.count == 0 or X.shape[0] == 0:
        return None
    table._to(X.device)
    ctx._to(X.device)
    known = table.seen[tok] & ctx.seen[key]
    if int(known.sum()) < max(32, X.shape[0] // 8):
        return None
    base = table.table[tok[known]]
    C = ctx.table[key[known]] if residual_rows else ctx.table[key[known]] - base
    return centred_corr(X[known] - base, C)


def adjacent_agreement(table: TokenTable | None, X: Tensor, keys: Tensor) -> float | None:
    """Correlation between what neighbouring positions carry beyond their tokens' rows,
    x_t − T[id_t] and x_{t−1} − T[id_{t−1}], over the pairs of positions of a row that both have
    a row in the table (``X`` (B, L, k), ``keys`` (B, L)). Neighbours share most of their context,
    and honest activations carry it: codes moved to other positions (exchanged between
    positions of one token, permuted, blended with others) lose the agreement. It needs no
    table of contexts and follows no sender, so nothing slow can move it; None while too few
    pairs have rows."""
    if table is None or table.count == 0 or X.shape[1] < 2:
        return None
    table._to(X.device)
    keys = keys.to(X.device)
    R = X - table.table[keys]
    known = table.seen[keys]
    both = known[:, 1:] & known[:, :-1]
    if int(both.sum()) < max(32, both.numel() // 8):
        return None
    return centred_corr(R[:, 1:][both], R[:, :-1][both])


def centred_corr(A: Tensor, B: Tensor) -> float:
    """Correlation of two (N, k) sets of vectors, each centred over its N rows; 0 when either is constant."""
    A = A - A.mean(0)
    B = B - B.mean(0)
    den = (A.square().sum() * B.square().sum()).sqrt()
    if float(den) <= 0.0:
        return 0.0
    return float((A * B).sum() / den)


# The context a position's code is compared with. Activations: the previous token alone, its
# table holding the residual x − T[id] (256 rows at a byte vocabulary, each filled by a few
# positions of every microbatch); gradients: the (input token, label) pair. Each direction uses
# the key under which honest codes agree more with their context (docs/SENTINEL.md, `ctx`).


def context_keys(x: Tensor, ids: Tensor, direction: str, buckets: int) -> tuple[Tensor, Tensor, Tensor]:
    """(token vectors (N', k), their token ids (N',), their context keys (N',)); see above."""
    if direction != "act":
        return TokenTable.pair_keys(x, ids, direction, buckets)
    ids = ids.to(x.device).long()
    return x[:, 1:].reshape(-1, x.shape[-1]), ids[:, 1:].reshape(-1), ids[:, :-1].reshape(-1).remainder(buckets)


def context_score(table: TokenTable | None, ctx: TokenTable | None, X: Tensor, tok: Tensor, key: Tensor,
                  direction: str) -> float | None:
    """The agreement ``ctx`` is 1 minus (``tok``: keys of ``table``)."""
    fn = residual_agreement if direction == "act" else context_agreement
    return fn(table, ctx, X, tok, key)


def context_update(table: TokenTable | None, ctx: TokenTable, X: Tensor, tok: Tensor, key: Tensor,
                   direction: str, weight: float = 1.0) -> None:
    """Fold an accepted tensor into the context table: activations' residuals against the token
    rows (positions whose token has a row), gradients' codes."""
    if direction != "act":
        ctx.update(X, key, weight)
        return
    if table is None or table.count == 0:
        return
    table._to(X.device)
    known = table.seen[tok]
    ctx.update((X - table.table[tok])[known], key[known], weight)
