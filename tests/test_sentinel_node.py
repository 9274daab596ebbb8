"""The node's side of SENTINEL, in one process (node/runtime/ over the in-memory transport of
tests/test_runtime.py): a ban makes the verifier forget the sender; the stage before a replica
whose output keeps being refused stops routing work to it, and only the hop whose tensors were
refused is blamed; attacks keep one instance per direction; the verifier's thread has its own
torch thread count. The same ban flow over real streams is tests/test_sentinel_swarm.py.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from node.runtime import pin_torch_threads
from security import SentinelVerifier
from tests.helpers.runtime import (
    Net, RecordingVerifier, establish, head_batches, link, make_runtime, start_all, stop_all, value, wait_for,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]



class ForgettingVerifier(RecordingVerifier):
    """RecordingVerifier that also notes ``forget`` calls, and on which thread they ran."""

    def __init__(self, reject=()):
        super().__init__(reject=set(reject))
        self.forgotten: list[tuple[str, str]] = []

    def forget(self, sender):
        self.forgotten.append((sender, threading.current_thread().name))


def counted(rt, protocol="fwd", result="ack"):
    return value(rt, "swarm_node_served_total", protocol=protocol, result=result)


@pytest.mark.asyncio
async def test_a_verifier_ban_makes_the_verifier_forget_the_sender(test_manifest):
    m = test_manifest
    net = Net()
    verifier = ForgettingVerifier(reject={"head"})
    head = make_runtime(m, 0, "head", net, batches=head_batches(m), max_inflight=1)
    body = make_runtime(m, 1, "body", net, verifier=verifier)
    link([head, body])
    await start_all([head, body])
    drive = asyncio.ensure_future(head.drive())
    try:
        assert await wait_for(lambda: body.router.is_banned("head") and verifier.forgotten, timeout=30)
    finally:
        drive.cancel()
        await stop_all([head, body])
    assert verifier.forgotten == [("head", verifier.forgotten[0][1])]
    assert verifier.forgotten[0][1].startswith("verify")  # off the event loop, after queued verdicts


def test_forget_drops_the_senders_references_so_it_returns_as_a_newcomer():
    v = SentinelVerifier(8, seq_len=16)
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        for sender in ("a", "b"):
            x = torch.randn(2, 16, 8, generator=g)
            v.verify(sender, "act", x, ids=torch.randint(0, 256, (2, 16), generator=g), mb=(sender, i))
    assert set(v.sentinel.peer_report("act")) == {"a", "b"}
    v.forget("b")
    assert set(v.sentinel.peer_report("act")) == {"a"}


@pytest.mark.asyncio
async def test_upstream_stops_routing_to_a_replica_whose_output_is_refused(test_manifest):
    """Two body replicas; the tail refuses everything b2 sends. b2 reports each refusal to the head
    (skip: rejected-by-verifier, its own output): the tail bans b2 for its tensors, the head for
    its refused output (flags_to_ban + 2 refusals in a row), b2 stops getting work, b1 carries the
    traffic and is banned by no one."""
    m = test_manifest.replace(schedule={"warmup_steps": 2})
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m), max_inflight=2)
    b1 = make_runtime(m, 1, "b1", net, seed=1)
    # no re-sync after refusals (its own test below): b2's version then shows it never stepped
    b2 = make_runtime(m, 1, "b2", net, seed=1, resync_after_refusals=0)
    v_tail = ForgettingVerifier(reject={"b2"})
    tail = make_runtime(m, 2, "tail", net, verifier=v_tail)
    rts = [head, b1, b2, tail]
    link(rts)
    await start_all(rts)
    drive = asyncio.ensure_future(head.drive())
    try:
        assert await wait_for(lambda: head.router.is_banned("b2") and tail.router.is_banned("b2"), timeout=60)
        await asyncio.sleep(0.3)  # what was already on its way lands
        b2_served, b1_steps, tail_steps = counted(b2), b1.version, tail.version
        assert await wait_for(lambda: b1.version >= b1_steps + 10 and tail.version >= tail_steps + 10, timeout=60)
        assert counted(b2) == b2_served  # no new work for the banned replica
    finally:
        drive.cancel()
        await stop_all(rts)
    flags = m.sentinel.flags_to_ban
    assert value(head, "swarm_node_bans_total", cause="verifier-downstream") == 1
    assert value(tail, "swarm_node_bans_total", cause="verifier") == 1
    assert value(tail, "swarm_node_verifier_verdicts_total", direction="act", verdict="reject") == flags
    assert b2.version == 0  # it never got a gradient
    assert not head.router.is_banned("b1") and not tail.router.is_banned("b1")
    assert [p for p, _ in v_tail.forgotten] == ["b2"]


@pytest.mark.asyncio
async def test_a_replica_banned_by_the_downstream_rule_alone_is_told_and_resyncs(test_manifest):
    """The tail refuses b2's output but does not ban b2 (its ban list never fills); the head bans
    b2 by the downstream rule. b2's refused microbatches bring it no gradient and it gets no more
    work, so the head's answer to the skip that banned it is the only thing that can tell it:
    that answer is ``banned``, and b2 starts re-syncing its weights from b1."""
    from security import BanList

    m = test_manifest.replace(schedule={"warmup_steps": 2})
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m), max_inflight=2)
    b1 = make_runtime(m, 1, "b1", net, seed=1)
    # only the re-sync while banned (the one after refusals is tested on its own below)
    b2 = make_runtime(m, 1, "b2", net, seed=1, resync_every=0.2, resync_after_refusals=0)
    tail = make_runtime(m, 2, "tail", net, verifier=RecordingVerifier(reject={"b2"}))
    tail.guard.banlist = BanList(flags_to_ban=1000, memory=1000)  # refuses each tensor, never bans
    resyncs = []

    async def resync():
        resyncs.append(b2.version)
        return True

    b2.guard.resync = resync
    rts = [head, b1, b2, tail]
    link(rts)
    await start_all(rts)
    drive = asyncio.ensure_future(head.drive())
    try:
        assert await wait_for(lambda: head.router.is_banned("b2"), timeout=60)
        assert await wait_for(lambda: b2.guard.banned_at is not None and resyncs, timeout=30)
    finally:
        drive.cancel()
        await stop_all(rts)
    assert value(head, "swarm_node_bans_total", cause="verifier-downstream") == 1
    assert not tail.router.is_banned("b2") and value(tail, "swarm_node_bans_total") == 0
    assert value(head, "swarm_node_served_total", protocol="bwd", result="banned") >= 1


@pytest.mark.asyncio
async def test_a_relayed_refusal_blames_only_the_hop_whose_output_was_refused(test_manifest):
    """Four stages; stage 3 refuses what s2a sends. Stage 1 (its direct upstream) bans s2a; it only
    relays the skips to the head, which must not blame stage 1 for them."""
    m = test_manifest.replace(model={"n_layers": 4}, stages={"layout": [[0, 1], [1, 2], [2, 3], [3, 4]]},
                              schedule={"warmup_steps": 2})
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m), max_inflight=2)
    s1 = make_runtime(m, 1, "s1", net)
    s2a = make_runtime(m, 2, "s2a", net, seed=2)
    s2b = make_runtime(m, 2, "s2b", net, seed=2)
    tail = make_runtime(m, 3, "tail", net, verifier=RecordingVerifier(reject={"s2a"}))
    rts = [head, s1, s2a, s2b, tail]
    link(rts)
    await start_all(rts)
    drive = asyncio.ensure_future(head.drive())
    try:
        assert await wait_for(lambda: s1.router.is_banned("s2a"), timeout=60)
        steps = tail.version
        assert await wait_for(lambda: tail.version >= steps + 5, timeout=60)
    finally:
        drive.cancel()
        await stop_all(rts)
    assert value(s1, "swarm_node_bans_total", cause="verifier-downstream") == 1
    assert value(s1, "swarm_node_served_total", protocol="bwd", result="skip") >= m.sentinel.flags_to_ban
    assert value(head, "swarm_node_bans_total") == 0
    assert not any(r for outcomes in head.guard.downstream.values() for r, _ in outcomes)  # none held against s1
    assert not head.router.banned()


@pytest.mark.asyncio
async def test_a_replica_whose_output_was_refused_sits_out_the_next_microbatches(test_manifest):
    """The stage before sends its next ``REFUSAL_COOL_CHOICES`` microbatches for that stage to the
    other replica (the refused one, with no gradient coming back, would look the least busy and
    draw them, each refused again for the same weights); an output that gets through ends it."""
    from node.runtime.guard import REFUSAL_COOL_CHOICES

    net = Net()
    head = make_runtime(test_manifest, 0, "head", net, batches=head_batches(test_manifest))
    b1, b2 = (make_runtime(test_manifest, 1, p, net) for p in ("b1", "b2"))
    link([head, b1, b2])
    head.router.on_sent("b2")  # b2 busier: b1 is the router's pick
    assert head.router.choose(1) == "b1"
    head.guard.downstream_outcome("b1", True, score=1.1, version=7)
    picks = [head.router.choose(1) for _ in range(REFUSAL_COOL_CHOICES + 1)]
    assert picks == ["b2"] * REFUSAL_COOL_CHOICES + ["b1"]
    head.guard.downstream_outcome("b1", True, score=1.1, version=7)
    head.guard.downstream_outcome("b1", False)
    assert head.router.choose(1) == "b1"
    head.guard.stop()


@pytest.mark.asyncio
async def test_a_refused_output_asks_its_own_stage_to_damp_that_version_s_look_ahead(test_manifest):
    """The tail refuses everything b sends: b hears it (its fwd answered rejected-by-verifier)
    and asks its look-ahead to damp the version that output was forwarded on
    (``LookaheadForward.damp``); the head, whose outputs b accepts and which only relays the
    refusal, asks nothing."""
    from security import BanList

    m = test_manifest.replace(schedule={"warmup_steps": 2})
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m), max_inflight=2)
    b = make_runtime(m, 1, "b", net)
    tail = make_runtime(m, 2, "tail", net, verifier=RecordingVerifier(reject={"b"}))
    tail.guard.banlist = BanList(flags_to_ban=1000, memory=1000)  # refuses each tensor, never bans
    asked = {"head": [], "b": []}
    for name, rt in (("head", head), ("b", b)):
        rt.trainer.output_refused = lambda w, name=name: asked[name].append(w.version)
    rts = [head, b, tail]
    link(rts)
    await start_all(rts)
    drive = asyncio.ensure_future(head.drive())
    try:
        assert await wait_for(lambda: len(asked["b"]) >= 3, timeout=60)
    finally:
        drive.cancel()
        await stop_all(rts)
    assert asked["head"] == []
    assert all(0 <= v <= b.version for v in asked["b"])  # the versions b forwarded them on


@pytest.mark.asyncio
async def test_a_replica_whose_outputs_are_refused_resyncs_before_any_ban(test_manifest):
    """The tail refuses everything b2 sends (clearly: score 9) and never bans it. A refused output
    brings no gradient, so b2 cannot step its way back; at its first clear refusal it fetches
    another replica's weights itself, before anyone has banned it, and once per ``resync_every``.
    b1, whose outputs the tail accepts, never does."""
    from security import BanList

    m = test_manifest.replace(schedule={"warmup_steps": 2})
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m), max_inflight=2)
    b1 = make_runtime(m, 1, "b1", net, seed=1)
    b2 = make_runtime(m, 1, "b2", net, seed=1, resync_every=600.0)
    tail = make_runtime(m, 2, "tail", net, verifier=RecordingVerifier(reject={"b2"}))
    tail.guard.banlist = BanList(flags_to_ban=1000, memory=1000)  # refuses each tensor, never bans
    refusals = {"b1": 0, "b2": 0}
    resyncs = {"b1": [], "b2": []}
    for name, rt in (("b1", b1), ("b2", b2)):
        counted_refusal = rt.guard.own_output_refused

        def refused(score=None, name=name, counted_refusal=counted_refusal):
            refusals[name] += 1
            return counted_refusal(score)

        async def resync(name=name, rt=rt):
            resyncs[name].append((refusals[name], rt.guard.banned_at, head.router.is_banned(name)))
            return True

        rt.guard.own_output_refused, rt.guard.resync = refused, resync
    rts = [head, b1, b2, tail]
    link(rts)
    await start_all(rts)
    drive = asyncio.ensure_future(head.drive())
    try:
        assert await wait_for(lambda: refusals["b2"] >= 4, timeout=60)
    finally:
        drive.cancel()
        await stop_all(rts)
    assert resyncs["b2"][0] == (1, None, False)  # its first refusal, before any ban
    assert len([r for r in resyncs["b2"] if r[1] is None]) == 1  # once per resync_every
    assert refusals["b1"] == 0 and resyncs["b1"] == []


@pytest.mark.asyncio
async def test_marginal_refusals_start_a_resync_two_in_a_row_and_a_clear_one_at_once(test_manifest):
    """Marginal refusals (score under 1 + ``ban_margin``: they count less than a flag toward a
    ban) start a re-sync at the second in a row, counted since an output of ours last got
    through; a clear one (or one without a score: a rule's refusal) at once."""
    m = test_manifest
    rt = make_runtime(m, 1, "b", Net(), resync_every=0.0)
    started = []

    async def resync():
        started.append(True)
        return True

    rt.guard.resync = resync
    g = rt.guard
    marginal, clear = 1.0 + m.sentinel.ban_margin / 2, 1.0 + m.sentinel.ban_margin
    assert not g.own_output_refused(marginal)
    g.note_accepted()  # an output of ours got through: the count starts over
    assert not g.own_output_refused(marginal)
    assert g.own_output_refused(marginal)
    await g.resync_task
    assert g.own_output_refused(clear)
    await g.resync_task
    assert g.own_output_refused(None)
    await g.resync_task
    assert len(started) == 3
    rt.options.resync_after_refusals = 0  # off
    assert not any(g.own_output_refused(clear) for _ in range(5))


@pytest.mark.asyncio
async def test_the_head_s_cool_down_counts_microbatches_sent_not_readiness_checks(test_manifest):
    """The head's injection loop asks whether the next stage has a replica before each microbatch;
    that question must not count down a cool-down (it did: a cool-down of n choices lasted n / 2
    microbatches). With b2 cooling for four choices, the head's first four microbatches go to b1."""
    m = test_manifest.replace(schedule={"warmup_steps": 2})
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m), max_inflight=1)
    b1, b2 = (make_runtime(m, 1, p, net, seed=1) for p in ("b1", "b2"))
    verifier = RecordingVerifier()
    tail = make_runtime(m, 2, "tail", net, verifier=verifier)
    rts = [head, b1, b2, tail]
    link(rts)
    await start_all(rts)
    head.router.cool("b2", 4, seconds=60.0)
    drive = asyncio.ensure_future(head.drive())
    try:
        def senders():
            with verifier.lock:
                return [sender for sender, direction, _ in verifier.seen if direction == "act"]
        assert await wait_for(lambda: len(senders()) >= 4, timeout=60)
        assert senders()[:4] == ["b1"] * 4  # in the order the tail received them
    finally:
        drive.cancel()
        await stop_all(rts)


