"""Device code for paged attention: Pallas kernels, their references, and the KV write.

Nothing in this package knows about requests; it consumes int32 arrays. Submodules load
lazily, so `paxkv.pallas_kernels.layout` (the page layout as plain facts) imports
without JAX.
"""

import importlib

_LAZY = {
    "BACKENDS": ".dispatch",
    "ragged_paged_attention": ".dispatch",
    "resolve_backend": ".dispatch",
    "AttentionInputs": ".contract",
    "AttentionShapes": ".contract",
    "attention_inputs": ".contract",
    "attention_op": ".contract",
    "compute_dtype": ".contract",
    "pack_kv_pages": ".kv_write",
    "write_kv_pages": ".kv_write",
    "dequantize": ".quantization",
    "quantize": ".quantization",
    "NULL_PAGE": ".layout",
    "ragged_paged_attention_reference": ".reference",
    "ragged_paged_attention_xla": ".xla",
}


def __getattr__(name: str) -> object:
    """Imports the submodule that defines `name` on first access (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
