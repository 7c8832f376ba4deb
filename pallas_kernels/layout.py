"""The page layout the kernels read, as plain facts (NumPy and ml_dtypes, no JAX).

One layer's pages are one array `[P, Hkv, ps, 2 * D]`: for KV head h, token j of a page
is one row holding its key (lanes `kv_lanes(KEY, D)`) then its value (lanes
`kv_lanes(VALUE, D)`). A page of a run of KV heads, K and V together, is one contiguous
block (one DMA). The minor axis is 2 D >= 128 for every supported head dim: TPU memory
tiles the minor axis by 128 lanes, so head_dim 64 fills them instead of being padded,
and XLA keeps the array row-major, the layout the kernels read (given a minor axis under
128 lanes it picks a page-minor layout instead, and copies the cache into the kernel's
before every call). Quantized pages carry `SCALE_DTYPE[P, Hkv, 2 * ps]` scales: for each
head, the page's ps key scales (`scale_row(KEY, j, ps)`) then its ps value scales. The
host imports this module to agree with the kernels on these facts without importing JAX.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

# Never allocated by the host pool; padded block-table entries point here, and a kernel
# reads it in place of any table entry that names no visible token.
NULL_PAGE: int = 0

# Which half of a token's row (and of a head's scales) is the key and which the value.
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


def kv_lanes(part: int, head_dim: int) -> slice:
    """The lanes (axis 3 of the pages) of a token's key (`part=KEY`) or value
    (`part=VALUE`)."""
    return slice(part * head_dim, (part + 1) * head_dim)


def scale_row(part: int, offset: Any, page_size: int) -> Any:
    """The entry (axis 2 of the scales) of token `offset`'s key scale (`part=KEY`) or
    value scale (`part=VALUE`); works on ints and arrays alike."""
    return part * page_size + offset


def scale_rows(part: int, page_size: int) -> slice:
    """The entries (axis 2 of the scales) of all of a page's key scales (`part=KEY`) or
    value scales (`part=VALUE`)."""
    return slice(part * page_size, (part + 1) * page_size)


def page_bytes(*, num_kv_heads: int, page_size: int, head_dim: int, page_dtype) -> int:
    """Device bytes of one page of one layer, K and V together, scales included."""
    dtype = np.dtype(page_dtype)
    entries = 2 * num_kv_heads * page_size * head_dim * dtype.itemsize
    scales = 2 * num_kv_heads * page_size * SCALE_DTYPE.itemsize if is_quantized(dtype) else 0
    return entries + scales
