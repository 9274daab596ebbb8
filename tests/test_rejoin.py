"""A node whose DHT lost every neighbour (its link was down longer than a few DHT requests) knocks
at the bootstrap peers, or at the peers it met before, and is back in the swarm's view: real
hivemind DHTs and p2pd on loopback. The partition itself, across network namespaces, is
tests/test_lab_faults.py."""

from __future__ import annotations

import asyncio
import functools

import pytest

from node.net import Membership, PeerRecord, Transport, start_dht, stop_dht
from node.net.identity import write_identity
from tests.helpers.procs import assert_no_p2pd_left

pytestmark = pytest.mark.timeout(120)


async def _forget_everyone(dht, node) -> int:
    """In the DHT's process: empty the routing table, as failed requests to every neighbour do."""
    table = node.protocol.routing_table
    for uid in list(table.uid_to_peer_id):
        del table[uid]
    return len(table.peer_id_to_uid)


async def _forget_peer(peer: str, dht, node) -> bool:
    """In the DHT's process: drop ``peer`` from the routing table, as a failed request to it does."""
    from hivemind.p2p import PeerID

    table = node.protocol.routing_table
    uid = table.get(peer_id=PeerID.from_base58(peer))
    if uid is not None:
        del table[uid]
    return table.get(peer_id=PeerID.from_base58(peer)) is None


async def _until(pred, timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if await pred():
            return True
        await asyncio.sleep(0.2)
    return await pred()


@pytest.mark.asyncio
@pytest.mark.parametrize("through", ["bootstrap", "met"])
async def test_an_isolated_dht_rejoins_and_its_records_reach_the_others_again(test_manifest, through, tmp_path):
    keys = {}
    for name in "ab":  # a node signs its own records with its identity key
        keys[name] = tmp_path / f"{name}.key"
        write_identity(keys[name])
    boot = start_dht([], ["/ip4/127.0.0.1/tcp/0"], local=True)
    boot_maddrs = [str(m) for m in boot.get_visible_maddrs()]
    a = start_dht(boot_maddrs, ["/ip4/127.0.0.1/tcp/0"], identity_path=str(keys["a"]), local=True)
    b = start_dht(boot_maddrs, ["/ip4/127.0.0.1/tcp/0"], identity_path=str(keys["b"]), local=True)
    transport = None
    try:
        transport = Transport(await a.replicate_p2p())
        ma, mb = Membership(a, test_manifest, ttl=30), Membership(b, test_manifest, ttl=30)
        b_id = b.peer_id.to_base58()
        b_maddrs = [f"{m}/p2p/{b_id}" if "/p2p/" not in str(m) else str(m) for m in b.get_visible_maddrs()]
        assert await mb.aannounce(PeerRecord(b_id, 1, "online", maddrs=b_maddrs))
        # a sees b and remembers where it was
        assert await _until(lambda: _sees(ma, b_id), 20)
        ma.remember(await ma.apeers())
        assert await ma.aneighbours() >= 1

        # a's link was down: every request failed both ways, so a forgot everyone and they forgot a
        a_id = a.peer_id.to_base58()
        assert await a.run_coroutine(_forget_everyone, return_future=True) == 0
        for other in (boot, b):
            assert await other.run_coroutine(functools.partial(_forget_peer, a_id), return_future=True)
        assert await ma.aneighbours() == 0
        # alone, a's announcement stays with a: b never sees it
        await ma.aannounce(PeerRecord(a_id, 0, "online"))
        await asyncio.sleep(1.0)
        assert not await _sees(mb, a_id)

        initial = boot_maddrs if through == "bootstrap" else []
        if through == "met":
            boot.shutdown()  # the bootstrap is gone too: only the peers met before are left
        answered = await ma.arejoin(transport.connect, initial)
        assert answered >= 1 and ma.rejoins == 1
        assert await ma.aneighbours() >= 1
        assert await ma.aannounce(PeerRecord(a_id, 0, "online"))
        assert await _until(lambda: _sees(mb, a_id), 20)
    finally:
        if transport is not None:
            await transport.close()
        for d in (b, a, boot):
            stop_dht(d)
    assert_no_p2pd_left()


@pytest.mark.asyncio
async def test_with_nobody_to_knock_at_rejoin_answers_zero_quickly(test_manifest):
    a = start_dht([], ["/ip4/127.0.0.1/tcp/0"], local=True)
    transport = None
    try:
        transport = Transport(await a.replicate_p2p())
        ma = Membership(a, test_manifest)
        assert await ma.aneighbours() == 0
        # a bootstrap address where nothing listens: not an error, just nobody answered
        dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
        assert await asyncio.wait_for(ma.arejoin(transport.connect, [dead], timeout=2.0), 15) == 0
        assert ma.rejoins == 0
    finally:
        if transport is not None:
            await transport.close()
        stop_dht(a)
    assert_no_p2pd_left()


async def _sees(m: Membership, peer: str) -> bool:
    return any(r.peer_id == peer for r in await m.apeers())
