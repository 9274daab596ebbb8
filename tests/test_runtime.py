"""node/runtime/ in one process: real stage runtimes exchanging real frames through an in-memory
transport (every frame is encoded and decoded with protocol.frames, exactly as on a stream).

The multi-process, real-libp2p versions of these flows are tests/test_swarm_e2e.py,
tests/test_churn.py and tests/test_restart.py; this file covers the runtime's rules quickly and
deterministically: training through three stages, bounded queues (busy), the TTL, probes of a
dead next hop, skip propagation, verifier rejects and bans, state sync, checkpoints, priorities.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from node.net import PeerBusy, PeerRejected
from node.runtime import ComputeWorker, QueueFull
from protocol import BWD, FWD, Reason, make_fwd
from tests.helpers.memnet import MemTransport, Net, buffers_of, frame_of
from tests.helpers.runtime import (
    Rec,
    RecordingVerifier,
    head_batches,
    link,
    make_runtime,
    start_all,
    stop_all,
    train_until,
    value,
    wait_for,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]



@pytest.mark.asyncio
async def test_three_stages_train_and_every_tensor_is_verified(test_manifest):
    m = test_manifest.replace(schedule={"warmup_steps": 2})
    net = Net()
    v_body, v_tail, v_head = RecordingVerifier(), RecordingVerifier(), RecordingVerifier()
    head = make_runtime(m, 0, "head", net, verifier=v_head, batches=head_batches(m), steps=80)
    body = make_runtime(m, 1, "body", net, verifier=v_body)
    tail = make_runtime(m, 2, "tail", net, verifier=v_tail)
    rts = [head, body, tail]
    link(rts)
    await start_all(rts)
    drive = asyncio.ensure_future(head.drive())
    maintain = [asyncio.ensure_future(rt.maintain(period=0.1)) for rt in rts]
    try:
        assert await wait_for(lambda: head.version >= 80 and head.inflight == 0, timeout=90)
        await asyncio.wait_for(drive, 5)  # the head stops injecting at --steps
        for rt in rts:
            assert await rt.drain(5.0)
    finally:
        for t in maintain:
            t.cancel()
        await stop_all(rts)
    losses = [loss for _, loss in tail.trainer.loss_history]
    assert len(losses) >= 80
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first - 0.5, (first, last)
    # every stage stepped once per microbatch (grad_accum 1), none leaked a context
    assert head.version == body.version == tail.version >= 80
    assert not head.pipeline.contexts and not body.pipeline.contexts and not tail.pipeline.contexts and head.inflight == 0
    # every activation the body and tail accepted, and every gradient the head and body accepted,
    # went through their verifier first
    assert sum(1 for _, d, _ in v_body.seen if d == "act") == value(body, "swarm_node_served_total",
                                                                    protocol="fwd", result="ack")
    assert sum(1 for _, d, _ in v_tail.seen if d == "act") == tail.version
    assert sum(1 for _, d, _ in v_body.seen if d == "grad") == body.version
    assert sum(1 for _, d, _ in v_head.seen if d == "grad") == head.version
    B, L, k = m.data.batch_size, m.model.seq_len, m.k
    assert set(shape for _, _, shape in v_head.seen) == {(B, L, k)}
    # metrics saw it: steps, tokens, loss, staleness (look-ahead runs async: some delay > 0)
    assert value(tail, "swarm_node_steps_total") == tail.version
    assert value(head, "swarm_node_tokens_total") == head.version * B * L
    assert value(head, "swarm_node_staleness_steps_count") == head.version
    assert value(head, "swarm_node_microbatch_rtt_seconds_count") == head.version
    assert 0 < value(tail, "swarm_node_loss") < 10
    # capacity (what routers weigh a replica by) is measured: tokens per compute-busy second, at
    # least the tokens per wall second (busy time is part of wall time)
    for rt in rts:
        cap, tps = rt.capacity_tokens_per_s(), rt.tokens_per_s()
        assert cap >= 0.9 * tps > 0, (rt.peer_id, cap, tps)


@pytest.mark.asyncio
async def test_full_queue_answers_busy_and_router_moves_on(test_manifest):
    m = test_manifest
    net = Net()
    body = make_runtime(m, 1, "body", net, queue_size=1)
    await start_all([body])
    gate = threading.Event()
    body.worker.submit("ctl", gate.wait)  # the compute worker is busy
    sender = MemTransport(net, "head")
    c = torch.randn(m.data.batch_size, m.model.seq_len, m.k)
    ids = torch.randint(0, 256, (m.data.batch_size, m.model.seq_len), dtype=torch.int32)

    def fwd(mb):
        return make_fwd(m.run.id, body.mhash, mb, 0, 0, ["head"], c, ids)

    try:
        reply = await sender.request("body", FWD, fwd(1), timeout=2)
        assert reply.header["type"] == "ack" and reply.header["queue"] == 1
        with pytest.raises(PeerBusy):
            await sender.request("body", FWD, fwd(2), timeout=2)
        # the same microbatch again is acknowledged without queueing it twice
        assert (await sender.request("body", FWD, fwd(1), timeout=2)).header["type"] == "ack"
        assert body.worker.depth("fwd") == 1
        # a fwd from the wrong stage or run is refused with the reason
        with pytest.raises(PeerRejected) as e:
            await sender.request("body", FWD, make_fwd(m.run.id, "0" * 64, 3, 0, 0, ["head"], c, ids), timeout=2)
        assert e.value.reason == "wrong-run"
    finally:
        gate.set()
        await stop_all([body])
    assert value(body, "swarm_node_served_total", protocol="fwd", result="busy") == 1


@pytest.mark.asyncio
async def test_a_lost_ack_sends_a_microbatch_along_two_routes_and_no_context_is_left(test_manifest):
    """The head's fwd reaches one body replica, but its ack is lost on the way back (on libp2p: a
    stream reset that overtook it): the head sends the same microbatch to the other replica. Both
    pass it on, and the tail gets the second copy while the first still waits for its compute.
    Only one gradient leaves the tail, along the first route; the copy is skipped at once. When the
    head is done and leaves, no stage holds a context, long before the 60 s TTL. (Without the
    skip, the tail acked the copy and sent nothing back: one replica kept its context until the
    TTL, as the churn test saw: in-flight 1 on a stage after the head left.)"""
    m = test_manifest
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m), max_inflight=1, steps=1, context_ttl=60)
    b1, b2, tail = (make_runtime(m, i, name, net, context_ttl=60) for i, name in ((1, "b1"), (1, "b2"), (2, "tail")))
    rts = [head, b1, b2, tail]
    lost = []

    def lose_the_first_fwd_ack(peer, protocol, header):
        if protocol == FWD and not lost:
            lost.append((peer, header["mb"]))
            return True
        return False

    head.transport.lose_reply = lose_the_first_fwd_ack
    gate = threading.Event()  # the tail's first forward waits until both copies reached it
    compute_fwd = tail.trainer.compute_fwd

    def gated(fwd):
        gate.wait(30)
        return compute_fwd(fwd)

    tail.trainer.compute_fwd = gated
    link(rts)
    await start_all(rts)
    drive = asyncio.ensure_future(head.drive())
    maintain = [asyncio.ensure_future(rt.maintain(period=0.05)) for rt in rts]

    def held():
        return {rt.peer_id: (len(rt.pipeline.contexts), len(rt.pipeline.pending)) for rt in rts}

    def copies():
        return [b.peer_id for b in (b1, b2) for peer, proto, h in b.transport.sent
                if proto == FWD and peer == "tail" and lost and h["mb"] == lost[0][1]]

    try:
        assert await wait_for(lambda: len(copies()) == 2, timeout=30), (lost, copies())
        gate.set()
        # (contexts, pending) per stage: the head waits for nothing it will not get
        assert await wait_for(lambda: head.version >= 1 and head.inflight == 0, timeout=30), held()
        await asyncio.wait_for(drive, 5)
        assert await head.drain(5.0)
        head.transport.down = True  # the head leaves
        assert await wait_for(lambda: all(v == (0, 0) for v in held().values()), timeout=5), held()
    finally:
        gate.set()
        drive.cancel()
        for t in maintain:
            t.cancel()
        await stop_all(rts)
    assert sorted(copies()) == ["b1", "b2"]  # the microbatch went along both routes
    assert value(tail, "swarm_node_served_total", protocol="fwd", result="duplicate") == 1
    assert sum(value(b, "swarm_node_contexts_expired_total") for b in (b1, b2)) == 0
    assert value(b1, "swarm_node_microbatches_total", outcome="dropped") + value(
        b2, "swarm_node_microbatches_total", outcome="dropped") == 1  # the copy, skipped
    assert not any(rt.pipeline.routes for rt in (b1, b2, tail))


@pytest.mark.asyncio
async def test_context_ttl_frees_memory_and_skips_upstream(test_manifest):
    """The tail accepts but never answers: the body's context expires, the head is told to skip."""
    m = test_manifest
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m), max_inflight=2, context_ttl=60)
    body = make_runtime(m, 1, "body", net, context_ttl=0.5, probe_after=60)
    black_hole = MemTransport(net, "tail")
    acks = []

    async def swallow(frame, peer):
        from protocol import make_ack

        acks.append(frame.header["mb"])
        return make_ack(frame.header["mb"], 2, 0)

    await black_hole.serve(FWD, swallow)
    black_hole.handlers["/swarm-node/health/1"] = lambda f, p: (_ for _ in ()).throw(AssertionError)
    link([head, body])
    body.router.update([Rec("head", 0), Rec("body", 1), Rec("tail", 2)])
    await start_all([head, body])
    drive = asyncio.ensure_future(head.drive())
    maintain = [asyncio.ensure_future(rt.maintain(period=0.05)) for rt in (head, body)]
    try:
        assert await wait_for(lambda: value(body, "swarm_node_contexts_expired_total") >= 4, timeout=30)
        # the head was told: its microbatches were dropped, not left to its own (60 s) TTL
        assert await wait_for(lambda: value(head, "swarm_node_microbatches_total", outcome="dropped") >= 3)
        assert head.inflight <= 2 and len(body.pipeline.contexts) <= 2
    finally:
        drive.cancel()
        for t in maintain:
            t.cancel()
        await stop_all([head, body])
    skips = [h for peer, proto, h in body.transport.sent if proto == BWD and h.get("skip")]
    assert skips and all(peer == "head" for peer, proto, h in body.transport.sent if proto == BWD)
    assert head.version == 0  # nothing was ever trained on


