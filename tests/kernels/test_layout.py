"""The KV cache's serving facts against hand-computed values: page bytes and cache dtypes."""

import ml_dtypes
import numpy as np
import pytest

from paxkv.pallas_kernels import layout as kv_layout


@pytest.mark.parametrize(
    "page_dtype, itemsize",
    [
        ("float32", 4),
        ("bfloat16", 2),
        ("float16", 2),
        ("int8", 1),
        ("float8_e4m3fn", 1),
        ("float8_e5m2", 1),
    ],
)
@pytest.mark.parametrize("page_size", [8, 16, 256])
@pytest.mark.parametrize("heads, dim", [(1, 64), (8, 128)])
def test_page_bytes_by_hand(page_dtype, itemsize, page_size, heads, dim):
    # K and V: heads x page_size x dim entries each; quantized pages add one bfloat16
    # scale per token per head, for K and for V.
    entries = 2 * heads * page_size * dim * itemsize
    scales = 2 * heads * page_size * 2 if itemsize == 1 else 0
    kw = dict(num_kv_heads=heads, page_size=page_size, head_dim=dim)
    assert kv_layout.page_bytes(**kw, page_dtype=page_dtype) == entries + scales
    assert kv_layout.page_bytes(**kw, page_dtype=np.dtype(page_dtype)) == entries + scales
    assert kv_layout.kv_page_bytes(num_layers=3, **kw, page_dtype=page_dtype) == 3 * (
        entries + scales
    )


def test_page_bytes_of_named_pages():
    # tiny: 2 KV heads x 64, 16 tokens a page: float32 16384 bytes, int8 4096 + 128 of scales.
    kw = dict(num_kv_heads=2, page_size=16, head_dim=64)
    assert kv_layout.page_bytes(**kw, page_dtype="float32") == 2 * 2 * 16 * 64 * 4 == 16384
    assert kv_layout.page_bytes(**kw, page_dtype="int8") == 2 * 2 * 16 * 64 + 2 * 2 * 16 * 2
    assert kv_layout.page_bytes(**kw, page_dtype=ml_dtypes.float8_e5m2) == 4096 + 128


def test_tpu_pads_the_scales_of_pages_of_64_to_128_lanes():
    # Scales [P, Hkv, 2, L]: L is the page size, or on TPU 128 lanes for pages of 64 (a
    # minor axis under 128 lanes makes XLA relay the array out every call; padding the
    # smaller pages would cost too much of the pool).
    sizes = (8, 16, 32, 64, 128, 256)
    assert [kv_layout.scale_lanes(ps) for ps in sizes] == list(sizes)
    assert [kv_layout.scale_lanes(ps, "gpu") for ps in sizes] == list(sizes)
    assert [kv_layout.scale_lanes(ps, "tpu") for ps in sizes] == [8, 16, 32, 128, 128, 256]
    kw = dict(num_kv_heads=2, page_size=64, head_dim=64, page_dtype="int8")
    assert kv_layout.page_bytes(**kw, platform="tpu") == 2 * 2 * 64 * 64 + 2 * 2 * 128 * 2
    assert kv_layout.page_bytes(**kw) == 2 * 2 * 64 * 64 + 2 * 2 * 64 * 2
    assert kv_layout.page_bytes(**kw, platform="gpu") == kv_layout.page_bytes(**kw)
    assert kv_layout.kv_page_bytes(num_layers=3, **kw, platform="tpu") == 3 * (16384 + 1024)
    # Float pages carry no scales, so no padding.
    kw["page_dtype"] = "bfloat16"
    assert kv_layout.page_bytes(**kw, platform="tpu") == kv_layout.page_bytes(**kw) == 32768


@pytest.mark.parametrize(
    "kv_cache_dtype, model_dtype, page_dtype",
    [
        ("auto", "float32", np.float32),
        ("auto", "bfloat16", ml_dtypes.bfloat16),
        ("int8", "bfloat16", np.int8),
        ("fp8", "float32", ml_dtypes.float8_e4m3fn),
        ("fp8_e5m2", "bfloat16", ml_dtypes.float8_e5m2),
    ],
)
def test_resolve_kv_cache_dtype(kv_cache_dtype, model_dtype, page_dtype):
    assert kv_layout.resolve_kv_cache_dtype(kv_cache_dtype, model_dtype) == np.dtype(page_dtype)


def test_kv_cache_dtype_names():
    assert kv_layout.KV_CACHE_DTYPES == ("auto", "int8", "fp8", "fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' must be one of"):
        kv_layout.resolve_kv_cache_dtype("int4", "float32")
