"""ReplicaAverager over real hivemind DHTs on loopback: two replicas converge on the averaged
slice while the training loop never waits; a lone replica skips; a failed round is dropped."""

from __future__ import annotations

import os
import time

import pytest
import torch

from node.net import ReplicaAverager, averaging_prefix

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
P2P_LOCAL = dict(use_relay=False, use_auto_relay=False, auto_nat=False, nat_port_map=False)


def _descendants(pid: int) -> set[int]:
    from node.base import processes

    children: dict[int, list[int]] = {}
    for p in processes():
        if p.alive:
            children.setdefault(p.ppid, []).append(p.pid)
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _is_torch_shm_manager(pid: int) -> bool:
    # torch's per-process shared-memory manager: started on the first share_memory_(), lives
    # as long as this test process, not something a test can or should stop
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].endswith(b"torch_shm_manager")
    except OSError:
        return True


def _dht(initial_peers=None):
    import hivemind

    return hivemind.DHT(initial_peers=initial_peers, start=True, host_maddrs=LOOPBACK, **P2P_LOCAL)


@pytest.fixture
def no_leftover_processes():
    before = _descendants(os.getpid())
    yield

    def ours():
        return {p for p in _descendants(os.getpid()) - before if not _is_torch_shm_manager(p)}

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ours():
        time.sleep(0.1)
    left = ours()
    assert not left, f"processes left behind: {left}"


def test_prefix_has_no_dots():
    assert averaging_prefix("swarm.default-1", 2) == "swarm_default-1_stage2_avg"