@pytest.mark.asyncio
async def test_dead_next_hop_is_probed_banned_and_traffic_moves(test_manifest):
    """Two body replicas; one dies (unreachable) with microbatches in flight. The head's probe finds
    it, bans it, drops its microbatches at once and sends new ones to the survivor."""
    m = test_manifest.replace(schedule={"warmup_steps": 2})
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m), max_inflight=2)
    b1 = make_runtime(m, 1, "b1", net)
    b2 = make_runtime(m, 1, "b2", net)
    tail = make_runtime(m, 2, "tail", net)
    rts = [head, b1, b2, tail]
    link(rts)
    await start_all(rts)
    drive = asyncio.ensure_future(head.drive())
    maintain = [asyncio.ensure_future(rt.maintain(period=0.05)) for rt in rts]
    try:
        assert await wait_for(lambda: b1.version >= 3 and b2.version >= 3, timeout=60)
        # kill -9 while the head waits on b1 (a microbatch of its own went there): with nothing
        # waiting on b1 the head has no reason to probe it and may just keep routing to b2
        assert await wait_for(lambda: any(c.next_peer == "b1" and c.sent_at for c in head.pipeline.contexts.values()),
                              timeout=30)
        b1.transport.down = True  # kill -9 (no await since the check: b1 still holds that microbatch)
        t_kill = time.monotonic()
        steps_at_kill = tail.version
        assert await wait_for(lambda: head.router.is_banned("b1"), timeout=10)
        # the gauge while the ban lasts, read in the same beat (the first ban is 2 s, and if the
        # head does not pick b1 again no second one follows: a gauge read later may say 0)
        head.sweep()
        assert value(head, "swarm_node_banned_peers") == 1
        assert await wait_for(lambda: tail.version >= steps_at_kill + 10, timeout=30)
        recovered = time.monotonic() - t_kill
        b2_before = b2.version
        assert await wait_for(lambda: b2.version >= b2_before + 5, timeout=30)
        assert not any(ctx.next_peer == "b1" for ctx in head.pipeline.contexts.values())
    finally:
        drive.cancel()
        for t in maintain:
            t.cancel()
        await stop_all(rts)
    assert recovered < 10
    assert value(head, "swarm_node_bans_total", cause="unreachable") >= 1