@pytest.mark.asyncio
async def test_scattered_refusals_of_an_honest_replica_never_ban_it(test_manifest):
    """Refusals mixed with delivered outputs (an honest replica at the next stage's false-positive
    rate) do not ban; only flags_to_ban + 2 refusals in a row do, and never the last replica."""
    net = Net()
    head = make_runtime(test_manifest, 0, "head", net, batches=head_batches(test_manifest))
    b1, b2 = (make_runtime(test_manifest, 1, p, net) for p in ("b1", "b2"))
    link([head, b1, b2])
    await establish(head, "b1", "b2")
    n = test_manifest.sentinel.flags_to_ban + 2
    for i in range(200):
        head.guard.downstream_outcome("b1", i % 3 == 0)  # a third refused, never n in a row
    assert not head.router.banned()
    for _ in range(n - 1):
        head.guard.downstream_outcome("b1", True)
    assert not head.router.is_banned("b1")
    head.guard.downstream_outcome("b1", True)
    assert head.router.is_banned("b1") and head.guard.is_banned_sender("b1")
    for _ in range(3 * n):  # b2 is now the last replica of its stage: never banned this way
        head.guard.downstream_outcome("b2", True)
    assert not head.router.is_banned("b2")
    head.guard.stop()


@pytest.mark.asyncio
async def test_a_newcomer_is_no_replacement_until_it_is_established(test_manifest):
    """An honest replica collects flags while it is alone (early training moves its statistics
    faster than the fences). A replica that has just joined is not yet a replacement for it: it
    is spared until the newcomer has had ``max(warmup, flags_to_ban)`` tensors accepted here and
    mostly passes; a newcomer whose tensors fail never becomes one. Once one is, the flagged
    replica is banned as before."""
    net = Net()
    verifier = RecordingVerifier()
    tail = make_runtime(test_manifest, 2, "tail", net, verifier=verifier)
    old, new = (make_runtime(test_manifest, 1, p, net) for p in ("old", "new"))
    link([old, new, tail])
    x, ids = torch.zeros(1, 4, 2), torch.zeros(1, 4, dtype=torch.long)

    async def send(peer, n, flagged):
        verifier.reject = {peer} if flagged else set()
        for i in range(n):
            await tail.guard.verify(peer, "act", x, i, ids, i)

    await establish(tail, "old")
    need = max(test_manifest.sentinel.warmup, test_manifest.sentinel.flags_to_ban)
    flags = test_manifest.sentinel.flags_to_ban
    await send("new", need - 1, flagged=False)  # one short of established
    for _ in range(2):
        await send("old", flags, flagged=True)
        await send("old", 2 * flags, flagged=False)
    assert not tail.router.is_banned("old") and not tail.guard.is_banned_sender("old")
    # a newcomer whose tensors mostly fail never becomes a replacement (and is banned itself)
    await send("new", 1, flagged=False)
    await send("new", flags, flagged=True)
    assert tail.router.is_banned("new") and not tail.guard.established("new")
    await send("old", flags, flagged=True)
    assert not tail.router.is_banned("old")
    # a third replica that has proved itself: now the flagged one is routed around
    third = make_runtime(test_manifest, 1, "third", net)
    link([old, new, third, tail])
    await send("old", 2 * flags, flagged=False)
    await send("third", need, flagged=False)
    assert tail.guard.established("third")
    await send("old", flags, flagged=True)
    assert tail.router.is_banned("old")
    tail.guard.stop()


