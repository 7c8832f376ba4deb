"""Keys of full KV pages for automatic prefix caching. Plain Python, no JAX.

Page i of a token sequence is keyed by `(hash(key of page i - 1), its page_size tokens,
extra)`, a chain, so equal keys mean equal whole prefixes: the page can be reused by
any request whose first (i + 1) * page_size tokens are the same. `extra` carries a
per-request `cache_salt` on the first page, so tenants with different salts never
share pages. Keys compare their tokens exactly; only the parent is compared by its
64-bit hash, so a false hit needs a hash collision of two different parents followed
by identical tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

PageKey = tuple[int, tuple[int, ...], Hashable]


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
    prev = hash(parent) if parent is not None else 0
    for i in range(start, stop):
        key = (
            prev,
            tuple(token_ids[i * page_size : (i + 1) * page_size]),
            salt if i == 0 else None,
        )
        keys.append(key)
        prev = hash(key)
    return keys