async def _restart_next_hop(m, *, new_address: bool):
    """Head and tail; the tail is killed with the head's microbatches in flight and restarted at
    once with the same peer id. Returns (head, new tail, seconds until it made 5 steps)."""
    m = m.replace(stages={"layout": [[0, 2], [2, m.model.n_layers]]})
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m), max_inflight=2)
    tail = make_runtime(m, 1, "tail", net)
    link([head, tail])
    await start_all([head, tail])
    drive = asyncio.ensure_future(head.drive())
    maintain = [asyncio.ensure_future(head.maintain(period=0.05))]
    again = None
    try:
        assert await wait_for(lambda: tail.version >= 3, timeout=60)
        # kill -9 while the head waits for gradients: they never come back
        assert await wait_for(lambda: any(c.next_peer == "tail" and c.sent_at for c in head.pipeline.contexts.values()),
                              timeout=30)
        sent_to_old = [ctx for ctx in head.pipeline.contexts.values() if ctx.sent_at]
        tail.transport.down = True
        again = make_runtime(m, 1, "tail", net)  # same identity, fresh process (new uptime)
        if new_address:  # it listens on a new port that the head's p2pd has not seen yet
            head.router.peers["tail"].maddrs = ["/ip4/127.0.0.1/tcp/4242/p2p/tail"]
            head.transport.undialled.add("tail")
        await start_all([again])
        for ctx in sent_to_old:  # the restart took a second (the probe tells them apart to 0.1 s)
            ctx.sent_at -= 1.0
        await tail.stop()
        maintain.append(asyncio.ensure_future(again.maintain(period=0.05)))
        t0 = time.monotonic()
        ok = await wait_for(lambda: again.version >= 5, timeout=20)
        took = time.monotonic() - t0
    finally:
        drive.cancel()
        for t in maintain:
            t.cancel()
        await stop_all([head] + ([again] if again is not None else []))
    assert ok, f"the restarted next hop got {again.version} steps; head contexts {list(head.pipeline.contexts.values())}"
    return head, again, took


