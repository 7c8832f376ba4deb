"""Automatic prefix caching: keys of full KV pages, and their lookup and registration. No JAX.

Page i of a token sequence is keyed by `(hash(key of page i - 1), its page_size tokens
as int32 bytes, extra)`, a chain, so equal keys mean equal whole prefixes: the page can be reused by
any request whose first (i + 1) * page_size tokens are the same. `extra` carries a
per-request `cache_salt` on the first page, so tenants with different salts never
share pages. Keys compare their tokens exactly; only the parent is compared by its
64-bit hash, so a false hit needs a hash collision of two different parents followed
by identical tokens.

`PrefixCache` registers every full page a sequence computes in the page pool under its
key, and finds the longest run of cached pages matching a new sequence's tokens. Cache
keys carry the KV-cache group index when there are several groups, so one prefix has a
page per group; a prefix of `h` pages hits when every global group has all `h` pages
cached and every window group the pages inside its window at token `h * page_size`
(vLLM's rule for hybrid models).
"""

from __future__ import annotations

import array
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from absl import logging

from paxkv.host.kv_groups import first_page_read
from paxkv.host.page_pool import PagePool
from paxkv.host.sequence_pages import PageKey, SequencePages
from paxkv.pallas_kernels.layout import NULL_PAGE

if TYPE_CHECKING:
    from paxkv.host.sequence import SequenceState
    from paxkv.host.sequence_pages import SequencePages


_MAX_LEADS = 8192  # first pages remembered for reporting sub-page prefix sharing


def page_key(parent: PageKey | None, tokens: Sequence[int], salt: Hashable = None) -> PageKey:
    """The key of a page holding `tokens` after the page keyed `parent` (None: the
    first page, which alone carries `salt`). Its tokens are kept as int32 bytes, which
    hash once (bytes cache their hash) and compare as memory, so keys are cheap to hash
    and compare however cold."""
    prev = hash(parent) if parent is not None else 0
    return (prev, array.array("i", tokens).tobytes(), salt)


def page_keys(
    token_ids: Sequence[int],
    page_size: int,
    *,
    num_pages: int | None = None,
    salt: Hashable = None,
    start: int = 0,
    parent: PageKey | None = None,
) -> list[PageKey]:
    """Keys of the full pages `start .. start + num_pages - 1` of `token_ids`.

    `num_pages` defaults to every full page. When `start > 0`, `parent` must be the key
    of page `start - 1`.
    """
    full = len(token_ids) // page_size
    stop = full if num_pages is None else min(full, start + num_pages)
    keys = []
    for i in range(start, stop):
        tokens = token_ids[i * page_size : (i + 1) * page_size]
        parent = page_key(parent, tokens, salt if i == 0 else None)
        keys.append(parent)
    return keys


HOST = -1  # a `CachedPrefix` table entry the host tier holds (no device page yet)


class CachedPrefix(NamedTuple):
    """A sequence's longest cached prefix (`PrefixCache.lookup`): per group, the page
    table of its `num_pages` pages (`NULL_PAGE` where a window group needs none, `HOST`
    where the host tier holds the page), and their keys."""

    tables: list[list[int]]
    keys: list[PageKey]

    @property
    def num_pages(self) -> int:
        """Table entries of the prefix."""
        return len(self.keys)

    def pages(self) -> list[int]:
        """The device pages it would hold, over every group."""
        return [p for t in self.tables for p in t if p > NULL_PAGE]

    def from_host(self) -> list[tuple[int, int]]:
        """The `(group, table position)` of each entry the host tier holds."""
        return [(g, i) for g, t in enumerate(self.tables) for i, p in enumerate(t) if p == HOST]

    def host_tokens(self, page_size: int) -> int:
        """Tokens of the table positions where some group's page comes from the host."""
        return len({i for _, i in self.from_host()}) * page_size


