"""Per-token-per-head quantization: the stored scale is the one the entries were made with."""

import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from paxkv.pallas_kernels.layout import SCALE_DTYPE
from paxkv.pallas_kernels.quantization import dequantize, quantize
from paxkv.pallas_kernels.reference import ragged_paged_attention_reference as reference

# Page dtype -> (largest finite value, mantissa bits, smallest subnormal exponent).
FORMATS = {
    np.dtype(ml_dtypes.float8_e4m3fn): (448.0, 3, -9),
    np.dtype(ml_dtypes.float8_e5m2): (57344.0, 2, -16),
}


def _vectors(seed: int) -> np.ndarray:
    """f32[6, 4, 64]: heads of very different magnitudes, never all zeros."""
    rng = np.random.default_rng(seed)
    magnitudes = np.array([1e-30, 1e-3, 1.0, 3.0, 1e4, 1e30], np.float32)
    return (rng.standard_normal((6, 4, 64)) * magnitudes[:, None, None]).astype(np.float32)


def test_scales_are_stored_in_the_scale_dtype():
    assert np.dtype(ml_dtypes.bfloat16) == SCALE_DTYPE
    for dtype in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2):
        x_q, scale = quantize(jnp.asarray(_vectors(0)), dtype)
        assert x_q.dtype == dtype and scale.dtype == SCALE_DTYPE and scale.shape == (6, 4)


def test_int8_entries_are_made_with_the_stored_scale():
    x = _vectors(1)
    x_q, scale = quantize(jnp.asarray(x), jnp.int8)
    s = np.asarray(scale).astype(np.float32)[..., None]
    assert np.all(np.isfinite(s)) and np.all(s > 0)
    # The stored (rounded) scale, not max|x| / 127, is what x was divided by.
    np.testing.assert_array_equal(np.asarray(x_q), np.clip(np.round(x / s), -127, 127))
    # So every entry is within half a step of the stored scale: the largest one too,
    # though the rounded scale can leave max|x| / scale just above 127.
    error = np.abs(np.asarray(dequantize(x_q, scale)) - x)
    assert np.all(error <= s / 2 * (1 + 2**-20))
    # The scale is max|x| / 127 rounded to nearest in bfloat16.
    amax = np.abs(x).max(axis=-1)
    np.testing.assert_array_equal(np.asarray(scale), (amax / 127).astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
def test_float8_entries_round_to_nearest_with_the_stored_scale(dtype):
    qmax, mantissa_bits, min_exponent = FORMATS[dtype]
    x = _vectors(2)
    x_q, scale = quantize(jnp.asarray(x), dtype)
    s = np.asarray(scale).astype(np.float32)[..., None]
    np.testing.assert_array_equal(
        np.asarray(x_q).view(np.uint8), np.clip(x / s, -qmax, qmax).astype(dtype).view(np.uint8)
    )
    # Half a unit in the last place: relative for normals, the subnormal spacing below.
    bound = np.maximum(np.abs(x) * 2.0 ** -(mantissa_bits + 1), s * 2.0 ** (min_exponent - 1))
    error = np.abs(np.asarray(dequantize(x_q, scale)) - x)
    assert np.all(error <= bound * (1 + 2**-20))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2], ids=str)
def test_zero_and_extreme_vectors_keep_a_finite_nonzero_scale(dtype):
    tiny = np.finfo(np.float32).tiny
    x = np.zeros((4, 8), np.float32)
    x[1, 3] = tiny / 64  # subnormal: max|x| / dtype_max would underflow
    x[2, :] = np.linspace(-3e38, 3e38, 8)
    x[3, 0] = -1e-38
    x_q, scale = quantize(jnp.asarray(x), dtype)
    s = np.asarray(scale).astype(np.float32)
    assert s[0] == 1.0 and np.all(np.asarray(x_q[0]).astype(np.float32) == 0)  # all zeros
    assert np.all(np.isfinite(s)) and np.all(s >= tiny)
    deq = np.asarray(dequantize(x_q, scale))
    assert np.all(np.isfinite(deq))
    # Half a step of each format at these values: int8's step is max/127 (the smallest
    # nonzero entry is max/7), fp8's 2^-3 (e4m3) or 2^-2 (e5m2) relative.
    rtol = {jnp.int8: 0.03, jnp.float8_e4m3fn: 0.07, jnp.float8_e5m2: 0.13}[dtype]
    np.testing.assert_allclose(deq[2], x[2], rtol=rtol)
    assert np.all(np.abs(deq[1] - x[1]) <= tiny)


def test_attention_rejects_scales_of_another_dtype():
    kv = jnp.zeros((3, 1, 8, 128), jnp.int8)
    scales = jnp.ones((3, 1, 2, 8), jnp.float32)
    i32 = lambda *xs: jnp.asarray(xs, jnp.int32)
    args = (jnp.ones((1, 1, 64), jnp.float32), kv, i32(1), i32([1]), i32(0, 1), i32(1))
    message = f"kv_scales.dtype=float32 must be {SCALE_DTYPE}"
    with pytest.raises(ValueError, match=re.escape(message)):
        reference(*args, sm_scale=1.0, kv_scales=scales)