@pytest.mark.asyncio
async def test_restarted_next_hop_loses_in_flight_microbatches_without_a_ttl_wait(test_manifest):
    """The probe reaches the restarted peer (same id): its uptime says the microbatches sent
    before it started died with the old process, so they are dropped and the head's in-flight
    slots free up at once instead of after context_ttl (120 s)."""
    head, again, took = await _restart_next_hop(test_manifest, new_address=False)
    assert took < 10
    assert value(head, "swarm_node_bans_total", cause="unreachable") == 0


@pytest.mark.asyncio
async def test_restarted_next_hop_on_a_new_address_is_redialled_not_banned(test_manifest):
    """The restarted peer listens on an address the head's transport does not know yet: the failed
    probe dials the multiaddrs it announced and finds it there, without banning it."""
    head, again, took = await _restart_next_hop(test_manifest, new_address=True)
    assert head.transport.dialled == ["/ip4/127.0.0.1/tcp/4242/p2p/tail"]
    assert took < 10
    assert value(head, "swarm_node_bans_total", cause="unreachable") == 0


@pytest.mark.asyncio
async def test_verifier_rejects_drop_skip_and_ban(test_manifest):
    m = test_manifest
    net = Net()
    verifier = RecordingVerifier(reject={"head"})
    head = make_runtime(m, 0, "head", net, batches=head_batches(m), max_inflight=1)
    body = make_runtime(m, 1, "body", net, verifier=verifier)
    link([head, body])
    await start_all([head, body])
    drive = asyncio.ensure_future(head.drive())
    try:
        flags = m.sentinel.flags_to_ban
        assert await wait_for(lambda: body.router.is_banned("head"), timeout=30)
        assert await wait_for(
            lambda: value(head, "swarm_node_requests_total", protocol="fwd", result="banned") >= 1, timeout=10)
    finally:
        drive.cancel()
        await stop_all([head, body])
    assert value(body, "swarm_node_verifier_verdicts_total", direction="act", verdict="reject",
                 reason="test-reject") == flags
    assert value(body, "swarm_node_bans_total", cause="verifier") == 1
    assert value(head, "swarm_node_requests_total", protocol="fwd", result="rejected-by-verifier") == flags
    assert not body.pipeline.contexts and body.version == 0
    assert len(head.pipeline.contexts) <= 1


def moved_replica(m, net, peer, version):
    """A stage-1 replica whose weights and optimizer version are not the initial ones."""
    rt = make_runtime(m, 1, peer, net, seed=1)
    with torch.no_grad():
        for p in rt.stage.parameters():
            p.add_(torch.randn_like(p))
    rt.trainer.lookahead.version = version
    return rt


@pytest.mark.asyncio
async def test_joiner_downloads_the_exact_weights(test_manifest):
    m = test_manifest
    net = Net()
    online = moved_replica(m, net, "old", version=42)
    joiner = make_runtime(m, 1, "new", net, seed=2, verify_state=False)
    link([online, joiner])
    await start_all([online])
    await joiner.start()
    try:
        got = await joiner.sync_from_replicas()
    finally:
        await stop_all([online, joiner])
    assert (got.version, got.source, got.verified) == (42, "old", False)
    assert joiner.version == 42
    for (n, a), (_, b) in zip(online.stage.named_parameters(), joiner.stage.named_parameters()):
        assert torch.equal(a, b), n
    assert value(joiner, "swarm_node_state_sync_bytes_total", direction="in") > 0


def _replicas_of_one_state(m, net, peers, version, poisoned=(), attack="state-scaled"):
    """Stage-1 replicas holding one state (each nudged a little, as asynchronous replicas drift);
    those in ``poisoned`` serve a ``state-*`` test attack's weights instead."""
    first = make_runtime(m, 1, peers[0], net, seed=1)  # initialised weights: what a fresh run trains
    first.trainer.lookahead.version = version
    out = [first]
    for peer in peers[1:]:
        rt = make_runtime(m, 1, peer, net, seed=1)
        with torch.no_grad():
            for a, b in zip(first.stage.parameters(), rt.stage.parameters()):
                b.copy_(a + 1e-4 * torch.randn_like(a))
        rt.trainer.lookahead.version = version
        out.append(rt)
    for rt in out:
        if rt.peer_id in poisoned:
            rt.state_attack = attack
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("attack", ["state-scaled", "state-random", "state-foreign"])
async def test_a_joiner_refuses_poisoned_state_and_takes_the_majority(test_manifest, attack):
    m = test_manifest
    net = Net()
    replicas = _replicas_of_one_state(m, net, ["a", "p", "b"], version=42, poisoned={"p"}, attack=attack)
    joiner = make_runtime(m, 1, "new", net, seed=2)
    link([*replicas, joiner])
    await start_all(replicas)
    await joiner.start()
    try:
        got = await joiner.sync_from_replicas()
    finally:
        await stop_all([*replicas, joiner])
    assert got.verified and got.refused == ["p"] and got.source in ("a", "b")
    assert max(d for peer, d in got.distances.items() if peer != "p") < 0.01 < got.distances["p"]
    assert joiner.router.is_banned("p") and not joiner.router.is_banned("a")
    assert value(joiner, "swarm_node_bans_total", cause="poisoned-state") == 1
    honest = dict(replicas[0].stage.named_parameters()) if got.source == "a" else dict(replicas[2].stage.named_parameters())
    for n, p in joiner.stage.named_parameters():
        assert torch.equal(p, honest[n]), n


