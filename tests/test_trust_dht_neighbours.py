"""A stranger holds every nearest position of the run's ``peers`` key (hivemind lets a node choose
its DHT id): its nodes say yes to every store, keep nothing, and answer with a stale record of
their choice. Honest readers still find every honest peer, from their DHT neighbours
(node/net/dht_neighbours.py, docs/THREAT_MODEL.md). Real hivemind nodes on loopback, in this
process: the honest ones guarded (``GuardedDHTNode``), the stranger's plain hivemind."""

from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.timed_storage import ValueWithExpiration

from node.net.dht_guard import GuardedDHTNode
from node.net.dht_neighbours import announce_and_keep, read_wide
from node.net.records import SwarmRecordValidator, peer_subkey
from security import PeerKey, new_ed25519_key

LOOPBACK = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False, auto_nat=False,
                nat_port_map=False, wait_timeout=30)
KEY = "swarm-node/trust-neighbours/0123456789abcdef/peers"
KEY_ID = DHTID.generate(source=KEY)
STRANGERS = 6  # more than hivemind's num_replicas (5): every copy of the key is the stranger's


def _announcement(key: PeerKey, at: float) -> dict:
    return {"peer_id": key.peer_id, "stage": 1, "state": "online", "throughput": 1.0, "queue": 0,
            "version": 0, "protocol": 1, "maddrs": [f"/ip4/127.0.0.1/tcp/9/p2p/{key.peer_id}"], "time": at}


class Withholding(DHTLocalStorage):
    """The stranger's storage: takes every store and keeps nothing of it; answers every find with
    what it chose to serve."""

    def __init__(self, served: DictionaryDHTValue | None = None):
        super().__init__()
        self.served = served

    def store(self, *args, **kwargs) -> bool:
        return True

    def store_subkey(self, *args, **kwargs) -> bool:
        return True

    def get(self, key):
        if key == KEY_ID and self.served is not None:
            return ValueWithExpiration(self.served, self.served.latest_expiration_time)
        return None


async def _maddrs(node) -> list[str]:
    return [str(m) for m in await node.get_visible_maddrs()]


