"""The pages each sequence holds: allocation, window sliding, freeing, and its queries. No JAX.

The scheduler decides who runs; this object decides which pages they hold (as vLLM
separates its KV-cache manager from the scheduling policy), and it alone keeps each
sequence's page tables, batch row and prefix keys (`SequencePages`, in a dict keyed
by the sequence, as vLLM's `req_to_blocks`). The scheduler and the engine ask it
(`needs_pages`, `row`, `tables`, ...) and never read those records.

Automatic prefix caching (`paxkv.host.prefix_cache`): a new sequence first takes the
longest run of cached pages matching its tokens (their reference counts go up) and
computes only the rest; at least its last token is always computed, so the partial
last page is handled by recompute. Freed pages keep their keys and stay reusable, in
LRU order, until allocation evicts them; a preempted sequence therefore usually finds
its own pages.

Several KV-cache groups (`paxkv.host.kv_groups`: a hybrid model's global and
sliding-window layers) each hold a page table per sequence, drawn from the one pool. A
window group holds only the pages its layers can still read: before a chunk from
position `start` runs, its pages wholly before `start - W + 1` go back to the pool
(keeping their prefix-cache keys), so it holds about `W / page_size + 1` pages whatever
the context.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from paxkv.host.batch_rows import BatchRows
from paxkv.host.host_tier import HostKVTier
from paxkv.host.kv_groups import KVCacheGroups, first_page_read, peak_pages
from paxkv.host.page_pool import PagePool
from paxkv.host.prefix_cache import CachedPrefix, PrefixCache
from paxkv.host.reservation import PagedReservation
from paxkv.host.sequence import SequenceState
from paxkv.host.sequence_pages import SequencePages
from paxkv.pallas_kernels.layout import NULL_PAGE, cdiv


class KVCacheManager:
    """The pages each sequence holds, drawn from `pool` under a reservation policy.

    Args:
      pool: the host page pool of the device cache.
      page_size: tokens per page.
      max_model_len: longest sequence (prompt + output).
      enable_prefix_caching: reuse cached pages of equal prefixes.
      reservation: how many slots a sequence holds (default: the pages it needs).
      kv_groups: the KV-cache groups (default: one group of global layers).
      max_chunk_tokens: most tokens one step computes for a sequence (the scheduler's
        token budget), which bounds a window group's pages.
      host_tier: the host-memory tier under the prefix cache (None: none).
    """

    def __init__(
        self,
        pool: PagePool,
        *,
        page_size: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        reservation: PagedReservation | None = None,
        kv_groups: KVCacheGroups | None = None,
        max_chunk_tokens: int | None = None,
        host_tier: HostKVTier | None = None,
    ) -> None:
        self.pool = pool
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.reservation = reservation or PagedReservation()
        if enable_prefix_caching and not self.reservation.shares_pages:
            raise ValueError(
                f"reservation={self.reservation.name!r} holds contiguous regions: "
                "turn prefix caching off"
            )
        self.kv_groups = kv_groups or KVCacheGroups.uniform(1)
        self.num_groups = self.kv_groups.num_groups
        # A window group lets pages go only under the paged policy: a contiguous
        # reservation holds its region whole.
        self.windows: tuple[int | None, ...] = tuple(
            g.window if self.reservation.shares_pages else None for g in self.kv_groups.groups
        )
        self.sliding = any(w is not None for w in self.windows)
        self._window_sizes = _window_sizes(self.windows)
        self.max_chunk_tokens = max_chunk_tokens or max_model_len
        self.prefix_cache = PrefixCache(pool, page_size, self.windows, enable_prefix_caching)
        # The persistent batch: every change to a sequence's pages is mirrored in its row.
        self.rows = BatchRows(cdiv(max_model_len, page_size), num_groups=self.num_groups)
        self._seqs: dict[SequenceState, SequencePages] = {}  # the sequences holding pages
        self.host_tier = host_tier
        if host_tier is not None:
            if not enable_prefix_caching:
                raise ValueError("a host KV tier keeps prefix-cache pages: turn prefix caching on")
            pool.record_evictions()

    # Queries.

    def tables(self, seq: SequenceState) -> list[list[int]]:
        """`seq`'s page table of each group (empty when it holds no pages). Read only."""
        held = self._seqs.get(seq)
        return held.tables if held is not None else [[] for _ in range(self.num_groups)]

    def num_pages(self, seq: SequenceState) -> int:
        """Table entries `seq` holds (in each group)."""
        held = self._seqs.get(seq)
        return len(held.tables[0]) if held is not None else 0

    def held(self, seq: SequenceState, start: int = 0, stop: int | None = None) -> list[int]:
        """The pages `seq` holds at table positions `start:stop`, over every group."""
        return [p for t in self.tables(seq) for p in t[start:stop] if p != NULL_PAGE]

    def row(self, seq: SequenceState) -> int:
        """`seq`'s row of the persistent batch (`rows`); it must hold pages."""
        return self._seqs[seq].row

    def needs_pages(self, seq: SequenceState, end: int) -> bool:
        """Whether `seq`'s pages cannot hold its first `end` tokens yet."""
        return end > self.num_pages(seq) * self.page_size

    def decode_row(self, seq: SequenceState, end: int) -> int | None:
        """`seq`'s row when its pages already hold its first `end` tokens (its decode
        needs no new page), after window groups let go of what a chunk from `end - 1`
        no longer reads; None when it needs pages. The per-step fast path of a decode."""
        held = self._seqs.get(seq)
        if held is None or end > len(held.tables[0]) * self.page_size:
            return None
        if self.sliding and end > held.slide_at:
            self._slide(held, end - 1)
        return held.row

    def num_keys(self, seq: SequenceState) -> int:
        """How many of seq's leading full pages are registered in the prefix cache."""
        return len(held.keys) if (held := self._seqs.get(seq)) is not None else 0

    def needs_registering(self, seq: SequenceState, end: int) -> bool:
        """Whether a full page of seq's first `end` tokens is not in the prefix cache yet."""
        if not self.prefix_cache.enabled:
            return False
        held = self._seqs.get(seq)
        return held is not None and end // self.page_size > len(held.keys)

    def window_start(self, seq: SequenceState, group: int) -> int:
        """The first table entry of `group` that `seq` may still hold: those before it
        fell behind the group's window and were let go of."""
        held = self._seqs.get(seq)
        return held.window_freed[group] if held is not None and self.sliding else 0

    # Sizes.

    def pages_to_hold(self, seq: SequenceState, num_tokens: int) -> int:
        """Table entries `seq` needs to compute its first `num_tokens` tokens."""
        tokens = self.reservation.tokens_to_hold(
            seq, self.num_pages(seq), num_tokens, self.max_model_len
        )
        return cdiv(tokens, self.page_size)

    def _peak(self, num_pages: int, num_tokens: int) -> int:
        return sum(
            peak_pages(w, num_pages, num_tokens, self.max_chunk_tokens, self.page_size)
            for w in self.windows
        )

    def pages_at_peak(self, seq: SequenceState, num_tokens: int) -> int:
        """Pages `seq` holds at most, over every group, to compute `num_tokens` tokens."""
        return self._peak(self.pages_to_hold(seq, num_tokens), num_tokens)

    def pages_at_submit(self, num_tokens: int) -> int:
        """Pages a request of `num_tokens` (prompt + max_tokens) needs at its longest,
        over every group."""
        tokens = self.reservation.tokens_at_submit(num_tokens, self.max_model_len)
        return self._peak(cdiv(tokens, self.page_size), tokens)

    def can_grow(self, seq: SequenceState, num_tokens: int) -> bool:
        """Whether the policy lets `seq` take pages to reach `num_tokens` (else it is
        preempted itself, rather than taking pages from others)."""
        n = self.num_pages(seq)
        return (
            num_tokens <= n * self.page_size
            or not n
            or self.reservation.can_grow(seq, n, num_tokens, self.page_size)
        )

    # Allocation.

    def _hold(self, seq: SequenceState) -> SequencePages:
        held = self._seqs.get(seq)
        if held is None:
            tables = [[] for _ in range(self.num_groups)]
            row = self.rows.acquire(seq.params, seq.seed, seq.lora_slot)
            held = self._seqs[seq] = SequencePages(tables, row, [0] * self.num_groups)
        return held

    def allocate(self, seq: SequenceState, num_tokens: int) -> bool:
        """Grows `seq`'s pages to hold its first `num_tokens` tokens (computing from
        `seq.num_computed_tokens`); False if it cannot (the pool is short, or the policy
        forbids growing), holding nothing more. Window groups first let go of the
        pages behind the window."""
        start = seq.num_computed_tokens
        if self.sliding:
            self.slide(seq, start)
        n = self.num_pages(seq)
        need = self.pages_to_hold(seq, num_tokens)
        if need <= n:
            return True
        if not self.can_grow(seq, num_tokens):
            return False
        # Per group: the new entries, NULL_PAGE for those behind its window.
        ps = self.page_size
        skip = [min(need, max(n, first_page_read(w, start, ps))) for w in self.windows]
        pages = self.pool.allocate(sum(need - k for k in skip))
        if pages is None:
            return False
        held = self._hold(seq)
        new, i = [], 0
        for k in skip:
            new.append([NULL_PAGE] * (k - n) + pages[i : i + need - k])
            i += need - k
        for table, more in zip(held.tables, new, strict=True):
            table.extend(more)
        if self.sliding:
            freed = held.window_freed
            for g, k in enumerate(skip):
                if freed[g] >= n:  # the new NULL entries continue the leading run
                    freed[g] = k
            held.slide_at = 0
        self.rows.append(held.row, new[0], new[1:])
        return True

    def slide(self, seq: SequenceState, start: int) -> None:
        """Gives back the pages of window groups that a chunk from token `start` (and
        every later one) cannot read; they keep their prefix-cache keys. Costs a
        comparison unless a page falls behind a window."""
        held = self._seqs.get(seq)
        if held is not None and start >= held.slide_at:
            self._slide(held, start)

    def _slide(self, held: SequencePages, start: int) -> None:
        freed, tables, ps = held.window_freed, held.tables, self.page_size
        let_go = []
        next_at = None
        for window, groups in self._window_sizes:
            first = (start - window + 1) // ps  # the first page this window reads
            for g in groups:
                if first > freed[g]:
                    table = tables[g]
                    stop = min(first, len(table))
                    for i in range(freed[g], stop):
                        if table[i] != NULL_PAGE:
                            let_go.append(table[i])
                            table[i] = NULL_PAGE
                            self.rows.clear(held.row, g, i)
                    freed[g] = max(freed[g], stop)
                # `first` passes freed[g] from this start on:
                at = (freed[g] + 1) * ps + window - 1
                next_at = at if next_at is None or at < next_at else next_at
        held.slide_at = next_at or 0
        if let_go:
            self.pool.free(let_go)

    def reserve_ahead(self, seqs: Iterable[tuple[SequenceState, int]]) -> bool:
        """Grows every `(seq, num_tokens)` pair's pages, or none of them (returns False)."""
        added: list[tuple[SequenceState, int]] = []
        for seq, num_tokens in seqs:
            before = self.num_pages(seq)
            if not self.allocate(seq, num_tokens):
                for s, n in added:
                    self._truncate(self._seqs[s], n)
                return False
            added.append((seq, before))
        return True

    def _truncate(self, held: SequencePages, num_pages: int) -> None:
        """Gives back `held`'s table entries from `num_pages` on, in every group."""
        for table in held.tables:
            self.pool.free([p for p in reversed(table[num_pages:]) if p != NULL_PAGE])
            del table[num_pages:]
        if self.sliding:
            held.window_freed[:] = [min(f, num_pages) for f in held.window_freed]
            held.slide_at = 0
        self.rows.truncate(held.row, num_pages)

    def trim(self, seq: SequenceState, num_tokens: int) -> None:
        """Gives back the table entries `seq` holds beyond those its first `num_tokens`
        tokens need (pages taken for speculative positions it did not accept)."""
        held = self._seqs.get(seq)
        if held is not None and len(held.tables[0]) > (k := self.pages_to_hold(seq, num_tokens)):
            self._truncate(held, k)

    def free(self, seq: SequenceState) -> None:
        """Returns every page `seq` holds to the pool, last page first (see `PagePool`),
        forgetting the prefix pages it registered but did not compute."""
        held = self._seqs.pop(seq, None)
        if held is None:
            return
        self.prefix_cache.forget(held, seq.num_computed_tokens)
        self._truncate(held, 0)
        self.rows.release(held.row)

    def preempt(self, seq: SequenceState) -> None:
        """Frees `seq`'s pages; it will recompute what it had computed."""
        self.reservation.on_preempt(seq, self.num_pages(seq), self.page_size)
        self.free(seq)

    # Prefix caching.

    def lookup(self, seq: SequenceState) -> CachedPrefix:
        """seq's longest cached prefix (`PrefixCache.lookup`), on the device or, with a
        host tier, continued there (`HOST` entries, which `take_hits` loads) when the
        pool has free pages for them; else on the device only."""
        tier = self.host_tier
        if tier is None:
            return self.prefix_cache.lookup(seq)
        self.save_evicted()  # a page evicted in this plan is found in the tier too
        prefix = self.prefix_cache.lookup(seq, tier.holds)
        loads = len(prefix.from_host())
        if loads and self.pool.num_free - self.prefix_cache.evictable(prefix) < loads:
            return self.prefix_cache.lookup(seq)
        return prefix

    def take_hits(self, seq: SequenceState, prefix: CachedPrefix) -> int:
        """Gives `seq` (holding nothing) the cached pages of `prefix` (`lookup`) as its
        computed prefix; returns how many tokens they hold. Its `HOST` entries get new
        pages, keyed, whose copies in from the host tier are recorded (made before the
        next step runs); the pool must have them (`lookup` checks)."""
        self.free(seq)
        tables = [list(t) for t in prefix.tables]
        device = prefix.pages()
        self.pool.touch(device)  # first: the allocation below must not evict them
        loads = prefix.from_host()
        if loads:  # new pages, keyed and loaded, before seq holds anything
            tier = self.host_tier
            pages = self.pool.allocate(len(loads)) if tier is not None else None
            if tier is None or pages is None:
                self.pool.free(reversed(device))
                raise RuntimeError("lookup() gave HOST entries the pool cannot hold")
            keys = [self.prefix_cache.key(g, prefix.keys[i]) for g, i in loads]
            tier.load(keys, pages)  # pins their slots before the evictions are saved
            self.save_evicted()  # the copies out run before the copies in
            self.pool.mark_cached_many(pages, keys)
            for (g, i), page in zip(loads, pages, strict=True):
                tables[g][i] = page
        held = self._hold(seq)
        h = prefix.num_pages
        held.tables[:] = tables
        held.keys[:] = prefix.keys
        if self.sliding:
            held.window_freed[:] = [
                min(first_page_read(w, h * self.page_size, self.page_size), h) for w in self.windows
            ]
        if h:
            self.rows.append(held.row, held.tables[0], held.tables[1:])
        return h * self.page_size

    def set_weight_version(self, version: int) -> None:
        """Keys pages by weights `version` from now on; no page cached under other
        weights, on the device or in the host tier, is found again."""
        self.prefix_cache.set_weight_version(version)
        if self.host_tier is not None:
            self.pool.take_evicted()
            self.host_tier.clear()

    def save_cached(self) -> None:
        """Hands every cached page to the host tier as if evicted (the device cache is
        about to be freed: sleep), after the pages evicted before; nothing without a
        tier."""
        if self.host_tier is not None:
            self.save_evicted()
            self.host_tier.save(self.pool.cached_pages())

    def save_evicted(self) -> None:
        """Hands the pages the pool evicted since the last call to the host tier, which
        records their copies out (nothing without a tier)."""
        if self.host_tier is not None:
            self.host_tier.save(self.pool.take_evicted())

    def drop_copies(self) -> None:
        """Forgets the host tier's copies not made yet (the device cache was lost)."""
        if self.host_tier is not None:
            self.pool.take_evicted()
            self.host_tier.drop_pending()

    def register_full_pages(self, seq: SequenceState, end: int | None = None) -> list[int]:
        """Caches the full pages of `seq`'s first `end` tokens (default: those it has
        computed) not cached yet; returns those pages. The scheduler calls it when it
        plans a chunk, with the chunk's end: the step writes each layer's K/V before any
        attention reads them, so sequences planned later in the same step can share
        these pages. If that chunk does not run, `free` forgets them."""
        held = self._seqs.get(seq)
        if held is None or not self.prefix_cache.enabled:
            return []
        before = len(held.keys)
        self.prefix_cache.register(seq, held, seq.num_computed_tokens if end is None else end)
        return self.held(seq, before, len(held.keys))

    # Checks.

    def check_invariants(self) -> None:
        """Raises AssertionError unless each sequence's row of the persistent batch
        holds exactly its page tables (tests call it after every step)."""
        rows = [held.row for held in self._seqs.values()]
        assert len(set(rows)) == len(rows), f"two sequences share a row: {rows}"
        assert self.rows.num_rows_in_use == len(rows), "a row is held by no sequence"
        for seq, held in self._seqs.items():
            assert len({len(t) for t in held.tables}) == 1, f"{seq.seq_id}: ragged tables"
            self.rows.check(held.row, held.tables)