@pytest.mark.asyncio
async def test_two_replicas_that_disagree_are_not_trusted_and_one_is_taken_unverified(test_manifest):
    from node.net import StateSyncError

    m = test_manifest
    net = Net()
    honest, poisoned = _replicas_of_one_state(m, net, ["a", "p"], version=7, poisoned={"p"})
    joiner = make_runtime(m, 1, "new", net, seed=2)
    link([honest, poisoned, joiner])
    await start_all([honest, poisoned])
    await joiner.start()
    before = {n: p.detach().clone() for n, p in joiner.stage.named_parameters()}
    try:
        with pytest.raises(StateSyncError, match="disagree"):
            await joiner.sync_from_replicas()
        for n, p in joiner.stage.named_parameters():  # nothing adopted
            assert torch.equal(p, before[n]), n
        link([honest, joiner])  # one replica online: nothing to compare with
        got = await joiner.sync_from_replicas()
    finally:
        await stop_all([honest, poisoned, joiner])
    assert (got.source, got.verified, got.refused) == ("a", False, [])


@pytest.mark.asyncio
async def test_a_banned_replica_keeps_its_weights_caught_up_with_another_replica(test_manifest):
    """After a neighbour answers "banned", a replica fetches another replica's weights (and
    version) every ``resync_every`` seconds until something of its own is accepted again, so it
    does not come back with weights a whole ban old; then it stops."""
    m = test_manifest
    net = Net()
    online = moved_replica(m, net, "old", version=42)
    stale = make_runtime(m, 1, "stale", net, seed=2, resync_every=0.05)
    link([online, stale])
    await start_all([online, stale])
    try:
        stale.guard.note_banned()
        assert await wait_for(lambda: stale.version == 42, timeout=5.0)
        for (n, a), (_, b) in zip(online.stage.named_parameters(), stale.stage.named_parameters()):
            assert torch.equal(a, b), n
        assert stale.trainer.lookahead.weights().version == 42
        assert value(stale, "swarm_node_state_sync_bytes_total", direction="in") > 0
        with torch.no_grad():  # the other replica trains on; so does the re-sync
            next(online.stage.parameters()).add_(1.0)
        assert await wait_for(lambda: torch.equal(next(online.stage.parameters()),
                                                  next(stale.stage.parameters())), timeout=5.0)
        stale.guard.last_accepted = time.monotonic()  # our traffic is accepted again
        assert await wait_for(lambda: stale.guard.resync_task.done(), timeout=5.0)
    finally:
        await stop_all([online, stale])
    # off, and alone in its stage: nothing to do, nothing breaks
    lone = make_runtime(m, 1, "lone", Net(), resync_every=0.0)
    lone.guard.note_banned()
    assert lone.guard.resync_task is None
    assert await make_runtime(m, 1, "lone2", Net()).resync_from_replica() is False


@pytest.mark.asyncio
async def test_a_banned_reply_from_the_next_stage_starts_the_resync(test_manifest):
    m = test_manifest
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m), steps=2)
    body = make_runtime(m, 1, "body", net, resync_every=0.05)
    tail = make_runtime(m, 2, "tail", net)
    tail.guard.banlist.ban("body", time.monotonic())
    link([head, body, tail])
    await start_all([head, body, tail])
    drive = asyncio.ensure_future(head.drive())
    try:
        assert await wait_for(lambda: body.guard.resync_task is not None, timeout=10.0)
        assert body.guard.banned_at is not None and body.guard.last_accepted < body.guard.banned_at
    finally:
        drive.cancel()
        await stop_all([head, body, tail])


