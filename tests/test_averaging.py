"""ReplicaAverager over real hivemind DHTs on loopback: two replicas converge on the averaged
slice while the training loop never waits; a lone replica skips; a failed round is dropped."""

from __future__ import annotations

import os
import time

import pytest
import torch

from node.averaging import ReplicaAverager, averaging_prefix

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
P2P_LOCAL = dict(use_relay=False, use_auto_relay=False, auto_nat=False, nat_port_map=False)


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields and fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
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
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _descendants(os.getpid()) - before:
        time.sleep(0.1)
    left = {p for p in _descendants(os.getpid()) - before if not _is_torch_shm_manager(p)}
    assert not left, f"processes left behind: {left}"


def test_prefix_has_no_dots():
    assert averaging_prefix("swarm.default-1", 2) == "swarm_default-1_stage2_avg"


@pytest.mark.timeout(90)
def test_two_replicas_move_toward_each_other_without_blocking(no_leftover_processes):
    torch.manual_seed(0)
    shapes = [(40, 30), (50,), (7, 11)]
    a = [torch.randn(s) for s in shapes]
    b = [torch.randn(s) + 3.0 for s in shapes]
    kw = dict(prefix="avgtest_stage1_avg", fraction=0.25, every=3, seed=11, correction=False,
              timeout=15.0, min_matchmaking_time=1.0, request_timeout=0.5)
    dht1 = _dht()
    dht2 = _dht([str(m) for m in dht1.get_visible_maddrs()])
    avg_a = ReplicaAverager(dht1, a, **kw)
    avg_b = ReplicaAverager(dht2, b, **kw)
    try:
        avg_a.start()
        avg_b.start()
        durations, applied_at = [], {}
        step, deadline = 0, time.monotonic() + 45
        before = None
        while time.monotonic() < deadline and len(applied_at) < 2:
            step += 1
            for x in a:  # "training": each replica keeps making its own progress
                x.add_(1e-3)
            for x in b:
                x.sub_(1e-3)
            for name, avg, params in (("a", avg_a, a), ("b", avg_b, b)):
                if step == 3:
                    before = [torch.cat([p.view(-1) for p in a]), torch.cat([p.view(-1) for p in b])]
                t0 = time.perf_counter()
                if avg.maybe_average(step) and name not in applied_at:
                    applied_at[name] = step
                durations.append(time.perf_counter() - t0)
            time.sleep(0.02)  # the compute of one step
        assert set(applied_at) == {"a", "b"}, (avg_a.stats, avg_b.stats)
        # round 0 averaged partition 0, snapshotted at step 3 on both replicas
        flat0 = avg_a.schedule.flat_indices(0)
        fa, fb = torch.cat([p.view(-1) for p in a]), torch.cat([p.view(-1) for p in b])
        gap_before = (before[0] - before[1])[flat0].abs().mean()
        gap_after = (fa - fb)[flat0].abs().mean()
        others = torch.ones(fa.numel(), dtype=torch.bool)
        others[flat0] = False
        gap_others = (fa - fb)[others].abs().mean()
        assert gap_before > 2.0
        # after the delta only the progress since the snapshot separates them (2e-3 per step)
        assert gap_after < 2e-3 * step + 1e-3, (gap_before, gap_after)
        assert gap_others > 2.0  # elements outside the slice were not averaged
        for avg in (avg_a, avg_b):
            assert avg.stats.last_group_size == 2
            assert avg.stats.bytes_sent == 4 * avg.schedule.max_size  # 2·(g−1)/g of the buffer, g = 2
        # the round took seconds (matchmaking >= 1 s); no call of the training hook waited for it
        assert avg_a.stats.last_round_seconds > 0.5
        assert max(durations) < 0.25, max(durations)
    finally:
        avg_a.close()
        avg_b.close()
        dht2.shutdown()
        dht1.shutdown()


@pytest.mark.timeout(60)
def test_lone_replica_skips_and_failed_round_is_dropped(no_leftover_processes):
    params = [torch.randn(64)]
    ref = params[0].clone()
    dht = _dht()
    lone = ReplicaAverager(dht, params, prefix="avgtest_stage0_avg", fraction=0.5, every=2, seed=1,
                           timeout=2.5, min_matchmaking_time=1.0, request_timeout=0.5, peers_fn=lambda: 1)
    hopeful = ReplicaAverager(dht, params, prefix="avgtest_stage9_avg", fraction=0.5, every=2, seed=1,
                              timeout=2.5, min_matchmaking_time=1.0, request_timeout=0.5)
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
        assert hopeful.stats.skipped_busy >= 1  # due rounds while the failing one ran were skipped
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
