"""The DHT's storage, bounded and replay-proof: what ``node.net.dht_guard``'s protocol keeps.

hivemind's storage (pinned 1.1.12) keeps any number of entries under a key, of any size; its
``TimedStorage.store`` records an incoming value's expiry in its heap *before* refusing it as older
than the value it holds (so a replayed old record deletes the current one when the old expiry
comes); and its lookups merge remote answers into the dictionary object storage holds, past any
bound. Here a key holds at most ``MAX_ENTRIES_PER_KEY`` entries and ``MAX_BYTES_PER_KEY`` bytes,
one sender adds at most ``MAX_ENTRIES_PER_WRITER`` new entries to a key, an entry is at most
``MAX_ENTRY_BYTES`` and the whole storage at most ``MAX_STORAGE_BYTES``: a *new* subkey is refused
at a bound, a newer record for a subkey already held still goes in; the expiry heap is updated only
for a value that is accepted; and storage hands out copies. Why each bound: ``dht_guard``'s module
docstring.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils.timed_storage import (
    ROOT,
    HeapEntry,
    TimedStorage,
    ValueWithExpiration,
    get_dht_time,
)

MAX_ENTRIES_PER_KEY = 1024  # subkeys one key holds
MAX_BYTES_PER_KEY = 1 << 20  # their bytes (subkey + value + ENTRY_OVERHEAD each): well under p2pd's 4 MiB
MAX_ENTRIES_PER_WRITER = 128  # new subkeys one sender may add to one key
MAX_ENTRY_BYTES = 64 << 10  # one value
MAX_STORAGE_BYTES = 64 << 20  # everything one storage holds
ENTRY_OVERHEAD = 64  # bytes counted per entry beyond its subkey and value (expiry, framing)
KEY_OVERHEAD = 1024  # bytes counted per key against MAX_STORAGE_BYTES (its bookkeeping objects)
SWEEP_EVERY_S = 1.0  # a full storage counts its lazily expired entries again at most this often
SELF = "self"  # the writer of what the node stores itself (its own records, its own lookups)
RECORDS_PER_S = 64.0  # records one sender may have validated per second at one node, sustained
RECORDS_BURST = 512.0  # and at once (an honest node stores a few records every announce period)
MAX_SENDERS_TRACKED = 4096  # senders whose rate a node follows (the least recent forgotten first)
VERIFIED_KEPT = 8192  # entries a reader remembers it found valid (checked once, not at every lookup)



def _entry_size(subkey_bytes: bytes, value: bytes) -> int:
    return len(subkey_bytes) + len(value) + ENTRY_OVERHEAD


# ----------------------------------------------------------------------------- storage


class OrderedTimedStorage(TimedStorage):
    """hivemind's ``TimedStorage`` whose expiry heap follows only the values it holds.

    Why: ``TimedStorage.store`` (hivemind 1.1.12) pushes the incoming expiry onto its heap and
    points the key at it before it compares expiries; a refused older value leaves the key pointing
    at the older expiry, and when that passes the newer value is deleted. Here the comparison comes
    first. Removals go through :meth:`_dropped` so subclasses can keep counts."""

    def _put(self, key, value, expiration_time: float) -> bool:
        if expiration_time < get_dht_time() and not self.frozen:
            return False
        current = self.data.get(key)
        if current is not None and current.expiration_time >= expiration_time:
            return False  # an older (or the same) value: refused before the heap sees it
        entry = HeapEntry(expiration_time, key)
        self.key_to_heap[key] = entry
        heapq.heappush(self.expiration_heap, entry)
        self.data[key] = ValueWithExpiration(value, expiration_time)
        if current is not None:
            self._replaced(key, current, value)
        else:
            self._remove_outdated()
        return True

    def store(self, key, value, expiration_time: float) -> bool:
        return self._put(key, value, expiration_time)

    def _remove_outdated(self) -> None:
        now = get_dht_time()
        heap = self.expiration_heap
        while not self.frozen and heap and (heap[ROOT].expiration_time < now or len(self.data) > self.maxsize):
            entry = heapq.heappop(heap)
            if self.key_to_heap.get(entry.key) == entry:
                item = self.data.pop(entry.key)
                del self.key_to_heap[entry.key]
                self._dropped(entry.key, item)

    def __delitem__(self, key) -> None:
        if key in self.key_to_heap:
            item = self.data.pop(key)
            del self.key_to_heap[key]
            self._dropped(key, item)

    def clear(self) -> None:
        for key in list(self.data):
            del self[key]
        self.expiration_heap.clear()

    def _dropped(self, key, item: ValueWithExpiration) -> None:
        """``key`` (holding ``item``) left the storage: expired, evicted or deleted."""

    def _replaced(self, key, old: ValueWithExpiration, new) -> None:
        """``key``'s value ``old`` was replaced by a newer one, ``new``."""