def test_marginal_refusals_in_a_row_do_not_ban_but_clear_ones_do(test_manifest):
    """The next stage's refusal carries its verifier's score as a typed field; a burst of
    barely-over-the-fence refusals (an honest replica whose statistics drift) weighs 0.25 each
    and bans no one, while clear refusals, rule rejections (no score) and refusals for a ban at
    the next stage count fully."""
    from security import verdict_score
    from security.verifier import Verdict

    net = Net()
    head = make_runtime(test_manifest, 0, "head", net, batches=head_batches(test_manifest))
    b1, b2, b3 = (make_runtime(test_manifest, 1, p, net) for p in ("b1", "b2", "b3"))
    link([head, b1, b2, b3])
    asyncio.run(establish(head, "b1", "b2", "b3"))
    n = test_manifest.sentinel.flags_to_ban + 2
    marginal = verdict_score(Verdict(False, "sentinel:swd", score=1.1))
    clear = verdict_score(Verdict(False, "sentinel:swd", score=1.7))
    assert marginal == pytest.approx(1.1)
    for _ in range(4 * n):
        head.guard.downstream_outcome("b1", True, marginal)
    assert not head.router.banned()
    # the next stage then bans b1 itself (its own weighted flags); those refusals carry no score
    for i in range(n):
        head.guard.downstream_outcome("b1", True, None, "banned by the next stage")
        if head.router.is_banned("b1"):
            break
    assert head.router.is_banned("b1") and i == 2  # 0.25 + 0.25 + 1 + 1 + 1 >= 3
    for _ in range(n - 1):
        head.guard.downstream_outcome("b2", True, clear)
    assert not head.router.is_banned("b2")
    head.guard.downstream_outcome("b2", True, clear)
    assert head.router.is_banned("b2")
    head.guard.stop()