@pytest.mark.asyncio
@pytest.mark.parametrize("horizon", ["pipeline", "stage"])
async def test_step_log_records_how_far_each_stage_looks_ahead(test_manifest, horizon):
    """``--json-log``: one JSON object per optimizer step, with the look-ahead the next forward
    uses (own steps), the step period, and the distance of those weights from the live ones."""
    import io
    import json

    m = test_manifest.replace(schedule={"warmup_steps": 2}, asyncmesh={"lookahead_horizon": horizon})
    net = Net()
    rts = [make_runtime(m, 0, "head", net, batches=head_batches(m), steps=20),
           make_runtime(m, 1, "body", net), make_runtime(m, 2, "tail", net)]
    logs = [io.StringIO() for _ in rts]
    for rt, f in zip(rts, logs):
        rt.trainer.step_log = f

    class Spy:  # an averager that only notes whether the step's look-ahead weights exist yet
        def __init__(self):
            self.cached_at_average = []

        def maybe_average(self, v):
            cached = rts[1].trainer.lookahead._cached
            self.cached_at_average.append(cached is None or cached.version != v)

    spy = rts[1].trainer.averager = Spy()  # logging must not compute them before an average is applied
    await train_until(rts, 20)
    recs = [[json.loads(line) for line in f.getvalue().splitlines()] for f in logs]
    for rt, rs in zip(rts, recs):
        assert [r["step"] for r in rs] == list(range(1, len(rs) + 1)) and len(rs) >= 20
        assert all(r["stage"] == rt.index for r in rs)
        assert rs[-1]["period_s"] > 0 and all(r["lookahead_dist"] >= 0 for r in rs)
    for rs in recs[:2]:  # head and body wait for gradients: they look ahead, their weights move
        assert max(r["lookahead_steps"] for r in rs) > 0 and max(r["lookahead_dist"] for r in rs) > 0
    assert all(spy.cached_at_average) and len(spy.cached_at_average) >= 20
    body_horizon, tail = recs[1][-1]["horizon_s"], recs[2]
    if horizon == "pipeline":  # every stage looks ahead by the head's horizon, sent in seconds
        assert body_horizon > 0 and max(r["lookahead_dist"] for r in tail) > 0
    else:  # own delays only: the tail's gradient is immediate, nothing to look ahead for
        assert body_horizon is None and all(r["lookahead_dist"] == 0 for r in tail)


def test_checkpoint_state_round_trip(test_manifest, tmp_path):
    from node.base import load_latest_checkpoint, save_checkpoint

    m = test_manifest
    net = Net()
    a = make_runtime(m, 1, "a", net, seed=3)
    x = torch.randn(m.data.batch_size, m.model.seq_len, m.k)
    ids = torch.randint(0, 256, (m.data.batch_size, m.model.seq_len))
    a.stage(x, ids).square().mean().backward()
    a.trainer.optimizer.step()
    a.trainer.lookahead.stepped()
    tensors, meta = a.checkpoint_state()
    save_checkpoint(tmp_path, a.version, tensors, meta)
    step, tensors, meta = load_latest_checkpoint(tmp_path)
    b = make_runtime(m, 1, "b", net, seed=4)
    b.restore(tensors, meta)
    assert step == b.version == 1 and meta["stage"] == 1 and meta["manifest_hash"] == a.mhash
    for (n, p), (_, q) in zip(a.stage.named_parameters(), b.stage.named_parameters()):
        assert torch.equal(p, q), n
    sa, sb = a.trainer.optimizer.state_dict()["state"], b.trainer.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)


