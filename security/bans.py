"""Ban list: count flags per peer, ban after enough of them, with exponential backoff.

Pure bookkeeping (time is passed in, so it is testable and the event loop owns the clock).
A verifier flag, a failed stream or a timeout is one ``record(peer, flagged=True, now)``; a good
exchange is ``record(peer, flagged=False, now)``. A peer is banned when ``flags_to_ban`` of its
last ``memory`` records are flags: an honest peer with a 1% false-positive rate almost never
collects 3 flags in 20 verdicts (probability ~1e-3 per 20), while an attacker whose every tensor
is flagged is banned on its third. The n-th ban of a peer lasts ``base_s · factor^(n-1)``
(capped at ``max_s``); a peer that stays clean for ``decay_s`` after a ban expires starts over.

Weighted flags (``record(..., weight=w)``, ``flag_weight``): a verifier flag whose score is
only just over the fence counts less toward a ban than a clear one. Rejecting a tensor and
banning its sender answer different questions: the tensor is dropped either way (so a marginal
tensor does no damage), but a ban takes a whole replica out of the stage for a minute or more,
and in real swarms honest replicas' marginal false positives come in bursts (replicas' weights
diverge between averaging rounds; the statistics move fast early in training), while an
attacker's flags are mostly clear ones.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class OneVersion:
    """Counts the marginal flags (weight < 1) of one sender version once. Tensors of one version
    were computed with the same weights, and a replica whose tensors are refused gets no gradient
    back, so it does not step and sends its next microbatches at the same version, all flagged
    alike: one piece of evidence, not several (docs/SENTINEL.md, "False flags in clean swarms").

    Bounded, since the version is the sender's word: a flag counts in full when it is clear
    (weight 1: a refused poisoner never steps either, and is banned as fast as without it), has no
    version, or starts a new version; and at most ``cap`` flags are discounted between two of the
    sender's accepted tensors (``accepted``), whatever versions they claim. So a sender that holds
    its version, or changes it every few tensors, saves at most ``cap`` marginal flags per
    accepted tensor."""

    cap: int = 4
    version: object = None
    largest: float = 0.0
    discounted: int = 0  # flags discounted since the sender's last accepted tensor

    def count(self, weight: float, version: object) -> float:
        """What a flag of ``weight`` for a tensor of ``version`` adds toward a ban."""
        if version is None or weight >= 1.0:
            return weight
        if version != self.version:
            self.version, self.largest = version, weight
            return weight
        if self.discounted >= self.cap:
            return weight
        self.discounted += 1
        extra = max(0.0, weight - self.largest)
        self.largest = max(self.largest, weight)
        return extra

    def accepted(self) -> None:
        """The sender's tensor got through: a new run of flags may be discounted again."""
        self.version, self.largest, self.discounted = None, 0.0, 0

    reset = accepted


@dataclass
class _Peer:
    recent: deque = field(default_factory=deque)  # what each of the last ``memory`` records weighs
    flags: deque = field(default_factory=deque)  # whether each of them was a flag
    until: float = 0.0  # banned while now < until
    strikes: int = 0  # bans so far (drives the backoff)
    reason: str = ""
    versions: OneVersion = field(default_factory=OneVersion)  # ``record(..., version=)``


