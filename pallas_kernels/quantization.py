"""Per-token-per-head quantization of KV entries (int8, fp8).

A quantized entry stores `x_q = x / scale` in the page dtype, with
`scale = max(|x|) / dtype_max` taken over the head dim of that token and head, and
dequantizes as `x_q.astype(f32) * scale`. An all-zero vector gets `scale = 1`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .layout import QUANTIZED_PAGE_DTYPES


def dtype_max(dtype) -> float:
    """Largest finite magnitude a quantized page dtype represents (int8: 127)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return 127.0
    return float(jnp.finfo(dtype).max)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Quantizes `x` (`[..., D]`) to `dtype`; returns `(x_q [..., D], scale f32[...])`."""
    dtype = jnp.dtype(dtype)
    if dtype not in QUANTIZED_PAGE_DTYPES:
        raise ValueError(f"dtype={dtype} must be one of {[str(d) for d in QUANTIZED_PAGE_DTYPES]}")
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / dtype_max(dtype), 1.0).astype(jnp.float32)
    scaled = x / scale[..., None]
    if dtype == jnp.int8:
        scaled = jnp.clip(jnp.round(scaled), -127, 127)
    return scaled.astype(dtype), scale


def dequantize(x_q: jax.Array, scale: jax.Array) -> jax.Array:
    """Inverse of `quantize`: `x_q [..., D]` times `scale [...]`, in float32."""
    return x_q.astype(jnp.float32) * scale[..., None].astype(jnp.float32)