def test_marginal_refusals_of_one_version_count_once(test_manifest):
    """A clean real swarm's burst: the tail refused six outputs of one honest body replica, all of
    its version 71 (refused microbatches bring no gradient, so it did not step), at scores
    1.64, 1.57, 1.42, 1.47, 1.42, 1.46; counted one by one they weighed 5.5 and the head banned
    it. Its marginal refusals (under 1 + ban_margin) of one version count once; the same scores
    over new versions still ban, and so do clear refusals of one version (a refused poisoner
    never steps either)."""
    net = Net()
    head = make_runtime(test_manifest, 0, "head", net, batches=head_batches(test_manifest))
    b1, b2, b3 = (make_runtime(test_manifest, 1, p, net) for p in ("b1", "b2", "b3"))
    link([head, b1, b2, b3])
    asyncio.run(establish(head, "b1", "b2", "b3"))
    burst = (1.64, 1.57, 1.42, 1.47, 1.42, 1.46)
    for score in burst:
        head.guard.downstream_outcome("b1", True, score, version=71)
    assert not head.router.is_banned("b1")
    for i, score in enumerate(burst):
        head.guard.downstream_outcome("b2", True, score, version=71 + i)
    assert head.router.is_banned("b2")
    for _ in range(test_manifest.sentinel.flags_to_ban + 2):  # b1's burst is over: its outputs get through
        head.guard.downstream_outcome("b1", False)
    for _ in range(test_manifest.sentinel.flags_to_ban + 2):
        head.guard.downstream_outcome("b3", True, 1.7, version=5)
    assert head.router.is_banned("b3")
    head.guard.stop()