@pytest.mark.timeout(90)
def test_two_replicas_move_toward_each_other_without_blocking(no_leftover_processes):
    """Replica a is pushed by gradient +1, replica b by −1 (SGD, momentum β), from weights 3 apart.
    Shadow copies train identically without averaging, so the expected result is exact. Each
    replica takes its snapshot when its own clock says the slot is near, so the two snapshots may
    be of different steps, t_a and t_b (one step apart when the slot's moment falls between a's
    and b's call of one step: ``test_replicas_in_lockstep_can_snapshot_a_step_apart``): at
    application, s = now − t_a steps after a's snapshot, on the slice S
      θ_a = θ_a^plain(now) + (θ_b^plain(t_b) − θ_a^plain(t_a))/2      (local progress kept)
      m_a = m_a^plain(now) + β^s·((m_a(t_a) + m_b(t_b))/2 − m_a(t_a))  (moments: the staleness correction)
    with m_r(t) = sign_r·(1 − β^t)/(1 − β), and nothing outside S changes."""
    torch.manual_seed(0)
    shapes = [(40, 30), (50,), (7, 11)]
    lr, beta = 1e-3, 0.9
    init_a = [torch.randn(s) for s in shapes]
    replicas = {}
    for name, sign, offset in (("a", 1.0, 0.0), ("b", -1.0, 3.0)):
        params = [(x + offset).clone() for x in init_a]
        shadow = [(x + offset).clone() for x in init_a]
        replicas[name] = dict(
            sign=sign, params=params, shadow=shadow, history=[],
            opt=torch.optim.SGD(params, lr=lr, momentum=beta),
            shadow_opt=torch.optim.SGD(shadow, lr=lr, momentum=beta),
        )
    kw = dict(prefix="avgtest_stage1_avg", fraction=0.25, every=3, seed=11, correction=True,
              timeout=15.0, min_matchmaking_time=1.0, request_timeout=0.5, period=2.0)
    dht1 = _dht()
    dht2 = _dht([str(m) for m in dht1.get_visible_maddrs()])
    for name, dht in (("a", dht1), ("b", dht2)):
        r = replicas[name]
        r["avg"] = ReplicaAverager(dht, r["params"], optimizer=r["opt"], **kw)
    try:
        for r in replicas.values():
            r["avg"].start()
        durations, applied = [], {}
        step, deadline = 0, time.monotonic() + 45
        while time.monotonic() < deadline and len(applied) < 2:
            step += 1
            for name, r in replicas.items():  # one step of "training" on each replica
                for opt, ps in ((r["opt"], r["params"]), (r["shadow_opt"], r["shadow"])):
                    for p in ps:
                        p.grad = torch.full_like(p, r["sign"])
                    opt.step()
                r["history"].append([p.clone() for p in r["shadow"]])  # θ^plain after `step` steps
                t0 = time.perf_counter()
                if r["avg"].maybe_average(step) and name not in applied:
                    applied[name] = (step, [p.clone() for p in r["params"]],
                                     [r["opt"].state[p]["momentum_buffer"].clone() for p in r["params"]])
                durations.append(time.perf_counter() - t0)
            time.sleep(0.02)  # the compute of one step
        assert set(applied) == {"a", "b"}, {n: r["avg"].stats for n, r in replicas.items()}
        flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
        moment = lambda r, t: r["sign"] * (1 - beta**t) / (1 - beta)  # noqa: E731 - m_r after t steps, plain
        for name, other in (("a", "b"), ("b", "a")):
            r, o = replicas[name], replicas[other]
            st = r["avg"].stats
            now, params, moments = applied[name]
            t0, t0_other = st.last_snapshot_step, o["avg"].stats.last_snapshot_step
            s = now - t0
            assert st.last_elapsed_steps == s and s >= 1 and st.last_group_size == 2
            assert st.rounds_applied == 1 and st.last_round == o["avg"].stats.last_round
            S = r["avg"].schedule.flat_indices(st.last_round)
            mine_now, mine_t0 = flat(r["history"][now - 1]), flat(r["history"][t0 - 1])
            theirs_t0 = flat(o["history"][t0_other - 1])
            expected = mine_now.clone()
            expected[S] += (theirs_t0[S] - mine_t0[S]) / 2
            torch.testing.assert_close(flat(params), expected, rtol=0, atol=1e-5)
            m_avg = (moment(r, t0) + moment(o, t0_other)) / 2
            m_expected = torch.full((S.numel(),), moment(r, now) + beta**s * (m_avg - moment(r, t0)))
            torch.testing.assert_close(flat(moments)[S], m_expected, rtol=1e-5, atol=1e-5)
            outside = torch.ones(expected.numel(), dtype=torch.bool)
            outside[S] = False
            torch.testing.assert_close(flat(moments)[outside], torch.full((int(outside.sum()),), moment(r, now)))
            assert st.last_moment_lambda == pytest.approx(beta**s)
            assert st.bytes_sent == 2 * 4 * r["avg"].schedule.max_size  # g = 2: all of a 2-slice buffer
        # moved toward each other: on the slice the replicas are closer than they would be at the
        # same steps without averaging by the whole separation they had at their snapshots (about
        # 3; the gradients push them apart, so the gap still grows by the steps the round took,
        # more on a loaded machine, which the comparison with the unaveraged gap removes)
        (na, pa, _), (nb, pb, _) = applied["a"], applied["b"]
        ta, tb = (replicas[n]["avg"].stats.last_snapshot_step for n in ("a", "b"))
        plain = lambda n_a, n_b: (flat(replicas["b"]["history"][n_b - 1])  # noqa: E731
                                  - flat(replicas["a"]["history"][n_a - 1]))[S]
        gap_at_snapshot, gap_plain = plain(ta, tb).mean(), plain(na, nb).mean()
        gap_after = (flat(pb) - flat(pa))[S].mean()
        assert gap_at_snapshot > 2.9 and gap_plain >= gap_at_snapshot
        assert gap_after == pytest.approx(float(gap_plain - gap_at_snapshot), abs=1e-4)
        assert gap_after < gap_plain - 2.9
        # the round took seconds (matchmaking >= 1 s); no call of the training hook waited for it
        assert replicas["a"]["avg"].stats.last_round_seconds > 0.5
        assert max(durations) < 0.25, max(durations)
    finally:
        for r in replicas.values():
            r["avg"].close()
        dht2.shutdown()
        dht1.shutdown()


