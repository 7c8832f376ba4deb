"""Device code for paged attention: Pallas kernels, their references, and the KV write.

Nothing in this package knows about requests; it consumes int32 arrays. The page layout
it reads, as plain facts without JAX, is `paxkv.kv_layout`. The TPU and GPU kernels load
when a call first picks their backend (`dispatch`).
"""

from .contract import (
    AttentionInputs,
    AttentionShapes,
    attention_inputs,
    attention_op,
    compute_dtype,
)
from .dispatch import BACKENDS, ragged_paged_attention, resolve_backend
from .kv_write import pack_kv_pages, write_kv_pages
from .quantization import dequantize, quantize
from .reference import ragged_paged_attention_reference
from .xla import ragged_paged_attention_xla

__all__ = [
    "BACKENDS",
    "AttentionInputs",
    "AttentionShapes",
    "attention_inputs",
    "attention_op",
    "compute_dtype",
    "dequantize",
    "pack_kv_pages",
    "quantize",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_xla",
    "resolve_backend",
    "write_kv_pages",
]