def test_attacks_are_one_instance_per_direction():
    from node.daemon import make_attacks

    attacks = make_attacks("delayed", seed=3, delay=1)
    assert set(attacks) == {"act", "grad"} and attacks["act"] is not attacks["grad"]
    act, grad = torch.full((1, 2, 8), 5.0), torch.full((1, 2, 8), 1e-4)
    attacks["act"](act, 0)
    attacks["grad"](grad, 0)
    # each replays its own direction's history: never an activation as a gradient
    assert torch.equal(attacks["act"](act * 2, 1), act)  # one shared instance would replay `grad` here
    assert torch.equal(attacks["grad"](grad * 2, 1), grad)


def test_the_verifier_thread_has_its_own_torch_thread_count():
    torch.set_num_threads(2)
    pool = ThreadPoolExecutor(1)
    try:
        pin_torch_threads(pool, 1)
        assert pool.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == 2  # the caller's count is untouched
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert seen == [2]  # and so is that of threads started later (the compute worker)
        assert pool.submit(lambda: (torch.randn(64, 64).sort(), torch.get_num_threads())[1]).result() == 1
    finally:
        pool.shutdown()


def test_a_refusal_weighs_by_the_score_it_carries():
    from security import refusal_weight_of, verdict_score
    from security.verifier import Verdict

    assert verdict_score(Verdict(False, "nan")) is None  # a rule's rejection carries no score
    assert verdict_score(Verdict(False, "sentinel:tok", score=float("inf"))) is None
    assert verdict_score(Verdict(False, "sentinel:tok", score=1.05)) == pytest.approx(1.05)
    assert refusal_weight_of(1.05, 0.5) == 0.25
    assert refusal_weight_of(1.3, 0.5) == pytest.approx(0.6)
    assert refusal_weight_of(4.2, 0.5) == 1.0
    assert refusal_weight_of(1.1, 0.0) == 1.0  # ban_margin 0: unweighted
    assert refusal_weight_of(None, 0.5) == 1.0  # no score: a rule's rejection or a ban there


