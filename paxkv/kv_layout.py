"""The KV cache as a serving setting: `kv_cache_dtype` names and the bytes a page costs.

The one copy of these facts for the engine, the planner, the benchmarks and the launch
flags. Plain NumPy (no JAX), so the capacity planner runs without an accelerator stack;
the page geometry itself is the kernels' (`paxkv.pallas_kernels.layout`).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from paxkv.pallas_kernels.layout import SCALE_DTYPE, page_bytes, scale_lanes

# kv_cache_dtype -> the dtype pages are stored in; "auto" stores them in the model dtype.
QUANTIZED_KV_CACHE_DTYPES: dict[str, np.dtype] = {
    "int8": np.dtype(np.int8),
    "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
    "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", *QUANTIZED_KV_CACHE_DTYPES)


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype) -> np.dtype:
    """The page dtype of `kv_cache_dtype`; "auto" is `model_dtype` (a name or a dtype)."""
    if kv_cache_dtype == "auto":
        return np.dtype(model_dtype)
    if kv_cache_dtype not in QUANTIZED_KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}")
    return QUANTIZED_KV_CACHE_DTYPES[kv_cache_dtype]


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
    `platform`: on "tpu" the scales are padded to 128 lanes, see `layout.scale_lanes`)."""
    return num_layers * page_bytes(
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        head_dim=head_dim,
        page_dtype=page_dtype,
        platform=platform,
    )


__all__ = [
    "KV_CACHE_DTYPES",
    "QUANTIZED_KV_CACHE_DTYPES",
    "SCALE_DTYPE",
    "kv_page_bytes",
    "page_bytes",
    "resolve_kv_cache_dtype",
    "scale_lanes",
]
