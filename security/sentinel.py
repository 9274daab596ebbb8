"""SENTINEL: judge each boundary tensor against momentum statistics of the stage's traffic.

docs/REFERENCES.md §3. Pure PyTorch, no I/O. A pipeline stage cannot average anything, so it checks what
it receives instead: every (B, L, k) activation or activation-gradient is reduced to a few
statistics that are comparable across batches, compared with an exponential moving average
(EMA) of the same statistics, and rejected when a distance leaves an adaptive Tukey fence.
Nothing is recomputed; the cost is a few reductions, one small sort and one table lookup.

1. Robust units (``normalize``). σ = median token norm / √k; the payload is divided by σ and
   clipped to ±3. Honest gradients now and then put most of a batch's energy in a few tokens of
   one odd sequence, which moves the RMS far more than the median token norm, so RMS-based
   statistics would flag honest traffic. log σ is kept as the scale
   (gradients: log(N·σ), N = B·L, cancelling the 1/N of a mean loss so microbatch size does not
   matter), with the part the batch's tokens explain taken out once the token table can say
   (``position_lognorms``: batches of indentation carry small codes).
2. Statistics (``Stats``) of the normalised token vectors x_t ∈ R^k:
   per channel mean, mean |x|, RMS; Q quantiles of the projections y_tj = x_t·p_j on m fixed,
   seeded unit vectors p_j.
3. Distances to the reference r (``distances``), in robust units:

       l1    = mean |m(s) − m(r)|,  m = [mean, absmean, rms] (3k values)      mean-absolute
       l2    = ‖m(s) − m(r)‖₂ / √(3k)                                         normalised L2
       sign  = share of Σ|s_i r_i| on components with opposite signs, over the channel means
               and the projection medians                                     sign-flip ratio
       swd   = mean_{q,j} |quant_qj(s) − quant_qj(r)|                         sliced Wasserstein-1
       scale = |log σ(s) − log σ(r)|

   and, when the token ids are given, two against the per-token table (``TokenTable``, an EMA
   of the normalised payload per token id; gradients keyed by the *next* token, the label of
   the loss at that position):

       tok   = 1 − corr(x_t, T[id_t])     (honest: act ≈ 0.15, grad ≈ 0.45; content-free ≈ 1)
       shift = ‖mean_t (x_t − T[id_t])‖ / RMS_t ‖x_t − T[id_t]‖

   ``tok`` and ``shift`` are our addition: every other statistic is invariant to permuting the
   token vectors of a batch, so a replay under new ids, a shuffle, or noise with the honest
   mean and covariance matches the reference exactly while destroying the content. A third,
   ``tokc`` (``Sentinel._tokc``), averages a sender's ``tok`` over its own last few tensors
   (per position: 1 − the mean over positions of their cosine with their rows, each centred,
   ``TokenTable.position_agreement``; the pooled ``tok`` is ruled by a batch's loudest positions)
   and compares it with the median of the other senders' averages (at least
   ``averaged_min_others`` of them), counting only the excess beyond ``averaged_mad`` median
   absolute deviations of the averages (honest replicas differ; ``excess_over``): persistent
   half-noise that single tensors hide inside the ``tok`` fence adds up; a drift all senders
   share cancels. Three more answer an adaptive adversary that knows all of the above:

       pos   = √N · mean_t clamp(z_t − 1, 0, 3),  z_t = ‖x_t − T[id_t]‖² / (c · median_t)
               (activations: a few positions carrying other tokens' codes)
       ctx   = 1 − corr(x_t − T[id_t], what the position's context usually adds): activations
               P[id_{t−1}], an EMA of the residual by previous token; gradients
               C[pair_t] − T[id_t], C keyed by the (token, label) pair (token_table.context_keys)
               (codes exchanged between positions of one token keep every per-token statistic)
       ctxc  = the sender's ctx averaged over its own tensors minus the other senders' median
               (as tokc for tok: the exchange made on every tensor adds up)
       adj   = 1 − corr(x_t − T[id_t], x_{t−1} − T[id_{t−1}]) over neighbouring positions
               (activations: neighbours share their context; codes exchanged or blended
               with other positions' lose it), and adjc its average as tokc for tok
       cum   = max over the single-tensor distances of the sender's averaged fence ratio minus
               the other senders' median (``Sentinel._cum``: a sender riding just inside the
               fences on every tensor)
       edge  = a CUSUM of the sender's single-tensor score (its largest fence ratio) above the
               other senders' level, over its accepted tensors (``Sentinel._edge``: the same
               rider, held near the honest level), fenced at a fixed limit
4. Verdict. Each distance is divided by its fence, a Tukey fence Q3 + κ·max(IQR, 0.1·median)
   over recent distances of *accepted* tensors (per sender, median over senders: ``Sentinel``;
   with one or two voters a voter's token-table distances also by its own level, capped:
   ``Sentinel._own_table_fences``);
   score = the largest ratio; reject when > 1 and name the distance (``sentinel:tok``...).
   "Any distance out" rather than a vote, because the attacks move different distances
   (scaling only ``scale``, a shuffle only ``tok``): a vote would let every single-distance
   attack through; κ sets the false-positive rate of the union.

References, warm-up and new senders: see ``Sentinel``; the reasoning and measurements behind the
choices are in docs/SENTINEL.md.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import threading
from collections import deque

import torch
from torch import Tensor

from security.stats import (  # noqa: F401  (re-exported: the statistics are part of SENTINEL's face)
    SPREAD_FLOOR,
    Stats,
    compute_stats,
    distances,
    excess_over,
    median_stats,
    normalize,
    position_lognorms,
    projections,
    tukey_fence,
)
from security.sentinel_state import (  # noqa: F401  (re-exported: part of SENTINEL's face)
    AVERAGED,
    DIRECTIONS,
    DISTANCES,
    SINGLE,
    TABLE,
    DirectionState,
    Judgement,
    SenderRecord,
    SentinelParams,
)
from security.token_table import TokenTable, adjacent_agreement, context_keys, context_score, context_update

def payload_digest(x: Tensor) -> bytes:
    """128-bit BLAKE2b of the tensor's bytes (dtype and shape included)."""
    t = x.detach().contiguous().cpu()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


