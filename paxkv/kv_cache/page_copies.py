"""Whole KV pages read out of the device cache and written back (the host tier's copies).

A page is its row of every array of the cache: each layer's (or slot's) K/V, and the
scales of quantized pages. A stacked cache (`PagedKVCache.slot_pages`) holds a page at
one row per slot (`page_rows`). Both programs take the rows as an int32 array, padded
by the caller to a few fixed sizes, so they compile once per size; the write donates
the cache (updated in place).
"""

from __future__ import annotations

import jax
import numpy as np

from paxkv.kv_cache.paged_cache import PagedKVCache


def rows_per_page(cache: PagedKVCache) -> int:
    """Rows of each array holding one page: its slots when stacked, else 1."""
    return cache.num_slots if cache.stacked else 1


def page_rows(cache: PagedKVCache, pages: np.ndarray) -> np.ndarray:  # i32[B * r]
    """The rows of `cache`'s arrays holding `pages` (i32[B]), page by page."""
    pages = np.asarray(pages, np.int32)
    if not cache.stacked:
        return pages
    offsets = np.arange(cache.num_slots, dtype=np.int32) * cache.slot_pages
    return (pages[:, None] + offsets).reshape(-1)


def page_bytes(cache: PagedKVCache) -> int:
    """Bytes of one page over every array of `cache` (its scales included)."""
    r = rows_per_page(cache)
    return sum(a.nbytes // a.shape[0] * r for a in jax.tree.leaves(cache))


@jax.jit
def read_pages(cache: PagedKVCache, rows: jax.Array) -> tuple[jax.Array, ...]:
    """Every array's `rows` (i32[R]): `[R, ...]` per array, in `jax.tree.leaves` order."""
    return tuple(a[rows] for a in jax.tree.leaves(cache))


def _write(cache: PagedKVCache, rows: jax.Array, data: tuple[jax.Array, ...]) -> PagedKVCache:
    leaves, tree = jax.tree.flatten(cache)
    return jax.tree.unflatten(
        tree, [a.at[rows].set(d.astype(a.dtype)) for a, d in zip(leaves, data, strict=True)]
    )


write_pages = jax.jit(_write, donate_argnums=0)
write_pages.__doc__ = """`cache` with `data[i]` (`[R, ...]`, `read_pages`' order) at `rows`
(i32[R]; a row listed twice must get equal data) of array i; the cache is donated."""

COMPILED_FUNCTIONS = ("read_pages", "_write")
