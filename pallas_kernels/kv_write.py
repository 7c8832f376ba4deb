"""Functional write of new tokens' K/V into their paged slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .contract import token_layout
from .layout import QUANTIZED_PAGE_DTYPES
from .quantization import quantize


def write_kv_pages(
    k_pages: jax.Array,  # [P, Hkv, ps, D]
    v_pages: jax.Array,  # [P, Hkv, ps, D]
    new_k: jax.Array,  # [T, Hkv, D]
    new_v: jax.Array,  # [T, Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    block_tables: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    k_scales: jax.Array | None = None,  # bf16[P, Hkv, ps]
    v_scales: jax.Array | None = None,  # bf16[P, Hkv, ps]
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """Writes each live query row's K/V into its cache slot and returns the new pages.

    Row t of live sequence s (same packing as the attention call) is at position
    `pos = kv_len - q_len + i` and goes to page `block_tables[s, pos // ps]`, offset
    `pos % ps`. Padding rows are dropped. When the pages are quantized the entries are
    quantized per token and head (see `quantization.quantize`) and their scales written
    to `k_scales`/`v_scales`. Returns `(k_pages, v_pages, k_scales, v_scales)`.

    This is a scatter: under `jit` with the pages donated, XLA updates them in place, so
    its cost depends on T, not on the cache size.
    """
    num_pages, num_kv_heads, page_size, head_dim = k_pages.shape
    if new_k.shape != new_v.shape or new_k.ndim != 3:
        raise ValueError(
            f"new_k.shape={new_k.shape} and new_v.shape={new_v.shape} must both be [T, Hkv, D]"
        )
    if new_k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"new_k.shape={new_k.shape} must be [T, Hkv={num_kv_heads}, D={head_dim}] to match k_pages"
        )
    quantized = jnp.dtype(k_pages.dtype) in QUANTIZED_PAGE_DTYPES
    if quantized != (k_scales is not None and v_scales is not None):
        raise ValueError(
            f"k_pages.dtype={k_pages.dtype}: quantized pages need k_scales and v_scales, float pages take none"
        )
    seq, pos, valid = token_layout(cu_q_lens, kv_lens, num_seqs, new_k.shape[0])
    page = block_tables[seq, pos // page_size]
    page = jnp.where(valid, page, num_pages)  # out of bounds: dropped by the scatter
    offset = pos % page_size

    def put(pages, new, scales):
        if scales is not None:
            new, s = quantize(new, pages.dtype)
            scales = scales.at[page, :, offset].set(s, mode="drop")
        pages = pages.at[page, :, offset].set(new.astype(pages.dtype), mode="drop")
        return pages, scales

    k_pages, k_scales = put(k_pages, new_k, k_scales)
    v_pages, v_scales = put(v_pages, new_v, v_scales)
    return k_pages, v_pages, k_scales, v_scales
