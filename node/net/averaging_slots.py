"""The wall-clock slots of replica averaging: which slots a replica joins and how long it may
look for a group in one (docs/ASYNCMESH.md). ``ReplicaAverager`` (``node.net.averaging``) keeps one
``SlotClock`` and tells it of every call of its training-loop hook, every slot it joins or passes
over, and every round it applies."""

from __future__ import annotations

import math


class SlotClock:
    """Slots of ``period`` seconds of unix time; a slot is joined ``lead`` seconds ahead (hivemind's
    matchmaking and one request round trip); ``request_timeout``: matchmaking's last request;
    ``every``: H, the local steps between two rounds a replica aims for."""

    def __init__(self, period: float, lead: float, request_timeout: float, every: int):
        self.period, self.lead, self.request_timeout, self.every = float(period), lead, request_timeout, every
        self.last_call: float | None = None
        self.call_seconds = 0.0  # EMA of the time between two calls (one local step)
        self.last = -1  # the last slot joined or passed over (the next one comes after it)
        self.span = 1.0  # EMA: seconds from a slot's start until its round was applied here

    def called(self, now: float) -> None:
        """The training loop called the hook at ``now``: one local step's time, averaged."""
        if self.last_call is not None:
            dt = max(0.0, now - self.last_call)
            self.call_seconds = dt if self.call_seconds == 0.0 else 0.7 * self.call_seconds + 0.3 * dt
        self.last_call = now

    def applied(self, number: int, now: float) -> None:
        """Slot ``number``'s round was applied at ``now``."""
        self.span = 0.5 * self.span + 0.5 * max(0.0, now - number * self.period)

    def stride(self) -> int:
        """The slots this replica joins are the multiples of this power of two: the one nearest
        (in ratio) to the span of H of its local steps, so a replica averages about every H steps
        (between 0.71 and 1.41 times as often), and never less than the smallest whose span holds
        one whole round: ``lead``, one step, and the longer of the measured time from a slot's
        start until its round is applied and the longest a round that finds no group is held
        (``lead`` after the slot's start, plus the last matchmaking request), so it is never still
        busy when its next slot comes. A replica that skipped every other multiple of its stride
        would lock onto one phase of them (slots 2, 6, 10, ... at stride 2) and never meet a
        replica on the other (0, 4, 8, ... at stride 4). Replicas of one speed join the same
        slots, and a slower replica's slots are a subset of every faster one's: it always meets
        them."""
        hold = max(self.span, self.lead + self.request_timeout)
        m = 1
        while m * self.period < self.lead + self.call_seconds + hold and m < 1 << 12:
            m *= 2
        h = self.every * self.call_seconds / self.period  # H steps, in slots
        while m * math.sqrt(2) < h and m < 1 << 12:
            m *= 2
        return m

    def next_slot(self, now: float) -> int:
        """The first slot this replica can join: a multiple of ``stride()``, after the last slot it
        joined or skipped, starting at least ``lead`` seconds after ``now``."""
        m = self.stride()
        k = max(int(-(-(now + self.lead) // self.period)), self.last + 1)
        return -(-k // m) * m

    def find_until(self, number: int) -> float:
        """When matchmaking for slot ``number`` gives up: just before this replica's next slot,
        never less than ``lead`` after the slot's start (a replica of the slot that was not found at
        its start, on a loaded machine or after a lost request, is still met)."""
        return number * self.period + max(self.lead, self.stride() * self.period - self.lead
                                          - 2 * self.call_seconds - 1.0)
