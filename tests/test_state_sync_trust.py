"""State sync that a single source cannot steer (node/net/state_verify.py): what a joiner takes (weights,
morph epoch, optimizer version) is decided by agreement among the sources it downloaded from and by
the run's signed records, never by one source's claim; a source whose claims disagree with its own
signed record or the run's is refused and banned like poisoned weights; a lone source is taken as
"unconfirmed" and the node says so.

Two levels: ``fetch_verified`` against sources served by the real ``serve_state`` over the in-memory
transport (tests/helpers/memnet.py), with the claims and records each case needs; and real stage
runtimes (``sync_from_replicas``: bans, ``/status``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import pytest
import torch

from node.net import StateSyncError, fetch_verified, parameters_of, serve_state
from protocol import STATE
from stages import build_stage, manifest_hash
from tests.helpers.runtime import Net, Rec, make_runtime, start_all, stop_all, value
from tests.helpers.memnet import MemTransport

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


@dataclass
class Signed:
    """A peer's signed announcement as the router holds it (``version``; ``epoch`` where announced)."""

    peer_id: str
    version: int
    epoch: int | None = None


def _states(m, n, seed=1):
    """``n`` honest replicas' weights of stage 1: one state, each nudged a little (asynchronous drift)."""
    torch.manual_seed(seed)
    base = {k: t.detach().clone() for k, t in parameters_of(build_stage(m, 1)).items()}
    return [{k: t + 1e-4 * torch.randn_like(t) for k, t in base.items()} for _ in range(n)]


def _other_basis(tensors):
    """The same weights in another basis: every entry's sign flipped at random (norms kept, values not)."""
    g = torch.Generator().manual_seed(7)
    return {k: t * (torch.randint(0, 2, t.shape, generator=g) * 2 - 1).to(t.dtype) for k, t in tensors.items()}


async def _serve(net, m, peer, version, tensors, epoch):
    """A replica that serves ``tensors`` declaring ``version`` and ``epoch`` (None: morphing off)."""
    async def snapshot():
        return version, tensors, epoch

    t = MemTransport(net, peer)
    await t.serve_stream(STATE, functools.partial(serve_state, run=m.run.id, mhash=manifest_hash(m), stage_index=1,
                                                  state=lambda: "online", snapshot=snapshot))


async def _fetch(net, m, peers, **kw):
    joiner = MemTransport(net, "joiner")
    return await fetch_verified(joiner, peers, m.run.id, manifest_hash(m), 1, build_stage(m, 1), timeout=5.0, **kw)


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- fetch_verified


@pytest.mark.asyncio
@pytest.mark.parametrize("case", ["record-says-3", "record-says-4", "ahead-of-the-run", "morphing-off"])
async def test_the_reviews_case_honest_state_taken_and_the_x25_source_with_a_higher_epoch_refused(test_manifest,
                                                                                                  case):
    """Two honest sources in epoch 3 and one serving their weights ×25 declaring epoch 4 (its signed
    record says 3; or says 4 too, when only the norm of its weights gives it away; or 5, ahead of
    the run's records; or a run that does not morph and an epoch 1): the honest state is taken, the
    attacker refused."""
    m = test_manifest
    net = Net()
    a, b = _states(m, 2)
    morphing = case != "morphing-off"
    honest_epoch = 3 if morphing else None
    declared, recorded = {"record-says-3": (4, 3), "record-says-4": (4, 4), "ahead-of-the-run": (5, 5),
                          "morphing-off": (1, None)}[case]
    await _serve(net, m, "p", 40, {k: 25 * t for k, t in a.items()}, declared)  # asked first
    await _serve(net, m, "a", 40, a, honest_epoch)
    await _serve(net, m, "b", 41, b, honest_epoch)
    records = {"p": Signed("p", 40, recorded), "a": Signed("a", 40, honest_epoch), "b": Signed("b", 41, honest_epoch)}
    run_epochs = [3, 3, 3, 3] if morphing else []  # the other stages' replicas and a, b
    got = await _fetch(net, m, ["p", "a", "b"], records=records, run_epochs=run_epochs, morphing=morphing)
    assert got.refused == ["p"] and "p" in got.reasons
    assert got.verified and got.outcome == "verified" and sorted(got.agreed) == ["a", "b"]
    assert got.epoch == (honest_epoch or 0) and got.version == 40
    assert _equal(got.tensors, a if got.source == "a" else b)


@pytest.mark.asyncio
@pytest.mark.parametrize("claim,recorded,refused", [(10**6, 40, True), (10**6, 10**6, False), (0, 0, False),
                                                    (0, 40, False)])
