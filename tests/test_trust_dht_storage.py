"""A stranger on the DHT, with its own hivemind node placed nearest the run's ``peers`` key (a chosen
DHT id), tries to hide, flood or shorten the run's membership at the nodes that store it, and to
make readers drop honest entries (node/net/dht_guard.py, docs/THREAT_MODEL.md). Real hivemind
nodes on loopback; what is asserted is what an honest reader (or the storing node's answer) sees.

The honest storing nodes are guarded ones: ``SwarmDHT`` processes (the node's own path) in the
cache test, ``GuardedDHTNode`` in this process elsewhere; the stranger's node is plain hivemind,
with no validator, sending raw protocol calls."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from node.net import dht_guard, dht_storage
from node.net.dht import start_dht, stop_dht
from node.net.dht_guard import GuardedDHTNode
from node.net.records import SwarmRecordValidator, peer_subkey
from security import PeerKey, new_ed25519_key

# wait_timeout: one RPC's bound (hivemind's default 3 s); a store of thousands of records to a node in
# this same process, on a loaded machine, may take longer, and no test here is about that bound
LOOPBACK = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False, auto_nat=False,
                nat_port_map=False, wait_timeout=30)
KEY = "swarm-node/trust-dht/0123456789abcdef/peers"  # the run's membership key
KEY_ID = DHTID.generate(source=KEY)
NEAREST = DHTID(int(KEY_ID) ^ 1)  # the stranger's chosen DHT id: nearer the key than anyone's


def _announcement(key: PeerKey) -> dict:
    """An announcement like ``membership.PeerRecord.to_value``'s."""
    return {"peer_id": key.peer_id, "stage": 0, "state": "online", "throughput": 1.0, "queue": 0,
            "version": 0, "protocol": 1, "maddrs": [f"/ip4/127.0.0.1/tcp/9/p2p/{key.peer_id}"], "time": time.time()}


def _signed(signer: PeerKey, expiration: float, value: dict | None = None) -> tuple[str, bytes, float]:
    """(subkey, value bytes, expiry) of ``signer``'s announcement as it travels in a store: signed
    by its own key, so any node may carry it."""
    subkey = peer_subkey(signer.peer_id)
    record = DHTRecord(KEY_ID.to_bytes(), MSGPackSerializer.dumps(subkey),
                       MSGPackSerializer.dumps(value or _announcement(signer)), expiration)
    return subkey, SwarmRecordValidator(signer).sign_value(record), expiration


def _keys(n: int) -> list[PeerKey]:
    return [PeerKey(new_ed25519_key()) for _ in range(n)]


async def _maddrs(node) -> list[str]:
    return [str(m) for m in await node.get_visible_maddrs()]


async def _stranger(initial_peers: list[str]) -> DHTNode:
    """The stranger's own plain hivemind node, nearest the key, validating nothing."""
    return await DHTNode.create(initial_peers=initial_peers, node_id=NEAREST, **LOOPBACK)


async def _raw_store(stranger: DHTNode, peer_id, records: list[tuple[str, bytes, float]], in_cache=False) -> list:
    """One store request from the stranger straight to ``peer_id``: hivemind's ``call_store``."""
    ok = await stranger.protocol.call_store(
        peer_id, keys=[KEY_ID] * len(records), values=[v for _, v, _ in records],
        expiration_time=[e for _, _, e in records], subkeys=[s for s, _, _ in records], in_cache=in_cache)
    assert ok is not None, "the storing node did not answer the store"
    return ok


async def _raw_find(asker: DHTNode, peer_id) -> tuple[int, DictionaryDHTValue | None]:
    """What ``peer_id`` answers for the key, unvalidated: (the answer's bytes, its dictionary)."""
    response = await asker.protocol.get_stub(peer_id).rpc_find(
        dht_pb2.FindRequest(keys=[KEY_ID.to_bytes()], peer=asker.protocol.node_info), timeout=20)
    result = response.results[0]
    found = MSGPackSerializer.loads(result.value) if result.type == dht_pb2.FOUND_DICTIONARY else None
    return response.ByteSize(), found


