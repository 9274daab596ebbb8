"""Morph epochs in the swarm, in one process: real stage runtimes exchanging real frames through the
in-memory transport (tests/helpers/memnet.py). The seeds are dealt over ``/swarm-node/morph/1``,
both sides of each boundary fold from them on their own, frames carry their epoch, and the
runtimes train across epochs. The multi-process version is tests/test_morph_swarm_e2e.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import torch

from node.net import PeerRejected, StateSyncError
from protocol import BWD, FWD, MORPH, Reason, make_bwd, make_fwd
from tests.helpers.runtime import (
    Net,
    Rec,
    RecordingVerifier,
    head_batches,
    link,
    make_runtime,
    start_all,
    stop_all,
    value,
    wait_for,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]

EVERY = 8  # head steps per morph epoch in these tests



def morph_manifest(test_manifest, every=EVERY):
    """stages/runs/test.toml with an optimizer that follows a change of basis (Muon, SGD for the rest)."""
    return test_manifest.replace(optim={"name": "muon", "lr": 0.02, "aux_optimizer": "sgd", "aux_lr": 0.05},
                                 schedule={"warmup_steps": 2}, morph={"every": every})


def chain_logits(rts, ids):
    """The chained function head -> body -> tail of three runtimes' stages, on their live weights."""
    with torch.no_grad():
        x = None
        for rt in rts:
            x = rt.stage(x, ids)
    return x


async def with_workers_held(rts, fn):
    """``fn()`` run on the compute thread of ``rts[0]`` while the compute threads of the others wait:
    the live weights of all the stages are read between two of their compute jobs."""
    ready, release = [threading.Event() for _ in rts[1:]], threading.Event()

    def hold(ev):
        ev.set()
        release.wait(30)

    held = [rt.worker.submit("ctl", hold, ev) for rt, ev in zip(rts[1:], ready)]
    try:
        def run():
            if not all(ev.wait(30) for ev in ready):
                raise TimeoutError("a compute thread did not come free within 30 s")
            return fn()

        return await rts[0].worker.submit("ctl", run)
    finally:
        release.set()
        await asyncio.gather(*held)


def seeds_held(rts):
    return {s for rt in rts for _, s in rt.morph._seeds.values()}


async def deal_and_enter(rts, epoch):
    """Let the dealers deal the seeds of ``epoch`` (a maintenance beat each), then enter it everywhere."""
    for rt in rts:
        rt.morph.sweep()
    assert await wait_for(lambda: all(not rt.morph.missing_seeds(epoch) for rt in rts), timeout=10)
    for rt in rts:
        assert await rt.morph.enter(epoch)


@pytest.mark.asyncio
async def test_a_dealer_that_entered_the_epoch_still_delivers_its_seed_to_a_replica_it_missed(test_manifest):
    """The head deals boundary 0's seed while the head's record has not reached the body yet (so
    the body answers ``busy``), and enters the epoch (its own side needs only its own seed). The
    seed stays with the head until the body has it: once the body sees the head it gets it,
    enters the epoch with the others and the chain is unchanged; then the head forgets it.
    (Forgetting it at the fold left a lone body replica waiting for a seed nobody held any
    more: a swarm stalled so in the e2e test.)"""
    m = morph_manifest(test_manifest)
    net = Net()
    head, body, tail = rts = [make_runtime(m, i, f"p{i}", net, seed=i) for i in range(3)]
    link(rts)
    body.router.update([Rec(body.peer_id, 1), Rec(tail.peer_id, 2)])  # the head's record has not reached the body
    await start_all(rts)
    ids = torch.randint(0, 256, (2, m.model.seq_len), generator=torch.Generator().manual_seed(5))
    try:
        before = chain_logits(rts, ids)
        for rt in rts:
            rt.morph.sweep()
        assert await wait_for(lambda: body.morph.has_seed(1, 1) and tail.morph.has_seed(1, 1), timeout=10)
        assert await head.morph.enter(1)
        assert not body.morph.has_seed(0, 1) and head.morph.has_seed(0, 1)  # kept: the body lacks it
        assert not await body.morph.enter(1)  # a seed missing: the body cannot follow yet
        link(rts)  # the head's record arrives
        head.morph.sweep()
        assert await wait_for(lambda: body.morph.has_seed(0, 1), timeout=10)
        assert await body.morph.enter(1) and await tail.morph.enter(1)
        torch.testing.assert_close(chain_logits(rts, ids), before, rtol=2e-4, atol=2e-4)
        head.morph.sweep()  # every replica across boundary 0 has it now: the head drops it
        assert not any(key[1] == 1 for rt in rts for key in rt.morph._seeds)
    finally:
        await stop_all(rts)


