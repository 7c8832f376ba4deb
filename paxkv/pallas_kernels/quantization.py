"""Per-token-per-head quantization of KV entries (int8, fp8).

A quantized entry stores `x_q = x / scale` in the page dtype, with
`scale = max(|x|) / dtype_max` taken over the head dim of that token and head and
stored in `SCALE_DTYPE` (bfloat16), and dequantizes as `x_q.astype(f32) * scale`. The
scale is rounded to `SCALE_DTYPE` before `x` is divided by it, so the stored scale is
exactly the one `x_q` was computed with: an int8 entry is then within `scale / 2` of
`x`. An all-zero vector gets `scale = 1`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .layout import QUANTIZED_PAGE_DTYPES, SCALE_DTYPE


def dtype_max(dtype) -> float:
    """Largest finite magnitude a quantized page dtype represents (int8: 127)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return 127.0
    return float(jnp.finfo(dtype).max)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Quantizes `x` (`[..., D]`) to `dtype`; returns `(x_q [..., D], scale bf16[...])`."""
    dtype = jnp.dtype(dtype)
    if dtype not in QUANTIZED_PAGE_DTYPES:
        raise ValueError(f"dtype={dtype} must be one of {[str(d) for d in QUANTIZED_PAGE_DTYPES]}")
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    qmax = dtype_max(dtype)
    # At least the smallest normal float, so that a subnormal amax never gives a scale
    # that rounds to zero (or that a flush-to-zero divide reads as zero).
    scale = jnp.where(amax > 0, jnp.maximum(amax / qmax, jnp.finfo(jnp.float32).tiny), 1.0)
    scale = scale.astype(SCALE_DTYPE)
    # Rounding the scale to nearest can leave max(|x|) / scale up to qmax * (1 + 2**-8):
    # clipped back to qmax, which stays within scale / 2 of it for int8.
    scaled = jnp.clip(x / scale[..., None].astype(jnp.float32), -qmax, qmax)
    if dtype == jnp.int8:
        scaled = jnp.round(scaled)
    return scaled.astype(dtype), scale


def dequantize(x_q: jax.Array, scale: jax.Array) -> jax.Array:
    """Inverse of `quantize`: `x_q [..., D]` times `scale [...]`, in float32."""
    return x_q.astype(jnp.float32) * scale[..., None].astype(jnp.float32)
