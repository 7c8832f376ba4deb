"""paxkv: paged KV-cache attention for JAX.

Submodules load lazily, so the host core (`paxkv.host`) imports without pulling in JAX.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "PagedKVCache": "paxkv.kv_cache",
    "PageTable": "paxkv.kv_cache",
    "PagePool": "paxkv.host.page_pool",
    "NULL_PAGE": "paxkv.pallas_kernels.layout",
    "LLM": "paxkv.llm",
    "Engine": "paxkv.engine.engine",
    "EngineConfig": "paxkv.engine.config",
    "SamplingParams": "paxkv.request",
    "RequestOutput": "paxkv.request",
    "RequestOutputKind": "paxkv.request",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paxkv' has no attribute {name!r}")


__all__ = sorted(_LAZY)
