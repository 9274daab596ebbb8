"""Routing: which replica of the next stage gets a microbatch, and which peers to avoid for now.

Pure bookkeeping (no I/O, no asyncio), so every rule is a unit test.

Candidates are the peers the DHT says are ``online`` in the wanted stage, minus banned ones and
minus ourselves. Each gets an expected wait::

    score = (queue + outstanding + 1) / capacity

``queue`` is the peer's compute queue as it last told us (acks carry it, announcements too),
``outstanding`` the microbatches we sent it whose gradient has not come back yet, ``capacity``
its announced tokens per second of compute-busy time (what it can do), or its announced
throughput where its record has no capacity field (an older peer). A replica that has not
measured its capacity yet (it just joined: 0) gets the median of its stage, so it is treated as
an average one rather than starved or flooded. The lowest score wins; ties are broken at random
so equal replicas share the load.

Capacity, not throughput (tokens trained per wall second): throughput is what a replica *got*,
so weighing by it fed back on itself. Of two equal replicas, the one that happened to get more
work announced more, was sent more, and the split stayed where chance had put it (in a clean
3-stage loopback swarm the two body replicas ended at 226 and 74 optimizer steps; tests/
test_routing.py reproduces the drift in a closed loop). A replica that computes twice as fast
still gets twice the work.

A capacity counts for at most ``MAX_CAPACITY_OVER_TYPICAL`` times the stage's typical one (the
lower median of its replicas' announcements): the claim is the replica's own, and a replica that
announced a thousandfold capacity would otherwise draw nearly all of a stage's microbatches and
hold them until it is banned for timing out. An honest replica up to that many times faster than
the typical one is weighed as it says.

Failures ban a peer with exponential backoff: ``base · 2^(strikes-1)`` seconds, capped at
``max_ban``. A success clears the strikes; a fresh DHT announcement from the peer (its own
timestamp newer than when it failed: it restarted, or the network healed) lifts the ban early. Bans for cause (the verifier flagged the peer,
it speaks another run) use an explicit duration.
"""

from __future__ import annotations

import collections
import random
import statistics
import threading
import time
from dataclasses import dataclass, field


class CapacityMeter:
    """A replica's capacity: tokens per second of compute-busy time over its last ``intervals``
    backwards, however long ago (so a replica that was sent nothing for a while still announces
    what it can do). Fed ``record(tokens so far, busy seconds so far)`` at each backward; 0.0
    until there are two intervals to measure. Thread-safe (the compute thread records, the event
    loop reads)."""

    def __init__(self, intervals: int = 32):
        if intervals < 2:
            raise ValueError(f"CapacityMeter: need at least 2 intervals, got {intervals}")
        self._points: collections.deque = collections.deque(maxlen=intervals + 1)
        self._lock = threading.Lock()

    def record(self, tokens_total: float, busy_s: float) -> None:
        with self._lock:
            self._points.append((float(tokens_total), float(busy_s)))

    def tokens_per_s(self) -> float:
        with self._lock:
            if len(self._points) < 3:
                return 0.0
            (tok0, busy0), (tok1, busy1) = self._points[0], self._points[-1]
        busy = busy1 - busy0
        return (tok1 - tok0) / busy if busy > 0 else 0.0


MAX_CAPACITY_OVER_TYPICAL = 4.0  # the most a replica's announced capacity counts, in stage medians


def announced_rate(rec) -> float:
    """What a replica is weighed by (by routers and ``--stage auto``): its announced capacity (0
    while it has not measured one); its throughput if its record has no capacity field (an older
    peer). ``rec``: a ``PeerState`` or a ``membership.PeerRecord``."""
    return rec.throughput if rec.capacity is None else rec.capacity