@pytest.mark.timeout(120)
def test_three_replicas_at_different_speeds_average_the_same_slices(no_leftover_processes):
    """Three replicas, one stepping forty times slower than the other two: every applied round is
    one slot's slice, applied by every member of its group (no slot-number disagreement), the slow
    one joins fewer slots (a larger stride), and its rounds take all three."""
    torch.manual_seed(1)
    kw = dict(prefix="avgtest_stage2_avg", fraction=0.25, every=2, seed=5, correction=False,
              timeout=10.0, min_matchmaking_time=1.0, request_timeout=0.5, period=0.6)
    dhts = [_dht()]
    dhts += [_dht([str(m) for m in dhts[0].get_visible_maddrs()]) for _ in range(2)]
    # a whole round holds a replica up to lead (2 s) + a step + 2.5 s: a stride of 8 slots (4.8 s)
    # for a and b; 16 (9.6 s) for slow, whose step alone is 2.2 s
    step_seconds = {"a": 0.05, "b": 0.05, "slow": 2.2}
    reps = {name: dict(params=[torch.randn(30, 20), torch.randn(40)], step=0, next=0.0, applied=[])
            for name in step_seconds}
    for (name, r), dht in zip(reps.items(), dhts):
        r["avg"] = ReplicaAverager(dht, r["params"], **kw)
    try:
        for r in reps.values():
            r["avg"].start()
        deadline = time.monotonic() + 75
        while time.monotonic() < deadline and min(len(r["applied"]) for r in reps.values()) < 3:
            now = time.monotonic()
            for name, r in reps.items():
                if now < r["next"]:
                    continue
                r["next"], r["step"] = now + step_seconds[name], r["step"] + 1
                for p in r["params"]:
                    p.add_(0.001)  # "training"
                if r["avg"].maybe_average(r["step"]):
                    st = r["avg"].stats
                    r["applied"].append((st.last_round, st.last_group_size))
            time.sleep(0.01)
        stats = {n: r["avg"].stats for n, r in reps.items()}
        brief = {n: (r["step"], r["avg"].stride(), r["applied"], {k: v for k, v in vars(stats[n]).items()
                                                           if k.startswith(("rounds", "skipped"))})
                 for n, r in reps.items()}
        assert all(len(r["applied"]) >= 3 for r in reps.values()), brief
        assert all(st.rounds_mismatched == 0 for st in stats.values()), brief
        strides = {n: r["avg"].stride() for n, r in reps.items()}
        assert strides["slow"] == 16 and strides["a"] < 16 and strides["b"] < 16, brief
        assert all(slot % 16 == 0 for slot, _ in reps["slow"]["applied"]), brief
        members: dict[int, list[tuple[str, int]]] = {}
        for name, r in reps.items():
            for slot, g in r["applied"]:
                members.setdefault(slot, []).append((name, g))
        for slot, who in members.items():  # everyone in a group applied that slot, with that group size
            sizes = {g for _, g in who}
            assert len(sizes) == 1 and len(who) <= sizes.pop(), (slot, who)
        assert all(g == 3 for _, g in reps["slow"]["applied"]), brief  # the fast ones are in every slow slot
    finally:
        for r in reps.values():
            r["avg"].close()
        for d in reversed(dhts):
            d.shutdown()


@pytest.mark.timeout(60)
def test_lone_replica_skips_and_failed_round_is_dropped(no_leftover_processes):
    params = [torch.randn(64)]
    ref = params[0].clone()
    dht = _dht()
    lone = ReplicaAverager(dht, params, prefix="avgtest_stage0_avg", fraction=0.5, every=2, seed=1,
                           timeout=2.5, min_matchmaking_time=1.0, request_timeout=0.5, peers_fn=lambda: 1)
    hopeful = ReplicaAverager(dht, params, prefix="avgtest_stage9_avg", fraction=0.5, every=2, seed=1,
                              timeout=2.5, min_matchmaking_time=1.0, request_timeout=0.5, period=1.0)
    try:
        lone.start()
        hopeful.start()
        worst, step, deadline = 0.0, 0, time.monotonic() + 25
        while time.monotonic() < deadline and hopeful.stats.rounds_failed == 0:
            step += 1
            for avg in (lone, hopeful):
                t0 = time.perf_counter()
                assert not avg.maybe_average(step)
                worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.05)
        assert lone.stats.rounds_started == 0 and lone.stats.skipped_alone >= 1
        assert hopeful.stats.rounds_started >= 1 and hopeful.stats.rounds_failed >= 1
        assert hopeful.stats.rounds_applied == 0 and hopeful.stats.bytes_sent == 0
        assert torch.equal(params[0], ref)
        assert worst < 0.25
    finally:
        lone.close()
        hopeful.close()
        dht.shutdown()