@pytest.mark.asyncio
async def test_compute_worker_runs_gradients_before_forwards():
    worker = ComputeWorker()
    worker.start()
    gate, order = threading.Event(), []
    try:
        first = worker.submit("fwd", gate.wait)
        futs = [worker.submit("fwd", order.append, "fwd1"), worker.submit("bwd", order.append, "bwd1"),
                worker.submit("fwd", order.append, "fwd2"), worker.submit("ctl", order.append, "ctl"),
                worker.submit("bwd", order.append, "bwd2")]
        with pytest.raises(QueueFull):
            worker.submit("fwd", order.append, "x", bound=2)
        gate.set()
        await asyncio.gather(first, *futs)
        assert order == ["ctl", "bwd1", "bwd2", "fwd1", "fwd2"]
        boom = worker.submit("bwd", lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            await boom
    finally:
        worker.stop()
    assert not worker._thread.is_alive()


@pytest.mark.asyncio
async def test_handlers_refuse_what_a_stage_cannot_take(test_manifest):
    m = test_manifest
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m))
    tail = make_runtime(m, 2, "tail", net)
    joining = make_runtime(m, 1, "joining", net)
    await head.start()
    await tail.start()
    await joining.start()  # started but not online yet
    head.set_state("online")
    tail.set_state("online")
    peer = MemTransport(net, "x")
    c = torch.randn(m.data.batch_size, m.model.seq_len, m.k)
    ids = torch.randint(0, 256, (m.data.batch_size, m.model.seq_len), dtype=torch.int32)
    try:
        with pytest.raises(PeerRejected) as e:
            await peer.request("head", FWD, make_fwd(m.run.id, head.mhash, 1, 0, 0, ["x"], c, ids), timeout=2)
        # the head takes no fwd at all: its fwd limit admits no body, so it refuses before reading one
        assert e.value.reason == "too-large"
        from protocol import make_bwd

        with pytest.raises(PeerRejected) as e:
            await peer.request("tail", BWD, make_bwd(m.run.id, tail.mhash, 1, 3, 0, ["a", "b", "tail", "x"], c),
                               timeout=2)
        assert e.value.reason == "too-large"  # likewise the tail for bwd
        with pytest.raises(PeerRejected) as e:  # a frame without a body gets the real reason
            await peer.request("tail", BWD, make_bwd(m.run.id, tail.mhash, 1, 3, 0, ["a", "b", "tail", "x"], None,
                                                     skip="busy"), timeout=2)
        assert e.value.reason == "wrong-stage"
        with pytest.raises(PeerBusy):  # joining: not serving yet
            await peer.request("joining", FWD, make_fwd(m.run.id, head.mhash, 1, 0, 0, ["x"], c, ids), timeout=2)
        # a gradient for a microbatch the head never sent is refused as stale
        with pytest.raises(PeerRejected) as e:
            await peer.request("head", BWD, make_bwd(m.run.id, head.mhash, 77, 1, 0, ["head", "x"], c), timeout=2)
        assert e.value.reason == "stale"
        huge = torch.randn(tail.max_batch * 2, m.model.seq_len, m.k)
        big_ids = torch.zeros(huge.shape[:2], dtype=torch.int32)
        with pytest.raises(PeerRejected) as e:  # refused from the header, before the body is allocated
            await peer.request("tail", FWD, make_fwd(m.run.id, tail.mhash, 6, 1, 0, ["h", "x"], huge, big_ids),
                               timeout=2)
        assert e.value.reason == "too-large"
        bad = c.clone()
        bad[0, 0, 0] = float("nan")
        with pytest.raises(PeerRejected) as e:
            await peer.request("tail", FWD, make_fwd(m.run.id, tail.mhash, 5, 1, 0, ["h", "x"], bad, ids), timeout=2)
        assert e.value.reason == "bad-frame"
    finally:
        await stop_all([head, tail, joining])
    assert tail.version == 0 and not head.pipeline.contexts
    assert Reason.BUSY.value == "busy"


@pytest.mark.asyncio
async def test_architecture_warmup_unlocks_each_stages_blocks_on_the_shared_schedule(test_manifest):
    """Warm-up in a swarm: each stage locks its own blocks of the manifest's groups (exact
    identity, out of the optimizer) and unlocks them at its own step of the shared schedule;
    unlocked blocks then train. A restore at a later step re-creates the lock state without
    touching the loaded weights."""
    m = test_manifest.replace(warmup={"enabled": True, "groups": ((1,), (2,)), "unlock_steps": (4, 8)})
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m), steps=14)
    body = make_runtime(m, 1, "body", net)
    tail = make_runtime(m, 2, "tail", net)
    rts = [head, body, tail]
    body_block, tail_block = body.stage.blocks[0], tail.stage.blocks[0]
    assert body.trainer.warmup.locked == {1} and tail.trainer.warmup.locked == {2} and head.trainer.warmup.locked == set()
    assert not body_block.active and not any(p.requires_grad for p in body_block.parameters())
    before = {n: p.detach().clone() for n, p in tail_block.named_parameters()}
    await train_until(rts, 14, drain=True)
    assert body.trainer.warmup.locked == set() and tail.trainer.warmup.locked == set()
    assert body_block.active and tail_block.active
    # unlocked at step 8 and trained for ~6 steps since: re-initialised, then moved by updates
    proj = {id(p) for q in tail_block.output_projections() for p in q.parameters()}
    moved = [n for n, p in tail_block.named_parameters() if id(p) in proj and p.abs().sum() > 0]
    assert moved, "the unlocked block's output projection never left zero"
    assert any(not torch.equal(p, before[n]) for n, p in tail_block.named_parameters())
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in tail.trainer.loss_history)

    # a restore at step 5 (a checkpoint of the body): layer 1 is unlocked as loaded, untouched
    fresh = make_runtime(m, 1, "body2", Net())
    tensors, meta = body.checkpoint_state()
    meta = {**meta, "version": 5}
    fresh.restore(tensors, meta)
    assert fresh.trainer.warmup.locked == set() and fresh.stage.blocks[0].active
    for (n, p), (_, q) in zip(fresh.stage.named_parameters(), body.stage.named_parameters()):
        assert torch.equal(p, q), n
    late = make_runtime(m, 2, "tail2", Net())
    late.trainer.set_version(5)  # a joiner that downloaded the tail's state at step 5: layer 2 still locked
    assert late.trainer.warmup.locked == {2} and not late.stage.blocks[0].active


