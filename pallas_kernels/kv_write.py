"""Functional write of new tokens' K/V into their paged slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .contract import token_layout
from .layout import KEY, QUANTIZED_PAGE_DTYPES, VALUE, kv_row
from .quantization import quantize


def write_kv_pages(
    kv_pages: jax.Array,  # [P, Hkv, 2 * ps, D]
    new_k: jax.Array,  # [T, Hkv, D]
    new_v: jax.Array,  # [T, Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    block_tables: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    kv_scales: jax.Array | None = None,  # bf16[P, Hkv, 2 * ps]
) -> tuple[jax.Array, jax.Array | None]:
    """Writes each live query row's K/V into its cache slot and returns the new pages.

    Row t of live sequence s (same packing as the attention call) is at position
    `pos = kv_len - q_len + i`; its K and V go to page `block_tables[s, pos // ps]`, rows
    `kv_row(KEY, pos % ps)` and `kv_row(VALUE, pos % ps)` of every head. Padding rows are
    dropped. When the pages are quantized the entries are quantized
    per token and head (see `quantization.quantize`) and their scales written to
    `kv_scales` at the same place. Returns `(kv_pages, kv_scales)`.

    This is one scatter of K and V together (`2 T` rows): under `jit` with the pages donated, XLA
    updates them in place, so its cost depends on T, not on the cache size.
    """
    num_pages, num_kv_heads, kv_rows, head_dim = kv_pages.shape
    page_size = kv_rows // 2
    if new_k.shape != new_v.shape or new_k.ndim != 3:
        raise ValueError(
            f"new_k.shape={new_k.shape} and new_v.shape={new_v.shape} must both be [T, Hkv, D]"
        )
    if new_k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"new_k.shape={new_k.shape} must be [T, Hkv={num_kv_heads}, D={head_dim}] to match kv_pages"
        )
    quantized = jnp.dtype(kv_pages.dtype) in QUANTIZED_PAGE_DTYPES
    if quantized != (kv_scales is not None):
        raise ValueError(
            f"kv_pages.dtype={kv_pages.dtype}: quantized pages need kv_scales, float pages take none"
        )
    seq, pos, valid = token_layout(cu_q_lens, kv_lens, num_seqs, new_k.shape[0])
    page = block_tables[seq, pos // page_size]
    page = jnp.where(valid, page, num_pages)  # out of bounds: dropped by the scatter
    offset = pos % page_size
    page = jnp.concatenate([page, page])  # i32[2T]: K rows, then V rows
    row = jnp.concatenate([kv_row(KEY, offset, page_size), kv_row(VALUE, offset, page_size)])
    new = jnp.concatenate([new_k, new_v])  # [2T, Hkv, D]
    if kv_scales is not None:
        new, scales = quantize(new, kv_pages.dtype)
        kv_scales = kv_scales.at[page, :, row].set(scales, mode="drop")
    kv_pages = kv_pages.at[page, :, row].set(new.astype(kv_pages.dtype), mode="drop")
    return kv_pages, kv_scales