class PrefixCache:
    """Finds and registers the full pages of sequences' prefixes in `pool`.

    Args:
      pool: the page pool that maps keys to pages.
      page_size: tokens per page.
      windows: per KV-cache group, its window (None: global).
      enabled: whether to look up and register at all.
    """

    def __init__(
        self, pool: PagePool, page_size: int, windows: tuple[int | None, ...], enabled: bool
    ) -> None:
        self.pool = pool
        self.page_size = page_size
        self.windows = windows
        self.enabled = enabled
        self.queries = 0  # prompt tokens looked up at first admission
        self.hits = 0  # of which found
        # Tokens resumed (preempted) sequences took from a cache, the device's or the
        # host tier's, instead of recomputing them (`Admission.admit`).
        self.resumed_hits = 0
        # Requests sharing their first 4+ tokens, but less than a page, with a cached prefix.
        self.short_prefix_misses = 0
        # Leading tokens of recently cached first pages (bounded), to notice prefixes
        # shared over less than a page.
        self._first_tokens: OrderedDict[tuple, None] = OrderedDict()
        # The model weights' version, part of every first page's key (`set_weight_version`).
        self.weight_version = 0

    def _salt(self, seq: SequenceState) -> Hashable:
        """What keys seq's first page besides its tokens: its cache salt, its LoRA
        adapter, and the weights."""
        salt = seq.cache_salt if seq.lora_key is None else (seq.cache_salt, seq.lora_key)
        return salt if not self.weight_version else (salt, self.weight_version)

    def set_weight_version(self, version: int) -> None:
        """Keys the pages registered from now on under weights `version`, and uncaches
        every cached page: none computed under other weights is matched again, and they
        are the first reused (plain free pages)."""
        self.weight_version = version
        self.forget_all()

    def forget_all(self) -> None:
        """Uncaches every cached page (they become plain free pages): their K/V is gone
        or stale."""
        self.pool.uncache_all()
        self._first_tokens.clear()

    def _key(self, group: int, key: PageKey) -> Hashable:
        return key if len(self.windows) == 1 else (group, key)

    def lookup(
        self, seq: SequenceState, host: Callable[[Hashable], bool] | None = None
    ) -> CachedPrefix:
        """The longest cached prefix of seq's tokens, leaving its last token (and every
        row whose prompt logprob is wanted, `SequenceState.cacheable_tokens`) to compute.
        A page missing on the device whose key `host(key)` holds (the host tier) is
        part of it too, as a `HOST` entry."""
        num_groups = len(self.windows)
        if not self.enabled:
            return CachedPrefix([[] for _ in range(num_groups)], [])
        ps = self.page_size
        keys = self.keys_of(seq, 0, seq.cacheable_tokens() // ps, None)
        lookup = self.pool.lookup
        if self.windows == (None,) and host is None:
            hits = []
            for key in keys:
                page = lookup(key)
                if page is None:
                    break
                hits.append(page)
            return CachedPrefix([hits], keys[: len(hits)])
        found: dict[tuple[int, int], int | None] = {}

        def at(g: int, i: int) -> int | None:
            """Group g's page i: on the device, `HOST`, or None; the tier is asked only
            for the entries the rule below reads, once each."""
            if (g, i) not in found:
                key = self._key(g, keys[i])
                page = lookup(key)
                if page is None and host is not None and host(key):
                    page = HOST
                found[g, i] = page
            return found[g, i]

        h = len(keys)
        for g, window in enumerate(self.windows):
            if window is None:
                h = next((i for i in range(h) if at(g, i) is None), h)
        while h and any(
            any(at(g, i) is None for i in range(first_page_read(w, h * ps, ps), h))
            for g, w in enumerate(self.windows)
            if w is not None
        ):
            h -= 1
        tables = []
        for g in range(num_groups):
            k = min(first_page_read(self.windows[g], h * ps, ps), h)
            tables.append([NULL_PAGE] * k + [at(g, i) for i in range(k, h)])
        return CachedPrefix(tables, keys[:h])

    def key(self, group: int, key: PageKey) -> Hashable:
        """The pool's key of `group`'s page keyed `key`."""
        return self._key(group, key)

    def evictable(self, prefix: CachedPrefix) -> int:
        """How many device pages of `prefix` sit in the free queue (cached, held by no
        one)."""
        return sum(1 for p in prefix.pages() if self.pool.refcount(p) == 0)

    def count(self, seq: SequenceState, num_hit_pages: int, host_tokens: int = 0) -> int | None:
        """Records the result of seq's first admission; returns its prompt tokens served
        from the device cache (None when not counted: caching off, or a resumed
        sequence, whose hits are recompute savings, not prompt hits). `host_tokens`:
        those the host tier served besides (not a miss)."""
        if not self.enabled or seq.num_preemptions:
            return None
        self.queries += len(seq.prompt_token_ids)
        hit_tokens = num_hit_pages * self.page_size
        self.hits += hit_tokens
        if (
            num_hit_pages == 0
            and not host_tokens
            and self._lead(seq.prompt_token_ids, self._salt(seq)) in (self._first_tokens)
        ):
            self.short_prefix_misses += 1
            # Once per process: every such request would say the same (issue 27).
            logging.log_first_n(
                logging.INFO,
                "paxkv: request %s shares a prefix shorter than one page (page_size=%d) with a "
                "cached one; prefixes are cached in whole pages, so it was not reused",
                1,
                seq.request_id,
                self.page_size,
            )
        return hit_tokens

    def prompt_keys(self, seq: SequenceState) -> list[PageKey]:
        """Keys of seq's full prompt pages, computed once per salt and kept on the
        sequence (`SequenceState.prompt_keys`)."""
        salt = self._salt(seq)
        memo = seq.prompt_keys
        if memo is None or memo[0] != salt:
            prompt = seq.prompt_token_ids
            memo = seq.prompt_keys = (salt, page_keys(prompt, self.page_size, salt=salt))
        return memo[1]

    def keys_of(
        self, seq: SequenceState, start: int, stop: int, parent: PageKey | None
    ) -> list[PageKey]:
        """Keys of seq's full pages `start .. stop - 1` (`parent`: page `start - 1`'s).
        Those of its prompt are computed once per salt and kept on the sequence (a
        prompt never changes): a lookup and the registrations after it hash each
        prompt page once. Only the other pages' tokens are read."""
        salt = self._salt(seq)
        head = self.prompt_keys(seq)[start:stop]
        first = start + len(head)
        if first >= stop:
            return head
        ps = self.page_size
        # page_keys salts the first page it is given: only when it is the sequence's first.
        return head + page_keys(
            seq.token_ids(first * ps, stop * ps),
            ps,
            parent=head[-1] if head else parent,
            salt=salt if first == 0 else None,
        )

    def _lead(self, tokens: list[int], salt: Hashable) -> tuple:
        return (salt, tuple(tokens[: min(4, self.page_size)]))

    def register(self, seq: SequenceState, held: SequencePages, end: int) -> None:
        """Caches the full pages of seq's first `end` tokens not cached yet (their keys
        join `held.keys`)."""
        ps = self.page_size
        full = min(end // ps, len(held.tables[0]))
        first = len(held.keys)
        if not self.enabled or first >= full:
            return
        new = self.keys_of(seq, first, full, held.keys[-1] if held.keys else None)
        if len(held.tables) == 1:  # one group: its pages keyed as they are, in one slice
            # (`new` may stop short of `full`: keys only of pages whose tokens are known)
            pages, keys = held.tables[0][first : first + len(new)], new
            if NULL_PAGE in pages:
                held_pages = [p != NULL_PAGE for p in pages]
                pages = list(itertools.compress(pages, held_pages))
                keys = list(itertools.compress(keys, held_pages))
        else:
            pages, keys = [], []
            for g, table in enumerate(held.tables):
                for i, key in enumerate(new, start=first):
                    if table[i] != NULL_PAGE:
                        pages.append(table[i])
                        keys.append(self._key(g, key))
        self.pool.mark_cached_many(pages, keys)
        if first == 0:
            lead = self._lead(seq.token_ids(0, min(4, ps)), self._salt(seq))
            self._first_tokens[lead] = None
            self._first_tokens.move_to_end(lead)
            if len(self._first_tokens) > _MAX_LEADS:
                self._first_tokens.popitem(last=False)
        held.keys.extend(new)

    def register_filled(
        self,
        seqs: Sequence[SequenceState],
        helds: Sequence[SequencePages | None],
        ends: Sequence[int],
    ) -> list[int | None]:
        """`register(seqs[i], helds[i], ends[i])` for each decode that caches one page,
        the one its token `ends[i]` fills, past its prompt's full pages and past its
        first, in one group (the running decodes' filled pages, one decode in
        `page_size` each step): in one pass, each key as `page_keys` makes it. Returns
        per decode the page it cached (`NULL_PAGE`: its table holds none there), or
        None where those conditions do not hold (nothing registered for it: the caller
        registers it the general way)."""
        ps = self.page_size
        if len(self.windows) != 1:
            return [None] * len(seqs)
        out: list[int | None] = []
        pages, keys, keyed = [], [], []
        for seq, held, end in zip(seqs, helds, ends, strict=True):
            i = len(held.keys) if held is not None else 0
            if not i or end // ps != i + 1 or i >= len(held.tables[0]) or i < seq.num_prompt // ps:
                out.append(None)
                continue
            key = page_key(held.keys[-1], seq.token_ids(i * ps, (i + 1) * ps))  # page i > 0
            page = held.tables[0][i]
            if page != NULL_PAGE:
                pages.append(page)
                keys.append(key)
            keyed.append((held.keys, key))
            out.append(page)
        # Marked in one pass, then kept: if marking raises, no key is kept, and the
        # caller's general path keys these pages again (marking a page with the key it
        # holds changes nothing).
        self.pool.mark_cached_many(pages, keys)
        for held_keys, key in keyed:
            held_keys.append(key)
        return out

    def forget(self, held: SequencePages, num_computed_tokens: int) -> None:
        """Uncaches the pages registered ahead of computing them (from token
        `num_computed_tokens` on: their chunk did not run), so no one finds them."""
        computed = min(num_computed_tokens // self.page_size, len(held.keys))
        for g, table in enumerate(held.tables):
            for i in range(computed, min(len(held.keys), len(table))):
                if table[i] != NULL_PAGE:
                    self.pool.uncache(table[i], self._key(g, held.keys[i]))
        del held.keys[computed:]