@pytest.mark.asyncio
@pytest.mark.parametrize("horizon", ["stage", "pipeline"])
async def test_pipeline_horizon_travels_with_fwd_and_sets_downstream_lookahead(test_manifest, horizon):
    """asyncmesh.lookahead_horizon = "pipeline": the head's τ̂ rides in every fwd as seconds (τ̂ ×
    its step period), the body passes it on, and body and tail extrapolate by max(own τ̂, that
    horizon in their own steps); with "stage" (the default) no fwd carries one and every stage
    uses its own τ̂ (the tail's is 0: it does not look ahead)."""
    m = test_manifest.replace(schedule={"warmup_steps": 2}, asyncmesh={"lookahead_horizon": horizon})
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m), steps=40)
    body = make_runtime(m, 1, "body", net)
    tail = make_runtime(m, 2, "tail", net)
    rts = [head, body, tail]
    sent = []
    orig = body.transport.request

    async def spy(peer, protocol, frames, *a, **kw):  # the body's outgoing fwds
        if protocol == FWD:
            sent.append(frame_of(buffers_of(frames)).header.get("horizon_s"))
        return await orig(peer, protocol, frames, *a, **kw)

    body.transport.request = spy
    await train_until(rts, 40)
    head_tau = head.trainer.lookahead.delays.tau_hat
    assert head_tau > 0 and head.trainer.lookahead.horizon is None  # the head looks ahead by its own τ̂ either way
    if horizon == "stage":
        assert body.trainer.lookahead.horizon is None and tail.trainer.lookahead.horizon is None and set(sent) == {None}
        assert tail.trainer.lookahead.weights().tau_hat == 0
        return
    # passed on by the body; the first microbatches left the head before its step period was
    # known (two steps: up to max_inflight + 1 microbatches)
    first = next(i for i, h in enumerate(sent) if h is not None)
    assert first <= m.train.max_inflight + 1 and all(h is not None for h in sent[first:]) and sent[-1] > 0
    for rt in (body, tail):
        # the EMA of the head's seconds over this stage's own step period; one replica per
        # stage, so every stage steps once per microbatch and that is about the head's τ̂
        assert rt.trainer.lookahead.horizon == pytest.approx(min(rt.trainer.horizon_s / rt.trainer.clock.period, rt.trainer.max_horizon))
        assert rt.trainer.lookahead.horizon == pytest.approx(head_tau, abs=1.5)
        assert rt.trainer.lookahead.extrapolation == max(rt.trainer.lookahead.delays.tau_hat, rt.trainer.lookahead.horizon)
        assert rt.status()["lookahead_horizon"] == round(rt.trainer.lookahead.extrapolation, 2)
    assert tail.trainer.lookahead.horizon > 0 and tail.trainer.lookahead.weights().tau_hat == tail.trainer.lookahead.extrapolation == tail.trainer.lookahead.horizon
    # a peer announcing an absurd horizon (the protocol allows up to an hour) cannot push a
    # stage's extrapolation past its max_inflight, the bound of the head's delay in 1F1B
    for _ in range(200):
        body.trainer.note_head_horizon(3600.0)
    assert body.trainer.lookahead.horizon <= body.trainer.max_horizon == m.train.max_inflight


def test_pipeline_horizon_is_counted_in_own_steps(test_manifest):
    """A body replica that gets a third of the microbatches steps a third as often: the head's
    horizon (τ̂ = 3 head steps, 1 s per step) is 1 of its own steps, not 3 (looking 3 of its own
    steps ahead went three times as far into the future as the head, and its output swung)."""
    m = test_manifest.replace(asyncmesh={"lookahead_horizon": "pipeline"})
    net = Net()
    head = make_runtime(m, 0, "head", net)
    body = make_runtime(m, 1, "body", net)
    head.trainer.lookahead.delays.tau_hat = 3.0
    for t in range(5):
        head.trainer.clock.tick(float(t))  # one step a second
        body.trainer.clock.tick(3.0 * t)  # one step every three seconds
    ctx = type("Ctx", (), {"horizon_s": None})()
    h_s = head.trainer.horizon_to_send(ctx)
    assert h_s == pytest.approx(3.0)
    assert body.trainer.lookahead.horizon is None  # nothing received yet
    body.trainer.note_head_horizon(h_s)
    assert body.trainer.lookahead.horizon == pytest.approx(1.0)
    assert body.trainer.horizon_to_send(type("Ctx", (), {"horizon_s": h_s})()) == h_s  # passed on unchanged
    body.trainer.clock.tick(12.0 + 1.5)  # the body speeds up: a step 1.5 s after the last one
    body.trainer._refresh_horizon()
    assert body.trainer.lookahead.horizon == pytest.approx(3.0 / (0.9 * 3.0 + 0.1 * 1.5))
