"""The host page pool: which KV-cache pages are free, in use, or cached for reuse.

Pages are integer ids into the device KV cache. Page ``NULL_PAGE`` is reserved: it is never
allocated, and padded block-table entries point at it, so the usable pages are
``1 .. num_pages - 1``.

Every usable page is in exactly one of three states:

- **free**: refcount 0 and no cache key; it sits in the free queue.
- **cached-evictable**: refcount 0 and holds a cache key; it sits in the free queue, whose
  order is least-recently-freed first, so it is evicted when allocation reaches it.
- **in use**: refcount > 0; it is not in the free queue.

``allocate`` takes pages from the front of the free queue and ``free`` appends pages whose
refcount reaches 0 to its tail. Callers should therefore free a sequence's pages in reverse
order (last page first): the tail of a prefix is then evicted before its head, and the head
is what other sequences are most likely to share.

The pool only stores cache keys; the prefix cache computes them. This module is plain Python
and must never import jax: allocation is a host decision.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Hashable, Iterable, Sequence

from paxkv.pallas_kernels.layout import (
    NULL_PAGE,  # never allocated; padded block-table entries point here
)

_DETACHED = -1  # prev/next value of a page that is not in the free queue
_NO_KEY = object()


class InvariantError(AssertionError):
    """Raised by `PagePool.check_invariants` when the pool's bookkeeping is inconsistent."""


