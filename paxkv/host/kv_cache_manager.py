"""Page bookkeeping of the sequences: lookup, allocation, prefix registration, freeing. No JAX.

The scheduler decides who runs; this object decides which pages they hold (as vLLM
separates its KV-cache manager from the scheduling policy). Automatic prefix caching:
every full page a sequence computes is registered in the pool under a chained key of
its tokens (`paxkv.host.prefix_cache`). A new sequence first takes the longest run of
cached pages matching its tokens (their reference counts go up) and computes only the
rest; at least its last token is always computed, so the partial last page is handled
by recompute. Freed pages keep their keys and stay reusable, in LRU order, until
allocation evicts them; a preempted sequence therefore usually finds its own pages.

Several KV-cache groups (`paxkv.host.kv_groups`: a hybrid model's global and
sliding-window layers) each hold a page table per sequence, drawn from the one pool. A
window group holds only the pages its layers can still read: before a chunk from
position `start` runs, its pages wholly before `start - W + 1` go back to the pool
(keeping their prefix-cache keys), so it holds about `W / page_size + 1` pages whatever
the context. A cached prefix of `h` pages hits when every global group has all `h`
pages cached and every window group the pages inside the window at position
`h * page_size` (vLLM's rule for hybrid models). Cache keys carry the group index, so
one prefix has a page per group.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from absl import logging

from paxkv.host.batch_rows import BatchRows
from paxkv.host.kv_groups import KVGroupLayout
from paxkv.host.page_pool import PagePool
from paxkv.host.prefix_cache import page_keys
from paxkv.host.reservation import PagedReservation
from paxkv.host.sequence import SequenceState
from paxkv.kv_layout import NULL_PAGE, cdiv

_MAX_LEADS = 8192  # first pages remembered for reporting sub-page prefix sharing


class KVCacheManager:
    """The pages each sequence holds, drawn from `pool` under a reservation policy.

    Args:
      pool: the host page pool of the device cache.
      page_size: tokens per page.
      max_model_len: longest sequence (prompt + output).
      enable_prefix_caching: reuse cached pages of equal prefixes.
      reservation: how many slots a sequence holds (default: the pages it needs).
      layout: the KV-cache groups (default: one group of global layers).
      max_chunk_tokens: most tokens one step computes for a sequence (the scheduler's
        token budget), which bounds a window group's pages.
    """

    def __init__(
        self,
        pool: PagePool,
        *,
        page_size: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        reservation: PagedReservation | None = None,
        layout: KVGroupLayout | None = None,
        max_chunk_tokens: int | None = None,
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
        self.enable_prefix_caching = enable_prefix_caching
        self.layout = layout or KVGroupLayout.uniform(1)
        self.num_groups = self.layout.num_groups
        # A window group lets pages go only under the paged policy: a contiguous
        # reservation holds its region whole.
        self.windows: tuple[int | None, ...] = tuple(
            g.window if self.reservation.shares_pages else None for g in self.layout.groups
        )
        self.sliding = any(w is not None for w in self.windows)
        # (window, its groups) for each window size: `slide` tests each size once.
        sizes: dict[int, list[int]] = {}
        for g, w in enumerate(self.windows):
            if w is not None:
                sizes.setdefault(w, []).append(g)
        self._window_sizes = tuple((w, tuple(gs)) for w, gs in sizes.items())
        self.max_chunk_tokens = max_chunk_tokens or max_model_len
        # Every change to a sequence's pages goes through this object, which mirrors it
        # in the sequence's row of the persistent batch.
        self.rows = BatchRows(cdiv(max_model_len, page_size), num_groups=self.num_groups)
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        # Requests sharing their first 4+ tokens, but less than a page, with a cached prefix.
        self.short_prefix_misses = 0
        # Leading tokens of recently cached first pages (bounded), to notice prefixes
        # shared over less than a page.
        self._first_tokens: OrderedDict[tuple, None] = OrderedDict()
        # The model weights' version, part of every cache key (see `set_weight_version`).
        self.weight_version = 0

    # Tables.

    def tables(self, seq: SequenceState) -> list[list[int]]:
        """`seq`'s page table of each group (group 0's is `seq.pages`)."""
        if self.num_groups == 1:
            return [seq.pages]
        if len(seq.group_pages) != self.num_groups - 1:
            seq.group_pages = [[NULL_PAGE] * len(seq.pages) for _ in range(self.num_groups - 1)]
        return [seq.pages, *seq.group_pages]

    def held(self, seq: SequenceState, start: int = 0, stop: int | None = None) -> list[int]:
        """The pages `seq` holds at table positions `start:stop`, over every group."""
        return [p for t in self.tables(seq) for p in t[start:stop] if p != NULL_PAGE]

    def _freed(self, seq: SequenceState) -> list[int]:
        if len(seq.window_freed) != self.num_groups:
            seq.window_freed = [0] * self.num_groups
        return seq.window_freed

    def first_needed(self, group: int, start: int) -> int:
        """The first page a chunk from token `start` reads in `group`'s layers."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, start - window + 1) // self.page_size

    def _key(self, group: int, key):
        return key if self.num_groups == 1 else (group, key)

    # Sizes.

    def pages_to_hold(self, seq: SequenceState, num_tokens: int) -> int:
        """Table entries `seq` needs to compute its first `num_tokens` tokens."""
        tokens = self.reservation.tokens_to_hold(seq, num_tokens, self.max_model_len)
        return cdiv(tokens, self.page_size)

    def _peak(self, num_pages: int, num_tokens: int) -> int:
        """Pages held at most, over every group, by a sequence of `num_tokens` tokens in
        `num_pages` table entries: a window group holds the pages of one chunk and the
        window before it."""
        total = 0
        for window in self.windows:
            if window is None:
                total += num_pages
            else:
                span = window - 1 + min(self.max_chunk_tokens, num_tokens)
                total += min(num_pages, cdiv(span, self.page_size) + 1)
        return total

    def pages_at_peak(self, seq: SequenceState, num_tokens: int) -> int:
        """Pages `seq` holds at most, over every group, to compute `num_tokens` tokens."""
        return self._peak(self.pages_to_hold(seq, num_tokens), num_tokens)

    def pages_at_submit(self, num_tokens: int) -> int:
        """Pages a request of `num_tokens` (prompt + max_tokens) needs at its longest,
        over every group."""
        tokens = self.reservation.tokens_at_submit(num_tokens, self.max_model_len)
        return self._peak(cdiv(tokens, self.page_size), tokens)

    def fits(self, seq: SequenceState, num_tokens: int) -> bool:
        """Whether `seq`'s pages already hold its first `num_tokens` tokens."""
        return num_tokens <= len(seq.pages) * self.page_size

    # Allocation.

    def allocate(self, seq: SequenceState, num_tokens: int) -> bool:
        """Grows `seq`'s pages to hold its first `num_tokens` tokens (computing from
        `seq.num_computed_tokens`); False if it cannot (the pool is short, or the policy
        forbids growing), holding nothing more. Window groups first let go of the
        pages behind the window."""
        start = seq.num_computed_tokens
        if self.sliding:
            self.slide(seq, start)
        n = len(seq.pages)
        need = self.pages_to_hold(seq, num_tokens)
        if need <= n:
            return True
        if not self.can_grow(seq, num_tokens):
            return False
        # Per group: the new entries, NULL_PAGE for those behind its window.
        skip = [min(need, max(n, self.first_needed(g, start))) for g in range(self.num_groups)]
        pages = self.pool.allocate(sum(need - k for k in skip))
        if pages is None:
            return False
        new, i = [], 0
        for k in skip:
            new.append([NULL_PAGE] * (k - n) + pages[i : i + need - k])
            i += need - k
        for table, more in zip(self.tables(seq), new, strict=True):
            table.extend(more)
        if self.sliding:
            freed = self._freed(seq)
            for g, k in enumerate(skip):
                if freed[g] >= n:  # the new NULL entries continue the leading run
                    freed[g] = k
            seq.slide_at = 0
        self.rows.append(seq, new[0], new[1:])
        return True

    def slide(self, seq: SequenceState, start: int) -> None:
        """Gives back the pages of window groups that a chunk from token `start` (and
        every later one) cannot read; they keep their prefix-cache keys. Costs a
        comparison per window size unless a page falls behind a window."""
        freed = seq.window_freed
        if len(freed) != self.num_groups:
            freed = self._freed(seq)
        ps = self.page_size
        let_go = None
        next_at = None
        for window, groups in self._window_sizes:
            first = (start - window + 1) // ps  # the first page this window reads
            for g in groups:
                if first > freed[g]:
                    table = self.tables(seq)[g]
                    stop = min(first, len(table))
                    for i in range(freed[g], stop):
                        if table[i] != NULL_PAGE:
                            let_go = let_go or []
                            let_go.append(table[i])
                            table[i] = NULL_PAGE
                            self.rows.clear(seq, g, i)
                    freed[g] = max(freed[g], stop)
                # `first` passes freed[g] from this start on:
                at = (freed[g] + 1) * ps + window - 1
                next_at = at if next_at is None or at < next_at else next_at
        seq.slide_at = next_at or 0
        if let_go:
            self.pool.free(let_go)

    def can_grow(self, seq: SequenceState, num_tokens: int) -> bool:
        """Whether the policy lets `seq` take pages to reach `num_tokens` (else it is
        preempted itself, rather than taking pages from others)."""
        return (
            self.fits(seq, num_tokens)
            or not seq.pages
            or self.reservation.can_grow(seq, num_tokens, self.page_size)
        )

    def reserve_ahead(self, seqs: Iterable[tuple[SequenceState, int]]) -> bool:
        """Grows every `(seq, num_tokens)` pair's pages, or none of them (returns False)."""
        added: list[tuple[SequenceState, int]] = []
        for seq, num_tokens in seqs:
            before = len(seq.pages)
            if not self.allocate(seq, num_tokens):
                for s, n in added:
                    self._truncate(s, n)
                return False
            added.append((seq, before))
        return True

    def _truncate(self, seq: SequenceState, num_pages: int) -> None:
        """Gives back `seq`'s table entries from `num_pages` on, in every group."""
        for table in self.tables(seq):
            self.pool.free([p for p in reversed(table[num_pages:]) if p != NULL_PAGE])
            del table[num_pages:]
        if self.sliding:
            freed = self._freed(seq)
            freed[:] = [min(f, num_pages) for f in freed]
            seq.slide_at = 0
        self.rows.truncate(seq, num_pages)

    def free(self, seq: SequenceState) -> None:
        """Returns every page `seq` holds to the pool, last page first (see `PagePool`)."""
        self.forget_uncomputed(seq)
        self._truncate(seq, 0)
        seq.pages = []
        seq.group_pages = []
        seq.window_freed = []
        seq.slide_at = 0
        self.rows.release(seq)

    def preempt(self, seq: SequenceState) -> None:
        """Frees `seq`'s pages and forgets what it computed; it will recompute."""
        self.reservation.on_preempt(seq, self.page_size)
        self.free(seq)
        seq.keys = []
        seq.num_computed_tokens = 0

    # Prefix caching.

    def lookup(self, seq: SequenceState) -> list[list[int]]:
        """Per group, the page table of the longest cached prefix of seq's tokens
        (`NULL_PAGE` where a window group needs no page), leaving its last token to
        compute. Records the keys of the hits in `seq.keys`."""
        if not self.enable_prefix_caching:
            return [[] for _ in range(self.num_groups)]
        tokens = seq.prompt_token_ids + seq.output_token_ids
        seq.keys = keys = page_keys(
            tokens,
            self.page_size,
            num_pages=(len(tokens) - 1) // self.page_size,
            salt=self._salt(seq),
        )
        lookup = self.pool.lookup
        if self.num_groups == 1 and not self.sliding:
            hits = []
            for key in keys:
                page = lookup(key)
                if page is None:
                    break
                hits.append(page)
            del keys[len(hits) :]
            return [hits]
        found = [[lookup(self._key(g, k)) for k in keys] for g in range(self.num_groups)]
        h = len(keys)
        for g in range(self.num_groups):
            if self.windows[g] is None:
                h = next((i for i, p in enumerate(found[g][:h]) if p is None), h)
        while h and any(
            None in found[g][self.first_needed(g, h * self.page_size) : h]
            for g in range(self.num_groups)
            if self.windows[g] is not None
        ):
            h -= 1
        del keys[h:]
        out = []
        for g, pages in enumerate(found):
            k = min(self.first_needed(g, h * self.page_size), h)
            out.append([NULL_PAGE] * k + pages[k:h])
        return out

    def evictable(self, hits: list[list[int]]) -> int:
        """How many pages of `hits` (from `lookup`) sit in the free queue (cached, held
        by no one)."""
        return sum(1 for t in hits for p in t if p != NULL_PAGE and self.pool.refcount(p) == 0)

    def take_hits(self, seq: SequenceState, hits: list[list[int]]) -> None:
        """Gives `seq` the cached pages `hits` (from `lookup`) as its computed prefix."""
        self.pool.touch([p for t in hits for p in t if p != NULL_PAGE])
        self.rows.release(seq)
        seq.pages = list(hits[0])
        seq.group_pages = [list(t) for t in hits[1:]]
        h = len(seq.pages)
        if self.sliding:
            seq.slide_at = 0
            seq.window_freed = [
                min(self.first_needed(g, h * self.page_size), h) for g in range(self.num_groups)
            ]
        if h:
            self.rows.append(seq, seq.pages, seq.group_pages)
        seq.num_computed_tokens = h * self.page_size

    def count_lookup(self, seq: SequenceState, num_hit_pages: int) -> None:
        """Records the prefix-cache result of `seq`'s first admission."""
        if not self.enable_prefix_caching or seq.num_preemptions:
            return  # a resumed sequence's hits are recompute savings, not prompt hits
        self.prefix_queries += len(seq.prompt_token_ids)
        hit_tokens = num_hit_pages * self.page_size
        self.prefix_hits += hit_tokens
        seq.num_cached_tokens = hit_tokens
        lead = self._lead(seq.prompt_token_ids, self._salt(seq))
        if num_hit_pages == 0 and lead in self._first_tokens:
            self.short_prefix_misses += 1
            logging.log_first_n(
                logging.INFO,
                "paxkv: request %s shares a prefix shorter than one page (page_size=%d) with a "
                "cached one; prefixes are cached in whole pages, so it was not reused",
                10,
                seq.request_id,
                self.page_size,
            )

    def forget_uncomputed(self, seq: SequenceState) -> None:
        """Uncaches the pages `seq` registered ahead of computing them (its planned chunk
        did not run: it failed, or was aborted before its step), so no one finds them."""
        computed = min(seq.num_computed_tokens // self.page_size, len(seq.keys))
        for g, table in enumerate(self.tables(seq)):
            for i in range(computed, min(len(seq.keys), len(table))):
                if table[i] != NULL_PAGE:
                    self.pool.uncache(table[i], self._key(g, seq.keys[i]))
        del seq.keys[computed:]

    def _salt(self, seq: SequenceState):
        """What keys seq's first page besides its tokens: its cache salt, and the weights."""
        return seq.cache_salt if not self.weight_version else (seq.cache_salt, self.weight_version)

    def set_weight_version(self, version: int) -> None:
        """Keys the pages computed from now on under weights `version`, and uncaches
        every page: none computed under other weights is matched again, and they are
        the first reused (plain free pages)."""
        self.weight_version = version
        pool = self.pool
        for page in range(1, pool.num_pages):
            key = pool.cache_key(page)
            if key is not None:
                pool.uncache(page, key)
        self._first_tokens.clear()

    def _lead(self, tokens: list[int], salt) -> tuple:
        return (salt, tuple(tokens[: min(4, self.page_size)]))

    def register_full_pages(self, seq: SequenceState, num_tokens: int | None = None) -> None:
        """Caches the full pages of `seq`'s first `num_tokens` tokens (default: those it
        has computed) not cached yet. The scheduler calls it when it plans a chunk, with
        the chunk's end: the step writes each layer's K/V before any attention reads
        them, so sequences planned later in the same step can share these pages.
        Pages registered so, whose chunk then does not run, are forgotten by
        `forget_uncomputed`."""
        if not self.enable_prefix_caching:
            return
        end = seq.num_computed_tokens if num_tokens is None else num_tokens
        ps = self.page_size
        full = min(end // ps, len(seq.pages))
        first = len(seq.keys)
        if first >= full:
            return
        # Only the new pages' tokens are read: the work does not grow with the sequence.
        tokens = seq.token_ids(first * ps, full * ps)
        # page_keys salts the first page it is given: only when it is the sequence's first.
        new = page_keys(
            tokens,
            ps,
            parent=seq.keys[-1] if seq.keys else None,
            salt=self._salt(seq) if first == 0 else None,
        )
        tables = self.tables(seq)
        for i, key in enumerate(new, start=first):
            for g, table in enumerate(tables):
                if table[i] != NULL_PAGE:
                    self.pool.mark_cached(table[i], self._key(g, key))
            if i == 0:
                lead = self._lead(tokens, self._salt(seq))
                self._first_tokens[lead] = None
                self._first_tokens.move_to_end(lead)
                if len(self._first_tokens) > _MAX_LEADS:
                    self._first_tokens.popitem(last=False)
        seq.keys.extend(new)

    # Metrics.

    def usage(self, running: Iterable[SequenceState]) -> dict[str, float]:
        """Pages and token slots in use, and the slots reserved but holding no token."""
        used_slots = reserved = 0
        ps = self.page_size
        for s in running:
            if self.num_groups == 1 and not self.sliding:
                used_slots += s.num_computed_tokens
                reserved += len(s.pages) * ps
                continue
            # A group holds the tokens from its first held page on.
            for g, table in enumerate(self.tables(s)):
                first = self._freed(s)[g] if self.sliding else 0
                used_slots += max(0, s.num_computed_tokens - first * ps)
                reserved += sum(1 for p in table[first:] if p != NULL_PAGE) * ps
        return {
            "pages_in_use": self.pool.num_in_use,
            "pages_total": self.pool.num_usable,
            "page_usage": self.pool.usage,
            "token_slots_used": used_slots,
            "token_slots_reserved": reserved,
            "wasted_slots": reserved - used_slots,
            "kv_utilization": used_slots / reserved if reserved else 1.0,
        }

    def group_usage(self, running: Iterable[SequenceState]) -> list[dict[str, int | None]]:
        """Per KV-cache group: its window, layers, and the pages running sequences hold."""
        held = [0] * self.num_groups
        for s in running:
            for g, table in enumerate(self.tables(s)):
                held[g] += sum(1 for p in table if p != NULL_PAGE)
        return [
            {"window": g.window, "layers": len(g.layers), "pages_held": held[i]}
            for i, g in enumerate(self.layout.groups)
        ]
