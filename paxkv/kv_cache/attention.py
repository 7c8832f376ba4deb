"""`paged_attention`: the one per-layer call into the paged cache that every model family
makes, writing the layer's new K/V and attending over its pages."""

from __future__ import annotations

from typing import Any

import jax

from paxkv.kv_cache.page_table import PageTable
from paxkv.kv_cache.paged_cache import PagedKVCache
from paxkv.pallas_kernels.dispatch import ragged_paged_attention
from paxkv.sharding import shardings


def paged_attention(
    layer: int | jax.Array,
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    kv_cache: PagedKVCache,
    table: PageTable,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    num_kv_heads: int,
    mesh: Any,
    backend: str,
    decode_only: bool = False,
    sinks: jax.Array | None = None,  # f32[Hq]
) -> tuple[jax.Array, PagedKVCache]:  # [T, Hq, D], new cache
    """Writes `layer`'s new K/V into the cache and attends over it: every model's one
    per-layer call into the paged cache.

    `layer` is an int, or a traced i32 scalar inside a scan over stacked layers (the
    cache is then stacked, `PagedKVCache.slot_pages`). `sliding_window` and `soft_cap`
    are this layer's (see `ragged_paged_attention`), and so are `sinks`, its attention
    sinks (one logit per query head; None: none). The layer's pages and page table
    are those of its KV-cache group (`PagedKVCache.slot`, `PagedKVCache.group`; one
    group unless the model mixes windows).
    On a `mesh` each device writes and reads only its own KV heads' slice of every page
    and attends with its own q heads (the heads of q, k, v and the pages share one
    spec, and the sinks are split as the query heads are); the page table is replicated,
    so no data crosses devices here.
    """

    def attend(q, k, v, kv_cache, table, layer, sinks=None):
        kv_cache = kv_cache.write(layer, k, v, table)
        attn = ragged_paged_attention(
            q,
            **kv_cache.attention_kwargs(layer, table),
            sm_scale=sm_scale,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
            backend=backend,
            decode_only=decode_only,
            sinks=sinks,
        )
        return attn, kv_cache

    if mesh is None:
        return attend(q, k, v, kv_cache, table, layer, sinks)
    heads = shardings.kv_head_spec(num_kv_heads, mesh)
    args, specs = (q, k, v, kv_cache, table), (heads, heads, heads, heads, shardings.REPLICATED)
    if isinstance(layer, int):  # static: closed over, not an argument
        per_shard = lambda q, k, v, kv_cache, table, *sinks: attend(
            q, k, v, kv_cache, table, layer, *sinks
        )
    else:
        per_shard = attend
        args, specs = (*args, layer), (*specs, shardings.REPLICATED)
    if sinks is not None:
        args, specs = (*args, sinks), (*specs, shardings.head_vector_spec(num_kv_heads, mesh))
    return shardings.shard_map(per_shard, mesh, in_specs=specs, out_specs=(heads, heads))(*args)
