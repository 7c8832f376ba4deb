"""Functional write of new tokens' K/V into their paged slots, and the page layout's
assembly from separate K and V pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .contract import token_layout
from .layout import QUANTIZED_PAGE_DTYPES
from .quantization import quantize


def _rows(k: jax.Array, v: jax.Array) -> jax.Array:  # [..., D] x 2 -> [..., 2 * D]
    """Tokens' rows as the pages hold them: the key's lanes (`KEY`), then the value's."""
    return jnp.concatenate([k, v], axis=-1)


def write_kv_pages(
    kv_pages: jax.Array,  # [P, Hkv, ps, 2 * D]
    new_k: jax.Array,  # [T, Hkv, D]
    new_v: jax.Array,  # [T, Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    block_tables: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    kv_scales: jax.Array | None = None,  # bf16[P, Hkv, 2, L]
) -> tuple[jax.Array, jax.Array | None]:
    """Writes each live query row's K/V into its cache slot and returns the new pages.

    Row t of live sequence s (same packing as the attention call) is at position
    `pos = kv_len - q_len + i`; its K and V go to page `block_tables[s, pos // ps]`, row
    `pos % ps` of every head (the key, then the value). Padding rows are dropped. When
    the pages are quantized the entries are quantized per token and head (see
    `quantization.quantize`), K and V apart, and their scales written to `kv_scales` at
    `[page, head, KEY, pos % ps]` and `[page, head, VALUE, pos % ps]`. Returns
    `(kv_pages, kv_scales)`.

    This is one scatter of whole rows, K and V together: under `jit` with the pages
    donated, XLA updates them in place, so its cost depends on T, not on the cache size.
    """
    num_pages, num_kv_heads, page_size, kv_lanes = kv_pages.shape
    head_dim = kv_lanes // 2
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
    if kv_scales is not None:
        (new_k, k_scales), (new_v, v_scales) = (
            quantize(new_k, kv_pages.dtype),
            quantize(new_v, kv_pages.dtype),
        )
        scales = jnp.stack([k_scales, v_scales], axis=-1)  # bf16[T, Hkv, 2]: KEY, VALUE
        kv_scales = kv_scales.at[page, :, :, offset].set(scales, mode="drop")
    new = _rows(new_k, new_v)  # [T, Hkv, 2 D]
    kv_pages = kv_pages.at[page, :, offset].set(new.astype(kv_pages.dtype), mode="drop")
    return kv_pages, kv_scales


def pack_kv_pages(
    k_pages: jax.Array,  # [P, Hkv, ps, D]
    v_pages: jax.Array,  # [P, Hkv, ps, D]
    k_scales: jax.Array | None = None,  # bf16[P, Hkv, ps]
    v_scales: jax.Array | None = None,  # bf16[P, Hkv, ps]
    *,
    scale_lanes: int | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """K and V pages held apart, as the kernels' one array: `(kv_pages [P, Hkv, ps, 2 * D],
    kv_scales bf16[P, Hkv, 2, L] or None)`, each token's key then its value (and each
    head's key scales, then its value scales, padded with ones to `scale_lanes` = L
    lanes, default ps; see `layout.scale_lanes`). A copy: for caches made elsewhere, not
    for a step's hot path."""
    if k_pages.shape != v_pages.shape or k_pages.ndim != 4:
        raise ValueError(
            f"k_pages.shape={k_pages.shape} and v_pages.shape={v_pages.shape} must both be "
            f"[P, Hkv, ps, D]"
        )
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales come together (quantized pages) or not at all")
    kv_pages = _rows(k_pages, v_pages)
    if k_scales is None:
        return kv_pages, None
    page_size = k_pages.shape[2]
    lanes = page_size if scale_lanes is None else scale_lanes
    if lanes < page_size:
        raise ValueError(f"scale_lanes={scale_lanes} must be >= page_size={page_size}")
    scales = jnp.stack([k_scales, v_scales], axis=2)  # [P, Hkv, 2, ps]: KEY, VALUE
    pad = [(0, 0)] * 3 + [(0, lanes - page_size)]
    return kv_pages, jnp.pad(scales, pad, constant_values=1)
