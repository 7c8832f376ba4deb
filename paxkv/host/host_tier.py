"""The host-memory tier under the prefix cache: which cached pages live in host slots. No JAX.

A full, keyed page that the device pool evicts (`PagePool.take_evicted`) is *saved*: its
key gets a host slot, and the engine copies the page's K/V (every layer, the scales of
quantized pages, the draft model's) into that slot before it dispatches anything that
could overwrite the page. A prompt whose prefix continues in the tier past the device's
hits *loads* those slots into freshly allocated pages instead of prefilling them.

This index decides and records; the engine (`paxkv.engine.host_tier`) moves the bytes.
Between two flushes it holds the copies to make, in the order that keeps them right:

- every save reads its device page before any load writes one (a load's target page may
  be one a save of the same flush reads: the evicted page is reused at once);
- a key loaded while its save is still pending reads the slot after the save lands
  (`take_copies` hands both over; the engine lands a flush's saves first when a load
  needs one of them);
- a slot a pending load reads is pinned, and a slot whose save has not landed
  (`landed`) is in transit: the LRU never hands either to another key.

The tier is inclusive: a restored page keeps its slot, so when the device evicts it
again nothing is copied (keyed pages are never rewritten).

Slots are evicted least-recently-used (a save or a hit makes a key the most recent); a
full tier whose every slot is pinned skips the save (the page is lost to both tiers, as
without the tier): the tier evicts, it never fails a request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


class HostKVTier:
    """An LRU index of page keys over `num_slots` host slots, with the copies pending.

    Args:
      num_slots: host pages the tier holds (`kv_host_cache_gib` over a page's bytes).
      page_bytes: bytes of one page over every array (for the metrics).
    """

    def __init__(self, num_slots: int, page_bytes: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} must be at least 1")
        self.num_slots = num_slots
        self.page_bytes = page_bytes
        self._slots: OrderedDict[Hashable, int] = OrderedDict()  # key -> slot, LRU first
        self._free = list(range(num_slots - 1, -1, -1))  # free slots, popped from the end
        self._pinned: dict[int, int] = {}  # slot -> pending loads reading it
        self._saves: list[tuple[int, int]] = []  # (device page, slot) to copy out
        self._saving: set[int] = set()  # their slots: not handed to another key
        self._transit: set[int] = set()  # slots of saves taken, not landed yet
        self._loads: list[tuple[int, int]] = []  # (slot, device page) to copy in
        # Counters (pages).
        self.saved = 0  # pages copied to the host
        self.loaded = 0  # pages copied back
        self.queries = 0  # keys looked up (`holds`)
        self.hits = 0  # pages loaded back (the key manager counts them)
        self.evictions = 0  # keys the tier dropped to make room
        self.skipped = 0  # evicted device pages not saved (every slot pinned)

    # Saving.

    def save(self, evicted: Iterable[tuple[int, Hashable]]) -> None:
        """Records the `(device page, key)` pairs the device pool evicted: each key not
        held gets a slot (evicting the least recently used unpinned key) and a pending
        copy; a key held already is only made the most recent."""
        for page, key in evicted:
            if key in self._slots:
                self._slots.move_to_end(key)
                continue
            slot = self._take_slot()
            if slot is None:
                self.skipped += 1
                continue
            self._slots[key] = slot
            self._saves.append((page, slot))
            self._saving.add(slot)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for key, slot in self._slots.items():  # least recently used first
            if slot not in self._pinned and slot not in self._saving and slot not in self._transit:
                del self._slots[key]
                self.evictions += 1
                return slot
        return None

    # Loading.

    def holds(self, key: Hashable) -> bool:
        """Whether the tier holds `key` (counted as a query: the prefix cache asks for
        each key its device pool misses, at every admission attempt)."""
        self.queries += 1
        return key in self._slots

    def load(self, keys: Sequence[Hashable], pages: Sequence[int]) -> None:
        """Records that each of `keys` (held) is copied into device page `pages[i]`
        before the next step; their slots are pinned until then."""
        self.hits += len(keys)
        for key, page in zip(keys, pages, strict=True):
            slot = self._slots[key]
            self._slots.move_to_end(key)
            self._pinned[slot] = self._pinned.get(slot, 0) + 1
            self._loads.append((slot, page))

    # The copies.

    @property
    def pending(self) -> bool:
        """Whether copies wait for the next flush."""
        return bool(self._saves or self._loads)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The pending `(page, slot)` saves and `(slot, page)` loads, in order, handed
        to the engine, which must run every save before any load; slots unpinned."""
        saves, loads = self._saves, self._loads
        self._saves, self._loads = [], []
        self._transit |= self._saving
        self._saving = set()
        self._pinned.clear()
        self.saved += len(saves)
        self.loaded += len(loads)
        return saves, loads

    def landed(self, slots: Iterable[int]) -> None:
        """Records that the saves into `slots` have reached host memory."""
        self._transit.difference_update(slots)

    def drop_pending(self) -> None:
        """Forgets the copies not made yet, and the keys whose saves have not landed
        (the device cache they would read and write is lost: a failed step took it)."""
        self._loads, self._pinned = [], {}
        self._saves = []
        lost = self._saving | self._transit
        for key, slot in [(k, s) for k, s in self._slots.items() if s in lost]:
            del self._slots[key]
            self._free.append(slot)
        self._saving, self._transit = set(), set()

    def clear(self) -> None:
        """Forgets every key and every copy not made yet (new weights: no page of the
        tier is found again; the pages pending loads would fill were uncached, and their
        sequences do not run on under the new weights)."""
        self._slots = OrderedDict()
        self._saves, self._loads, self._pinned = [], [], {}
        self._saving, self._transit = set(), set()
        self._free = list(range(self.num_slots - 1, -1, -1))

    # Queries.

    @property
    def num_used(self) -> int:
        """Slots holding a key."""
        return len(self._slots)

    @property
    def usage(self) -> float:
        """Fraction of slots holding a key, in [0, 1]."""
        return len(self._slots) / self.num_slots

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def check_invariants(self) -> None:
        """Raises AssertionError unless every slot is either free or held by one key."""
        held = list(self._slots.values())
        assert len(set(held)) == len(held), "two keys share a slot"
        assert not set(held) & set(self._free), "a held slot is free"
        assert len(set(self._free)) == len(self._free), "a slot is free twice"
        assert len(held) + len(self._free) == self.num_slots, (
            f"{len(held)} held + {len(self._free)} free != {self.num_slots} slots"
        )
