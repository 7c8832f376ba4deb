"""Page tables built from plain per-sequence page lists, for tests, demos and benchmarks.

The engine's path builds its tables from the persistent batch rows
(`paxkv.host.batch_rows.BatchRows`); these build one from scratch, the independent
oracle the tests check the rows against.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from paxkv.kv_cache import PageTable
from paxkv.pallas_kernels.layout import NULL_PAGE, cdiv


def pad_page_table(
    pages: Sequence[Sequence[int]],
    kv_lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    page_size: int,
    max_num_seqs: int,
    pages_per_seq: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(block_tables i32[S, pages_per_seq], kv_lens i32[S], cu_q_lens i32[S + 1], num_seqs i32[1])`.

    Live sequence s holds `pages[s]` and has `kv_lens[s]` tokens after the step, of which
    `q_lens[s]` are new. Unused entries point at `NULL_PAGE`; padding sequences have
    length 0 and no query rows.
    """
    n = len(kv_lens)
    if not (len(pages) == n == len(q_lens)):
        raise ValueError(f"pages, kv_lens and q_lens have lengths {len(pages)}, {n}, {len(q_lens)}")
    if n > max_num_seqs:
        raise ValueError(f"{n} sequences exceed max_num_seqs={max_num_seqs}")
    held = np.fromiter((len(row) for row in pages), np.int64, count=n)
    lens = np.zeros(max_num_seqs, np.int32)
    lens[:n] = kv_lens
    if n and held.max() > pages_per_seq:
        s = int(np.argmax(held > pages_per_seq))
        raise ValueError(
            f"sequence {s} holds {held[s]} pages, more than pages_per_seq={pages_per_seq}"
        )
    short = cdiv(lens[:n], page_size) > held
    if short.any():
        s = int(np.argmax(short))
        raise ValueError(f"sequence {s}: kv_len={lens[s]} needs more than its {held[s]} pages")
    # One scatter of every sequence's pages into the padded table.
    table = np.full((max_num_seqs, pages_per_seq), NULL_PAGE, np.int32)
    flat = np.fromiter(itertools.chain.from_iterable(pages), np.int32, count=int(held.sum()))
    rows = np.repeat(np.arange(n), held)
    starts = np.cumsum(held) - held
    table[rows, np.arange(flat.size) - np.repeat(starts, held)] = flat
    cu = np.zeros(max_num_seqs + 1, np.int32)
    np.cumsum(q_lens, out=cu[1 : n + 1])
    cu[n + 1 :] = cu[n]
    return table, lens, cu, np.array([n], np.int32)


def page_table_from_host(
    pages: Sequence[Sequence[int]],
    kv_lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    page_size: int,
    max_num_seqs: int,
    pages_per_seq: int,
) -> PageTable:
    """A device `PageTable` of one step's host-side lists, padded to the fixed shapes
    `[max_num_seqs, pages_per_seq]` (`pad_page_table`).

    `pages[s]` are the page ids of live sequence s in order, `kv_lens[s]` its cache
    length after the step and `q_lens[s]` its new tokens.
    """
    table, lens, cu, n = pad_page_table(
        pages,
        kv_lens,
        q_lens,
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        pages_per_seq=pages_per_seq,
    )
    return PageTable(
        block_tables=jnp.asarray(table),
        kv_lens=jnp.asarray(lens),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray(n),
        page_size=page_size,
    )