class Sentinel:
    """References, fences and verdicts for both directions of one stage; ``judge`` one payload.

    - **Per-sender momentum.** Every (sender, direction) keeps an EMA of the Stats of what it
      sends (β_act / β_grad, the paper's momentum), decayed in the direction's time: a sender
      heard from every R-th tensor gets β^R per tensor, so its EMA is as fresh as the stage's
      instead of R times staler.
    - **The reference** a tensor is judged against is the coordinate-wise median of the EMAs
      of the senders active in the last ``window`` tensors that have had ``sender_min``
      tensors accepted (``_voters``): what the majority of the replicas sends. A malicious
      minority (25-37.5% of a stage's replicas) cannot move a median, even with tensors
      subtle enough to be accepted — with a mean over all traffic instead, the
      accepted part of a subtle attack drags the reference toward itself and makes the
      honest look deviant.
    - **Fences**: each sender keeps the distances of its last ``sender_window`` accepted
      tensors; the fence of a distance is the median over active senders of their own Tukey
      fences (Q3 + κ·IQR), once three senders have ``sender_min`` values — again a minority
      cannot widen it. Before that, the Tukey fence over the direction's last ``window``
      accepted distances.
    - **New senders**: a newcomer is judged from its first tensor against the reference and
      fences of the established majority: an honest replica looks like them and is accepted,
      a malicious one is rejected and gets no vote in the median until ``sender_min`` of its
      tensors have been accepted. No per-sender warm-up, so nothing is trusted blindly after
      the stage's own warm-up.
    - **Warm-up**: the first ``warmup`` tensors of a direction are accepted unconditionally (the
      paper's honest warm-up); a distance counts once there are enough values to fence with.
    - **Learning from rejections**: see ``_learn`` (bounded pulls; the shift mode that keeps an
      abrupt honest change from locking every sender out).
    - **Replays**: an exact copy of a payload seen in the last ``replay_window`` tensors of the
      direction is rejected as ``replay`` unless it carries the same microbatch id (a
      retransmission); a replay with a little noise added is left to ``tok``.

    ``judge`` holds an internal lock, so it is safe from several threads (calls are serialised).
    """

    def __init__(self, params: SentinelParams | None = None):
        self.params = params or SentinelParams()
        self._dirs = {d: DirectionState(self.params) for d in DIRECTIONS}
        self._proj: dict[tuple[int, str], Tensor] = {}
        self._gen = torch.Generator().manual_seed(self.params.seed ^ 0x5E17)
        self._lock = threading.Lock()

    def _projections(self, k: int, device: torch.device) -> Tensor:
        key = (k, str(device))
        if key not in self._proj:
            self._proj[key] = projections(k, self.params.n_projections, self.params.seed).to(device)
        return self._proj[key]

    def _active(self, state: DirectionState) -> list[SenderRecord]:
        horizon = state.seen - self.params.window
        return [rec for rec in state.senders.values() if rec.last >= horizon]

    def _voters(self, state: DirectionState) -> list[SenderRecord]:
        """The active senders that have had at least ``sender_min`` tensors accepted (all the
        active ones if none has). A newcomer votes in the reference only once it has earned it:
        otherwise a rejected newcomer's first tensor would become a vote at once, and with two
        honest replicas of a stage, one attacker would pick the median."""
        active = self._active(state)
        established = [rec for rec in active if rec.seen - rec.rejected >= self.params.sender_min]
        return established or active

    def _reference(self, state: DirectionState, sender: str | None = None) -> Stats | None:
        """Coordinate-wise median of the EMAs of the voting senders (``_voters``: active in the
        last ``window`` tensors and established): what the majority of the replicas sends,
        whatever a minority does.

        With fewer than three voters there is no majority, and an established voter is judged
        against its *own* EMA (``sender`` given; the paper's per-sender reference). The median
        of two is one of them per coordinate (the lower middle): a replica was judged against the
        other wherever the other's statistic was lower, so of two honest replicas whose outputs
        drift apart (own data, own step count, averaging only a slice) the one that moved up
        was flagged (tests/test_sentinel.py has such a drifting replica). A newcomer is still judged against the voters (it has no history to trust yet),
        so one cannot join a stage of one or two replicas with garbage. What two replicas cannot
        tell is which of them drifted (as with ``tokc``), so an established replica that changes
        slowly is followed and one that jumps is rejected until its EMA catches up."""
        voters = self._voters(state)
        rec = self._alone_with(voters, state, sender)
        if rec is not None:
            return rec.ema
        if state.ref_version != state.seen:
            state.ref = median_stats([rec.ema for rec in voters]) if voters else None
            state.ref_version = state.seen
        return state.ref

    def _partners(self, state: DirectionState, sender: str | None) -> list[Stats]:
        """With fewer than three voters, the EMAs of the *other* voters, for an established voter
        (judged against its own EMA, ``_reference``): its tensor also passes if it is within the
        fences of what a partner replica sends now. Of two honest replicas that a stage-wide move
        reaches a few seconds apart, the second is judged against its own, not yet moved, EMA,
        though it sends what its partner already sent. This admits nothing that does not look like an established replica's
        current output (and a newcomer, judged against the voters, gets no partner)."""
        voters = self._voters(state)
        rec = self._alone_with(voters, state, sender)
        return [] if rec is None else [v.ema for v in voters if v is not rec]

    @staticmethod
    def _alone_with(voters: list[SenderRecord], state: DirectionState, sender: str | None) -> SenderRecord | None:
        """``sender``'s record if it is one of fewer than three voters (no majority: it is judged
        against its own EMA, with its partner's as the second opinion), else None."""
        if sender is None or len(voters) >= 3:
            return None
        rec = state.senders.get(sender)
        return rec if any(v is rec for v in voters) else None

    @staticmethod
    def _over(d: dict[str, float], fences: dict[str, float]) -> dict[str, float]:
        """Every distance of ``d`` over its fence: name -> distance/fence (inf for a non-finite
        distance), largest first."""
        out = {}
        for name, value in d.items():
            fence = fences.get(name, math.inf)
            if math.isinf(fence):
                continue
            ratio = math.inf if not math.isfinite(value) else (
                value / fence if fence > 0 else (0.0 if value <= 0 else math.inf))
            if ratio > 1.0:
                out[name] = ratio
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @staticmethod
    def _score(d: dict[str, float], fences: dict[str, float]) -> tuple[float, str | None]:
        """The worst distance over its fence, as a ratio (inf for a non-finite distance), and its name."""
        score, worst = 0.0, None
        for name, value in d.items():
            fence = fences[name]
            if math.isinf(fence):
                continue
            ratio = value / fence if fence > 0 else (0.0 if value <= 0 else math.inf)
            if not math.isfinite(value) or ratio > score:
                score, worst = (math.inf if not math.isfinite(value) else ratio), name
        return score, worst

    def _fences(self, state: DirectionState) -> dict[str, float]:
        """Per distance: the median over active senders of their own Tukey fences (each over its
        last ``sender_window`` accepted distances), once three senders have enough; before that
        the Tukey fence over the direction's last ``window`` accepted distances."""
        p = self.params
        need = max(p.min_window, p.warmup // 2)
        active = [rec for rec in self._active(state)]
        out = {}
        for name in DISTANCES:
            if name == "edge":  # a sum with its own fixed limit (``_edge``), not a distance with a spread
                out[name] = p.edge_limit
                continue
            floor = SPREAD_FLOOR.get(name, 0.0)
            own = [tukey_fence(rec.windows[name], p.kappa, p.iqr_floor, floor) for rec in active
                   if len(rec.windows[name]) >= p.sender_min]
            if len(own) >= 3:
                out[name] = statistics.median(own)
            elif len(state.windows[name]) >= need:
                out[name] = tukey_fence(state.windows[name], p.kappa, p.iqr_floor, floor)
            else:
                out[name] = math.inf
        return out

    def _own_table_fences(self, state: DirectionState, sender: str | None, fences: dict[str, float]) -> dict[str, float]:
        """With one or two voters, an established voter's token-table distances (``TABLE``) are
        fenced by the larger of the direction's fence and the voter's own (Tukey over its last
        ``sender_window`` accepted values), the latter at most ``own_fence_cap`` times the former.

        With one or two voters each is judged against its own EMA (``_reference``), except for
        these: they measure a tensor against tables every sender feeds, which hold more of the
        busier replica's traffic, and whose fence (the direction's window) is mostly that
        replica's values. The look-ahead makes a replica's output depend on its own pace, so the
        faster replica's tensors can lie outside a fence drawn mostly from the other's. A newcomer, and any sender once three
        voters are active (the median of their own fences is the fence then), keeps the
        direction's fence; the cap bounds what a replica can gain by moving its own level."""
        p = self.params
        voters = self._voters(state)
        rec = state.senders.get(sender) if sender is not None else None
        if len(voters) >= 3 or rec is None or not any(v is rec for v in voters):
            return fences
        out = dict(fences)
        for name in TABLE:
            window = rec.windows[name]
            if len(window) >= p.sender_min and math.isfinite(fences[name]):
                own = tukey_fence(window, p.kappa, p.iqr_floor, SPREAD_FLOOR.get(name, 0.0))
                out[name] = max(fences[name], min(own, p.own_fence_cap * fences[name]))
        return out

    # -- queries -----------------------------------------------------------------------------

    def forget(self, sender: str) -> None:
        """Drop a sender's record (it left, or was banned): it no longer votes in the reference."""
        with self._lock:
            for state in self._dirs.values():
                if state.senders.pop(sender, None) is not None:
                    state.ref_version = -1

    def fences(self, direction: str) -> dict[str, float]:
        """The current fence of each distance (inf while there is too little to fence with)."""
        with self._lock:
            return self._fences(self._dirs[direction])

    def peer_report(self, direction: str) -> dict[str, dict]:
        """Per sender: tensors seen, rejected, and the distances of its EMA to the reference."""
        with self._lock:
            state = self._dirs[direction]
            ref = self._reference(state)
            return {
                name: {"seen": rec.seen, "rejected": rec.rejected,
                       "distances": distances(rec.ema, ref) if ref is not None else {}}
                for name, rec in state.senders.items()
            }

    def reference_tensor(self, direction: str, ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor | None:
        """The stage's expected payload for ``ids`` (B, L): E[x | token] from the table, at the
        reference scale (the reference channel means where a token is unknown). A stand-in for a
        rejected gradient if the operator wants one; None before references exist."""
        with self._lock:
            state = self._dirs[direction]
            ref = self._reference(state)
            if state.table is None or ref is None:
                return None
            sigma = math.exp(float(ref.scale)) / (ids.numel() if direction == "grad" else 1)
            return (state.table.expected(ids, direction, ref.mean) * sigma).to(dtype)

    # -- the verdict -------------------------------------------------------------------------

    def judge(self, sender: str, direction: str, x: Tensor, ids: Tensor | None = None,
              mb: object = None, commit: bool = True) -> Judgement:
        """Judge a well-formed (B, L, k) payload (shape/dtype/finite checks are the caller's);
        ``ids`` (B, L) token ids enable ``tok``/``shift``; ``mb`` the microbatch id.
        ``commit=False`` judges without learning anything from the tensor (diagnostics)."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        with self._lock, torch.no_grad():
            return self._judge(sender, direction, x, ids, mb, commit)

    def _judge(self, sender, direction, x, ids, mb, commit) -> Judgement:
        p = self.params
        state = self._dirs[direction]

        if p.replay_window:
            digest = payload_digest(x)
            if digest in state.hashes:
                if mb is not None and state.hashes[digest] == mb:
                    return Judgement(True, None, 0.0, {}, "retransmit")
                if commit and sender in state.senders:
                    state.senders[sender].rejected += 1
                return Judgement(False, "replay", math.inf, {}, "replay")
            if commit:
                state.hashes[digest] = mb
                while len(state.hashes) > p.replay_window:
                    state.hashes.popitem(last=False)

        k = x.shape[-1]
        X = x.detach().float().reshape(-1, k)
        norms = X.norm(dim=1)
        Xn, log_scale = normalize(X, direction == "grad", p.clip, norms)
        s = compute_stats(Xn, log_scale, self._projections(k, Xn.device), p.n_quantiles, p.max_tokens, self._gen)
        tX = tkeys = tnorms = residual = ratio_ema = edge_next = None
        raw_scale = float(s.scale)
        if ids is not None:
            tX, tkeys = TokenTable.keys(Xn.view(x.shape), ids, direction, p.token_buckets)
            lognorms = position_lognorms(norms, k, direction == "grad").view(*x.shape[:-1], 1)
            tnorms = TokenTable.keys(lognorms, ids, direction, p.token_buckets)[0]
            if state.table is not None and state.table.k == k:
                residual = state.table.lognorm_residual(tkeys, tnorms)
                if residual is not None and state.scale_offset is not None:
                    s.scale = torch.tensor(residual + state.scale_offset)  # ``position_lognorms``
        ref = self._reference(state, sender)
        d = distances(s, ref) if ref is not None else {}
        averaged: dict[str, float] = {}
        cX = ctok = cpair = None
        if ids is not None:
            cX, ctok, cpair = context_keys(Xn.view(x.shape), ids, direction, p.ctx_buckets)
            ctok = ctok.remainder(p.token_buckets)
            if state.table is not None and state.table.k == k:
                for name, value in (("tok", state.table.agreement(tX, tkeys)), ("shift", state.table.shift(tX, tkeys)),
                                    ("pos", state.table.outliers(tX, tkeys, p.pos_c) if direction == "act" else None),
                                    ("ctx", context_score(state.table, state.ctx, cX, ctok, cpair, direction)),
                                    ("adj", adjacent_agreement(state.table, Xn.view(x.shape), tkeys.view(x.shape[:-1]))
                                     if direction == "act" else None)):
                    if value is not None:
                        d[name] = 1.0 - value if name in ("tok", "ctx", "adj") else value
            # tokc averages the per-position agreement, not the pooled one ``tok`` judges: pooled,
            # the few positions with large codes rule it, and noise on the others hides there
            # (``TokenTable.position_agreement``); a single tensor is judged pooled, where an
            # edit of a few positions shows most
            pa = state.table.position_agreement(tX, tkeys) if "tok" in d else None
            for name in AVERAGED:
                if name in d:
                    value = 1.0 - pa if name == "tok" and pa is not None else d[name]
                    d[name + "c"], averaged[name] = self._tokc(state, sender, name, value)

        basis, score, worst, over = "warmup", 0.0, None, {}
        if state.accepted >= p.warmup:
            basis = "reference"
            fences = self._own_table_fences(state, sender, self._fences(state))
            cum, ratio_ema = self._cum(state, sender, d, fences)
            if cum is not None:
                d["cum"] = cum
            edge, edge_next = self._edge(state, sender, d, fences)
            if edge is not None:
                d["edge"] = edge
            for name in p.off:
                d.pop(name, None)
            score, worst = self._score(d, fences)
            if score > 1.0:
                for partner in self._partners(state, sender):
                    alt = {**d, **distances(s, partner)}  # the token-table distances do not depend on it
                    alt_score, alt_worst = self._score(alt, fences)
                    if alt_score <= 1.0 and alt_score < score:
                        score, worst, d, basis = alt_score, alt_worst, alt, "partner"
            over = self._over(d, fences)
        accept = score <= 1.0
        if not accept and self._shifted(state, sender) and score <= p.shift_reach:
            # most recent tensors leave the fences: the stage's honest distribution has moved
            # (see _learn); a moderate deviation is accepted and followed, not held against anyone
            accept, basis = True, "shift"
        verdict = Judgement(accept, None if accept else f"sentinel:{worst}", score, d, basis, over)
        if commit:
            self._learn(state, sender, direction, s, d, tX, tkeys, accept, score, basis, averaged, tnorms,
                        None if residual is None else raw_scale - residual)
            if ratio_ema is not None:
                state.senders[sender].ratio_ema = ratio_ema
            if edge_next is not None:
                rec = state.senders[sender]
                rec.score_ema, total = edge_next
                if total is not None and accept and basis != "shift":
                    # a dropped tensor does no harm; a stage-wide move lifts every sender's score
                    rec.edge = total
            if cX is not None and accept:
                table_weight = p.reject_weight if basis == "shift" else 1.0
                if state.ctx is None or state.ctx.k != k:
                    state.ctx = TokenTable(p.ctx_buckets, k, p.beta_tok)
                context_update(state.table, state.ctx, cX, ctok, cpair, direction, table_weight)
        return verdict

    def _cum(self, state: DirectionState, sender: str, d: dict[str, float],
             fences: dict[str, float]) -> tuple[float | None, dict | None]:
        """(cum, the sender's updated ratio EMAs). Per single-tensor distance, the sender's fence
        ratio (distance / fence, capped at 1: a rejected tensor is dropped anyway and must not
        haunt an honest sender's average) averaged over its own tensors (EMA ``beta_ratio``,
        rejected ones included, a newcomer starting from the others' median); cum = the largest
        excess of these averages over the median of the other voters' averages beyond
        ``averaged_mad`` MADs (``excess_over``, as ``tokc``), floored at 0: honest replicas
        differ here too. An attacker that stays just inside the
        fences on every tensor (the white-box fence rider) sits near 1 on its chosen distance
        while honest senders average well below; a change every honest sender shares moves the
        median with it. Judged, like ``tokc``,
        only against at least ``averaged_min_others`` other voters."""
        rec = state.senders.get(sender)
        others = [r.ratio_ema for r in self._voters(state) if r.ratio_ema is not None and r is not rec]
        prev = rec.ratio_ema if rec is not None and rec.ratio_ema is not None else {}
        b = self.params.beta_ratio
        ema, cum = {}, 0.0
        for name in SINGLE:
            if name in self.params.off:
                continue
            fence = fences.get(name, math.inf)
            if name not in d or not math.isfinite(fence) or fence <= 0 or not math.isfinite(d[name]):
                if name in prev:
                    ema[name] = prev[name]
                continue
            ratio = min(1.0, d[name] / fence)
            vals = [o[name] for o in others if name in o]
            med = statistics.median(vals) if self._others_enough(vals) else None
            start = prev.get(name, med)
            ema[name] = ratio if start is None else b * start + (1 - b) * ratio
            if med is not None:
                cum = max(cum, excess_over(ema[name], vals, self.params.averaged_mad))
        if not self._others_enough(others):
            return None, ema
        return cum, ema

    def _others_enough(self, others: list) -> bool:
        """Whether a sender is judged against the other voters' averages (``tokc``, ``ctxc``,
        ``adjc``, ``cum``, ``edge``): only with at least ``averaged_min_others`` of them (the
        reason: ``_tokc``)."""
        return len(others) >= self.params.averaged_min_others

    def _edge(self, state: DirectionState, sender: str, d: dict[str, float],
              fences: dict[str, float]) -> tuple[float | None, tuple[float, float | None] | None]:
        """(edge, (the sender's updated score EMA, its updated sum or None)). The tensor's
        single-tensor score (its largest fence ratio over ``SINGLE``, capped at 1) minus the
        other voters' level (the median of their score EMAs, ``beta_edge``) minus ``edge_allow``,
        at most ``edge_step``, added to the sender's sum, which never drops below 0 (a CUSUM
        test); edge is that sum, fenced at ``edge_limit``.

        An attacker that knows the fences sends, on every tensor, the most harmful edit that
        stays just inside them (the white-box rider): its score sits at its chosen margin on
        every tensor, while honest tensors score lower and vary, so no single tensor tells it
        apart and the sum does within a few. Against
        the sum the rider can only keep its score near the honest level on average, and its
        harm grows with how far above its own honest tensor's score it may go (about
        sqrt(m^2 - s0^2) for a margin m: docs/SENTINEL.md, "Harm"). It is the score and not
        each distance's ratio that is summed because the distance the rider binds on changes
        from tensor to tensor (tok, ctx, adj, swd...): per-distance sums in each ratio's own
        spread either never bound it or, with a lagging level, flagged honest senders while
        training raised their ratios (docs/experiments/2026-12-07-sentinel-edge.md). The
        level is the other voters' *fast* average, so a rise every sender shares moves it
        within a tensor or two; ``edge_step`` keeps one honest outlier from filling the sum.

        Only accepted tensors add to the sum (a dropped tensor does no harm, and an honest
        sender refused for another reason must not pile up a debt), and shift-accepted ones
        do not (a stage-wide move lifts every sender's score). Only against at least
        ``averaged_min_others`` other voters, like ``tokc`` and ``cum``."""
        p = self.params
        rec = state.senders.get(sender)
        ratios = [d[n] / fences[n] if math.isfinite(d[n]) else math.inf for n in SINGLE
                  if n in d and n not in p.off and 0 < fences.get(n, math.inf) < math.inf]
        if not ratios:
            return None, None
        single = min(1.0, max(ratios))
        prev = rec.score_ema if rec is not None else None
        ema = single if prev is None else p.beta_edge * prev + (1 - p.beta_edge) * single
        others = [r.score_ema for r in self._voters(state) if r.score_ema is not None and r is not rec]
        if not self._others_enough(others):
            return None, (ema, None)
        step = min(single - statistics.median(others) - p.edge_allow, p.edge_step)
        total = max(0.0, (rec.edge if rec is not None else 0.0) + step)
        return total, (ema, total)

    def _tokc(self, state: DirectionState, sender: str, name: str, value: float) -> tuple[float, float]:
        """(tokc, the sender's updated tok EMA) for ``name`` = "tok"; the same for "ctx"
        (``ctxc``: codes exchanged between positions of one token on every tensor lift ``ctx``
        by less than a single tensor's fence lets through, but the average of a few lies many
        honest spreads above the other senders'). tokc: how far the sender's ``tok`` distance,
        averaged over its own last few tensors (rejected ones included, EMA ``beta_cum``), lies
        above the median of the voters' averages, beyond ``averaged_mad`` MADs of them
        (``excess_over``). A persistent small shift that single tensors
        hide inside the ``tok`` fence (norm-matched noise on gradients) adds up in the average;
        a drift every honest sender shares moves the median with it, so it is not flagged and
        cannot trip shift mode. A newcomer's average starts from the voters' median.

        Only against at least ``averaged_min_others`` (5) other voters. With one, the "median"
        is that one sender, and of two replicas that differ neither can be told to be the odd
        one. Two honest replicas always differ (own data, own progress, averaging only a slice),
        and the one with fewer steps has the higher ``tok`` (the token table follows the busier
        one's traffic). With two others, their spread is one difference (the MAD of two values is
        half of it), so a third honest replica that lies further from two that happen to agree is
        flagged; with three others, one deviation from their median is always 0. In clean real
        swarms of two, three and four body replicas these checks flagged and banned honest
        replicas (docs/experiments/2026-12-07-sentinel-measurements.md). So with up to five
        replicas of a stage they are not judged; the single-tensor distances, ``tok``
        included, still are. The harm part, whose eight senders have seven others each, is where
        they are measured against attacks."""
        p = self.params
        rec = state.senders.get(sender)
        others = [r.averaged[name] for r in self._voters(state) if name in r.averaged and r is not rec]
        med = statistics.median(others) if self._others_enough(others) else None
        prev = rec.averaged.get(name, med) if rec is not None else med
        ema = value if prev is None else p.beta_cum * prev + (1 - p.beta_cum) * value
        return (0.0 if med is None else excess_over(ema, others, p.averaged_mad)), ema

    def _shifted(self, state: DirectionState, sender: str | None = None) -> bool:
        """At least 80% of the senders heard from in the last ``shift_horizon`` tensors (and at
        least three) sent their latest tensor outside the fences: more than a malicious minority
        of replicas (up to 37.5%, plus an honest false positive or two) can cause, so the honest
        distribution itself has moved. Counted in senders, not tensors, so attackers cannot
        trigger it by sending more; they can by outnumbering the honest replicas (Sybils), which
        SENTINEL does not defend against anyway.

        With fewer than three senders (one or two replicas upstream) every one of them must be
        out. There is no majority to appeal to then, and without this an honest lone replica
        whose statistics move faster than its fences (early training) has every tensor dropped
        until the stage stalls. Only voters
        count (``_voters``), so a rejected newcomer cannot trigger it; what a lone attacker gains
        is deviations up to ``shift_reach`` fences, and a lone replica can stall its stage
        anyway.

        Another voter counts as out if its latest tensor is, or one of its tensors among the
        direction's last ``shift_memory`` was: a move that reaches two replicas a little apart is
        a move of the stage whichever showed it first. Counting latest tensors only, the first to
        move is refused (its partner not yet out), the second is then excused (the first out) and, once
        accepted, steps and comes back inside, while the first, refused, gets no gradient, cannot
        step, and sends its next outputs out again, now with its partner inside. What this adds for an
        attacker is a few tensors after each honest tensor out, as the latest-tensor rule already
        gave one."""
        p = self.params
        horizon = state.seen - p.shift_horizon
        voters = [rec for rec in self._voters(state) if rec.last >= horizon]
        current = state.senders.get(sender) if sender is not None else None
        if current is not None and not any(rec is current for rec in voters):
            current = None  # a newcomer (no vote) cannot help call a shift
        # ``sender``'s tensor now being judged is out (the caller asks only then) and counts as
        # its latest: of two replicas that an upstream move reaches one after the other, the
        # second is excused at its first tensor out, not its second. Only beside other voters:
        # a lone sender still needs two tensors out in a row. The others: out lately (``shift_memory``).
        recent = state.seen - p.shift_memory

        def out(rec: SenderRecord) -> bool:
            if rec is current:
                return len(voters) >= 2 or rec.out
            return rec.out or rec.out_at >= recent

        active = [out(rec) for rec in voters]
        if len(active) < 3 and len(active) < len(self._active(state)):
            return False  # some sender is not (yet) a voter: no verdict on a stage-wide shift
        return len(active) >= 1 and sum(active) >= math.ceil(0.8 * len(active))

    def _record(self, state: DirectionState, sender: str, s: Stats) -> SenderRecord:
        rec = state.senders.get(sender)
        if rec is None:
            rec = SenderRecord(ema=s.clone(), windows={
                name: deque(maxlen=self.params.sender_window) for name in DISTANCES})
            state.senders[sender] = rec
            while len(state.senders) > self.params.max_senders:
                state.senders.popitem(last=False)
        else:
            state.senders.move_to_end(sender)
        return rec

    def _learn(self, state, sender, direction, s, d, tX, tkeys, accept, score, basis, averaged,
               tnorms=None, offset=None) -> None:
        """Fold a judged tensor in.

        A rejected tensor moves its sender's EMA (one vote in the reference) at ``reject_weight``
        of the rate and only as if it sat on the fence, (s − r)/score, so garbage (zeros: log
        scale −80) cannot drag it; it does not touch the token table.
        When most active senders' latest tensors leave their fences (``_shifted``) — more than a
        minority of malicious replicas can cause — the stage's honest distribution has moved (a
        learning-rate change, a block unlocked by the architecture warm-up, steady drift faster
        than the fences): deviations up to ``shift_reach`` fences are then accepted (basis
        ``shift``) and the senders' EMAs follow them at the full rate (the token table only at
        ``reject_weight``), so the references catch up instead of every honest sender being
        rejected and banned. Shift-accepted distances do not enter the fence windows.
        """
        p = self.params
        weight = 1.0 if accept else p.reject_weight
        # the table learns only from accepted tensors (shift-accepted ones slowly): a rejected
        # negation would shrink its rows toward zero and make every honest residual look biased
        table_weight = 0.0 if not accept else (p.reject_weight if basis == "shift" else 1.0)
        new = sender not in state.senders
        rec = self._record(state, sender, s)
        if not new:
            # decay in the direction's time: a sender heard from every R-th tensor keeps an EMA
            # as fresh as the stage's, not R times staler
            gap = max(1, state.seen - rec.last)
            a = (1 - p.beta(direction) ** gap) * weight
            target = s
            if not accept:
                shrink = min(1.0, 1.0 / score) if math.isfinite(score) else 0.0
                target = Stats(*(getattr(rec.ema, f) + (getattr(s, f) - getattr(rec.ema, f)) * shrink
                                 for f in Stats.FIELDS))
            rec.ema.ema_(target, 1 - a)
        rec.averaged.update(averaged)  # computed with tokc / ctxc in judge
        rec.last = state.seen
        rec.seen += 1
        rec.rejected += not accept
        state.seen += 1
        if tX is not None and table_weight > 0:
            if state.table is None or state.table.k != tX.shape[-1]:
                state.table = TokenTable(p.token_buckets, tX.shape[-1], p.beta_tok)
            state.table.update(tX, tkeys, table_weight, norms=tnorms)
            if offset is not None:  # log scale minus the residual scale (``position_lognorms``)
                a = (1 - p.beta_tok) * table_weight
                state.scale_offset = offset if state.scale_offset is None else (1 - a) * state.scale_offset + a * offset
        if basis in ("reference", "shift") and score > 1.0:
            rec.out_at = rec.last
        if accept and basis != "shift":
            state.accepted += 1
            for name, value in d.items():
                if math.isfinite(value):
                    state.windows[name].append(value)
                    rec.windows[name].append(value)