def test_start_off_main_thread_is_refused():
    import threading

    avg = ReplicaAverager(None, [torch.zeros(4)], prefix="x_stage0_avg", fraction=0.5, every=1, seed=0)
    errors = []
    t = threading.Thread(target=lambda: errors.append(_try(avg.start)))
    t.start()
    t.join()
    assert errors and "main thread" in str(errors[0])
    with pytest.raises(RuntimeError, match="before start"):
        avg.maybe_average(1)


def test_round_bytes_are_bounded():
    with pytest.raises(ValueError, match="avg_fraction"):
        ReplicaAverager(None, [torch.zeros(1000)], prefix="x_stage0_avg", fraction=1.0, every=1, seed=0,
                        max_round_bytes=1000)


def _try(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def _finished_round(avg, number, result=None, error=None):
    """A round whose hivemind part is already over (no network): drives ReplicaAverager's bookkeeping."""
    import concurrent.futures

    from node.net.averaging_round import Round
    from stages import snapshot

    idx = avg.schedule.indices(number)
    rnd = Round(number, 0, idx, snapshot(avg.params, idx), None, [False] * len(avg.params), 0.0)
    rnd.future = concurrent.futures.Future()
    if error is not None:
        rnd.future.set_exception(error)
    else:
        rnd.future.set_result(result)
    avg._round = rnd
    return rnd


def test_slot_number_disagreement_is_discarded_and_failures_are_skipped():
    params = [torch.arange(8, dtype=torch.float32)]
    ref = params[0].clone()
    avg = ReplicaAverager(None, params, prefix="x_stage0_avg", fraction=0.5, every=100, seed=3, correction=False)
    avg._averager = object()  # stands in for the hivemind process: nothing below talks to it
    _finished_round(avg, 2, result=(torch.full((4,), 100.0), [2, 2 + (1 << 16)], [[False], [False]], [0, 0]))
    assert avg.maybe_average(1) is False and avg.stats.rounds_mismatched == 1
    assert torch.equal(params[0], ref)  # a mixed-slice "average" is never applied
    _finished_round(avg, 6, error=TimeoutError("no group"))
    assert avg.maybe_average(2) is False and avg.stats.rounds_failed == 1
    rnd = _finished_round(avg, 6, result=(torch.full((4,), 100.0), [6, 6], [[False], [False]], [0, 0]))
    assert avg.maybe_average(3) is True and avg.stats.rounds_applied == 1
    S = rnd.indices[0]
    assert torch.equal(params[0][S], torch.full((4,), 100.0))
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[S] = False
    assert torch.equal(params[0][untouched], ref[untouched])


def test_rounds_across_morph_epochs_are_discarded():
    """Morphing: weights of two epochs are in two bases. A round whose group reports another epoch,
    or during which this replica entered a new epoch, is never applied; one within an epoch is."""
    params = [torch.arange(8, dtype=torch.float32)]
    ref = params[0].clone()
    epoch = [3]
    avg = ReplicaAverager(None, params, prefix="x_stage0_avg", fraction=0.5, every=100, seed=3, correction=False,
                          epoch_fn=lambda: epoch[0])
    avg._averager = object()  # stands in for the hivemind process: nothing below talks to it
    rnd = _finished_round(avg, 2, result=(torch.full((4,), 100.0), [2, 2], [[False], [False]], [3, 4]))
    rnd.epoch = 3
    assert avg.maybe_average(1) is False and avg.stats.rounds_epoch_discarded == 1
    assert torch.equal(params[0], ref)
    rnd = _finished_round(avg, 3, result=(torch.full((4,), 100.0), [3, 3], [[False], [False]], [3, 3]))
    rnd.epoch = 3
    epoch[0] = 4  # this replica folded while the round ran: its snapshot is in the old basis
    assert avg.maybe_average(2) is False and avg.stats.rounds_epoch_discarded == 2
    assert torch.equal(params[0], ref)
    rnd = _finished_round(avg, 4, result=(torch.full((4,), 100.0), [4, 4], [[False], [False]], [4, 4]))
    rnd.epoch = 4
    assert avg.maybe_average(3) is True and avg.stats.rounds_applied == 1
    assert torch.equal(params[0][rnd.indices[0]], torch.full((4,), 100.0))


def _clocked(every=10, period=5.0, min_matchmaking_time=2.0):
    """A ReplicaAverager on a fake clock whose rounds are only recorded: (local step, slot, time)."""
    t = [1000.3]
    avg = ReplicaAverager(None, [torch.zeros(8)], prefix="x_stage0_avg", fraction=0.5, every=every, seed=0,
                          period=period, min_matchmaking_time=min_matchmaking_time, clock=lambda: t[0])
    avg._averager = object()  # stands in for the hivemind process: nothing below talks to it
    begun = []
    avg._begin = lambda step, number: begun.append((step, number, t[0]))
    return avg, t, begun


def _drive(avg, t, steps, step_seconds, first=1):
    for step in range(first, first + steps):
        t[0] += step_seconds
        avg.maybe_average(step)


def test_rounds_join_clock_slots_after_h_steps_with_the_snapshot_just_before_the_slot():
    avg, t, begun = _clocked(every=10, period=5.0)
    assert avg.lead == 3.0  # min_matchmaking_time + 1 s
    _drive(avg, t, 9, 0.1)
    assert begun == [] and avg.pending_slot is None  # nothing before H local steps
    _drive(avg, t, 200, 0.1, first=10)
    slots = [n for _, n, _ in begun]
    # H steps take 1 s, but a whole round may hold a replica 7.1 s (lead, a step, and a round that
    # finds no group: lead after the slot's start plus a request): every second slot
    assert avg.stride() == 2 and slots == list(range(slots[0], slots[0] + 2 * len(slots), 2))
    assert slots[0] == 202  # due at t = 1001.3: the first even slot that starts 3 s (lead) later or more
    for _, n, when in begun:  # snapshot one step before lead seconds ahead of the slot's start
        assert n * 5.0 - 3.0 - 0.1 - 1e-6 <= when < n * 5.0 - 3.0 + 1e-6


def test_replicas_in_lockstep_can_snapshot_a_step_apart():
    """Two replicas stepping in lockstep (a's call, then b's, then the next step), on one clock:
    each takes its snapshot when its own call sees the slot near, so where the slot's moment falls
    between a's and b's call of one step, b snapshots that step and a the next, for the same slot.
    (The two-replica test over hivemind expected one step for both, and failed when this happened.)"""
    outcomes = set()
    for offset in range(40):
        t = [1000.3 + offset * 0.001]
        begun: dict[str, list] = {"a": [], "b": []}
        avgs = {}
        for name in "ab":
            avg = ReplicaAverager(None, [torch.zeros(8)], prefix="x_stage0_avg", fraction=0.5, every=3, seed=0,
                                  period=2.0, min_matchmaking_time=1.0, clock=lambda: t[0])
            avg._averager = object()  # stands in for the hivemind process: nothing below talks to it
            avg._begin = lambda step, number, out=begun[name]: out.append((step, number))
            avgs[name] = avg
        step = 0
        while not (begun["a"] and begun["b"]):
            step += 1
            for name in "ab":  # 0.02 s of one replica's compute, then its call
                t[0] += 0.02
                avgs[name].maybe_average(step)
        (step_a, slot_a), (step_b, slot_b) = begun["a"][0], begun["b"][0]
        assert slot_a == slot_b
        outcomes.add(step_a - step_b)
    assert outcomes == {0, 1}  # the same step, or b's a step before a's


def test_a_slower_replica_joins_a_subset_of_a_faster_ones_slots():
    fast, tf, fast_begun = _clocked(every=10, period=5.0)
    slow, ts, slow_begun = _clocked(every=10, period=5.0)
    _drive(fast, tf, 4000, 0.1)  # H steps in 1 s: every slot
    _drive(slow, ts, 125, 3.0)  # H steps in 30 s, 6 slots: every eighth slot (nearer than every fourth)
    assert fast.stride() == 2 and slow.stride() == 8
    slow_slots = [n for _, n, _ in slow_begun]
    assert len(slow_slots) >= 5 and all(n % 8 == 0 for n in slow_slots)
    assert all(b - a == 8 for a, b in zip(slow_slots, slow_slots[1:]))
    assert set(slow_slots) <= {n for _, n, _ in fast_begun}
    steps = [s for s, _, _ in slow_begun]
    assert all(12 <= b - a <= 15 for a, b in zip(steps, steps[1:]))  # about H = 10 steps (40 s / 3 s)
    medium, tm, _ = _clocked(every=10, period=5.0)
    _drive(medium, tm, 40, 2.0)  # H steps in 20 s, 4 slots: every fourth
    assert medium.stride() == 4


class _HeldUntil:
    """A round's future on a fake clock: done at ``until``, then raises like a round with no group."""

    def __init__(self, t, until):
        self.t, self.until = t, until

    def done(self):
        return self.t[0] >= self.until

    def result(self, timeout=None):
        raise RuntimeError("no group")


def test_a_replica_whose_rounds_find_no_group_still_joins_every_multiple_of_its_stride():
    """Every round fails, each held as long as a real one is (matchmaking until ``find_until``,
    then one last request): the replica is never still busy when the next multiple of its stride
    comes. (With the stride's floor counting only the time until an applied round, a stride-1
    replica was busy at every other slot and settled on one parity of them, where it could miss
    a replica on the other for good.)"""

    class Worker:
        def submit(self, fn, rnd):
            return _HeldUntil(t, rnd.find_until + 0.9)  # the last request (request_timeout 1 s) ends late

    avg, t, _ = _clocked(every=10, period=5.0)
    joined = []
    real_begin = type(avg)._begin
    avg._begin = lambda step, number: (joined.append(number), real_begin(avg, step, number))
    avg._worker = Worker()
    _drive(avg, t, 3000, 0.1)  # 300 s
    m = avg.stride()
    assert avg.stats.skipped_busy == 0 and len(joined) >= 20, (m, avg.stats.skipped_busy, joined)
    assert all(n % m == 0 for n in joined) and all(b - a == m for a, b in zip(joined, joined[1:])), (m, joined)
    assert avg.stats.rounds_failed == len(joined) - 1 and m == 2


def test_a_missed_or_busy_slot_is_passed_over():
    import concurrent.futures

    from node.net.averaging_round import Round

    avg, t, begun = _clocked(every=2, period=5.0)
    _drive(avg, t, 3, 0.1)  # due at step 3 (H = 2 after the first call)
    target = avg.pending_slot
    assert target is not None and begun == []
    t[0] = target * 5.0 - 1.0  # one long step: only 1 s is left before the slot, too late to match
    avg.maybe_average(4)
    assert begun == [] and avg.pending_slot is None
    avg.maybe_average(5)
    m, nxt = avg.stride(), avg.pending_slot
    assert nxt is not None and nxt % m == 0 and target < nxt <= target + m  # the next multiple of the stride
    # a round still in flight when the next slot comes: that slot goes without this replica
    avg._round = Round(0, 0, [], torch.zeros(0), None, [False], 0.0)
    avg._round.future = concurrent.futures.Future()
    t[0] = nxt * 5.0 - 3.05
    avg.maybe_average(6)
    assert avg.stats.skipped_busy == 1 and begun == []
    avg._round = None
    _drive(avg, t, 100, 0.1, first=7)
    assert begun and begun[0][1] > nxt and avg.stats.skipped_busy == 1


def test_averaging_period_is_checked():
    with pytest.raises(ValueError, match="period"):
        ReplicaAverager(None, [torch.zeros(4)], prefix="x_stage0_avg", fraction=0.5, every=1, seed=0, period=0.0)


def test_a_round_over_replaced_weights_is_discarded():
    """A re-sync replaces the weights while a round runs: its snapshot is of weights that are gone,
    so the round is thrown away (not applied as a delta onto the new ones), and the next round is
    due H steps after the new version."""
    avg, t, begun = _clocked(every=4)
    params = avg.params
    _finished_round(avg, 2, result=(torch.full((4,), 100.0), [2, 2], [[False], [False]], [0, 0]))
    avg._round.start_step = 10
    params[0].copy_(torch.full((8,), -1.0))  # adopt_state: another replica's weights
    avg.state_replaced()
    assert avg.maybe_average(12) is False and avg.stats.rounds_state_replaced == 1
    assert torch.equal(params[0], torch.full((8,), -1.0))
    _drive(avg, t, 3, 0.1, first=13)
    assert avg.pending_slot is None  # the next round: H = 4 steps after the new weights (step 12)
    _drive(avg, t, 1, 0.1, first=16)
    assert avg.pending_slot is not None
    # a round whose snapshot is newer than the version now: the weights went back, replaced too
    _finished_round(avg, 3, result=(torch.full((4,), 100.0), [3, 3], [[False], [False]], [0, 0]))
    avg._round.start_step = 20
    assert avg.maybe_average(17) is False and avg.stats.rounds_state_replaced == 2
    assert torch.equal(params[0], torch.full((8,), -1.0)) and avg.stats.rounds_applied == 0


def test_a_rounds_delta_is_blended_over_the_next_local_steps():
    """blend_steps = 4: a round's delta reaches the weights a quarter at a time, at the round's
    application and after each of the next three local steps, and in full; the elements outside
    the slice and what the replica learned since the snapshot are kept."""
    params = [torch.arange(8, dtype=torch.float32)]
    ref = params[0].clone()
    avg = ReplicaAverager(None, params, prefix="x_stage0_avg", fraction=0.5, every=100, seed=3, correction=False,
                          blend_steps=4)
    avg._averager = object()  # stands in for the hivemind process: nothing below talks to it
    rnd = _finished_round(avg, 6, result=(torch.full((4,), 100.0), [6, 6], [[False], [False]], [0, 0]))
    S = rnd.indices[0]
    delta = 100.0 - ref[S]
    params[0][S] += 1.0  # learned after the snapshot: kept
    seen = []
    for step in range(1, 7):
        assert avg.maybe_average(step) is (step == 1)
        seen.append(params[0][S].clone())
    for i, value in enumerate(seen):
        torch.testing.assert_close(value, ref[S] + 1.0 + min(i + 1, 4) / 4 * delta)
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[S] = False
    assert torch.equal(params[0][untouched], ref[untouched]) and avg.blend.pending == 0


def test_a_blended_delta_is_dropped_with_replaced_weights_or_a_new_morph_epoch_and_flushed_for_its_slice():
    """The rest of a blended delta belongs to the weights it was computed for: a re-sync or a morph
    epoch drops it. A later round over the same slice snapshots the earlier round in full, and a
    round applied while one is still blending applies the earlier one's rest first."""
    from stages import BlendedDelta

    epoch = [0]
    params = [torch.zeros(8)]
    avg = ReplicaAverager(None, params, prefix="x_stage0_avg", fraction=0.5, every=100, seed=3, correction=False,
                          blend_steps=4, epoch_fn=lambda: epoch[0])
    avg._averager = object()
    rnd = _finished_round(avg, 6, result=(torch.full((4,), 8.0), [6, 6], [[False], [False]], [0, 0]))
    S = rnd.indices[0]
    avg.maybe_average(1)
    assert torch.equal(params[0][S], torch.full((4,), 2.0)) and avg.blend.pending == 3
    avg.state_replaced()
    avg.maybe_average(2)
    assert torch.equal(params[0][S], torch.full((4,), 2.0)) and avg.blend.pending == 0
    _finished_round(avg, 6, result=(torch.full((4,), 10.0), [6, 6], [[False], [False]], [0, 0]))
    avg.maybe_average(3)  # snapshot at 2.0: delta 8, a quarter now
    assert torch.equal(params[0][S], torch.full((4,), 4.0))
    epoch[0] = 1  # folded into a new basis: the rest is not applied
    avg.maybe_average(4)
    assert torch.equal(params[0][S], torch.full((4,), 4.0)) and avg.blend.pending == 0
    # a snapshot of the same slice flushes the rest first; another slice's does not
    rnd = _finished_round(avg, 6, result=(torch.full((4,), 8.0), [6, 6], [[False], [False]], [1, 1]))
    rnd.epoch = 1
    avg.maybe_average(5)
    assert torch.equal(params[0][S], torch.full((4,), 5.0))
    other = next(n for n in range(7, 200) if avg.schedule.partition(n) != avg.schedule.partition(6))
    submitted = []  # _begin hands the round to the worker thread: a stand-in records it
    avg._worker = type("W", (), {"submit": lambda self, fn, rnd: submitted.append(rnd) or _future()})()
    avg._begin(6, other)
    assert torch.equal(params[0][S], torch.full((4,), 5.0)) and avg.blend.pending == 3
    avg._round = None
    avg._begin(6, 6 + avg.schedule.n_partitions)  # the same slice again
    assert torch.equal(params[0][S], torch.full((4,), 8.0)) and avg.blend.pending == 0
    torch.testing.assert_close(submitted[-1].snap, torch.full((4,), 8.0))
    # a round applied while another blends: the earlier one's rest first, nothing lost
    blend, t = BlendedDelta(4), [torch.zeros(4)]
    blend.add(t, [torch.arange(4)], torch.zeros(4), torch.full((4,), 4.0))
    blend.add(t, [torch.arange(4)], torch.full((4,), 4.0), torch.full((4,), 8.0))
    assert torch.equal(t[0], torch.full((4,), 5.0)) and blend.pending == 3
    blend.flush(t)
    assert torch.equal(t[0], torch.full((4,), 8.0))
    with pytest.raises(ValueError, match="blend steps"):
        BlendedDelta(0)


def _future():
    import concurrent.futures

    return concurrent.futures.Future()



def test_prefix_is_in_the_organisers_namespace():
    from security import organiser_fingerprint

    a, b = averaging_prefix("swarm.default-1", 2, "keyA"), averaging_prefix("swarm.default-1", 2, "keyB")
    assert a == f"swarm_default-1_{organiser_fingerprint('keyA')}_stage2_avg" and a != b and "." not in a


@pytest.mark.timeout(150)
def test_only_the_stages_members_average_and_a_poisoned_member_is_dropped(no_leftover_processes):
    """Three replicas hold the stage's records (a, b honest; c's weights are 25 times theirs) and
    a stranger without one runs an averager under the same key. The stranger never shares a group
    with them (they refuse its requests and do not follow it) and applies nothing; in the groups
    of a, b and c, a's and b's reducers drop c's contribution and count it, and the range that c
    reduced comes back poisoned and is refused, so a and b stay where honest averaging puts them."""
    torch.manual_seed(2)
    base = [torch.randn(30, 20), torch.randn(40)]
    weights = {"a": [x + 0.1 * torch.randn_like(x) for x in base], "b": [x + 0.1 * torch.randn_like(x) for x in base],
               "c": [25 * x for x in base], "stranger": [25 * x for x in base]}
    kw = dict(prefix="avgtest_stage3_avg", fraction=0.25, every=2, seed=5, correction=False,
              timeout=10.0, min_matchmaking_time=1.0, request_timeout=0.5, period=0.6)
    dhts = [_dht()]
    dhts += [_dht([str(m) for m in dhts[0].get_visible_maddrs()]) for _ in range(3)]
    ids = {name: d.peer_id.to_base58() for name, d in zip(weights, dhts)}
    members = {ids["a"], ids["b"], ids["c"]}
    reps = {}
    for (name, params), dht in zip(weights.items(), dhts):
        fn = None if name == "stranger" else (lambda me=ids[name]: members - {me})
        reps[name] = dict(params=params, step=0, applied=[],
                          avg=ReplicaAverager(dht, params, members_fn=fn, **kw))
    try:
        for r in reps.values():
            r["avg"].start()
        deadline = time.monotonic() + 100

        def done():
            return all(any(g == 3 for _, g in reps[n]["applied"]) for n in ("a", "b"))

        while time.monotonic() < deadline and not done():
            for r in reps.values():
                r["step"] += 1
                if r["avg"].maybe_average(r["step"]):
                    st = r["avg"].stats
                    r["applied"].append((st.last_round, st.last_group_size))
            time.sleep(0.05)
        for r in reps.values():
            r["avg"]._read_report()  # the averager processes' counts now, not as of each one's last round
        stats = {n: r["avg"].stats for n, r in reps.items()}
        brief = {n: (r["applied"], {k: v for k, v in vars(stats[n]).items()
                                     if k.startswith(("rounds", "contrib", "parts", "strangers", "groups"))})
                 for n, r in reps.items()}
        assert done(), brief
        assert stats["stranger"].rounds_applied == 0, brief
        assert all(g <= 3 for n in ("a", "b", "c") for _, g in reps[n]["applied"]), brief  # never with the stranger
        assert sum(stats[n].strangers_refused + stats[n].groups_refused for n in ("a", "b", "c")) >= 1, brief
        for n in ("a", "b"):
            assert stats[n].contributions_dropped >= 1 and stats[n].parts_refused >= 1, brief
            # nothing of c's weights reached them: every element within the honest spread of the base
            drift = max(float((p - x).abs().max()) for p, x in zip(reps[n]["params"], base))
            assert drift < 1.0, (n, drift, brief)
    finally:
        for r in reps.values():
            r["avg"].close()
        for d in reversed(dhts):
            d.shutdown()
