"""node/net/routing.py and the pure parts of node/net/membership.py: replica choice, bans, stage choice."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from node.net import CapacityMeter, Router
from node.net.routing import announced_rate


@dataclass
class Rec:  # the fields of membership.PeerRecord the router reads
    peer_id: str
    stage: int
    state: str = "online"
    throughput: float = 0.0
    queue: int = 0
    version: int = 0
    maddrs: list = field(default_factory=list)
    time: float = 0.0
    capacity: float | None = None  # None: a record without the field (weighed by throughput)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def make(records, **kw):
    clock = Clock()
    r = Router("me", rng=random.Random(0), clock=clock, **kw)
    r.update(records)
    return r, clock


def test_prefers_short_queue_and_high_throughput():
    r, _ = make([Rec("a", 1, throughput=100, queue=4), Rec("b", 1, throughput=100, queue=0),
                 Rec("c", 2, throughput=1000)])
    assert r.choose(1) == "b"
    r, _ = make([Rec("a", 1, throughput=400, queue=1), Rec("b", 1, throughput=100, queue=0)])
    assert r.choose(1) == "a"  # (1+1)/400 < (0+1)/100


def test_outstanding_microbatches_spread_the_load():
    r, _ = make([Rec("a", 1, throughput=100), Rec("b", 1, throughput=100)])
    picks = []
    for _ in range(6):
        p = r.choose(1)
        r.on_sent(p)
        picks.append(p)
    assert picks.count("a") == 3 and picks.count("b") == 3
    r.on_done("a")
    r.on_done("a")
    assert r.choose(1) == "a"


def test_new_replica_counts_as_an_average_one():
    # 'new' announced 0 tokens/s: floored at the stage median, so it is neither starved nor flooded
    r, _ = make([Rec("old1", 1, throughput=100, queue=2), Rec("old2", 1, throughput=100, queue=2),
                 Rec("new", 1, throughput=0, queue=0)])
    assert r.choose(1) == "new"
    for _ in range(3):
        r.on_sent("new")
    assert r.choose(1) in ("old1", "old2")


def test_a_replica_that_claims_a_thousandfold_capacity_gets_at_most_four_times_the_typical_share():
    # its claim is its own: weighed as at most 4 x the stage's lower median, it cannot draw all the
    # microbatches (which it would then hold until banned for timing out)
    r, _ = make([Rec("liar", 1, capacity=1e5), Rec("b", 1, capacity=100), Rec("c", 1, capacity=100)])
    picks = []
    for _ in range(60):  # none comes back: the outstanding count is what spreads them
        p = r.choose(1)
        r.on_sent(p)
        picks.append(p)
    assert picks.count("b") >= 9 and picks.count("c") >= 9, picks
    assert picks.count("liar") <= 4 * min(picks.count("b"), picks.count("c")) + 4, picks
    # an honest replica three times as fast as the typical one is weighed as it says
    r, _ = make([Rec("fast", 1, capacity=300), Rec("b", 1, capacity=100), Rec("c", 1, capacity=100)])
    picks = []
    for _ in range(50):
        p = r.choose(1)
        r.on_sent(p)
        picks.append(p)
    assert abs(picks.count("fast") - 30) <= 2, picks


def test_excludes_self_offline_joining_and_excluded():
    r, _ = make([Rec("me", 1, throughput=1e9), Rec("j", 1, state="joining"), Rec("d", 1, state="draining"),
                 Rec("a", 1), Rec("b", 1)])
    assert r.choose(1, exclude={"a"}) == "b"
    assert r.choose(1, exclude={"a", "b"}) is None
    assert r.choose(3) is None
    assert r.count_by_stage(3) == [0, 2, 0]


def test_failures_ban_with_exponential_backoff_and_success_clears():
    r, clock = make([Rec("a", 1), Rec("b", 1)], ban_base=2.0, max_ban=10.0)
    assert r.on_failure("a") == 2.0
    assert r.is_banned("a") and r.choose(1) == "b" and r.banned() == ["a"]
    clock.t += 2.1
    assert not r.is_banned("a")
    assert r.on_failure("a") == 4.0
    assert r.on_failure("a") == 8.0
    assert r.on_failure("a") == 10.0  # capped
    clock.t += 10.1
    r.on_ack("a", 0.01, queue=0)  # a success clears the strikes
    assert r.on_failure("a") == 2.0
    assert r.bans_total["unreachable"] == 5


def test_a_refused_replica_sits_out_the_next_choices_while_another_is_available():
    """``cool``: a replica whose output the next stage refused looks idle (no gradient comes back,
    its queue empties) and would draw the next microbatches; it is passed over for ``choices``
    choices of its stage while another replica is available, at most ``seconds``, and a cool-down
    of 0 ends it. Alone in its stage it is still chosen."""
    r, clock = make([Rec("a", 1, throughput=100, queue=0), Rec("b", 1, throughput=100, queue=3)])
    assert r.choose(1) == "a"  # the least loaded
    r.cool("a", 2)
    assert [r.choose(1), r.choose(1), r.choose(1)] == ["b", "b", "a"]
    r.cool("a", 2)
    clock.t += 10.1  # expired
    assert r.choose(1) == "a"
    r.cool("a", 5)
    assert r.choose(1) == "b"
    r.cool("a", 0)  # its output got through again
    assert r.choose(1) == "a"
    r.cool("a", 2)
    assert r.choose(1, exclude={"b"}) == "a"  # nobody else: still chosen
    r.on_failure("b")  # banned: nobody else
    assert r.choose(1) == "a"
    r.cool("nobody", 2)  # unknown peers are ignored


def test_a_fresh_announcement_lifts_an_unreachable_ban():
    r, clock = make([Rec("a", 1, time=50.0), Rec("b", 1, time=50.0)])
    r.on_failure("a")
    r.on_failure("a")
    assert r.is_banned("a")
    r.update([Rec("a", 1, time=50.0), Rec("b", 1, time=51.0)])  # its old record: still banned
    assert r.is_banned("a")
    r.update([Rec("a", 1, time=60.0), Rec("b", 1, time=61.0)])  # it announced itself again
    assert not r.is_banned("a") and r.choose(1, exclude={"b"}) == "a"
    r.ban("b", 30.0, "verifier")  # a ban for cause is not lifted by announcing
    r.update([Rec("a", 1, time=70.0), Rec("b", 1, time=71.0)])
    assert r.is_banned("b")


def test_ban_for_cause_outlives_a_dht_refresh_then_expires():
    r, clock = make([Rec("a", 1), Rec("b", 1)])
    r.ban("a", 30.0, "verifier")
    r.update([Rec("b", 1)])  # 'a' left the DHT but its ban is remembered
    assert r.is_banned("a")
    r.update([Rec("a", 1), Rec("b", 1)])  # it comes back: still banned
    assert r.choose(1) == "b"
    clock.t += 31
    r.update([Rec("b", 1)])
    assert "a" not in r.peers


def test_busy_counts_as_queue_until_the_next_ack():
    r, _ = make([Rec("a", 1, throughput=100), Rec("b", 1, throughput=100)])
    first = r.choose(1)
    r.on_busy(first)
    other = r.choose(1)
    assert other != first
    r.on_ack(first, 0.01, queue=0)
    r.on_busy(other)
    assert r.choose(1) == first


def test_stage_change_resets_local_load():
    r, _ = make([Rec("a", 1)])
    r.on_sent("a")
    r.update([Rec("a", 2)])
    assert r.peers["a"].outstanding == 0 and r.choose(2) == "a"


def test_choose_stage_picks_least_served():
    from node.net import PeerRecord, choose_stage

    recs = [PeerRecord("a", 0, "online", throughput=500), PeerRecord("b", 1, "online", throughput=200),
            PeerRecord("c", 2, "online", throughput=300)]
    assert choose_stage(recs, 3) == 1
    assert choose_stage(recs, 4) == 3  # an empty stage first
    # offline peers do not count; a joining one (0 tokens/s yet) breaks ties by peer count
    recs += [PeerRecord("d", 1, "offline", throughput=0), PeerRecord("e", 1, "online", throughput=400)]
    assert choose_stage(recs, 3) == 2
    tie = [PeerRecord("x", 0, "joining"), PeerRecord("y", 2, "online")]
    assert choose_stage(tie, 3) == 1


def test_choose_stage_weighs_capacity_not_throughput():
    from node.net import PeerRecord, choose_stage

    # a running pipeline: every stage trains the same tokens/s, so throughput cannot tell where
    # compute is short; capacity (tokens per busy second) can. An older peer without capacity
    # counts its throughput.
    recs = [PeerRecord("a", 0, "online", throughput=300, capacity=900),
            PeerRecord("b", 1, "online", throughput=300, capacity=400),
            PeerRecord("c", 2, "online", throughput=300, capacity=700)]
    assert choose_stage(recs, 3) == 1
    recs.append(PeerRecord("d", 1, "online", throughput=600))  # stage 1 now 1000
    assert choose_stage(recs, 3) == 2


def test_peer_records_reject_malformed_values():
    from node.net import PeerRecord

    good = PeerRecord("p", 1, "online", throughput=3.0, queue=2, version=9, maddrs=["/ip4/1.2.3.4/tcp/1"])
    assert PeerRecord.from_value(good.to_value()).version == 9
    for bad in (None, [], {"peer_id": "p"}, {**good.to_value(), "state": "hacked"},
                {**good.to_value(), "stage": -1}, {**good.to_value(), "throughput": "fast"},
                {**good.to_value(), "throughput": -5}, {**good.to_value(), "throughput": float("nan")},
                {**good.to_value(), "capacity": -1.0}, {**good.to_value(), "capacity": float("inf")},
                {**good.to_value(), "capacity": "lots"}):
        assert PeerRecord.from_value(bad) is None
    with_cap = PeerRecord("p", 1, "online", throughput=3.0, capacity=12.5)
    assert PeerRecord.from_value(with_cap.to_value()).capacity == 12.5
    assert "capacity" not in good.to_value()  # a record without the field, as a peer from before it
    assert PeerRecord.from_value(good.to_value()).capacity is None
    assert PeerRecord.from_value({**good.to_value(), "capacity": 0}).capacity == 0.0


def test_capacity_outranks_throughput():
    # b trained fewer tokens lately (it was sent less), but computes as fast as a: equal weight
    r, _ = make([Rec("a", 1, throughput=300, capacity=500, queue=1), Rec("b", 1, throughput=100, capacity=500)])
    assert r.choose(1) == "b"  # (0+1)/500 < (1+1)/500; by throughput a would win: 2/300 < 1/100
    # an older peer announcing only throughput is weighed by it, and sets the stage median too
    r, _ = make([Rec("a", 1, capacity=400), Rec("old", 1, throughput=100), Rec("new", 1)])
    assert announced_rate(r.peers["old"]) == 100 and announced_rate(r.peers["a"]) == 400
    assert r.choose(1) == "a"  # new: median 250 -> 1/250; a: 1/400
    # a replica that has not measured its capacity yet (capacity 0) gets the median even if it
    # has trained a little: its throughput of those few tokens would starve it
    r, _ = make([Rec("a", 1, capacity=400, throughput=400, queue=1), Rec("b", 1, capacity=400, throughput=400, queue=1),
                 Rec("new", 1, capacity=0.0, throughput=5, queue=1)])
    assert announced_rate(r.peers["new"]) == 0
    picks = [r.choose(1) for _ in range(30)]
    assert picks.count("new") > 0  # tied with a and b at the median, not ranked 80x behind


def _closed_loop(announce: str, ticks: int = 1500, inflight: int = 6, window: int = 100, seed: int = 0) -> float:
    """Two equal replicas of stage 1 fed by one head through a real Router: each tick the head
    keeps ``inflight`` microbatches out, each replica finishes a queued one with probability 0.9,
    a gradient comes back 2-6 ticks later. Every 10 ticks the replicas announce either what
    they got (``throughput``: finished per tick over the last ``window`` ticks) or what they can
    do (``capacity``: 0.9 per busy tick for both). Replica a starts with twice b's history.
    Returns a's share of the work over the run."""
    rng = random.Random(seed)
    done = {"a": [t for t in range(-window, 0) for _ in range(2) if rng.random() < 0.5],
            "b": [t for t in range(-window, 0) if rng.random() < 0.5]}
    queue, back, served, out = {"a": 0, "b": 0}, [], {"a": 0, "b": 0}, 0

    def records(now):
        if announce == "capacity":
            return [Rec(p, 1, capacity=0.9, queue=queue[p]) for p in ("a", "b")]
        return [Rec(p, 1, throughput=max(1e-3, sum(t > now - window for t in done[p]) / window), queue=queue[p])
                for p in ("a", "b")]

    r, _ = make(records(0))
    for t in range(ticks):
        if t % 10 == 0:
            r.update(records(t))
        while out < inflight:
            p = r.choose(1)
            r.on_sent(p)
            queue[p] += 1
            out += 1
        for p in ("a", "b"):
            if queue[p] and rng.random() < 0.9:
                queue[p] -= 1
                served[p] += 1
                done[p].append(t)
                back.append((t + rng.randint(2, 6), p))
        for item in [b for b in back if b[0] <= t]:
            back.remove(item)
            r.on_done(item[1])
            out -= 1
    return served["a"] / (served["a"] + served["b"])