@pytest.mark.asyncio
async def test_both_sides_derive_the_same_transform_the_chain_is_unchanged_and_the_seed_stays_secret(
        test_manifest, caplog):
    m = morph_manifest(test_manifest)
    net = Net()
    rts = [make_runtime(m, i, f"p{i}", net, seed=i) for i in range(3)]
    link(rts)
    await start_all(rts)
    caplog.set_level(logging.DEBUG)
    ids = torch.randint(0, 256, (2, m.model.seq_len), generator=torch.Generator().manual_seed(1))
    try:
        before = chain_logits(rts, ids)
        w_before = {i: {n: p.detach().clone() for n, p in rt.stage.named_parameters()} for i, rt in enumerate(rts)}
        seen: set[bytes] = set()
        for epoch in (1, 2, 3):
            for rt in rts:
                rt.morph.sweep()
            assert await wait_for(lambda: all(not rt.morph.missing_seeds(epoch) for rt in rts), timeout=10)
            # both sides of each boundary hold the same seed, and each boundary its own
            b0 = {rt.morph._seeds[(0, epoch)][1] for rt in rts[:2]}
            b1 = {rt.morph._seeds[(1, epoch)][1] for rt in rts[1:]}
            assert len(b0) == len(b1) == 1 and b0 != b1
            seen |= b0 | b1
            for rt in rts:
                assert await rt.morph.enter(epoch)
            assert not seeds_held(rts)  # discarded after folding
            assert all(rt.morph.epoch == epoch for rt in rts)
        after = chain_logits(rts, ids)
        torch.testing.assert_close(after, before, rtol=2e-4, atol=2e-4)
        # ... while the weights themselves moved: stages taken apart at epochs 0 and 3 do not fit
        body_qkv = "blocks.0.attn.qkv_proj.weight"
        moved = (rts[1].stage.get_parameter(body_qkv) - w_before[1][body_qkv]).norm() / w_before[1][body_qkv].norm()
        assert moved > 0.1, float(moved)
        for i, rt in enumerate(rts):
            assert value(rt, "swarm_node_morph_epoch") == 3
            assert value(rt, "swarm_node_morphs_total") == 3
            assert value(rt, "swarm_node_morph_seconds") > 0
            assert rt.status()["morph_epoch"] == 3
    finally:
        await stop_all(rts)
    # the seeds went over the morph protocol only: never into a header, a log line or the status
    text = caplog.text + repr([rt.status() for rt in rts])
    headers = [h for rt in rts for _, _, h in rt.transport.sent]
    # one dealer per boundary and epoch, one receiver across it: 2 boundaries x 3 epochs
    assert sum(1 for rt in rts for _, proto, _ in rt.transport.sent if proto == MORPH) == 2 * 3
    for s in seen:
        for form in (s.hex(), repr(s), str(list(s))):
            assert form not in text and form not in repr(headers)