class PagePool:
    """Reference-counted pool of KV-cache pages with an LRU free queue and cache keys.

    Args:
      num_pages: total pages in the device cache, including ``NULL_PAGE``; at least 2.
    """

    def __init__(self, num_pages: int) -> None:
        num_pages = operator.index(num_pages)
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be at least 2 (page {NULL_PAGE} is reserved)")
        self._num_pages = num_pages
        self._refcounts = [0] * num_pages
        self._page_to_key: dict[int, Hashable] = {}
        self._key_to_page: dict[Hashable, int] = {}
        self._num_evictions = 0
        # (page, key) of each eviction since `take_evicted`, when recorded (a host tier).
        self._evicted: list[tuple[int, Hashable]] | None = None
        # The free queue is a circular doubly linked list through a sentinel node whose id is
        # `num_pages`; `_next[sentinel]` is the front and `_prev[sentinel]` the tail.
        self._sentinel = num_pages
        self._prev = [_DETACHED] * (num_pages + 1)
        self._next = [_DETACHED] * (num_pages + 1)
        self._prev[self._sentinel] = self._next[self._sentinel] = self._sentinel
        self._num_queued = 0
        for page in range(1, num_pages):
            self._append(page)

    # Free queue.

    def _append(self, page: int) -> None:
        _link_at_tail((page,), self._prev, self._next, self._sentinel)
        self._num_queued += 1

    def _remove(self, page: int) -> None:
        prev, nxt = self._prev[page], self._next[page]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._prev[page] = self._next[page] = _DETACHED
        self._num_queued -= 1

    def _queued(self, page: int) -> bool:
        return self._next[page] != _DETACHED

    # Validation.

    def _check_page(self, page: int) -> int:
        page = operator.index(page)
        if page == NULL_PAGE:
            raise ValueError(f"page {page} is NULL_PAGE, which is never allocated")
        if not 0 < page < self._num_pages:
            raise ValueError(f"page {page} is out of range [1, {self._num_pages})")
        return page

    # Allocation and reference counting.

    def allocate(self, n: int) -> list[int] | None:
        """Takes ``n`` pages from the front of the free queue, each with refcount 1.

        A taken page that holds a cache key is evicted: its key is dropped. Returns the pages
        in the order taken, or ``None``, with the pool unchanged, if fewer than ``n`` pages
        are free or cached-evictable.
        """
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"{n=} must be non-negative")
        if n > self._num_queued:
            return None
        # The first n pages of the queue, unlinked at once (no call per page).
        nxt, prev, refcounts = self._next, self._prev, self._refcounts
        pages = []
        page = nxt[self._sentinel]
        for _ in range(n):
            pages.append(page)
            following = nxt[page]
            prev[page] = nxt[page] = _DETACHED
            refcounts[page] = 1
            page = following
        nxt[self._sentinel] = page
        prev[page] = self._sentinel
        self._num_queued -= n
        to_key = self._page_to_key
        if to_key:  # taken pages that hold a key are evicted
            for page in pages:
                key = to_key.pop(page, _NO_KEY)
                if key is not _NO_KEY:
                    del self._key_to_page[key]
                    self._num_evictions += 1
                    if self._evicted is not None:
                        self._evicted.append((page, key))
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Drops one reference to each page, in order; a page listed twice loses two.

        A page whose refcount reaches 0 goes to the tail of the free queue, keeping its cache
        key if it has one, so pages freed earlier are evicted earlier. Free a sequence's pages
        last page first, so that its tail is evicted before its shared head.

        Raises ValueError, with the pool unchanged, if any page is ``NULL_PAGE``, out of
        range, or would be freed more times than it is referenced.
        """
        pages = list(pages)
        refcounts = self._refcounts
        if (  # the common case in C loops: distinct plain ints in range, each referenced
            pages
            and set(map(type, pages)) == {int}
            and min(pages) > NULL_PAGE
            and max(pages) < self._num_pages
            and len(set(pages)) == len(pages)
            and all(map(refcounts.__getitem__, pages))
        ):
            for page in pages:
                refcounts[page] -= 1
            freed = [page for page in pages if not refcounts[page]]
            _link_at_tail(freed, self._prev, self._next, self._sentinel)
            self._num_queued += len(freed)
            return
        pages = [self._check_page(p) for p in pages]
        for page, count in collections.Counter(pages).items():
            if count > self._refcounts[page]:
                raise ValueError(
                    f"page {page} is freed {count} time(s) but has refcount {self._refcounts[page]}"
                )
        for page in pages:
            self._refcounts[page] -= 1
            if self._refcounts[page] == 0:
                self._append(page)

    def touch(self, pages: Iterable[int]) -> None:
        """Adds one reference to each page found by a prefix-cache hit.

        A cached-evictable page leaves the free queue, so it will not be evicted. Every page
        must be in use or hold a cache key: a free page without a key holds nothing worth
        reusing and must come from `allocate`. Raises ValueError, with the pool unchanged,
        otherwise.
        """
        pages = [self._check_page(p) for p in pages]
        for page in pages:
            if self._refcounts[page] == 0 and page not in self._page_to_key:
                raise ValueError(f"page {page} is free and holds no cache key; allocate it")
        for page in pages:
            if self._refcounts[page] == 0:
                self._remove(page)
            self._refcounts[page] += 1

    # Cache keys.

    def mark_cached(self, page: int, key: Hashable) -> bool:
        """Records that in-use ``page`` holds the contents named by ``key``.

        Returns True if ``page`` now holds ``key``. Returns False, changing nothing, if ``key``
        already names another page (the existing page stays the canonical copy). Raises
        ValueError if ``page`` is not in use or already holds a different key.
        """
        self.mark_cached_many((page,), (key,))
        return self._key_to_page[key] == page

    def mark_cached_many(self, pages: Sequence[int], keys: Sequence[Hashable]) -> None:
        """`mark_cached(pages[i], keys[i])` for each, in order, in one pass: the same
        checks and outcome (a key another page already holds stays with it; an error
        leaves the earlier pages marked, as one call at a time would)."""
        refcounts, to_key, to_page = self._refcounts, self._page_to_key, self._key_to_page
        for page, key in zip(pages, keys, strict=True):
            if type(page) is not int or page == NULL_PAGE or not 0 < page < self._num_pages:
                page = self._check_page(page)  # raises unless a valid page id
            if not refcounts[page]:
                raise ValueError(f"page {page} is not in use and cannot be marked cached")
            held = to_key.get(page, key)
            if held is not key and held != key:
                raise ValueError(f"page {page} already holds cache key {held!r}, not {key!r}")
            owner = to_page.get(key)
            if owner is None:
                to_page[key] = page
                to_key[page] = key
            elif owner == page:
                to_key[page] = key

    def record_evictions(self) -> None:
        """From now on, keeps the `(page, key)` of every page `allocate` evicts, for
        `take_evicted` (the host tier saves them before the pages are overwritten)."""
        if self._evicted is None:
            self._evicted = []

    def take_evicted(self) -> list[tuple[int, Hashable]]:
        """The `(page, key)` pairs evicted since the last call, oldest first."""
        evicted = self._evicted or []
        if self._evicted is not None:
            self._evicted = []
        return evicted

    def uncache(self, page: int, key: Hashable) -> None:
        """Drops `key` from `page` if the page holds it (its contents were never written);
        nothing otherwise."""
        page = self._check_page(page)
        if self._page_to_key.get(page) == key:
            del self._page_to_key[page]
            del self._key_to_page[key]

    def uncache_all(self) -> None:
        """Drops every cache key: no page is found by `lookup` until marked again (new
        weights, or the device cache's contents lost); refcounts and the free queue are
        unchanged."""
        self._page_to_key.clear()
        self._key_to_page.clear()

    def cached_pages(self) -> list[tuple[int, Hashable]]:
        """Every `(page, key)` a page holds, least recently freed first among the
        evictable ones (held pages first)."""
        queued, node = [], self._next[self._sentinel]
        while node != self._sentinel:
            queued.append(node)
            node = self._next[node]
        order = {p: i for i, p in enumerate(queued)}
        pages = sorted(self._page_to_key, key=lambda p: order.get(p, -1))
        return [(p, self._page_to_key[p]) for p in pages]

    def lookup(self, key: Hashable) -> int | None:
        """Returns the page holding ``key``, or None if no page does."""
        return self._key_to_page.get(key)

    def refcount(self, page: int) -> int:
        """Returns the number of references to ``page``; 0 if it is free or cached-evictable."""
        return self._refcounts[self._check_page(page)]

    # Metrics.

    @property
    def num_pages(self) -> int:
        """Total pages, including ``NULL_PAGE``."""
        return self._num_pages

    @property
    def num_usable(self) -> int:
        """Pages that can ever be allocated: all but ``NULL_PAGE``."""
        return self._num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages `allocate` can take now: free plus cached-evictable."""
        return self._num_queued

    @property
    def num_cached(self) -> int:
        """Pages holding a cache key, whatever their refcount."""
        return len(self._page_to_key)

    @property
    def num_in_use(self) -> int:
        """Pages with refcount > 0."""
        return self.num_usable - self._num_queued

    @property
    def usage(self) -> float:
        """Fraction of usable pages in use, in [0, 1]."""
        return self.num_in_use / self.num_usable

    @property
    def num_evictions(self) -> int:
        """Cached pages evicted by `allocate` since the pool was created."""
        return self._num_evictions

    def check_invariants(self) -> None:
        """Raises InvariantError, saying what is wrong, unless the bookkeeping is consistent."""

        def require(condition: bool, message: str) -> None:
            if not condition:
                raise InvariantError(message)

        require(self._refcounts[NULL_PAGE] == 0, "NULL_PAGE is referenced")
        require(not self._queued(NULL_PAGE), "NULL_PAGE is in the free queue")
        require(NULL_PAGE not in self._page_to_key, "NULL_PAGE holds a cache key")
        negative = [p for p, rc in enumerate(self._refcounts) if rc < 0]
        require(not negative, f"pages {negative} have negative refcounts")

        queued = []
        seen = set()
        node = self._sentinel
        for _ in range(self._num_pages + 1):
            nxt = self._next[node]
            require(nxt != _DETACHED, f"free queue breaks after node {node}")
            require(self._prev[nxt] == node, f"free queue: prev[{nxt}] != {node}")
            node = nxt
            if node == self._sentinel:
                break
            require(node not in seen, f"free queue has a cycle at page {node}")
            seen.add(node)
            queued.append(node)
        else:
            raise InvariantError("free queue does not return to its sentinel")
        require(
            len(queued) == self._num_queued,
            f"free queue holds {len(queued)} pages but counts {self._num_queued}",
        )
        require(NULL_PAGE not in seen, "NULL_PAGE is in the free queue")
        referenced = [p for p in queued if self._refcounts[p] != 0]
        require(not referenced, f"pages {referenced} are in the free queue and referenced")
        idle = {p for p in range(1, self._num_pages) if self._refcounts[p] == 0}
        require(idle == seen, f"refcount-0 pages not queued: {sorted(idle - seen)}")
        detached_wrongly = [
            p
            for p in range(1, self._num_pages)
            if p not in seen and (self._prev[p] != _DETACHED or self._next[p] != _DETACHED)
        ]
        require(not detached_wrongly, f"pages {detached_wrongly} have stale queue links")

        num_cached_evictable = sum(1 for p in queued if p in self._page_to_key)
        num_free = len(queued) - num_cached_evictable
        num_in_use = sum(1 for rc in self._refcounts[1:] if rc > 0)
        require(
            num_free + num_cached_evictable + num_in_use == self.num_usable,
            f"{num_free=} + {num_cached_evictable=} + {num_in_use=} != {self.num_usable}",
        )

        require(
            len(self._page_to_key) == len(self._key_to_page),
            f"{len(self._page_to_key)} pages hold keys but {len(self._key_to_page)} keys map",
        )
        for page, key in self._page_to_key.items():
            require(0 < page < self._num_pages, f"cache key on out-of-range page {page}")
            require(
                self._key_to_page.get(key) == page,
                f"page {page} holds key {key!r} but the key maps to {self._key_to_page.get(key)}",
            )


def _link_at_tail(pages: Sequence[int], prev: list[int], nxt: list[int], sentinel: int) -> None:
    """Links `pages` (detached), in order, at the tail of the free queue whose links are
    `prev` / `nxt` around `sentinel`."""
    tail = prev[sentinel]
    for page in pages:
        prev[page] = tail
        nxt[tail] = page
        tail = page
    nxt[tail] = sentinel
    prev[sentinel] = tail