async def test_a_source_lying_about_its_version_cannot_set_the_adopted_version(test_manifest, claim, recorded,
                                                                               refused):
    """Three sources agree on the weights; one declares another version. Where its signed record
    says otherwise (beyond the slack a few seconds of training explain) it is refused; where its
    record says the same, it is one claim of three, and the adopted version is their median."""
    m = test_manifest
    net = Net()
    states = _states(m, 3)
    await _serve(net, m, "liar", claim, states[0], None)  # asked first
    await _serve(net, m, "a", 40, states[1], None)
    await _serve(net, m, "b", 42, states[2], None)
    records = {"liar": Signed("liar", recorded), "a": Signed("a", 40), "b": Signed("b", 42)}
    got = await _fetch(net, m, ["liar", "a", "b"], records=records, morphing=False, max_sources=3)
    assert got.version in (40, 42)
    assert (got.refused == ["liar"]) is refused
    if refused:
        assert "signed record says 40" in got.reasons["liar"] and got.version == 40
    else:
        assert got.verified and len(got.agreed) == 3


@pytest.mark.asyncio
@pytest.mark.parametrize("declared,recorded", [(5, 3), (2, 4)])
async def test_a_lone_source_whose_epoch_disagrees_with_its_signed_record_is_refused(test_manifest, declared,
                                                                                    recorded):
    """Ahead of its own record by more than the one epoch a switch since its announcement explains,
    or behind it (an epoch never goes back): refused, though it is the only source."""
    m = test_manifest
    net = Net()
    (a,) = _states(m, 1)
    await _serve(net, m, "p", 40, a, declared)
    with pytest.raises(StateSyncError) as e:
        await _fetch(net, m, ["p"], records={"p": Signed("p", 40, recorded)}, morphing=True)
    assert e.value.refused == ["p"] and e.value.untrusted and not e.value.busy
    assert f"declares morph epoch {declared}; its signed record says {recorded}" in str(e.value)


@pytest.mark.asyncio
async def test_replicas_legitimately_an_epoch_apart_are_not_blamed(test_manifest):
    """During a morph switch a stage's replicas are one epoch apart: the epoch two sources agree in
    is taken and the third one is left alone; with one source in each epoch, the one most of the
    run's records announce is taken (unconfirmed), and nobody is refused."""
    m = test_manifest
    net = Net()
    a, b, c = _states(m, 3)
    await _serve(net, m, "old", 40, _other_basis(c), 3)
    await _serve(net, m, "a", 40, a, 4)
    await _serve(net, m, "b", 41, b, 4)
    records = {"old": Signed("old", 40, 3), "a": Signed("a", 40, 4), "b": Signed("b", 41, 3)}  # b: not re-announced
    got = await _fetch(net, m, ["old", "a", "b"], records=records, run_epochs=[3, 3, 4, 4], morphing=True)
    assert (got.epoch, got.verified, got.refused, got.ignored) == (4, True, [], ["old"])

    got = await _fetch(net, m, ["old", "a"], records=records, run_epochs=[3, 4, 4, 4], morphing=True)
    assert (got.epoch, got.source, got.outcome, got.refused, got.ignored) == (4, "a", "unconfirmed", [], ["old"])
    got = await _fetch(net, m, ["old", "a"], records=records, run_epochs=[3, 3, 3, 4], morphing=True)
    assert (got.epoch, got.source, got.outcome, got.refused, got.ignored) == (3, "old", "unconfirmed", [], ["a"])


# ---------------------------------------------------------------- the runtime: bans, /status


def _records(rt, recs):
    rt.router.update(recs)


@pytest.mark.asyncio
async def test_a_joiner_refuses_and_bans_a_source_serving_x25_weights_in_a_later_epoch(test_manifest):
    """The review's case through ``sync_from_replicas`` (a run that does not morph): two honest
    replicas, and one serving their weights ×25 as epoch 1, asked first."""
    m = test_manifest
    net = Net()
    p = make_runtime(m, 1, "p", net, seed=1)
    a = make_runtime(m, 1, "a", net, seed=1)
    b = make_runtime(m, 1, "b", net, seed=1)
    for rt in (p, a, b):
        rt.trainer.lookahead.version = 42

    async def poisoned_snapshot():
        version, tensors, _ = await p.worker.submit("ctl", p.trainer.snapshot)
        return version, {k: 25 * t for k, t in tensors.items()}, 1

    p._snapshot = poisoned_snapshot
    joiner = make_runtime(m, 1, "new", net, seed=2)
    _records(joiner, [Rec(r.peer_id, 1, version=42) for r in (p, a, b)])
    await start_all([p, a, b])
    await joiner.start()
    try:
        got = await joiner.sync_from_replicas()
    finally:
        await stop_all([p, a, b, joiner])
    assert (got.refused, got.epoch, got.version, got.verified) == (["p"], 0, 42, True)
    assert joiner.router.is_banned("p") and not joiner.router.is_banned("a")
    assert value(joiner, "swarm_node_bans_total", cause="poisoned-state") == 1
    honest = dict(a.stage.named_parameters())
    for n, t in joiner.stage.named_parameters():
        assert torch.equal(t, honest[n]), n