@pytest.mark.asyncio
async def test_the_verdict_log_holds_one_line_per_verdict_with_its_distances(test_manifest, tmp_path, caplog):
    """``--verdict-log``: one JSON object per verdict (peer, direction, version, microbatch,
    verdict, score, basis, every distance and those over their fences); a rejection's line
    carries what the log line's worst distance hides. A write that fails (full disk, closed
    file) stops the log with an error and verification goes on."""
    import json

    net = Net()
    tail = make_runtime(test_manifest, 2, "tail", net, verifier=SentinelVerifier(test_manifest.k))
    path = tmp_path / "verdicts.jsonl"
    tail.guard.verdict_log = open(path, "a", encoding="utf-8")
    g = torch.Generator().manual_seed(0)
    table = torch.randn(256, test_manifest.k, generator=g)
    for i in range(30):
        ids = torch.randint(0, 256, (2, 16), generator=g)
        x = table[ids] + 0.3 * torch.randn(2, 16, test_manifest.k, generator=g)
        await tail.guard.verify("b1", "act", x * (40.0 if i == 29 else 1.0), 100 + i, ids, i)
    tail.guard.verdict_log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 30 and [r["mb"] for r in rows] == list(range(30))
    assert {r["peer"] for r in rows} == {"b1"} and {r["direction"] for r in rows} == {"act"}
    assert rows[0]["basis"] == "warmup" and rows[0]["accept"] and rows[5]["version"] == 105
    bad = rows[-1]
    assert not bad["accept"] and bad["reason"] == "sentinel:scale" and bad["score"] > 1
    assert bad["over"]["scale"] == bad["score"] and all(v > 1 for v in bad["over"].values())
    assert {"l1", "scale", "tok"} <= set(bad["distances"])
    # the closed file: the next write fails; logged once, verification goes on
    x = table[ids]
    verdict = await tail.guard.verify("b1", "act", x, 200, ids, 30)
    assert verdict is not None and tail.guard.verdict_log is None
    assert "verdict log: cannot write" in caplog.text
    await tail.guard.verify("b1", "act", x, 201, ids, 31)
    tail.guard.stop()