@pytest.mark.timeout(240)
@pytest.mark.asyncio
async def test_readers_find_every_honest_peer_when_the_stranger_holds_every_nearest_position():
    nodes: list[DHTNode] = []
    try:
        boot = await GuardedDHTNode.create(record_validator=SwarmRecordValidator(), **LOOPBACK)
        nodes.append(boot)
        initial = await _maddrs(boot)
        # a stale record of an honest peer (read earlier, replayed): what the stranger serves
        keys = [PeerKey(new_ed25519_key()) for _ in range(3)]
        stale_at = time.time() - 100
        stale_exp = get_dht_time() + 30
        stale_value = SwarmRecordValidator(keys[0]).sign_value(DHTRecord(
            KEY_ID.to_bytes(), MSGPackSerializer.dumps(peer_subkey(keys[0].peer_id)),
            MSGPackSerializer.dumps(_announcement(keys[0], stale_at)), stale_exp))
        served = DictionaryDHTValue()
        served.store(peer_subkey(keys[0].peer_id), stale_value, stale_exp)

        async def stranger(i: int) -> DHTNode:
            s = await DHTNode.create(initial_peers=initial, node_id=DHTID(int(KEY_ID) ^ i), **LOOPBACK)
            s.protocol.storage = Withholding(served)
            s.protocol.cache = Withholding()
            nodes.append(s)
            return s

        async def honest_node(key: PeerKey) -> DHTNode:
            h = await GuardedDHTNode.create(initial_peers=initial, record_validator=SwarmRecordValidator(key),
                                            **LOOPBACK)
            nodes.append(h)
            return h

        for i in range(1, STRANGERS + 1):  # one after the other: p2pd daemons starting at once time out
            await stranger(i)
        honest = [await honest_node(k) for k in keys]

        # hivemind's store and lookup (the path before node.net.dht_neighbours): the records go to the
        # stranger's nodes only, and a reader sees at most the stale record they serve
        now = time.time()
        for key, h in zip(keys, honest):
            assert await h.store(KEY, _announcement(key, now), get_dht_time() + 60, subkey=peer_subkey(key.peer_id))
        for h in honest:
            plain = await asyncio.wait_for(h.get(KEY, latest=True), 30)
            seen = {} if plain is None else {s: v.value["time"] for s, v in plain.value.items()}
            assert all(t == stale_at for t in seen.values()), seen

        # each honest node keeps its own record as it announces (Membership.aannounce)
        now = time.time()
        for key, h in zip(keys, honest):
            ok = await announce_and_keep(KEY, peer_subkey(key.peer_id), _announcement(key, now), get_dht_time() + 60,
                                         None, h)
            assert ok  # the stranger's nodes said yes

        # every honest reader, through its neighbours, sees every honest peer, each at its fresh record
        ids = [k.peer_id for k in keys]
        for h in honest:
            found = await asyncio.wait_for(read_wide(KEY, ids, None, h), 30)
            assert found is not None
            assert set(found.value) == {peer_subkey(i) for i in ids}, set(found.value)
            assert all(found.value[peer_subkey(k.peer_id)].value["time"] == now for k in keys)

        # a reader that joins later and knows only the bootstrap peer: the bootstrap holds nothing of
        # the key, the stranger withholds, and the honest nodes it meets while joining tell it
        late = await GuardedDHTNode.create(initial_peers=initial, record_validator=SwarmRecordValidator(),
                                           **LOOPBACK)
        nodes.append(late)
        found = await asyncio.wait_for(read_wide(KEY, [], None, late), 30)
        assert found is not None and set(found.value) == {peer_subkey(i) for i in ids}
    finally:
        for n in nodes:
            await n.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_a_neighbour_s_forged_or_older_entries_do_not_replace_what_the_reader_holds():
    """A neighbour (the stranger's node, here its reader's only one) answers with an entry under an
    honest peer's subkey signed by another key, and an older record of that peer: the reader keeps
    the peer's own fresh record and drops the forgery."""
    nodes: list[DHTNode] = []
    try:
        victim, forger = PeerKey(new_ed25519_key()), PeerKey(new_ed25519_key())
        exp = get_dht_time() + 60
        subkey = peer_subkey(victim.peer_id)

        def signed(signer: PeerKey, value: dict, expiration: float) -> bytes:
            return SwarmRecordValidator(signer).sign_value(DHTRecord(
                KEY_ID.to_bytes(), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiration))

        served = DictionaryDHTValue()
        served.store(subkey, signed(forger, _announcement(victim, time.time() + 1000), exp + 100), exp + 100)
        stranger = await DHTNode.create(node_id=DHTID(int(KEY_ID) ^ 1), **LOOPBACK)
        stranger.protocol.storage = Withholding(served)
        nodes.append(stranger)
        reader = await GuardedDHTNode.create(initial_peers=await _maddrs(stranger),
                                             record_validator=SwarmRecordValidator(), **LOOPBACK)
        nodes.append(reader)
        fresh = time.time()
        assert reader.protocol.storage.store_subkey(KEY_ID, subkey, signed(victim, _announcement(victim, fresh), exp),
                                                    exp)
        found = await asyncio.wait_for(read_wide(KEY, [], None, reader), 30)
        assert found is not None and found.value[subkey].value["time"] == fresh  # the forgery was dropped

        older = DictionaryDHTValue()
        older.store(subkey, signed(victim, _announcement(victim, fresh - 50), exp - 10), exp - 10)
        stranger.protocol.storage.served = older  # the victim's own, older record
        found = await asyncio.wait_for(read_wide(KEY, [], None, reader), 30)
        assert found.value[subkey].value["time"] == fresh and found.value[subkey].expiration_time == exp
    finally:
        for n in nodes:
            await n.shutdown()