@pytest.mark.asyncio
async def test_frames_of_another_epoch_are_refused_and_never_mixed(test_manifest):
    m = morph_manifest(test_manifest)
    net = Net()
    v_body = RecordingVerifier()
    head = make_runtime(m, 0, "head", net)
    body = make_runtime(m, 1, "body", net, verifier=v_body)
    tail = make_runtime(m, 2, "tail", net)
    rts = [head, body, tail]
    link(rts)
    await start_all(rts)
    sender = head.transport
    B, L, k = m.data.batch_size, m.model.seq_len, m.k
    c = torch.randn(B, L, k)
    ids = torch.randint(0, 256, (B, L), dtype=torch.int32)

    def fwd(mb, epoch):
        return make_fwd(m.run.id, body.mhash, mb, 0, 0, ["head"], c, ids, epoch=epoch)

    try:
        await deal_and_enter(rts, 1)
        # an older epoch's activations: refused with the receiver's epoch, never verified or computed
        with pytest.raises(PeerRejected) as e:
            await sender.request("body", FWD, fwd(1, 0), timeout=2)
        assert (e.value.reason, e.value.epoch) == (Reason.WRONG_EPOCH.value, 1)
        # two epochs ahead: this stage missed a seed; refused (and it starts catching up)
        with pytest.raises(PeerRejected) as e:
            await sender.request("body", FWD, fwd(2, 3), timeout=2)
        assert (e.value.reason, e.value.epoch) == (Reason.WRONG_EPOCH.value, 1)
        # the next epoch without its seeds: busy (wait for them), nothing folded
        from node.net import PeerBusy

        with pytest.raises(PeerBusy):
            await sender.request("body", FWD, fwd(3, 2), timeout=2)
        assert body.morph.epoch == 1 and not body.pipeline.contexts and not body.pipeline.pending
        assert v_body.seen == []
        assert value(body, "swarm_node_served_total", protocol="fwd", result="wrong-epoch") == 3
        # the current epoch goes through
        reply = await sender.request("body", FWD, fwd(4, 1), timeout=2)
        assert reply.header["type"] == "ack"
        assert await wait_for(lambda: 4 in body.pipeline.contexts or tail.version > 0, timeout=20)
        # a gradient of another epoch than its forward's: refused, the context dropped, upstream told
        body.pipeline.contexts.clear()
        head_ctx_mb = 5
        route = ("head", "body", "tail")
        from node.runtime import Context

        w = body.trainer.lookahead.weights()
        body.pipeline.contexts[head_ctx_mb] = Context(head_ctx_mb, route[:2], c, ids.long(), ids, w, 0,
                                                       next_peer="tail", epoch=1)
        grad = make_bwd(m.run.id, body.mhash, head_ctx_mb, 2, 0, route, torch.randn(B, L, k), epoch=0)
        with pytest.raises(PeerRejected) as e:
            await tail.transport.request("body", BWD, grad, timeout=2)
        assert (e.value.reason, e.value.epoch) == (Reason.WRONG_EPOCH.value, 1)
        assert head_ctx_mb not in body.pipeline.contexts
        assert await wait_for(lambda: any(p == "head" and h.get("skip") == "wrong-epoch" and h.get("mb") == head_ctx_mb
                                          for p, proto, h in body.transport.sent if proto == BWD), timeout=5)
        # the compute thread checks again: a job of the old epoch raises instead of computing
        from node.runtime.trainer import EpochChanged
        from protocol import Fwd

        old = Fwd(9, 0, 0, route[:1], "subspace", 0, c, ids, epoch=0)
        with pytest.raises(EpochChanged):
            body.trainer.compute_fwd(old)
    finally:
        await stop_all(rts)


@pytest.mark.asyncio
async def test_three_stages_train_across_morph_epochs_like_without(test_manifest):
    """Head, body and tail train 72 head steps: with morphing every 8 steps (8 epoch changes) the loss falls
    as it does without morphing, the same seeds and data."""
    steps = 72
    results = {}
    for every in (0, EVERY):
        m = morph_manifest(test_manifest, every)
        net = Net()
        rts = [make_runtime(m, 0, "head", net, batches=head_batches(m), steps=steps),
               make_runtime(m, 1, "body", net, seed=1), make_runtime(m, 2, "tail", net, seed=2)]
        link(rts)
        await start_all(rts)
        drive = asyncio.ensure_future(rts[0].drive())
        maintain = [asyncio.ensure_future(rt.maintain(period=0.05)) for rt in rts]
        try:
            assert await wait_for(lambda: rts[0].version >= steps and rts[0].inflight == 0, timeout=150)
            await asyncio.wait_for(drive, 5)
        finally:
            for t in maintain:
                t.cancel()
            await stop_all(rts)
        losses = [loss for _, loss in rts[2].trainer.loss_history]
        results[every] = (losses, [rt.morph.epoch for rt in rts], rts)
    plain, _, _ = results[0]
    losses, epochs, rts = results[EVERY]
    entered = (steps - 1) // EVERY  # epoch e begins at head version e·M, before the head's next injection
    assert epochs == [entered] * 3, epochs  # every stage went through every epoch
    assert entered >= 5
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < first - 0.5, (first, last)
    plain_last = sum(plain[-8:]) / 8
    assert abs(last - plain_last) < 0.15, (last, plain_last)
    # the head drained before each fold: nothing was lost to the epoch changes
    assert value(rts[0], "swarm_node_microbatches_total", outcome="dropped") == 0
    assert len(losses) >= steps
    for rt in rts:
        assert value(rt, "swarm_node_morphs_total") == entered
        assert not rt.morph._seeds or all(e > rt.morph.epoch for _, e in rt.morph._seeds)