@dataclass
class PeerState:
    peer_id: str
    stage: int
    state: str = "online"
    throughput: float = 0.0
    capacity: float | None = None  # announced tokens per busy second; 0: not measured yet; None: no field
    queue: int = 0
    version: int = 0
    epoch: int | None = None  # its announced morph epoch (None: not announced)
    maddrs: list[str] = field(default_factory=list)
    outstanding: int = 0  # our microbatches at this peer, gradient not back yet
    rtt_ema: float | None = None  # seconds for an ack
    strikes: int = 0
    banned_until: float = 0.0
    ban_cause: str = ""
    in_dht: bool = True
    announced: float = 0.0  # the peer's own timestamp on its latest DHT record
    ban_announced: float = 0.0  # that timestamp when we banned it for being unreachable
    cool: int = 0  # choices of its stage to sit out (``Router.cool``)
    cool_until: float = 0.0  # ... at most until then


class Router:
    """Per-node view of the other peers: stages, load, bans."""

    def __init__(self, self_peer: str = "", *, ban_base: float = 2.0, max_ban: float = 120.0,
                 rng: random.Random | None = None, clock=time.monotonic):
        self.self_peer = self_peer
        self.ban_base, self.max_ban = ban_base, max_ban
        self.rng = rng or random.Random()
        self.clock = clock
        self.peers: dict[str, PeerState] = {}
        self.bans_total: dict[str, int] = {}

    # ---- membership

    def update(self, records) -> None:
        """Replace the DHT view with ``records`` (``membership.PeerRecord``-like objects). Local
        measurements and bans of peers still present are kept; a banned peer that left the DHT
        is remembered until its ban ends."""
        seen = set()
        for r in records:
            if r.peer_id == self.self_peer:
                continue
            seen.add(r.peer_id)
            p = self.peers.get(r.peer_id)
            if p is None:
                p = self.peers[r.peer_id] = PeerState(r.peer_id, r.stage)
            if p.stage != r.stage:  # it changed stage: old local load figures mean nothing
                p.outstanding, p.rtt_ema = 0, None
            p.stage, p.state, p.throughput = r.stage, r.state, float(r.throughput)
            cap = getattr(r, "capacity", None)
            p.capacity = None if cap is None else float(cap)
            p.queue, p.version, p.maddrs, p.in_dht = int(r.queue), int(r.version), list(r.maddrs), True
            epoch = getattr(r, "epoch", None)
            p.epoch = None if epoch is None else int(epoch)
            p.announced = float(getattr(r, "time", 0.0))
            if p.ban_cause == "unreachable" and p.announced > p.ban_announced and p.banned_until > self.clock():
                # it re-announced itself after we found it unreachable (restarted, or the network
                # healed): give it another chance now rather than at the end of its backoff
                p.banned_until = 0.0
        now = self.clock()
        for pid in list(self.peers):
            if pid not in seen:
                p = self.peers[pid]
                if p.banned_until > now:
                    p.in_dht = False
                else:
                    del self.peers[pid]

    def stage_peers(self, stage: int, include_banned: bool = False) -> list[PeerState]:
        now = self.clock()
        return [
            p for p in self.peers.values()
            if p.stage == stage and p.in_dht and p.state == "online"
            and (include_banned or p.banned_until <= now)
        ]

    def count_by_stage(self, n_stages: int) -> list[int]:
        """Online peers per stage as seen in the DHT (ourselves not included)."""
        out = [0] * n_stages
        for p in self.peers.values():
            if p.in_dht and p.state == "online" and 0 <= p.stage < n_stages:
                out[p.stage] += 1
        return out

    # ---- choice

    def score(self, p: PeerState, typical: float) -> float:
        capacity = min(announced_rate(p) or typical, MAX_CAPACITY_OVER_TYPICAL * typical)
        return (p.queue + p.outstanding + 1) / max(capacity, 1e-9)

    def choose(self, stage: int, exclude=()) -> str | None:
        """The replica of ``stage`` with the shortest expected wait, or None if there is none.
        Replicas cooling down after a refusal (``cool``) are passed over while another one is
        available, each such choice counting down their cool-down."""
        cands = [p for p in self.stage_peers(stage) if p.peer_id not in exclude]
        if not cands:
            return None
        now = self.clock()
        cooling = [p for p in cands if p.cool > 0 and p.cool_until > now]
        if cooling and len(cooling) < len(cands):
            for p in cooling:
                p.cool -= 1
            cands = [p for p in cands if not any(p is c for c in cooling)]
        rates = [r for r in map(announced_rate, self.stage_peers(stage, include_banned=True)) if r > 0]
        typical = statistics.median_low(rates) if rates else 1.0
        scored = [(self.score(p, typical), self.rng.random(), p.peer_id) for p in cands]
        return min(scored)[2]

    # ---- outcomes

    def _get(self, peer: str) -> PeerState | None:
        return self.peers.get(peer)

    def on_sent(self, peer: str) -> None:
        p = self._get(peer)
        if p is not None:
            p.outstanding += 1

    def on_done(self, peer: str) -> None:
        """A microbatch we sent ``peer`` came back (or was given up)."""
        p = self._get(peer)
        if p is not None and p.outstanding > 0:
            p.outstanding -= 1

    def on_ack(self, peer: str, rtt: float, queue: int | None = None) -> None:
        p = self._get(peer)
        if p is None:
            return
        p.strikes = 0
        p.rtt_ema = rtt if p.rtt_ema is None else 0.8 * p.rtt_ema + 0.2 * rtt
        if queue is not None:
            p.queue = int(queue)

    def cool(self, peer: str, choices: int, seconds: float = 10.0) -> None:
        """The next stage refused ``peer``'s output: pass it over for the next ``choices`` choices
        of its stage where another replica is available (for at most ``seconds``); ``choices``
        0 ends a cool-down (its output got through again).

        A replica whose output is refused gets no gradient, so it does not step and its queue
        empties: by load alone it looks the least busy and drew the stage's next microbatches,
        each refused again for the same weights (a clean real swarm: eight activations of one
        version refused in two seconds while a stage-wide move reached its partner's output
        four seconds later). Passing it over for a couple of microbatches lets the partner's
        output show the move to the next stage first, and wastes less work on a poisoner."""
        p = self._get(peer)
        if p is not None:
            p.cool, p.cool_until = max(0, choices), self.clock() + seconds

    def on_busy(self, peer: str) -> None:
        """``busy`` is backpressure, not a fault: count its queue as full until the next ack."""
        p = self._get(peer)
        if p is not None:
            p.queue = max(p.queue + 1, 1)

    def on_failure(self, peer: str, cause: str = "unreachable") -> float:
        """Unreachable / timed out / broken reply: ban for ``base · 2^(strikes-1)`` s. Returns the ban."""
        p = self._get(peer)
        if p is None:
            p = self.peers[peer] = PeerState(peer, -1, in_dht=False)
        p.strikes += 1
        seconds = min(self.max_ban, self.ban_base * 2 ** (p.strikes - 1))
        self._ban(p, seconds, "unreachable" if cause in ("failure", "unreachable") else cause)
        p.ban_announced = p.announced
        return seconds

    def ban(self, peer: str, seconds: float, cause: str) -> None:
        """Ban for cause (verifier flags, wrong run) for ``seconds``."""
        p = self._get(peer)
        if p is None:
            p = self.peers[peer] = PeerState(peer, -1, in_dht=False)
        self._ban(p, seconds, cause)

    def _ban(self, p: PeerState, seconds: float, cause: str) -> None:
        p.banned_until = max(p.banned_until, self.clock() + seconds)
        p.ban_cause = cause
        p.outstanding = 0
        self.bans_total[cause] = self.bans_total.get(cause, 0) + 1

    def is_banned(self, peer: str) -> bool:
        p = self._get(peer)
        return p is not None and p.banned_until > self.clock()

    def banned(self) -> list[str]:
        now = self.clock()
        return [p.peer_id for p in self.peers.values() if p.banned_until > now]
