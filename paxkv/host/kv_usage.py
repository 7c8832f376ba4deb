"""How full the KV cache is: pages and token slots held by the running sequences. No JAX."""

from __future__ import annotations

from collections.abc import Iterable

from paxkv.host.kv_cache_manager import KVCacheManager
from paxkv.host.sequence import SequenceState
from paxkv.pallas_kernels.layout import NULL_PAGE


def kv_usage(kv: KVCacheManager, running: Iterable[SequenceState]) -> dict[str, float]:
    """Pages and token slots in use, and the slots reserved but holding no token."""
    used_slots = reserved = 0
    ps = kv.page_size
    for s in running:
        # A group holds the tokens from its first held page on.
        for g, table in enumerate(kv.tables(s)):
            if not table:
                break
            first = kv.window_start(s, g)
            used_slots += max(0, s.num_computed_tokens - first * ps)
            reserved += sum(1 for p in table[first:] if p != NULL_PAGE) * ps
    pool = kv.pool
    return {
        "pages_in_use": pool.num_in_use,
        "pages_total": pool.num_usable,
        "page_usage": pool.usage,
        "token_slots_used": used_slots,
        "token_slots_reserved": reserved,
        "wasted_slots": reserved - used_slots,
        "kv_utilization": used_slots / reserved if reserved else 1.0,
    }


def group_usage(
    kv: KVCacheManager, running: Iterable[SequenceState]
) -> list[dict[str, int | None]]:
    """Per KV-cache group: its window, layers, and the pages running sequences hold."""
    held = [0] * kv.num_groups
    for s in running:
        for g, table in enumerate(kv.tables(s)):
            held[g] += sum(1 for p in table if p != NULL_PAGE)
    return [
        {"window": g.window, "layers": len(g.layers), "pages_held": held[i]}
        for i, g in enumerate(kv.kv_groups.groups)
    ]
