"""Page bookkeeping of the sequences: lookup, allocation, prefix registration, freeing. No JAX.

The scheduler decides who runs; this object decides which pages they hold (as vLLM
separates its KV-cache manager from the scheduling policy). Automatic prefix caching:
every full page a sequence computes is registered in the pool under a chained key of
its tokens (`paxkv.host.prefix_cache`). A new sequence first takes the longest run of
cached pages matching its tokens (their reference counts go up) and computes only the
rest; at least its last token is always computed, so the partial last page is handled
by recompute. Freed pages keep their keys and stay reusable, in LRU order, until
allocation evicts them; a preempted sequence therefore usually finds its own pages.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from absl import logging

from paxkv.host.batch_rows import BatchRows
from paxkv.host.page_pool import PagePool
from paxkv.host.prefix_cache import page_keys
from paxkv.host.reservation import PagedReservation
from paxkv.host.sequence import SequenceState
from paxkv.pallas_kernels.layout import cdiv

_MAX_LEADS = 8192  # first pages remembered for reporting sub-page prefix sharing


class KVCacheManager:
    """The pages each sequence holds, drawn from `pool` under a reservation policy.

    Args:
      pool: the host page pool of the device cache.
      page_size: tokens per page.
      max_model_len: longest sequence (prompt + output).
      enable_prefix_caching: reuse cached pages of equal prefixes.
      reservation: how many slots a sequence holds (default: the pages it needs).
    """

    def __init__(
        self,
        pool: PagePool,
        *,
        page_size: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        reservation: PagedReservation | None = None,
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
        # Every change to a sequence's pages goes through this object, which mirrors it
        # in the sequence's row of the persistent batch.
        self.rows = BatchRows(cdiv(max_model_len, page_size))
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        # Requests sharing their first 4+ tokens, but less than a page, with a cached prefix.
        self.short_prefix_misses = 0
        # Leading tokens of recently cached first pages (bounded), to notice prefixes
        # shared over less than a page.
        self._first_tokens: OrderedDict[tuple, None] = OrderedDict()

    # Sizes.

    def pages_to_hold(self, seq: SequenceState, num_tokens: int) -> int:
        """Pages `seq` must hold in all to compute its first `num_tokens` tokens."""
        tokens = self.reservation.tokens_to_hold(seq, num_tokens, self.max_model_len)
        return cdiv(tokens, self.page_size)

    def pages_at_submit(self, num_tokens: int) -> int:
        """Pages a request of `num_tokens` (prompt + max_tokens) needs at its longest."""
        return cdiv(
            self.reservation.tokens_at_submit(num_tokens, self.max_model_len), self.page_size
        )

    def fits(self, seq: SequenceState, num_tokens: int) -> bool:
        """Whether `seq`'s pages already hold its first `num_tokens` tokens."""
        return num_tokens <= len(seq.pages) * self.page_size

    # Allocation.

    def allocate(self, seq: SequenceState, num_tokens: int) -> bool:
        """Grows `seq`'s pages to hold its first `num_tokens` tokens; False if it cannot
        (the pool is short, or the policy forbids growing), holding nothing more."""
        need = self.pages_to_hold(seq, num_tokens) - len(seq.pages)
        if need <= 0:
            return True
        if not self.can_grow(seq, num_tokens):
            return False
        pages = self.pool.allocate(need)
        if pages is None:
            return False
        seq.pages.extend(pages)
        self.rows.append(seq, pages)
        return True

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
                    self.pool.free(reversed(s.pages[n:]))
                    del s.pages[n:]
                    self.rows.truncate(s, n)
                return False
            added.append((seq, before))
        return True

    def free(self, seq: SequenceState) -> None:
        """Returns every page `seq` holds to the pool, last page first (see `PagePool`)."""
        self.forget_uncomputed(seq)
        self.pool.free(reversed(seq.pages))
        seq.pages = []
        self.rows.release(seq)

    def preempt(self, seq: SequenceState) -> None:
        """Frees `seq`'s pages and forgets what it computed; it will recompute."""
        self.reservation.on_preempt(seq, self.page_size)
        self.free(seq)
        seq.keys = []
        seq.num_computed_tokens = 0

    # Prefix caching.

    def lookup(self, seq: SequenceState) -> list[int]:
        """Pages of the longest cached prefix of seq's tokens, leaving its last token to
        compute. Records the keys of the hits in `seq.keys`."""
        if not self.enable_prefix_caching:
            return []
        tokens = seq.prompt_token_ids + seq.output_token_ids
        seq.keys = page_keys(
            tokens,
            self.page_size,
            num_pages=(len(tokens) - 1) // self.page_size,
            salt=seq.cache_salt,
        )
        hits = []
        for key in seq.keys:
            page = self.pool.lookup(key)
            if page is None:
                break
            hits.append(page)
        del seq.keys[len(hits) :]
        return hits

    def evictable(self, pages: Iterable[int]) -> int:
        """How many of `pages` sit in the free queue (cached, held by no one)."""
        return sum(1 for p in pages if self.pool.refcount(p) == 0)

    def take_hits(self, seq: SequenceState, hits: list[int]) -> None:
        """Gives `seq` the cached pages `hits` (from `lookup`) as its computed prefix."""
        self.pool.touch(hits)
        self.rows.release(seq)
        seq.pages = list(hits)
        if hits:
            self.rows.append(seq, seq.pages)
        seq.num_computed_tokens = len(hits) * self.page_size

    def count_lookup(self, seq: SequenceState, num_hit_pages: int) -> None:
        """Records the prefix-cache result of `seq`'s first admission."""
        if not self.enable_prefix_caching or seq.num_preemptions:
            return  # a resumed sequence's hits are recompute savings, not prompt hits
        self.prefix_queries += len(seq.prompt_token_ids)
        hit_tokens = num_hit_pages * self.page_size
        self.prefix_hits += hit_tokens
        seq.num_cached_tokens = hit_tokens
        lead = self._lead(seq.prompt_token_ids, seq.cache_salt)
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
        for i in range(computed, min(len(seq.keys), len(seq.pages))):
            self.pool.uncache(seq.pages[i], seq.keys[i])
        del seq.keys[computed:]

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
            salt=seq.cache_salt if first == 0 else None,
        )
        for i, key in enumerate(new, start=first):
            self.pool.mark_cached(seq.pages[i], key)
            if i == 0:
                lead = self._lead(tokens, seq.cache_salt)
                self._first_tokens[lead] = None
                self._first_tokens.move_to_end(lead)
                if len(self._first_tokens) > _MAX_LEADS:
                    self._first_tokens.popitem(last=False)
        seq.keys.extend(new)

    # Metrics.

    def usage(self, running: Iterable[SequenceState]) -> dict[str, float]:
        """Pages and token slots in use, and the slots reserved but holding no token."""
        used_slots = reserved = 0
        for s in running:
            used_slots += s.num_computed_tokens
            reserved += len(s.pages) * self.page_size
        return {
            "pages_in_use": self.pool.num_in_use,
            "pages_total": self.pool.num_usable,
            "page_usage": self.pool.usage,
            "token_slots_used": used_slots,
            "token_slots_reserved": reserved,
            "wasted_slots": reserved - used_slots,
            "kv_utilization": used_slots / reserved if reserved else 1.0,
        }