@pytest.mark.asyncio
async def test_a_joiner_adopts_the_median_version_not_the_first_sources(test_manifest):
    m = test_manifest
    net = Net()
    rts = [make_runtime(m, 1, peer, net, seed=1) for peer in ("liar", "a", "b")]
    for rt, v in zip(rts, (10**6, 40, 42)):
        rt.trainer.lookahead.version = v
    joiner = make_runtime(m, 1, "new", net, seed=2)
    _records(joiner, [Rec(rt.peer_id, 1, version=rt.version) for rt in rts])  # the liar announces its lie too
    await start_all(rts)
    await joiner.start()
    try:
        got = await joiner.sync_from_replicas()
    finally:
        await stop_all([*rts, joiner])
    assert got.verified and got.version == 42 and joiner.version == 42


@pytest.mark.asyncio
async def test_a_lone_source_whose_version_disagrees_with_its_signed_record_is_refused_and_banned(test_manifest):
    m = test_manifest
    net = Net()
    liar = make_runtime(m, 1, "liar", net, seed=1)
    liar.trainer.lookahead.version = 10**6
    joiner = make_runtime(m, 1, "new", net, seed=2)
    _records(joiner, [Rec("liar", 1, version=40)])
    await start_all([liar])
    await joiner.start()
    before = {n: t.detach().clone() for n, t in joiner.stage.named_parameters()}
    try:
        with pytest.raises(StateSyncError) as e:
            await joiner.sync_from_replicas()
    finally:
        await stop_all([liar, joiner])
    assert e.value.refused == ["liar"] and "signed record says 40" in str(e.value)
    assert joiner.version == 0 and all(torch.equal(t, before[n]) for n, t in joiner.stage.named_parameters())
    assert joiner.router.is_banned("liar")
    assert value(joiner, "swarm_node_bans_total", cause="poisoned-state") == 1
    assert joiner.status()["state_sync"]["outcome"] == "refused"


@pytest.mark.asyncio
async def test_a_lone_honest_source_is_taken_as_unconfirmed_and_the_node_says_so(test_manifest, caplog):
    m = test_manifest
    net = Net()
    only = make_runtime(m, 1, "only", net, seed=1)
    only.trainer.lookahead.version = 42
    joiner = make_runtime(m, 1, "new", net, seed=2)
    _records(joiner, [Rec("only", 1, version=40)])  # announced a few steps ago
    await start_all([only])
    await joiner.start()
    try:
        with caplog.at_level(logging.WARNING, logger="swarm_node.state_sync"):
            got = await joiner.sync_from_replicas()
    finally:
        await stop_all([only, joiner])
    assert (got.source, got.verified, got.outcome, got.refused, got.version) == ("only", False, "unconfirmed", [], 42)
    assert any("UNCONFIRMED" in r.getMessage() and "only" in r.getMessage() for r in caplog.records)
    status = joiner.status()["state_sync"]
    assert status["outcome"] == "unconfirmed" and status["source"] == "only" and status["counts"] == {"unconfirmed": 1}
    assert not joiner.router.banned()


@pytest.mark.asyncio
async def test_in_a_morphing_run_a_x25_source_one_epoch_ahead_is_refused_by_its_norm(test_manifest):
    """A morphing run whose records announce no epoch (peers from before that field): replicas in
    epoch 3, and one serving their weights ×25 as epoch 4, asked first. One epoch ahead is what a
    switch in progress looks like, so its epoch alone proves nothing; the norm of its weights
    (which a change of basis keeps) gives it away. The joiner takes epoch 3 and bans it."""
    m = test_manifest.replace(optim={"name": "muon", "lr": 0.02, "aux_optimizer": "sgd", "aux_lr": 0.05},
                              schedule={"warmup_steps": 2}, morph={"every": 4})
    net = Net()
    rts = [make_runtime(m, 1, peer, net, seed=1) for peer in ("p", "a", "b")]
    for rt in rts:
        rt.trainer.lookahead.version = 14
        rt.trainer.epoch = 3
        rt.morph.known["new"] = 0  # settled: the servers hand it their state
    p = rts[0]

    async def poisoned_snapshot():
        version, tensors, _ = await p.worker.submit("ctl", p.trainer.snapshot)
        return version, {k: 25 * t for k, t in tensors.items()}, 4

    p._snapshot = poisoned_snapshot
    joiner = make_runtime(m, 1, "new", net, seed=2)
    _records(joiner, [Rec(rt.peer_id, 1, version=14) for rt in rts])
    await start_all(rts)
    await joiner.start()
    try:
        got = await joiner.sync_from_replicas()
    finally:
        await stop_all([*rts, joiner])
    assert (got.refused, got.epoch, got.verified) == (["p"], 3, True) and "norm" in got.reasons["p"]
    assert joiner.morph.epoch == 3 and joiner.router.is_banned("p")
    honest = dict(rts[1].stage.named_parameters())
    for n, t in joiner.stage.named_parameters():
        assert torch.equal(t, honest[n]), n