async def _read(reader: DHTNode) -> dict:
    """What an honest reader sees under the key (membership reads with ``latest=True``): subkey -> value."""
    found = await asyncio.wait_for(reader.get(KEY, latest=True), 30)
    return {} if found is None else dict(found.value)


async def _shutdown(*nodes) -> None:
    for node in nodes:
        if node is not None:
            await node.shutdown()


# ----------------------------------------------------------------------------- cache shadowing


@pytest.mark.timeout(180)
@pytest.mark.asyncio
async def test_one_entry_stored_for_the_cache_hides_no_announcement(tmp_path):
    """Finding: hivemind's ``rpc_find`` answers from the cache when the cached copy expires later,
    and ``rpc_store`` fills the cache on the caller's say-so. The stranger stores one valid entry
    "for the cache", expiring late, at both storing nodes (the swarm's own ``SwarmDHT`` processes)
    and keeps nothing honest itself; the reader must still see both nodes' announcements."""
    paths, dhts, stranger, reader = [], [], None, None
    try:
        for i in range(2):
            path = tmp_path / f"id{i}.key"
            path.write_bytes(new_ed25519_key())
            paths.append(path)
            dhts.append(start_dht([a for d in dhts for a in map(str, d.get_visible_maddrs())],
                                  ["/ip4/127.0.0.1/tcp/0"], identity_path=str(path), local=True))
        initial = [str(a) for a in dhts[0].get_visible_maddrs()]
        stranger = await _stranger(initial)
        honest = [PeerKey(p.read_bytes()) for p in paths]
        for dht, key in zip(dhts, honest):  # each storing node announces itself, as a node does
            stored = await dht.store(KEY, _announcement(key), get_dht_time() + 60, subkey=peer_subkey(key.peer_id),
                                     return_future=True)
            assert stored
        stranger.protocol.storage.clear()  # the stranger keeps no honest entry: it withholds them
        sybil = _keys(1)[0]
        shadow = _signed(sybil, get_dht_time() + 250)  # valid, and later than anything stored
        stranger.protocol.storage.store(KEY_ID, shadow[1], shadow[2], subkey=shadow[0])
        for dht in dhts:
            assert await _raw_store(stranger, dht.peer_id, [shadow], in_cache=True) == [True]

        reader = await GuardedDHTNode.create(initial_peers=initial, client_mode=True,
                                             record_validator=SwarmRecordValidator(), **LOOPBACK)
        seen = await _read(reader)
        assert {peer_subkey(k.peer_id) for k in honest} <= set(seen), f"the reader saw only {sorted(seen)}"
        for key in honest:
            assert seen[peer_subkey(key.peer_id)].value["peer_id"] == key.peer_id
    finally:
        await _shutdown(reader, stranger)
        for dht in dhts:
            stop_dht(dht)


# ----------------------------------------------------------------------------- flooding


class CountingValidator(SwarmRecordValidator):
    """The project's validator, counting the records it is asked to judge."""

    judged = 0

    def validate(self, record):
        self.judged += 1
        return super().validate(record)


def _memory_estimate(found: DictionaryDHTValue | None) -> int:
    """Bytes a storing node spends on the key: each entry's value and subkey objects, plus its
    bookkeeping (value-with-expiry, heap entry, dictionary slots: about 300 bytes per entry)."""
    if found is None:
        return 0
    return sum(sys.getsizeof(sk) + sys.getsizeof(item.value) + 300 for sk, item in found.data.items())


