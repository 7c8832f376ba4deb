"""What the KV cache holds for one sequence, as the KV-cache manager keeps it. No JAX.

Only `paxkv.host.kv_cache_manager` and the prefix cache it drives change these records;
everyone else asks the manager (as vLLM's `KVCacheBlocks` hides `req_to_blocks`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

# A full page's prefix-cache key: (parent key hash, its tokens as int32 bytes, salt of a
# first page).
PageKey = tuple[int, bytes, Hashable]


@dataclasses.dataclass(eq=False)
class SequencePages:
    """The page tables, row and prefix keys of one sequence that holds pages.

    `tables[g]` is group g's page table (`paxkv.host.kv_groups`): page j holds tokens
    `j * page_size ..`; every group's table is as long as group 0's, with `NULL_PAGE`
    where a window group holds nothing. Tables grow only at the end while the sequence
    runs.
    """

    tables: list[list[int]]
    row: int  # its row of the persistent batch (`paxkv.host.batch_rows`)
    # Per group, the leading entries it has let go of (or never took) because they fell
    # behind its window.
    window_freed: list[int]
    # The first chunk start at which a window group has a page to let go of (a cache of
    # `KVCacheManager.slide`'s test; 0: unknown, test).
    slide_at: int = 0
    # The prefix-cache keys of its first full pages: computed ones, and those of the
    # chunk planned this step (registered ahead, see `PrefixCache.register`).
    keys: list[PageKey] = dataclasses.field(default_factory=list)
