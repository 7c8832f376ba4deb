"""The page layout the kernels read, as plain facts (NumPy and ml_dtypes, no JAX).

One layer's pages are one array `[P, Hkv, 2 * ps, D]`: for each KV head, a page's ps
keys (rows `KEY * ps + j`) then its ps values (rows `VALUE * ps + j`). One page of a
run of KV heads, K and V together, is then one contiguous block (one DMA), and the
rows stay the second-minor axis, the one TPU memory tiles by. Quantized pages carry
`SCALE_DTYPE[P, Hkv, 2 * ps]` scales beside them, in the same rows (the same memory
order as `[P, Hkv, 2, ps]`, without tiling a size-2 axis). The host imports this module to agree
with the kernels on these facts without importing JAX.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

# Never allocated by the host pool; padded block-table entries point here, and a kernel
# reads it in place of any table entry that names no visible token.
NULL_PAGE: int = 0

# Which half of a head's 2 * ps rows holds the keys and which the values.
KEY, VALUE = 0, 1

MIN_PAGE_SIZE = 8
MAX_PAGE_SIZE = 1024

# Storage dtypes the kernels dequantize (per token and head, `x.astype(f32) * scale`).
QUANTIZED_PAGE_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(np.int8),
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2),
)
FLOAT_PAGE_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(np.float32),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float16),
)
# Dtype of the per-token-per-head scales of quantized pages. bfloat16 keeps float32's
# exponent range, so no amax a float32 activation holds rounds its scale to 0 or inf, and
# at 2 bytes a token-head of int8 pages costs D + 2 bytes against 2 D in bf16.
SCALE_DTYPE = np.dtype(ml_dtypes.bfloat16)


def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` for non-negative integers, or NumPy arrays of them, on the host.

    Traced and in-kernel code uses `pl.cdiv` instead.
    """
    return -(-a // b)


def is_quantized(page_dtype) -> bool:
    """Whether pages of `page_dtype` are stored quantized, with scales beside them."""
    return np.dtype(page_dtype) in QUANTIZED_PAGE_DTYPES


def valid_page_size(page_size: int) -> bool:
    """Whether the kernels accept `page_size` tokens per page: a power of two in range."""
    return MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE and page_size & (page_size - 1) == 0


def kv_row(part: int, offset: Any, page_size: int) -> Any:
    """Row of a page's head (axis 2 of the pages) that holds token `offset`'s key
    (`part=KEY`) or value (`part=VALUE`); works on ints and arrays alike."""
    return part * page_size + offset


def kv_half(part: int, page_size: int) -> slice:
    """The rows of a page's head (axis 2 of the pages) holding all its keys
    (`part=KEY`) or all its values (`part=VALUE`)."""
    return slice(part * page_size, (part + 1) * page_size)


def page_bytes(*, num_kv_heads: int, page_size: int, head_dim: int, page_dtype) -> int:
    """Device bytes of one page of one layer, K and V together, scales included."""
    dtype = np.dtype(page_dtype)
    entries = 2 * num_kv_heads * page_size * head_dim * dtype.itemsize
    scales = 2 * num_kv_heads * page_size * SCALE_DTYPE.itemsize if is_quantized(dtype) else 0
    return entries + scales