@pytest.mark.timeout(240)
@pytest.mark.asyncio
async def test_five_thousand_junk_entries_stay_bounded_and_honest_ones_readable():
    """Finding: a key takes any number of entries, so its answer outgrows p2pd's 4 MiB message limit
    (the node can no longer answer it) and memory grows without bound; one request's thousands of
    records are all verified in one go. The stranger sends 5000 validly signed announcements of
    made-up peers under the run's key, first in 50 requests, then in one."""
    validator = CountingValidator()
    storing = stranger = reader = None
    try:
        honest = _keys(2)
        storing = await GuardedDHTNode.create(record_validator=validator, **LOOPBACK)
        initial = await _maddrs(storing)
        stranger = await _stranger(initial)
        for key in honest:  # two honest announcements already held
            assert await _raw_store(stranger, storing.peer_id, [_signed(key, get_dht_time() + 120)]) == [True]

        expiration = get_dht_time() + 200
        junk = [_signed(k, expiration) for k in _keys(5000)]
        for i in range(0, 5000, 100):  # in many requests
            await _raw_store(stranger, storing.peer_id, junk[i:i + 100])
        size, found = await _raw_find(stranger, storing.peer_id)
        entries, memory = len(found.data), _memory_estimate(found)
        print(f"\n5000 junk entries in 50 requests: the answer is {size} bytes, {entries} entries, "
              f"about {memory / 2**20:.2f} MiB held for the key")
        assert entries <= dht_storage.MAX_ENTRIES_PER_WRITER + len(honest)
        assert size <= dht_storage.MAX_BYTES_PER_KEY + 65536

        junk2 = [_signed(k, expiration) for k in _keys(5000)]
        judged = validator.judged
        started = time.monotonic()
        ok = await _raw_store(stranger, storing.peer_id, junk2)  # in one request
        took = time.monotonic() - started
        size, found = await _raw_find(stranger, storing.peer_id)
        entries, memory = len(found.data), _memory_estimate(found)
        print(f"then 5000 more in one request ({validator.judged - judged} records verified, {took:.2f} s): "
              f"the answer is {size} bytes, {entries} entries, about {memory / 2**20:.2f} MiB held for the key")
        assert validator.judged - judged <= dht_guard.MAX_RECORDS_PER_REQUEST
        assert sum(ok) == 0  # the stranger's share of the key was full already
        assert entries <= dht_storage.MAX_ENTRIES_PER_WRITER + len(honest)
        assert size <= dht_storage.MAX_BYTES_PER_KEY + 65536

        reader = await GuardedDHTNode.create(initial_peers=initial, client_mode=True,
                                             record_validator=SwarmRecordValidator(), **LOOPBACK)
        seen = await _read(reader)
        assert {peer_subkey(k.peer_id) for k in honest} <= set(seen)
        # an honest peer refreshing its own entry still gets in (from its own node: the stranger's
        # sender budget is spent)
        assert await _raw_store(reader, storing.peer_id, [_signed(honest[0], get_dht_time() + 150)]) == [True]
    finally:
        await _shutdown(reader, stranger, storing)