class KeyEntries(OrderedTimedStorage):
    """The subkeys of one key, with their sizes and who added each (internal to
    :class:`GuardedLocalStorage`; lookups get plain ``DictionaryDHTValue`` copies)."""

    def __init__(self, owner: GuardedLocalStorage):
        super().__init__()
        self.owner = owner
        self.nbytes = 0
        self.latest_expiration_time = float("-inf")
        self._size: dict[Any, int] = {}
        self._writer: dict[Any, Any] = {}
        self._per_writer: dict[Any, int] = {}

    def admit(self, subkey, subkey_bytes: bytes, value: bytes, expiration_time: float, writer) -> bool:
        """Store one entry within the bounds; False if refused (older than the one held, or a new
        subkey past a bound)."""
        if len(value) > MAX_ENTRY_BYTES:
            return False
        self._remove_outdated()
        size = _entry_size(subkey_bytes, value)
        held = self.data.get(subkey)
        if held is not None:  # a refresh: no new subkey, only its size may change
            if held.expiration_time >= expiration_time:
                return False
            grow = size - self._size[subkey]
            if grow > 0 and (self.nbytes + grow > MAX_BYTES_PER_KEY or not self.owner.has_room(grow)):
                return False
        else:
            if len(self.data) >= MAX_ENTRIES_PER_KEY or self.nbytes + size > MAX_BYTES_PER_KEY:
                return False
            if writer != SELF and self._per_writer.get(writer, 0) >= MAX_ENTRIES_PER_WRITER:
                return False
            if not self.owner.has_room(size):
                return False
        if not self._put(subkey, value, expiration_time):
            return False
        if held is None:
            self._writer[subkey] = writer
            self._per_writer[writer] = self._per_writer.get(writer, 0) + 1
        self._size[subkey] = size
        self.nbytes += size
        self.owner.total_bytes += size
        self.latest_expiration_time = max(self.latest_expiration_time, expiration_time)
        return True

    def _replaced(self, key, old: ValueWithExpiration, new=None) -> None:
        size = self._size.pop(key)
        self.nbytes -= size
        self.owner.total_bytes -= size

    def _dropped(self, key, item: ValueWithExpiration) -> None:
        self._replaced(key, item)
        writer = self._writer.pop(key)
        left = self._per_writer[writer] - 1
        if left:
            self._per_writer[writer] = left
        else:
            del self._per_writer[writer]

    def plain(self, budget: float = float("inf")) -> tuple[DictionaryDHTValue, int]:
        """A hivemind ``DictionaryDHTValue`` copy of the live entries, freshest first while they fit
        in ``budget`` bytes; and the bytes it holds."""
        self._remove_outdated()
        copy, used = DictionaryDHTValue(), 0
        for subkey, item in sorted(self.data.items(), key=lambda kv: -kv[1].expiration_time):
            size = self._size[subkey]
            if used + size > budget:
                continue
            copy.store(subkey, item.value, item.expiration_time)
            used += size
        return copy, used


