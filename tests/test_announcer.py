"""The daemon's calls into p2pd and the DHT are bounded: the announce loop goes on after a call
that hangs past its bound (one WARNING line, tried again next period), reads what the node holds
at every period, and a p2pd that never gives the node its connection at start-up ends in one
clear error. Fakes stand in for p2pd and the DHT: no network."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from node.base import CliError
from node.daemon.announcer import Announcer, Holding

pytestmark = pytest.mark.timeout(60)

RELAY = "/ip4/203.0.113.7/tcp/4001/p2p/QmRelay/p2p-circuit/p2p/QmMe"


class Hangs:
    """An awaitable call that never answers on the calls numbered in ``hang_on`` (1-based) and
    answers ``value`` on the others; counts the calls and the hung calls that were cancelled."""

    def __init__(self, value, hang_on=(1,)):
        self.value, self.hang_on = value, set(hang_on)
        self.calls = self.cancelled = 0

    async def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.hang_on:
            try:
                await asyncio.Event().wait()  # never set: a p2pd or DHT that does not answer
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return self.value() if callable(self.value) else self.value


@dataclass
class FakeMembership:
    """``node.net.Membership`` as the announcer uses it, without a DHT."""

    announced: list = field(default_factory=list)
    peers_read: int = 0

    async def aannounce(self, record, ttl=None, timeout=10.0):
        self.announced.append(record)
        return True

    async def apeers(self, timeout=10.0):
        self.peers_read += 1
        return []

    async def aneighbours(self, timeout=5.0):
        return 3

    async def arefresh_manifest(self, timeout=10.0):
        return None

    def remember(self, records):
        pass


class FakeRouter:
    def update(self, peers):
        self.peers = peers

    def count_by_stage(self, n_stages):
        return [0] * n_stages


class _Gauge:
    def __init__(self):
        self.value = None

    def set(self, v):
        self.value = v

    def inc(self):
        self.value = (self.value or 0) + 1

    def labels(self, **_):
        return self


def _metrics():
    return SimpleNamespace(peers=_Gauge(), dht_neighbours=_Gauge(), dht_rejoins=_Gauge())


def _announcer(membership, transport, holding, **bounds) -> Announcer:
    return Announcer(peer_id="QmMe", maddrs=["/ip4/127.0.0.1/tcp/1/p2p/QmMe"], holding=holding,
                     membership=membership, transport=transport, router=FakeRouter(), metrics=_metrics(),
                     n_stages=2, every=0.05, **bounds)


async def _until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def _run_until(announcer: Announcer, pred) -> None:
    task = asyncio.ensure_future(announcer.run())
    try:
        await _until(pred)
    finally:
        announcer.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.asyncio
async def test_the_loop_goes_on_after_get_visible_maddrs_hangs_and_announces_the_relay_address(caplog):
    maddrs = Hangs(lambda: [RELAY])  # the first call hangs, the next ones answer a relay address
    membership = FakeMembership()
    a = _announcer(membership, SimpleNamespace(p2p=SimpleNamespace(get_visible_maddrs=maddrs)),
                   lambda: Holding(1, "online", version=7), maddrs_timeout=0.2)
    caplog.set_level(logging.WARNING, logger="swarm_node.daemon")
    t0 = time.monotonic()
    await _run_until(a, lambda: len(membership.announced) >= 3 and membership.announced[-1].maddrs == [RELAY])
    assert maddrs.cancelled == 1 and maddrs.calls >= 3
    assert time.monotonic() - t0 < 5.0
    # the first record went out after the hung call's bound, with the old addresses
    assert membership.announced[0].maddrs == ["/ip4/127.0.0.1/tcp/1/p2p/QmMe"]
    assert membership.peers_read >= 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "get_visible_maddrs" in warnings[0] and "0.2 s" in warnings[0], warnings


@pytest.mark.asyncio
async def test_a_dht_store_that_ignores_its_own_timeout_is_bounded_too(caplog):
    membership = FakeMembership()
    store = Hangs(True, hang_on=(1, 2))
    stored = []

    async def aannounce(record, ttl=None, timeout=10.0):  # a store whose own timeout never fires
        await store()
        stored.append(record)
        return True

    membership.aannounce = aannounce
    a = _announcer(membership, SimpleNamespace(), lambda: Holding(0, "online"), local=True, dht_timeout=0.1)
    caplog.set_level(logging.WARNING, logger="swarm_node.daemon")
    await _run_until(a, lambda: len(stored) >= 2)
    assert store.cancelled == 2 and membership.peers_read >= 3  # every period read the peers
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("announce online (DHT store)" in w for w in warnings), warnings


@pytest.mark.asyncio
async def test_the_announcer_reads_what_the_node_holds_at_every_period():
    membership = FakeMembership()
    now = {"holding": Holding(0, "joining")}
    a = _announcer(membership, SimpleNamespace(), lambda: now["holding"], local=True)
    task = asyncio.ensure_future(a.run())
    try:
        await _until(lambda: len(membership.announced) >= 1)
        now["holding"] = Holding(1, "online", throughput=12.5, version=3)
        a.poke()
        await _until(lambda: membership.announced[-1].stage == 1)
    finally:
        a.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    first, last = membership.announced[0], membership.announced[-1]
    assert (first.stage, first.state) == (0, "joining")
    assert (last.stage, last.state, last.throughput, last.version) == (1, "online", 12.5, 3)
    assert a.record("offline").state == "offline" and a.record("bogus").state == "joining"


# ---- start-up: the node's own connection to the DHT's p2pd


@pytest.mark.asyncio
async def test_a_dht_process_that_never_answers_replicate_p2p_is_one_clear_error():
    from node.daemon.checks import replicate_p2p

    never = asyncio.get_running_loop().create_future()
    dht = SimpleNamespace(run_coroutine=lambda coro, return_future=False: never)
    t0 = time.monotonic()
    with pytest.raises(CliError) as e:
        await replicate_p2p(dht, timeout=0.3)
    assert time.monotonic() - t0 < 3.0
    msg = str(e.value)
    assert "\n" not in msg and "replicate_p2p" in msg and "0.3 s" in msg, msg
    assert never.cancelled()


@pytest.mark.asyncio
async def test_a_p2pd_that_accepts_and_never_answers_is_one_clear_error(tmp_path):
    """The real hivemind path (``P2P.replicate`` identifying itself to p2pd) against a control
    socket that accepts and never answers: a stuck p2pd."""
    from hivemind.utils.multiaddr import Multiaddr

    from node.daemon.checks import replicate_p2p

    path = str(tmp_path / "p2pd.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    try:
        answered = asyncio.get_running_loop().create_future()
        answered.set_result(Multiaddr(f"/unix{path}"))
        dht = SimpleNamespace(run_coroutine=lambda coro, return_future=False: answered)
        with pytest.raises(CliError) as e:
            await replicate_p2p(dht, timeout=0.5)
        assert "replicate_p2p" in str(e.value) and "\n" not in str(e.value)
    finally:
        server.close()
        os.unlink(path)


@pytest.mark.asyncio
async def test_node_serve_fails_with_that_error_and_closes_what_it_built(test_manifest):
    import torch

    from node.daemon import Node, StartUp

    never = asyncio.get_running_loop().create_future()
    dht = SimpleNamespace(run_coroutine=lambda coro, return_future=False: never)
    cfg = SimpleNamespace(seed=1, checkpoint_dir="")
    started = StartUp(test_manifest, 0, torch.device("cpu"), dht, membership=None, metrics=None, server=None,
                      peer_id="QmMe", maddrs=[])
    node = Node(cfg, started, replicate_timeout=0.2)
    t0 = time.monotonic()
    with pytest.raises(CliError, match="replicate_p2p") as e:
        await node.serve()
    assert time.monotonic() - t0 < 5.0 and "\n" not in str(e.value)
    assert never.cancelled()
    assert node.slot._ckpt_pool._shutdown  # the stage's checkpoint writer is closed
    assert node.announcer is None and node.transport is None
    assert not asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)  # its handlers are gone


def test_the_blocking_start_up_reads_of_the_dht_are_bounded(test_manifest):
    """At start-up the node reads the swarm's manifest (and, with ``--stage auto``, its peers)
    before its event loop runs; a DHT that never answers is one ``TimeoutError`` naming the read,
    which the start-up checks turn into one CliError line."""
    import concurrent.futures

    from node.daemon.checks import join_swarm_manifest
    from node.net import Membership

    pending: list[concurrent.futures.Future] = []

    def get(key, latest=False, return_future=False):
        assert return_future  # a blocking read would not be bounded
        pending.append(concurrent.futures.Future())
        return pending[-1]

    def run_coroutine(coro, return_future=False):  # the peers' read runs in the DHT process
        return get(None, return_future=return_future)

    me = SimpleNamespace(to_base58=lambda: "12D3KooWMe")
    membership = Membership(SimpleNamespace(get=get, run_coroutine=run_coroutine, peer_id=me), test_manifest)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="peer records read within 0.2 s"):
        membership.peers(timeout=0.2)
    membership.check_and_publish_manifest = lambda: Membership.check_and_publish_manifest(membership, timeout=0.2)
    with pytest.raises(CliError) as e:
        join_swarm_manifest(membership, test_manifest)
    assert time.monotonic() - t0 < 3.0
    assert "\n" not in str(e.value) and "manifest read" in str(e.value), e.value
    assert all(f.cancelled() for f in pending)