def allocate_decodes(kv: KVCacheManager, seqs: Sequence[SequenceState], ends: list[int]) -> int:
    """`kv.allocate(seqs[i], ends[i])` for each in order, up to the first that cannot;
    returns how many were granted (the rest hold nothing more). When each takes exactly
    one more page (one group, no windows, the policy letting all grow and the pool
    holding them all: the running decodes' sequences whose token starts a page), the
    pages come from one pool call and one write of the persistent batch."""
    held = list(map(kv._seqs.get, seqs))
    if not kv.sliding and kv.num_groups == 1 and held.count(None) == 0:
        ps = kv.page_size
        if type(kv.reservation) is PagedReservation:  # a page per page_size tokens, always
            one_more = all(
                -(-end // ps) == len(h.tables[0]) + 1 for end, h in zip(ends, held, strict=True)
            )
        else:
            one_more = all(
                kv.pages_to_hold(seq, end) == len(h.tables[0]) + 1 and kv.can_grow(seq, end)
                for seq, end, h in zip(seqs, ends, held, strict=True)
            )
        pages = kv.pool.allocate(len(seqs)) if one_more else None
        if pages is not None:
            try:  # the persistent batch first: a row past its width changes nothing
                kv.rows.append_one([h.row for h in held], pages)
            except Exception:
                kv.pool.free(pages)
                raise
            for h, page in zip(held, pages, strict=True):
                h.tables[0].append(page)
            return len(seqs)
    for i, (seq, end) in enumerate(zip(seqs, ends, strict=True)):
        if not kv.allocate(seq, end):
            return i
    return len(seqs)


def register_decodes(
    kv: KVCacheManager, seqs: Sequence[SequenceState], ends: Sequence[int]
) -> list[list[int]]:
    """`kv.register_full_pages(seqs[i], ends[i])` for each, in order; the decodes that
    each fill one page past their prompt's are keyed in one pass
    (`PrefixCache.register_filled`)."""
    cache = kv.prefix_cache
    if not cache.enabled:
        return [[] for _ in seqs]
    short = cache.register_filled(seqs, list(map(kv._seqs.get, seqs)), ends)
    return [
        kv.register_full_pages(seq, end) if page is None else [page] if page != NULL_PAGE else []
        for seq, end, page in zip(seqs, ends, short, strict=True)
    ]


def _window_sizes(windows: tuple[int | None, ...]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(window, its groups) for each window size: `slide` tests each size once."""
    sizes: dict[int, list[int]] = {}
    for g, w in enumerate(windows):
        if w is not None:
            sizes.setdefault(w, []).append(g)
    return tuple((w, tuple(gs)) for w, gs in sizes.items())
