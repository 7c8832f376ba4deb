"""Device code for paged attention: Pallas kernels, their references, and the KV write.

Nothing in this package knows about requests; it consumes int32 arrays.
"""

from .attention import BACKENDS, ragged_paged_attention, resolve_backend
from .attention_inputs import AttentionShapes, check_attention_inputs
from .kv_write import write_kv_pages
from .quantization import dequantize, quantize
from .reference import NULL_PAGE, ragged_paged_attention_reference

__all__ = [
    "BACKENDS",
    "NULL_PAGE",
    "AttentionShapes",
    "check_attention_inputs",
    "dequantize",
    "quantize",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "resolve_backend",
    "write_kv_pages",
]