def test_equal_replicas_share_the_load_when_weighed_by_capacity():
    # weighed by what they got, the split chance (or a head start) made sustains itself: the
    # replica sent more announces more and is sent more; weighed by capacity it evens out.
    # (In a real clean swarm with no ban the two body replicas ended at 226 and 74 steps.)
    # Four seeds (deterministic): by capacity 0.489-0.507 over 8 seeds; by throughput a keeps
    # 0.53-0.64 of the work, never back to even within the run.
    for seed in range(4):
        assert abs(_closed_loop("capacity", seed=seed) - 0.5) < 0.03, seed
    got = [_closed_loop("throughput", seed=seed) for seed in range(4)]
    assert min(got) > 0.52 and sum(got) / len(got) > 0.55, got


def test_capacity_meter_counts_tokens_per_busy_second_over_the_last_backwards():
    m = CapacityMeter(intervals=4)
    assert m.tokens_per_s() == 0.0
    tokens = busy = 0.0
    for _ in range(2):  # two points, one interval: not enough
        tokens, busy = tokens + 1000, busy + 0.5
        m.record(tokens, busy)
    assert m.tokens_per_s() == 0.0
    m.record(tokens + 1000, busy + 0.5)
    assert m.tokens_per_s() == 2000.0
    tokens, busy = tokens + 1000, busy + 0.5
    for _ in range(4):  # the replica got faster: after 4 more backwards only they count
        tokens, busy = tokens + 1000, busy + 0.25
        m.record(tokens, busy)
    assert m.tokens_per_s() == 4000.0
    with pytest.raises(ValueError):
        CapacityMeter(intervals=1)
