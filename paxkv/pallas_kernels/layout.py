"""The KV page format: what the kernels read and the host allocates, as plain facts.

One layer's pages are one array `[P, Hkv, ps, 2 * D]`: for KV head h, token j of a page
is one row holding its key (lanes `kv_lanes(KEY, D)`) then its value (lanes
`kv_lanes(VALUE, D)`). A page of a run of KV heads, K and V together, is one contiguous
block (one DMA). The minor axis is 2 D >= 128 for every supported head dim: TPU memory
tiles the minor axis by 128 lanes, so head_dim 64 fills them instead of being padded,
and XLA keeps the array row-major, the layout the kernels read (given a minor axis under
128 lanes it picks a page-minor layout instead, and copies the cache into the kernel's
before every call). Quantized pages carry `SCALE_DTYPE[P, Hkv, 2, L]` scales: for head h
of page p, `[p, h, KEY, j]` is token j's key scale and `[p, h, VALUE, j]` its value scale;
lanes `j >= ps` are padding, never read. L is `scale_lanes(ps, platform)`.

The one copy of these facts (the null page, the page dtypes and their `kv_cache_dtype`
names, the bytes a page costs) for the kernels, the host, the engine, the planner and the
launch flags. NumPy and ml_dtypes only, no JAX: the lowest floor of the house, so the
host core and the capacity planner import it without an accelerator stack.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# Never allocated by the host pool; padded block-table entries point here, and a kernel
# reads it in place of any table entry that names no visible token.
NULL_PAGE: int = 0

# Which half of a token's row (and of a head's scales) is the key and which the value.
KEY, VALUE = 0, 1

MIN_PAGE_SIZE = 8
MAX_PAGE_SIZE = 1024

# kv_cache_dtype -> the dtype pages are stored in; "auto" stores them in the model dtype.
# The kernels dequantize these (per token and head, `x.astype(f32) * scale`).
QUANTIZED_KV_CACHE_DTYPES: dict[str, np.dtype] = {
    "int8": np.dtype(np.int8),
    "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
    "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", *QUANTIZED_KV_CACHE_DTYPES)
QUANTIZED_PAGE_DTYPES: tuple[np.dtype, ...] = tuple(QUANTIZED_KV_CACHE_DTYPES.values())
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


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype) -> np.dtype:
    """The page dtype of `kv_cache_dtype`; "auto" is `model_dtype` (a name or a dtype)."""
    if kv_cache_dtype == "auto":
        return np.dtype(model_dtype)
    if kv_cache_dtype not in QUANTIZED_KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}")
    return QUANTIZED_KV_CACHE_DTYPES[kv_cache_dtype]


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


# Lanes of TPU memory's minor tile.
TPU_LANES = 128
# The smallest page size whose scales a TPU cache pads to whole 128-lane rows.
TPU_PADDED_SCALES_MIN_PAGE_SIZE = 64


def scale_lanes(page_size: int, platform: str | None = None) -> int:
    """L, the minor axis of the scales `[P, Hkv, 2, L]` of a cache for `platform`
    ("tpu", "gpu", "cpu"; None: not TPU).

    `page_size`, except on TPU from page size 64 to 127, where it is 128. XLA keeps a
    TPU array row-major, the layout the kernel reads, only if its minor axis fills the
    128 lanes; otherwise it picks a page-minor layout and copies the scales into the
    kernel's layout before every call (the deviceless compile's HLO shows both). Padding
    costs 4 bytes per token and head at page size 64 (3% of an int8 page at head_dim 64),
    but 28 at page size 16 (a sixth fewer int8 pages at head_dim 64): below 64 the scales
    stay unpadded, and copied.
    """
    if platform == "tpu" and TPU_PADDED_SCALES_MIN_PAGE_SIZE <= page_size < TPU_LANES:
        return TPU_LANES
    return page_size


def page_bytes(
    *, num_kv_heads: int, page_size: int, head_dim: int, page_dtype, platform: str | None = None
) -> int:
    """Device bytes of one page of one layer, K and V together, scales (as laid out for
    `platform`, see `scale_lanes`) included."""
    dtype = np.dtype(page_dtype)
    entries = 2 * num_kv_heads * page_size * head_dim * dtype.itemsize
    if not is_quantized(dtype):
        return entries
    return entries + 2 * num_kv_heads * scale_lanes(page_size, platform) * SCALE_DTYPE.itemsize


def kv_page_bytes(
    *,
    num_layers: int,
    num_kv_heads: int,
    page_size: int,
    head_dim: int,
    page_dtype,
    platform: str | None = None,
) -> int:
    """Device bytes of one page across every layer (K, V and their scales, laid out for
    `platform`: on "tpu" the scales are padded to 128 lanes, see `scale_lanes`)."""
    return num_layers * page_bytes(
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        head_dim=head_dim,
        page_dtype=page_dtype,
        platform=platform,
    )
