"""The DHT's storage and lookup side, hardened against strangers: a node's storage for a key cannot
be hidden, flooded past a bound or emptied early by a replay, and a reader keeps every valid
entry of an answer.

hivemind's DHT (pinned 1.1.12) trusts whoever talks to it more than a public swarm can afford.
``SwarmDHT`` (``node.net.hivemind_patches``) runs every DHT node of the project, regular nodes and
bootstrap peers alike, with :class:`GuardedDHTProtocol` in place of hivemind's ``DHTProtocol``.
What it changes, and why:

Cache shadowing
    hivemind's ``rpc_store`` stores into the node's *cache* when the caller says ``in_cache``, and
    its ``rpc_find`` answers from the cache whenever the cached copy expires later than the stored
    one: one entry sent "for the cache" with a far expiry, at the nodes nearest a key (a node picks
    its own DHT id, so being nearest is cheap), hides every honest announcement stored there. Here
    the caller's ``in_cache`` flag is ignored (such a store is an ordinary store, under the same
    validation and bounds), only the node's own lookups fill its cache, and ``rpc_find`` answers
    from storage whenever storage holds the key (the cache only for keys storage lacks).

Unbounded keys
    hivemind keeps any number of entries under a key, of any size, and answers them all in one
    message: past p2pd's 4 MiB limit the node can no longer answer that key at all, and memory
    grows without bound. Here a key holds at most ``MAX_ENTRIES_PER_KEY`` entries and
    ``MAX_BYTES_PER_KEY`` bytes, one sender adds at most ``MAX_ENTRIES_PER_WRITER`` new entries to
    a key, an entry is at most ``MAX_ENTRY_BYTES``, and the whole storage at most
    ``MAX_STORAGE_BYTES``. When a bound is reached a *new* subkey is refused; an existing subkey's
    refresh (a newer record for it) still goes in. An answer never exceeds ``MAX_ANSWER_BYTES``.

Verification work per request and per sender
    A store request is validated record by record (a signature check each, about half a
    millisecond); hivemind validates all of a request's records in one go, so thousands of records
    block the node's event loop for seconds. Here a request is validated for at most
    ``MAX_RECORDS_PER_REQUEST`` records, a sender for at most ``RECORDS_PER_S`` records a second
    (bursts of ``RECORDS_BURST``, ``node.net.dht_storage.SenderRates``): the rest are refused unread
    and counted (``swarm_node_forged_records_total{kind="unread"}``). The node yields to its event
    loop every ``VALIDATE_CHUNK`` records.

Replays evict
    hivemind's ``TimedStorage.store`` records the expiry of an incoming value in its expiry heap
    *before* it refuses the value as older than the one it holds; when that older expiry comes, the
    heap drops the newer value. A replayed old record thus deletes the current one early. Here the
    heap is updated only for a value that is accepted.

All-or-nothing dictionaries
    hivemind drops a whole dictionary answer when one of its entries fails validation, honest
    entries included, and takes the answer's expiry as its sender claims it (a claimed expiry of
    infinity ends a reader's ``latest=True`` lookup at once). Here a reader keeps each valid entry
    of an answer, drops the others, and dates the answer by its valid entries alone. It checks an
    entry it has found valid before (same bytes, same expiry) only once: every lookup, and every
    neighbour asked by ``node.net.dht_neighbours``, brings the same signed records again.

Reader's own storage
    hivemind's lookup merges remote answers into the very dictionary object its local storage
    holds, past any bound. Here storage hands out copies.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any, Optional

import hivemind.dht.node as hivemind_node
from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2PContext
from hivemind.proto import dht_pb2
from hivemind.utils.timed_storage import (
    TimedStorage,
    ValueWithExpiration,
    get_dht_time,
)

from node.net.dht_storage import (
    GuardedLocalStorage, KeyEntries, MAX_BYTES_PER_KEY, MAX_ENTRIES_PER_KEY, MAX_ENTRY_BYTES, SenderRates,
    VerifiedEntries,
)

_PLAIN_SUBKEY = DHTProtocol.IS_REGULAR_VALUE
_WHOLE_DICTIONARY = DHTProtocol.IS_DICTIONARY
MAX_RECORDS_PER_REQUEST = 256  # records validated per store request; the rest are refused unread
MAX_KEYS_PER_FIND = 64  # keys answered per find request (hivemind asks at most 16 at a time)
MAX_ANSWER_BYTES = 3 << 20  # values in one find answer, all keys together (p2pd refuses over 4 MiB)
VALIDATE_CHUNK = 32  # records validated between two yields to the event loop


# ----------------------------------------------------------------------------- protocol


class GuardedDHTProtocol(DHTProtocol):
    """hivemind's ``DHTProtocol`` (1.1.12) with the storage of :class:`GuardedLocalStorage` and the
    ``rpc_store``, ``rpc_find`` and dictionary validation described in the module docstring. Other
    nodes see the same RPC names as hivemind's (``DHTProtocol.rpc_*``), so guarded and plain nodes
    talk to each other."""

    @classmethod
    def _get_handle_name(cls, namespace, method_name: str) -> str:
        # hivemind names a servicer's handlers after its class; ours must answer as DHTProtocol's
        return DHTProtocol._get_handle_name(namespace, method_name)

    @classmethod
    async def create(cls, *args: Any, **kwargs: Any) -> GuardedDHTProtocol:
        self = await super().create(*args, **kwargs)
        self._guard_storage()  # a client-mode node registers no handlers: its storage is guarded here
        return self

    async def add_p2p_handlers(self, p2p, wrapper=None, **kwargs: Any) -> None:
        # DHTProtocol.create makes hivemind's storage and cache just before it starts serving:
        # swap both before the first request can reach them
        self._guard_storage()
        await super().add_p2p_handlers(p2p, wrapper, **kwargs)

    def _guard_storage(self) -> None:
        if not hasattr(self, "sender_rates"):  # (DHTProtocol.create builds the protocol without __init__)
            self.sender_rates = SenderRates()  # records each sender may still have checked
            self._verified = VerifiedEntries()  # entries this node, as a reader, found valid
        if not isinstance(self.storage, GuardedLocalStorage):
            self.storage = GuardedLocalStorage()
        if not isinstance(self.cache, GuardedLocalStorage):
            maxsize = self.cache.maxsize
            self.cache = GuardedLocalStorage(maxsize=None if maxsize == float("inf") else maxsize)

    # ---- serving

    async def rpc_store(self, request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
        """hivemind's store, but: ``in_cache`` is ignored (everything goes to storage, under the same
        checks), dictionaries are taken entry by entry, at most ``MAX_RECORDS_PER_REQUEST`` records are
        validated, the event loop gets a turn every ``VALIDATE_CHUNK`` validations, and storage bounds
        apply per sender (``context.remote_id``)."""
        if request.peer:  # as hivemind: the sender joins our routing table
            asyncio.create_task(self.rpc_ping(dht_pb2.PingRequest(peer=request.peer), context))
        response = dht_pb2.StoreResponse(store_ok=[], peer=self.node_info)
        n = len(request.keys)
        if not (len(request.subkeys) == len(request.values) == len(request.expiration_time) == n):
            response.store_ok.extend([False] * n)
            return response
        writer = context.remote_id if context.remote_id is not None else "unknown"
        allowed = min(MAX_RECORDS_PER_REQUEST, self.sender_rates.available(writer))
        budget = [allowed, VALIDATE_CHUNK]  # records left to validate; until the next yield
        unread = 0
        for key, tag, value, expiration_time in zip(
                request.keys, request.subkeys, request.values, request.expiration_time):
            if budget[0] <= 0:  # past the request's or the sender's budget: refused unread
                unread += 1
                response.store_ok.append(False)
                continue
            try:
                key_id = DHTID.from_bytes(key)
            except Exception:  # noqa: BLE001 - a malformed key id: refused
                response.store_ok.append(False)
                continue
            if tag == _WHOLE_DICTIONARY:
                ok = await self._store_whole_dictionary(key, key_id, value, writer, budget)
            else:
                ok = await self._store_one(key, key_id, tag, value, expiration_time, writer, budget)
            response.store_ok.append(ok)
        self.sender_rates.spend(writer, allowed - budget[0], unread)
        if unread:
            self._count_unread(unread)
        return response

    def _count_unread(self, n: int) -> None:
        """Records refused unread, in the validator's forgery counter (kind ``unread``) if it has one."""
        validator = self.record_validator
        for v in getattr(validator, "_validators", [validator]):
            counter = getattr(v, "counter", None)
            if counter is not None:
                counter.add("unread", n)
                return

    async def _spend(self, budget: list[int]) -> bool:
        """One validation from the request's budget; yield to the loop every VALIDATE_CHUNK."""
        if budget[0] <= 0:
            return False
        budget[0] -= 1
        budget[1] -= 1
        if budget[1] <= 0:
            budget[1] = VALIDATE_CHUNK
            await asyncio.sleep(0)
        return True

    async def _store_one(self, key: bytes, key_id: DHTID, tag: bytes, value: bytes, expiration_time: float,
                         writer, budget: list[int]) -> bool:
        if len(value) > MAX_ENTRY_BYTES or not await self._spend(budget):
            return False
        if not self._validate_record(key, tag, value, expiration_time):
            return False
        if tag == _PLAIN_SUBKEY:
            return self.storage.store(key_id, value, expiration_time)
        try:
            subkey = self.serializer.loads(tag)
            hash(subkey)
        except Exception:  # noqa: BLE001 - not a subkey hivemind could have written
            return False
        return self.storage.store_subkey(key_id, subkey, value, expiration_time, writer=writer, subkey_bytes=tag)

    async def _store_whole_dictionary(self, key: bytes, key_id: DHTID, value: bytes, writer,
                                      budget: list[int]) -> bool:
        """Each entry on its own (hivemind refuses the whole dictionary for one bad entry)."""
        if len(value) > MAX_BYTES_PER_KEY * 2 or budget[0] <= 0:
            return False
        try:
            dictionary = self.serializer.loads(value)
        except Exception:  # noqa: BLE001 - not a dictionary hivemind could have written
            return False
        if not isinstance(dictionary, DictionaryDHTValue):
            return False
        all_ok = True
        for subkey, (item_value, item_expiration) in list(dictionary.data.items()):
            try:
                subkey_bytes = self.serializer.dumps(subkey)
            except Exception:  # noqa: BLE001
                all_ok = False
                continue
            ok = isinstance(item_value, bytes) and await self._store_one(
                key, key_id, subkey_bytes, item_value, item_expiration, writer, budget)
            all_ok = all_ok and ok
        return all_ok

    async def rpc_find(self, request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
        """hivemind's find, but: storage answers whenever it holds the key (the cache only for keys it
        lacks, and only the node itself fills the cache), and the answer stays within
        ``MAX_ANSWER_BYTES`` (freshest entries first)."""
        if request.peer:  # as hivemind: the sender joins our routing table
            asyncio.create_task(self.rpc_ping(dht_pb2.PingRequest(peer=request.peer), context))
        response = dht_pb2.FindResponse(results=[], peer=self.node_info)
        try:
            exclude = DHTID.from_bytes(request.peer.node_id) if request.peer.node_id else None
        except Exception:  # noqa: BLE001
            exclude = None
        budget = MAX_ANSWER_BYTES
        for i, key in enumerate(request.keys):
            try:
                key_id = DHTID.from_bytes(key)
            except Exception:  # noqa: BLE001
                response.results.append(dht_pb2.FindResult(type=dht_pb2.NOT_FOUND))
                continue
            if i >= MAX_KEYS_PER_FIND:
                response.results.append(dht_pb2.FindResult(type=dht_pb2.NOT_FOUND))
                continue
            item = self.storage.entries(key_id)
            if item is None:
                item = self.cache.entries(key_id)
            result, used = self._answer(item, budget)
            budget -= used
            for node_id, peer_id in self.routing_table.get_nearest_neighbors(key_id, k=self.bucket_size,
                                                                              exclude=exclude):
                result.nearest_node_ids.append(node_id.to_bytes())
                result.nearest_peer_ids.append(peer_id.to_bytes())
            response.results.append(result)
        return response

    def _answer(self, item: Optional[ValueWithExpiration], budget: int) -> tuple[dht_pb2.FindResult, int]:
        if item is None:
            return dht_pb2.FindResult(type=dht_pb2.NOT_FOUND), 0
        if isinstance(item.value, KeyEntries):
            copy, used = item.value.plain(budget)
            if not copy.data:
                return dht_pb2.FindResult(type=dht_pb2.NOT_FOUND), 0
            return dht_pb2.FindResult(type=dht_pb2.FOUND_DICTIONARY, value=self.serializer.dumps(copy),
                                      expiration_time=copy.latest_expiration_time), used
        if len(item.value) > budget:
            return dht_pb2.FindResult(type=dht_pb2.NOT_FOUND), 0
        return dht_pb2.FindResult(type=dht_pb2.FOUND_REGULAR, value=item.value,
                                  expiration_time=item.expiration_time), len(item.value)

    # ---- reading others' answers

    async def call_find(self, peer, keys):
        """hivemind's ``call_find`` (whose dictionary check, :meth:`_validate_dictionary`, here keeps
        the valid entries); a dictionary's expiry is then its latest valid entry's, not what the
        answer claims."""
        output = await super().call_find(peer, keys)
        if not output:
            return output
        for key, (found, nearest) in list(output.items()):
            if found is not None and isinstance(found.value, DictionaryDHTValue):
                dictionary = found.value
                if not dictionary.data:
                    output[key] = None, nearest
                    continue
                latest = max(item.expiration_time for item in dictionary.data.values())
                output[key] = ValueWithExpiration(dictionary, latest), nearest
        return output

    def _validate_dictionary(self, key_bytes: bytes, dictionary: DictionaryDHTValue) -> bool:
        """Keep the entries that pass the validator (hivemind: all of them, or the answer is dropped).
        Also dropped: expired entries, entries past ``MAX_ENTRIES_PER_KEY`` (no guarded node answers
        more; the rest is not worth the signature checks), and values the reader could not decode
        (hivemind's lookup would fail on them after the fact). Filters ``dictionary`` in place and
        resets what its sender claimed about it (size limit, latest expiry); True if any entry is left."""
        if not isinstance(dictionary, DictionaryDHTValue):
            return False
        now = get_dht_time()
        kept = []
        for n, (subkey, item) in enumerate(list(dictionary.data.items())):
            if n >= MAX_ENTRIES_PER_KEY:
                break
            value, expiration_time = item.value, item.expiration_time
            if not isinstance(value, bytes) or not isinstance(expiration_time, (int, float)) or expiration_time < now:
                continue
            try:
                record = DHTRecord(key_bytes, self.serializer.dumps(subkey), value, expiration_time)
                mark = VerifiedEntries.mark(record)
                if mark not in self._verified:
                    if self.record_validator is not None:
                        if not self.record_validator.validate(record):
                            continue
                        self.serializer.loads(self.record_validator.strip_value(record))
                    else:
                        self.serializer.loads(value)
                self._verified.add(mark)
            except Exception:  # noqa: BLE001 - an entry the reader cannot use: dropped
                continue
            kept.append((subkey, value, expiration_time))
        dictionary.clear()
        dictionary.maxsize = float("inf")
        dictionary.latest_expiration_time = float("-inf")
        with dictionary.freeze():
            for subkey, value, expiration_time in kept:
                dictionary.store(subkey, value, expiration_time)
        return bool(kept)


# ----------------------------------------------------------------------------- installing


_GUARDED = contextvars.ContextVar("swarm_node_guarded_dht", default=False)
_HIVEMIND_PROTOCOL = DHTProtocol
_guard_process = False


class _ProtocolOfContext(DHTProtocol):
    """Stands for ``DHTProtocol`` in ``hivemind.dht.node``, whose ``DHTNode.create`` makes its
    protocol from that module-level name (hivemind 1.1.12 has no argument for it): inside
    :meth:`GuardedDHTNode.create`, or in a process :func:`guard_this_process` was called in, it
    makes a :class:`GuardedDHTProtocol`; anywhere else hivemind's own."""

    @classmethod
    async def create(cls, *args: Any, **kwargs: Any) -> DHTProtocol:
        impl = GuardedDHTProtocol if (_guard_process or _GUARDED.get()) else _HIVEMIND_PROTOCOL
        return await impl.create(*args, **kwargs)


def missing_hivemind_name() -> Optional[str]:
    """The first private part of hivemind (1.1.12) the guard relies on that the installed hivemind
    lacks, or None."""
    needs = {
        "hivemind.dht.node.DHTProtocol": getattr(hivemind_node, "DHTProtocol", None) in (
            _HIVEMIND_PROTOCOL, _ProtocolOfContext),
        "DHTProtocol._validate_dictionary": callable(getattr(DHTProtocol, "_validate_dictionary", None)),
        "DHTProtocol._get_handle_name": callable(getattr(DHTProtocol, "_get_handle_name", None)),
        "TimedStorage.key_to_heap": "key_to_heap" in vars(TimedStorage()),
    }
    return next((name for name, found in needs.items() if not found), None)


def install() -> None:
    """Let ``DHTNode.create`` make guarded protocols where asked (idempotent). Raises ``RuntimeError``
    when hivemind no longer makes its protocol from ``hivemind.dht.node.DHTProtocol``."""
    current = getattr(hivemind_node, "DHTProtocol", None)
    if current is _ProtocolOfContext:
        return
    if current is not _HIVEMIND_PROTOCOL:
        raise RuntimeError("hivemind.dht.node.DHTProtocol is not hivemind's DHTProtocol: the DHT guard "
                           "(node/net/dht_guard.py, written against hivemind 1.1.12) cannot install itself")
    hivemind_node.DHTProtocol = _ProtocolOfContext


def guard_this_process() -> None:
    """Every DHT node created in this process from now on is guarded (``SwarmDHT``'s child)."""
    global _guard_process
    install()
    _guard_process = True


class GuardedDHTNode(DHTNode):
    """hivemind's ``DHTNode`` with a :class:`GuardedDHTProtocol` (same arguments as
    ``DHTNode.create``); for nodes made in a process that also makes plain ones."""

    @classmethod
    async def create(cls, *args: Any, **kwargs: Any) -> GuardedDHTNode:
        install()
        token = _GUARDED.set(True)
        try:
            return await super().create(*args, **kwargs)
        finally:
            _GUARDED.reset(token)