def test_a_sender_s_records_past_its_rate_are_refused_and_its_bucket_refills():
    now = [0.0]
    rates = dht_storage.SenderRates(rate=10.0, burst=100.0, max_senders=2, clock=lambda: now[0])
    assert rates.available("a") == 100
    rates.spend("a", 100)
    assert rates.available("a") == 0 and rates.available("b") == 100  # one sender's flood is its own
    now[0] = 2.5
    assert rates.available("a") == 25
    rates.spend("a", 25, refused=75)
    assert rates.available("a") == 0 and rates.refused == 75
    now[0] = 1000.0
    assert rates.available("a") == 100  # never past the burst
    rates.spend("b", 1)
    rates.spend("c", 1)  # a third sender: the least recent ("a") is forgotten
    assert "a" not in rates._buckets and set(rates._buckets) == {"b", "c"}


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_a_flooding_sender_gets_its_rate_checked_and_the_rest_refused_unread_while_others_store():
    """One sender floods a node with store requests: past its burst, its records are refused without
    a check each (and counted as ``unread``), while another sender's record still goes in."""
    from node.net.records import ForgeryCounter

    validator = CountingValidator(counter=ForgeryCounter())
    storing = stranger = other = None
    try:
        storing = await GuardedDHTNode.create(record_validator=validator, **LOOPBACK)
        initial = await _maddrs(storing)
        stranger = await _stranger(initial)
        junk = [(f"junk:{i}", MSGPackSerializer.dumps({"x": i}), get_dht_time() + 100) for i in range(2000)]
        started = time.monotonic()
        for i in range(0, len(junk), 200):
            assert not any(await _raw_store(stranger, storing.peer_id, junk[i:i + 200]))
        took = time.monotonic() - started
        allowed = dht_storage.RECORDS_BURST + dht_storage.RECORDS_PER_S * took
        print(f"\n2000 junk records in {took:.2f} s: {validator.judged} checked, "
              f"{validator.counter.snapshot()['unread']} refused unread")
        assert validator.judged <= allowed, (validator.judged, allowed)
        assert validator.counter.snapshot()["unread"] >= len(junk) - allowed
        other = await DHTNode.create(initial_peers=initial, **LOOPBACK)
        key = _keys(1)[0]
        assert await _raw_store(other, storing.peer_id, [_signed(key, get_dht_time() + 60)]) == [True]
    finally:
        await _shutdown(other, stranger, storing)


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_a_full_key_refuses_new_subkeys_but_takes_refreshes_and_answers_within_the_bound():
    """Many writers together (here the node itself, which no per-sender bound limits) fill a key:
    it holds at most ``MAX_ENTRIES_PER_KEY`` entries in ``MAX_BYTES_PER_KEY``, refuses a new subkey,
    still takes a newer record for a subkey it holds, and its answer stays within the bound."""
    storing = asker = None
    try:
        storing = await GuardedDHTNode.create(record_validator=SwarmRecordValidator(), **LOOPBACK)
        asker = await _stranger(await _maddrs(storing))
        keys = _keys(dht_storage.MAX_ENTRIES_PER_KEY + 200)
        expiration = get_dht_time() + 120
        stored = [storing.protocol.storage.store(KEY_ID, value, exp, subkey=subkey)
                  for subkey, value, exp in (_signed(k, expiration) for k in keys)]
        size, found = await _raw_find(asker, storing.peer_id)
        print(f"\n{len(keys)} entries offered: {sum(stored)} kept, the answer is {size} bytes, "
              f"about {_memory_estimate(found) / 2**20:.2f} MiB held for the key")
        assert sum(stored) <= dht_storage.MAX_ENTRIES_PER_KEY and not stored[-1]
        assert len(found.data) == sum(stored) and size <= dht_storage.MAX_BYTES_PER_KEY + 65536
        first = keys[0]
        newer = _signed(first, expiration + 10)
        assert storing.protocol.storage.store(KEY_ID, newer[1], newer[2], subkey=newer[0])
        _, found = await _raw_find(asker, storing.peer_id)
        assert found.data[peer_subkey(first.peer_id)].expiration_time == expiration + 10
    finally:
        await _shutdown(asker, storing)