@pytest.mark.asyncio
async def test_a_joiner_gets_state_two_epochs_after_it_appeared_in_the_current_basis(test_manifest):
    """A second body replica appears at epoch e: the first one refuses it its state (busy) until
    epoch e+2, then serves it tagged with its epoch; the joiner takes weights and epoch, gets the
    next seeds and trains along across the following epochs."""
    m = morph_manifest(test_manifest, every=4)
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m))
    b1 = make_runtime(m, 1, "b1", net, seed=1)
    tail = make_runtime(m, 2, "tail", net, seed=2)
    b2 = make_runtime(m, 1, "b2", net, seed=5)
    rts = [head, b1, tail]
    link(rts)
    await start_all(rts)
    drive = asyncio.ensure_future(head.drive())
    maintain = [asyncio.ensure_future(rt.maintain(period=0.05)) for rt in rts]
    try:
        assert await wait_for(lambda: all(rt.morph.epoch >= 1 for rt in rts), timeout=60)  # past the founders
        # b2 appears (joining): everyone sees it from now on
        await b2.start()
        b2.set_state("joining")
        recs = [Rec(rt.peer_id, rt.index) for rt in rts] + [Rec("b2", 1, state="joining")]
        for rt in rts:
            rt.router.update(recs)
            rt.morph.sweep()
        b2.router.update([Rec(rt.peer_id, rt.index) for rt in rts])
        appeared = b1.morph.epoch
        with pytest.raises(StateSyncError) as e:
            await b2.sync_from_replicas()
        assert e.value.busy
        assert await wait_for(lambda: b1.morph.epoch >= appeared + 2, timeout=90)
        got = await b2.sync_from_replicas()
        assert got.epoch >= appeared + 2 and b2.morph.epoch == got.epoch
        assert "morph_in" in got.tensors and "morph_out" in got.tensors  # the basis maps travel with the weights
        ids = torch.randint(0, 256, (2, m.model.seq_len), generator=torch.Generator().manual_seed(3))

        def compare():
            return b1.trainer.epoch, chain_logits([head, b1, tail], ids), chain_logits([head, b2, tail], ids)

        # with every compute thread held: no fold (which turns b1's weights before its epoch reads the
        # new one) and no optimizer step of any stage runs while the weights are read
        epoch_b1, via_b1, via_b2 = await with_workers_held([head, b1, tail, b2], compare)
        if epoch_b1 == got.epoch:  # (b1 may have entered the next epoch meanwhile)
            rel = float((via_b2 - via_b1).norm() / via_b1.norm())
            assert rel < 0.05, rel  # the joiner's stage fits its neighbours (b1 trained a step or two since)
        b2.set_state("online")
        maintain.append(asyncio.ensure_future(b2.maintain(period=0.05)))
        recs[-1] = Rec("b2", 1)
        for rt in [head, b1, tail, b2]:
            rt.router.update(recs)
        joined_at = b2.morph.epoch
        # b2 follows the next epochs: it gets the seeds and folds, and takes microbatches
        assert await wait_for(lambda: b2.morph.epoch >= joined_at + 2 and b2.version > got.version + 2, timeout=90)
        assert head.morph.epoch - 1 <= b2.morph.epoch <= head.morph.epoch
        # the two replicas stay in one basis: in the same epoch their basis maps are the same (they
        # folded the same transforms since b2 took b1's maps; one fold missed or taken from another
        # seed would change them). Their weights drift apart (different microbatches, no averaging
        # in one process), so the maps, not the outputs, are what to compare here.
        # (compared with no fold running on either: folds start only from ``enter``, under its lock,
        # on this event loop, and nothing below yields to it)
        assert await wait_for(lambda: b1.morph.epoch == b2.morph.epoch and not b1.morph._lock.locked()
                              and not b2.morph._lock.locked(), timeout=30)
        assert b2.morph.epoch > got.epoch
        for name in ("morph_in", "morph_out"):
            torch.testing.assert_close(b2.stage.get_buffer(name), b1.stage.get_buffer(name), rtol=0, atol=1e-9)
    finally:
        drive.cancel()
        for t in maintain:
            t.cancel()
        await stop_all(rts + [b2])