class GuardedLocalStorage(DHTLocalStorage):
    """A DHT node's storage (or cache) with bounds per key, per sender and in total, expiry that a
    replay cannot shorten, and copies handed out instead of the dictionaries it holds (see the
    module docstring). A drop-in for hivemind's ``DHTLocalStorage`` as ``DHTNode`` and
    ``DHTProtocol`` use it: ``store``, ``store_subkey``, ``get``, ``items``, ``top``, ``in``, ``len``."""

    # the ordered heap of OrderedTimedStorage, for the top-level keys
    _put = OrderedTimedStorage._put
    _remove_outdated = OrderedTimedStorage._remove_outdated
    __delitem__ = OrderedTimedStorage.__delitem__
    clear = OrderedTimedStorage.clear

    def __init__(self, maxsize: Optional[int] = None):
        super().__init__(maxsize=maxsize)
        self.total_bytes = 0  # what the bounds count: entries' sizes and KEY_OVERHEAD per key
        self._swept_at = float("-inf")

    def has_room(self, size: int) -> bool:
        if self.total_bytes + size <= MAX_STORAGE_BYTES:
            return True
        now = get_dht_time()
        if now - self._swept_at >= SWEEP_EVERY_S:  # entries expire lazily: count again before refusing
            self._swept_at = now
            self._remove_outdated()
            for item in list(self.data.values()):
                if isinstance(item.value, KeyEntries):
                    item.value._remove_outdated()
        return self.total_bytes + size <= MAX_STORAGE_BYTES

    def _new_key(self, key, value, expiration_time: float) -> bool:
        """``_put`` for a key not held, counting its KEY_OVERHEAD."""
        if not self._put(key, value, expiration_time):
            return False
        self.total_bytes += KEY_OVERHEAD
        return True

    @staticmethod
    def _content(value) -> int:
        return value.nbytes if isinstance(value, KeyEntries) else _entry_size(b"", value)

    def _dropped(self, key, item: ValueWithExpiration) -> None:
        self.total_bytes -= KEY_OVERHEAD + self._content(item.value)

    def _replaced(self, key, old: ValueWithExpiration, new) -> None:
        if old.value is not new:  # (not the same key's entries, now living longer)
            self.total_bytes -= self._content(old.value)

    # ---- writing

    def store(self, key: DHTID, value, expiration_time: float, subkey=None, writer=SELF) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time, writer=writer)
        if isinstance(value, DictionaryDHTValue):  # the node caching a dictionary it looked up
            return self.store_dictionary(key, value, writer=writer) > 0
        if not isinstance(value, bytes) or len(value) > MAX_ENTRY_BYTES:
            return False
        self._remove_outdated()
        held = self.data.get(key)
        if held is not None and held.expiration_time >= expiration_time:
            return False
        if not self.has_room(_entry_size(b"", value) + (KEY_OVERHEAD if held is None else 0)):
            return False
        if not (self._new_key if held is None else self._put)(key, value, expiration_time):
            return False
        self.total_bytes += _entry_size(b"", value)
        return True

    def store_subkey(self, key: DHTID, subkey, value: bytes, expiration_time: float, writer=SELF,
                     subkey_bytes: Optional[bytes] = None) -> bool:
        """hivemind's rule (a dictionary replaces a plain value only if it expires later), within
        the bounds."""
        if not isinstance(value, bytes):
            return False
        self._remove_outdated()
        held = self.data.get(key)
        if subkey_bytes is None:
            subkey_bytes = DHTProtocol.serializer.dumps(subkey)
        if held is None or (not isinstance(held.value, KeyEntries) and expiration_time > held.expiration_time):
            # a new key (or a dictionary replacing a plain value that expires sooner, as in hivemind)
            if not self.has_room(KEY_OVERHEAD + _entry_size(subkey_bytes, value)):
                return False
            entries = KeyEntries(self)
            if not entries.admit(subkey, subkey_bytes, value, expiration_time, writer):
                return False
            if held is not None:
                del self[key]
            if not self._new_key(key, entries, entries.latest_expiration_time):
                self.total_bytes -= entries.nbytes
                return False
            return True
        if not isinstance(held.value, KeyEntries):
            return False
        entries = held.value
        if not entries.admit(subkey, subkey_bytes, value, expiration_time, writer):
            return False
        if entries.latest_expiration_time > held.expiration_time:  # the key lives as long as its latest entry
            self._put(key, entries, entries.latest_expiration_time)
        return True

    def store_dictionary(self, key: DHTID, dictionary: DictionaryDHTValue, writer=SELF) -> int:
        """Each entry of ``dictionary`` as a subkey of ``key``; how many went in."""
        stored = 0
        for subkey, item in list(dictionary.items()):
            stored += self.store_subkey(key, subkey, item.value, item.expiration_time, writer=writer)
        return stored

    # ---- reading

    def entries(self, key: DHTID) -> Optional[ValueWithExpiration]:
        """What the storage holds under ``key`` itself (no copy): bytes or :class:`KeyEntries`."""
        self._remove_outdated()
        return self.data.get(key)

    def get(self, key: DHTID) -> Optional[ValueWithExpiration]:
        """A copy: hivemind's lookup merges remote answers into the dictionary it gets from here."""
        item = self.entries(key)
        if item is None or not isinstance(item.value, KeyEntries):
            return item
        copy, _ = item.value.plain()
        if not copy.data:
            return None
        return ValueWithExpiration(copy, item.expiration_time)

    def items(self):
        self._remove_outdated()
        for key in list(self.data):
            item = self.get(key)
            if item is not None:
                yield key, item

    def top(self):
        self._remove_outdated()
        while self.expiration_heap and self.key_to_heap.get(self.expiration_heap[ROOT].key) != self.expiration_heap[ROOT]:
            heapq.heappop(self.expiration_heap)
        if not self.expiration_heap:
            return None, None
        key = self.expiration_heap[ROOT].key
        return key, self.get(key)