# ----------------------------------------------------------------------------- reader side


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_one_invalid_entry_in_an_answer_costs_the_reader_only_that_entry():
    """Finding: hivemind drops a whole dictionary answer for one entry that fails validation. The
    stranger relays two honest announcements together with one forged entry (another peer's
    announcement under a victim's subkey) and one that claims to live forever; the reader keeps the
    two honest ones, and the answer's expiry is theirs."""
    stranger = reader = None
    try:
        stranger = await DHTNode.create(node_id=NEAREST, **LOOPBACK)
        honest = _keys(2)
        expiration = get_dht_time() + 60
        for subkey, value, exp in [_signed(k, expiration) for k in honest]:
            stranger.protocol.storage.store_subkey(KEY_ID, subkey, value, exp)
        victim, forger = _keys(2)
        _, forged, _ = _signed(forger, expiration, value=_announcement(victim))  # the victim's fields, wrong key
        stranger.protocol.storage.store_subkey(KEY_ID, peer_subkey(victim.peer_id), forged, expiration)
        forever = _signed(_keys(1)[0], float("inf"))
        stranger.protocol.storage.store_subkey(KEY_ID, *forever)

        reader = await GuardedDHTNode.create(initial_peers=await _maddrs(stranger), client_mode=True,
                                             record_validator=SwarmRecordValidator(), **LOOPBACK)
        found = await asyncio.wait_for(reader.get(KEY, latest=True), 30)
        assert found is not None, "the reader dropped the whole answer"
        assert set(found.value) == {peer_subkey(k.peer_id) for k in honest}
        assert found.expiration_time == expiration
    finally:
        await _shutdown(reader, stranger)


@pytest.mark.timeout(60)
@pytest.mark.asyncio
async def test_a_reader_checks_a_signed_entry_once_however_many_answers_bring_it():
    validator = CountingValidator()
    reader = None
    try:
        reader = await GuardedDHTNode.create(record_validator=validator, **LOOPBACK)

        honest = _keys(2)
        expiration = get_dht_time() + 60
        signed = {e: [_signed(k, e) for k in honest] for e in (expiration, expiration + 1)}

        def answer(expiration):  # another copy of the same records, as another node's answer is
            d = DictionaryDHTValue()
            for entry in signed[expiration]:
                d.store(*entry)
            return d

        for _ in range(5):  # five answers bring the same two records
            assert reader.protocol._validate_dictionary(KEY_ID.to_bytes(), answer(expiration))
        assert validator.judged == 2
        assert reader.protocol._validate_dictionary(KEY_ID.to_bytes(), answer(expiration + 1))  # refreshed: new
        assert validator.judged == 4
        forged = DictionaryDHTValue()
        subkey, value, _ = signed[expiration + 1][0]
        forged.store(subkey, value[:-1] + bytes([value[-1] ^ 1]), expiration + 1)  # one bit of the signature
        assert not reader.protocol._validate_dictionary(KEY_ID.to_bytes(), forged)
        assert validator.judged == 5
    finally:
        await _shutdown(reader)


# ----------------------------------------------------------------------------- replays


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_a_replayed_older_record_does_not_expire_the_newer_one():
    """Finding: hivemind's timed storage records a refused older record's expiry in its heap, which
    then deletes the newer record at that time. An honest peer's record expiring at T2 is stored;
    the stranger replays its older record (expiring at T1 < T2) at every storing node; after T1 the
    reader still sees the newer record."""
    storing = stranger = reader = None
    try:
        honest = _keys(1)[0]
        storing = await GuardedDHTNode.create(record_validator=SwarmRecordValidator(), **LOOPBACK)
        initial = await _maddrs(storing)
        stranger = await _stranger(initial)
        t1 = get_dht_time() + 2.0
        older = _signed(honest, t1)  # the stranger kept this one from an earlier announcement
        newer = _signed(honest, get_dht_time() + 60)
        assert await _raw_store(stranger, storing.peer_id, [newer]) == [True]
        assert await _raw_store(stranger, storing.peer_id, [older]) == [False]  # refused as older
        reader = await GuardedDHTNode.create(initial_peers=initial, client_mode=True,
                                             record_validator=SwarmRecordValidator(), **LOOPBACK)
        await asyncio.sleep(max(0.0, t1 - get_dht_time()) + 0.5)  # the point of the test: T1 has passed
        seen = await _read(reader)
        assert peer_subkey(honest.peer_id) in seen, "the replay expired the newer record"
        assert seen[peer_subkey(honest.peer_id)].expiration_time == newer[2]
    finally:
        await _shutdown(reader, stranger, storing)
