"""Reading a run's key from the DHT nodes a reader is connected to, not only from the key's
nearest storers.

Why: a DHT keeps a key at the few nodes whose ids are nearest to it (hivemind: ``num_replicas``,
5), and hivemind lets every node choose its own id. A stranger who places that many nodes next
to the run's ``peers`` key holds every copy of the membership: it cannot forge an entry (each is
signed by the peer it names, ``node.net.records``), but it can withhold them all or answer only
stale ones, and honest readers would see an empty or dying swarm.

So a reader (:func:`read_wide`) asks, besides the nearest storers, its DHT *neighbours*: up to
``NEIGHBOURS_ASKED`` peers of its routing table, the run's members it knows first. Each node keeps
in its own storage every valid entry it has read this way and its own record
(:func:`announce_and_keep`), and answers a neighbour's find from that storage, so the records
spread from node to node as gossip does, and one honest neighbour is enough to learn every
honest peer it knows. What a neighbour says is checked as any DHT answer is (the guard's
per-entry validation: the signature of the peer each entry names, the size and expiry bounds), and
kept under that neighbour's name against the per-sender bound (``node.net.dht_storage``). A lying
neighbour can therefore only withhold entries or repeat old ones; the freshest record of each peer
wins, and a repeated one dies at its own expiry. What stays open: a reader whose neighbours are
all the stranger's (it chooses whom it talks to only at join, from its initial peers) learns
nothing from them; its initial peers are the operator's choice.

Both functions run in the DHT's process (``hivemind.DHT.run_coroutine``) on a node built with
``node.net.dht_guard``'s protocol (a plain hivemind node would merge a neighbour's whole answer or
drop it).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, Optional, Sequence

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.utils.timed_storage import ValueWithExpiration

from node.net.dht_storage import SELF

NEIGHBOURS_ASKED = 16  # routing-table peers asked per read, besides the key's nearest storers
ASK_TIMEOUT_S = 3.0  # one neighbour's answer
NEAREST_ASKED = 5  # the key's nearest storers asked (hivemind's num_replicas)


def choose_neighbours(node, prefer: Sequence[str], asked: int = NEIGHBOURS_ASKED) -> list:
    """Up to ``asked`` peers of ``node``'s routing table: those named in ``prefer`` (base58 peer
    ids, the run's members the caller knows) first, then others at random."""
    table = list(node.protocol.routing_table.peer_id_to_uid.keys())
    wanted = set(prefer)
    first = [p for p in table if p.to_base58() in wanted]
    rest = [p for p in table if p.to_base58() not in wanted]
    random.shuffle(first)
    random.shuffle(rest)
    return (first + rest)[:asked]


async def _ask(node, peer, key_id: DHTID, timeout: float) -> Optional[DictionaryDHTValue]:
    try:
        found = await asyncio.wait_for(node.protocol.call_find(peer, [key_id]), timeout)
    except Exception:  # noqa: BLE001 - a neighbour that does not answer is one of many
        return None
    if not found or key_id not in found:
        return None
    item = found[key_id][0]
    if item is None or not isinstance(item.value, DictionaryDHTValue):
        return None
    return item.value


def _plain(node, key_id: DHTID) -> Optional[ValueWithExpiration]:
    """What ``node``'s storage holds under ``key_id``, deserialised as ``DHTNode.get`` returns it:
    ``ValueWithExpiration({subkey: ValueWithExpiration(value, expiry)}, latest expiry)``."""
    held = node.protocol.storage.get(key_id)
    if held is None or not isinstance(held.value, DictionaryDHTValue):
        return None
    validator, serializer = node.protocol.record_validator, node.protocol.serializer
    out = {}
    for subkey, (value, expiration) in held.value.items():
        try:
            if validator is not None:
                value = validator.strip_value(DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), value, expiration))
            out[subkey] = ValueWithExpiration(serializer.loads(value), expiration)
        except Exception:  # noqa: BLE001 - an entry this node cannot decode is not returned
            continue
    if not out:
        return None
    return ValueWithExpiration(out, max(item.expiration_time for item in out.values()))


async def read_wide(key: str, prefer: Sequence[str], _dht: Any, node, *, asked: int = NEIGHBOURS_ASKED,
                    timeout: float = ASK_TIMEOUT_S) -> Optional[ValueWithExpiration]:
    """The dictionary under ``key`` as the key's nearest storers and up to ``asked`` neighbours
    (``prefer`` first) hold it, merged entry by entry (the freshest of each subkey) in this node's
    storage, which is then returned as ``DHTNode.get`` would return it (None if empty)."""
    key_id = DHTID.generate(source=key)
    try:
        nearest = await asyncio.wait_for(node.find_nearest_nodes([key_id], k_nearest=NEAREST_ASKED), timeout * 2)
        storers = list(nearest.get(key_id, {}).values())
    except Exception:  # noqa: BLE001 - the neighbours may still answer
        storers = []
    peers = list(dict.fromkeys([*storers, *choose_neighbours(node, prefer, asked)]))
    peers = [p for p in peers if p != node.peer_id]
    answers = await asyncio.gather(*(_ask(node, p, key_id, timeout) for p in peers))
    for peer, dictionary in zip(peers, answers):
        if dictionary is not None:
            node.protocol.storage.store_dictionary(key_id, dictionary, writer=peer.to_base58())
    return _plain(node, key_id)


async def announce_and_keep(key: str, subkey: Any, value: Any, expiration: float, _dht: Any, node) -> bool:
    """Store this node's own record under ``key``/``subkey`` in the DHT (as ``DHT.store`` does) and
    keep it, signed, in this node's own storage, so that neighbours reading through
    :func:`read_wide` hear it from the node itself. True if some storer took it."""
    key_id = DHTID.generate(source=key)
    serializer, validator = node.protocol.serializer, node.protocol.record_validator
    value_bytes = serializer.dumps(value)
    if validator is not None:
        value_bytes = validator.sign_value(DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), value_bytes,
                                                     expiration))
    node.protocol.storage.store_subkey(key_id, subkey, value_bytes, expiration, writer=SELF)
    try:
        return bool(await node.store(key, value, expiration, subkey=subkey))
    except Exception:  # noqa: BLE001 - the record is kept here; the next announce tries again
        return False
