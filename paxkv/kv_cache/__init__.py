"""The device KV cache: the paged pages of every layer, the per-step page table, and the
one per-layer call that writes a layer's new K/V and attends over its pages.

Below both the models (which call `paged_attention` from each layer) and the engine
(which creates, donates and shards the cache); above the kernels and the host.
"""

from paxkv.kv_cache.attention import paged_attention
from paxkv.kv_cache.page_table import PageTable
from paxkv.kv_cache.paged_cache import PagedKVCache

__all__ = ["PageTable", "PagedKVCache", "paged_attention"]