class BanList:
    def __init__(self, flags_to_ban: int = 3, memory: int = 20, base_s: float = 60.0,
                 factor: float = 2.0, max_s: float = 3600.0, decay_s: float | None = None,
                 version_cap: int = 4):
        if flags_to_ban <= 0 or memory < flags_to_ban:
            raise ValueError(f"bans: need 0 < flags_to_ban <= memory, got {flags_to_ban}, {memory}")
        if base_s <= 0 or factor < 1 or max_s < base_s:
            raise ValueError("bans: need base_s > 0, factor >= 1, max_s >= base_s")
        if version_cap < 1:
            raise ValueError(f"bans: version_cap must be >= 1, got {version_cap}")
        self.flags_to_ban, self.memory, self.version_cap = flags_to_ban, memory, version_cap
        self.base_s, self.factor, self.max_s = base_s, factor, max_s
        self.decay_s = max_s if decay_s is None else decay_s
        self._peers: dict[str, _Peer] = {}

    def _peer(self, peer: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            p = self._peers[peer] = _Peer(recent=deque(maxlen=self.memory), flags=deque(maxlen=self.memory),
                                              versions=OneVersion(self.version_cap))
        return p

    def record(self, peer: str, flagged: bool, now: float, reason: str = "", weight: float = 1.0,
               version: object = None) -> bool:
        """Note one verdict/outcome for ``peer``; True if this record got it banned. A flag
        counts ``weight`` (in (0, 1], see ``flag_weight``); the peer is banned when the weights
        of its last ``memory`` records sum to ``flags_to_ban``.

        ``version``: the sender's optimizer version the tensor came with; the marginal flags of
        one version count once, for up to ``version_cap`` of them (``OneVersion``). Clear flags
        count in full: a refused poisoner is banned as fast as without the discount."""
        if flagged and not 0.0 < weight <= 1.0:
            raise ValueError(f"bans: a flag's weight must be in (0, 1], got {weight}")
        p = self._peer(peer)
        if now < p.until:
            return False  # already banned; its traffic should not reach us
        if p.strikes and p.until and now - p.until > self.decay_s:
            p.strikes = 0
        if flagged:
            weight = p.versions.count(weight, version)
        else:
            p.versions.accepted()
        p.recent.append(float(weight) if flagged else 0.0)
        p.flags.append(bool(flagged))
        if flagged and sum(p.recent) >= self.flags_to_ban - 1e-9:
            self.ban(peer, now, reason)
            return True
        return False

    def ban(self, peer: str, now: float, reason: str = "") -> float:
        """Ban ``peer`` now (the backoff grows with each ban); returns when it ends."""
        p = self._peer(peer)
        duration = min(self.max_s, self.base_s * self.factor ** min(p.strikes, 64))
        p.strikes += 1
        p.until = now + duration
        p.reason = reason
        p.recent.clear()
        p.flags.clear()
        p.versions.reset()
        return p.until

    def is_banned(self, peer: str, now: float) -> bool:
        p = self._peers.get(peer)
        return p is not None and now < p.until

    def banned(self, now: float) -> dict[str, float]:
        """Peers banned at ``now`` -> when their ban ends."""
        return {peer: p.until for peer, p in self._peers.items() if now < p.until}

    def strikes(self, peer: str) -> int:
        p = self._peers.get(peer)
        return 0 if p is None else p.strikes

    def reason(self, peer: str) -> str:
        p = self._peers.get(peer)
        return "" if p is None else p.reason

    def flag_rate(self, peer: str) -> float:
        """Fraction of ``peer``'s remembered verdicts that were flags (0 when none)."""
        p = self._peers.get(peer)
        return sum(p.flags) / len(p.flags) if p is not None and p.flags else 0.0

    def spare(self, peer: str, now: float) -> None:
        """End ``peer``'s ban now but keep its strike count, so a repeat ban backs off further.
        For a sender the caller cannot route around (the last replica of its stage)."""
        p = self._peers.get(peer)
        if p is not None and now < p.until:
            p.until = now

    def forgive(self, peer: str) -> None:
        """Forget everything about ``peer`` (an operator decision)."""
        self._peers.pop(peer, None)


def ban_weight(verdict, margin: float) -> float:
    """What a verdict (anything with ``accept`` and, optionally, ``score``) adds toward a ban:
    ``flag_weight`` of its score when it was rejected; an accepted one's is never counted."""
    if verdict.accept:
        return 1.0
    return flag_weight(float(getattr(verdict, "score", 0.0) or 0.0), margin)


def flag_weight(score: float, margin: float, floor: float = 0.25) -> float:
    """How much a verifier flag of ``score`` (> 1: the worst distance over its fence, ratio)
    counts toward a ban: ``(score − 1) / margin`` clipped to ``[floor, 1]``. A score of
    ``1 + margin`` or more counts fully, as does a non-finite one and a rejection by a rule
    rather than a fence (score <= 1: bad shape, replay); a barely-over-the-fence flag counts
    ``floor`` (with ``flags_to_ban`` 3 and a floor of 0.25, twelve of them in twenty verdicts: a
    sender most of whose tensors fail is still banned). ``margin`` 0: every flag counts 1 (the
    rule without weights)."""
    if margin < 0 or not 0 < floor <= 1:
        raise ValueError(f"bans: need margin >= 0 and floor in (0, 1], got {margin}, {floor}")
    if margin == 0 or not math.isfinite(score) or score <= 1.0:
        return 1.0  # a rule's rejection (bad shape, replay: score <= 1), not a fence's, counts fully
    return min(1.0, max(floor, (score - 1.0) / margin))


def verdict_score(verdict) -> float | None:
    """The score to send with a verifier's refusal (the ``score`` field of a ``reject`` and of the
    refused hop's ``bwd`` skip): ``verdict.score`` when a fence refused (score > 1 and finite: the
    worst distance over its fence, a ratio); None for a rule's refusal (bad shape, replay) or a
    verdict without a score."""
    try:
        score = float(getattr(verdict, "score", 0.0) or 0.0)
    except (TypeError, ValueError):
        return None
    return score if score > 1.0 and math.isfinite(score) else None


def refusal_weight_of(score: float | None, margin: float) -> float:
    """How much a downstream refusal counts toward banning the hop whose output was refused:
    ``flag_weight`` of the score the refusal carried, 1 when it carried none (a rule's
    rejection, a ban at the next stage, or a peer that does not send scores)."""
    return 1.0 if score is None else flag_weight(float(score), margin)