# ----------------------------------------------------------------------------- senders' rates


class SenderRates:
    """A token bucket of records per sender (``RECORDS_PER_S``, up to ``RECORDS_BURST``): what a
    store request may have validated. Records past a sender's bucket are refused unread, so a
    stranger's flood costs a node the reading of its request and not a check per record.
    Follows at most ``max_senders`` senders (a forgotten one comes back with a full bucket; new
    identities are free anyway, see docs/THREAT_MODEL.md)."""

    def __init__(self, rate: float = RECORDS_PER_S, burst: float = RECORDS_BURST,
                 max_senders: int = MAX_SENDERS_TRACKED, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.max_senders, self.clock = rate, burst, max_senders, clock
        self._buckets: OrderedDict[Any, tuple[float, float]] = OrderedDict()  # sender -> (tokens, when)
        self.refused = 0  # records refused unread, all senders

    def available(self, sender) -> int:
        """Whole records ``sender`` may have validated now."""
        tokens, at = self._buckets.get(sender, (self.burst, self.clock()))
        return int(min(self.burst, tokens + (self.clock() - at) * self.rate))

    def spend(self, sender, used: int, refused: int = 0) -> None:
        """``sender`` used ``used`` records of its bucket; ``refused`` more were refused unread."""
        now = self.clock()
        tokens, at = self._buckets.pop(sender, (self.burst, now))
        self._buckets[sender] = (min(self.burst, tokens + (now - at) * self.rate) - used, now)
        while len(self._buckets) > self.max_senders:
            self._buckets.popitem(last=False)
        self.refused += refused


class VerifiedEntries:
    """The entries a reader found valid, the most recent ``kept``: every lookup, and every neighbour
    asked by ``node.net.dht_neighbours``, brings the same signed records again, and each is checked
    once. An entry is the same only with the same key, subkey, value bytes and expiry, and one found
    valid stays valid until it expires (the expiry cap is judged against a later now)."""

    def __init__(self, kept: int = VERIFIED_KEPT):
        self.kept = kept
        self._marks: OrderedDict[tuple, None] = OrderedDict()

    @staticmethod
    def mark(record) -> tuple:
        """What identifies a ``DHTRecord``: key, subkey, a digest of its value, expiry."""
        return (record.key, record.subkey, hashlib.blake2b(record.value, digest_size=16).digest(),
                record.expiration_time)

    def __contains__(self, mark: tuple) -> bool:
        return mark in self._marks

    def add(self, mark: tuple) -> None:
        self._marks[mark] = None
        self._marks.move_to_end(mark)
        while len(self._marks) > self.kept:
            self._marks.popitem(last=False)