@pytest.mark.asyncio
async def test_a_replica_whose_outputs_the_next_stage_refuses_is_no_replacement(test_manifest):
    """At the head, a poisoner of the middle stage can look clean: its gradients pass the head's
    verifier (they are honest, or a statistics-preserving swap), while the next stage refuses
    most of its activations. Such a replica is not established (``Guard.established``): it is
    no replacement for an honest replica that collects marginal flags early in training, so the
    honest one is spared, as it was before the newcomer came. Once the newcomer's outputs are
    delivered like an honest replica's, it is one, and the flagged replica is routed around."""
    net = Net()
    verifier = RecordingVerifier()
    head = make_runtime(test_manifest, 0, "head", net, verifier=verifier, batches=head_batches(test_manifest))
    honest, poisoner = (make_runtime(test_manifest, 1, p, net) for p in ("honest", "poisoner"))
    link([head, honest, poisoner])
    x, ids = torch.zeros(1, 4, 2), torch.zeros(1, 4, dtype=torch.long)
    flags = test_manifest.sentinel.flags_to_ban

    async def grads(peer, n, flagged):
        verifier.reject = {peer} if flagged else set()
        for i in range(n):
            await head.guard.verify(peer, "grad", x, 100 + i, ids, i)

    await establish(head, "honest", "poisoner")  # the poisoner's gradients pass here
    for _ in range(flags + 1):  # ... but the next stage refuses its outputs (not yet enough to ban it)
        head.guard.downstream_outcome("poisoner", True, score=2.0)
    head.guard.downstream_outcome("poisoner", False)
    assert not head.router.is_banned("poisoner")
    await grads("honest", flags, flagged=True)
    assert not head.router.is_banned("honest") and not head.guard.is_banned_sender("honest")
    assert not head.guard.established("poisoner")
    # outputs delivered like an honest replica's: now it is a replacement
    for _ in range(2 * (flags + 2)):
        head.guard.downstream_outcome("poisoner", False)
    assert head.guard.established("poisoner")
    await grads("honest", flags, flagged=True)
    assert head.router.is_banned("honest")
    head.guard.stop()


@pytest.mark.asyncio
async def test_the_last_replica_is_spared_while_its_record_is_missing_from_the_router(test_manifest):
    """The router forgets a peer whose record one DHT read did not return (``Router.update``). A
    lone replica's stage is the one its tensors come from, not its record's: while its record is
    missing, its flags still do not ban it, and neither do refusals of its outputs downstream."""
    net = Net()
    verifier = RecordingVerifier()
    tail = make_runtime(test_manifest, 2, "tail", net, verifier=verifier)
    lone = make_runtime(test_manifest, 1, "lone", net)
    head = make_runtime(test_manifest, 0, "head", net, verifier=verifier, batches=head_batches(test_manifest))
    link([head, lone, tail])
    await establish(tail, "lone")
    await establish(head, "lone")
    tail.router.update([])  # one DHT read without its record
    head.router.update([])
    assert "lone" not in tail.router.peers and "lone" not in head.router.peers
    x, ids = torch.zeros(1, 4, 2), torch.zeros(1, 4, dtype=torch.long)
    flags = test_manifest.sentinel.flags_to_ban
    verifier.reject = {"lone"}
    for i in range(flags):
        await tail.guard.verify("lone", "act", x, 100 + i, ids, i)
        await head.guard.verify("lone", "grad", x, 100 + i, ids, i)
    for i in range(3 * (flags + 2)):
        head.guard.downstream_outcome("lone", True, 2.0, version=200 + i)
    assert not tail.guard.is_banned_sender("lone") and not head.guard.is_banned_sender("lone")
    assert value(tail, "swarm_node_bans_total", cause="verifier") == 0
    assert value(head, "swarm_node_bans_total", cause="verifier-downstream") == 0
    tail.guard.stop()
    head.guard.stop()
