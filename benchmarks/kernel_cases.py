"""The kernel benchmark's cases: a run's settings, one batch of inputs in paxkv's page
layout, and the work (bytes read, useful FLOPs) attention over it does.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from paxkv.pallas_kernels.kv_write import pack_kv_pages
from paxkv.pallas_kernels.layout import cdiv, is_quantized, kv_lanes, page_bytes, scale_lanes
from paxkv.pallas_kernels.quantization import quantize

IMPLS = ("paxkv", "paxkv-1-item", "jax-pallas", "xla-dense")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a run depends on (the flags, after --tiny)."""

    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    prefill_batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    page_dtype: str
    iters: int
    warmup: int
    max_kv_gib: float
    copy_mib: int
    matmul_size: int
    impls: tuple[str, ...]

    @classmethod
    def tiny(cls, **overrides) -> Settings:
        """Sizes that run on the CPU in seconds (f32, so results compare tightly)."""
        base = dict(
            batch_sizes=(3,), contexts=(40,), prefill_lens=(24,), prefill_batch=2,
            num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32",
            page_dtype="float32", iters=2, warmup=1, max_kv_gib=1.0, copy_mib=8, matmul_size=128,
            impls=IMPLS,
        )  # fmt: skip
        return cls(**{**base, **overrides})


@dataclasses.dataclass
class Inputs:
    """One batch in paxkv's layout, on the device."""

    q: jax.Array  # [T, Hq, D]
    kv_pages: jax.Array  # [P, Hkv, ps, 2 * D]
    kv_scales: jax.Array | None  # bf16[P, Hkv, 2, L]
    kv_lens: jax.Array  # i32[S]
    block_tables: jax.Array  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array  # i32[S + 1]
    num_seqs: jax.Array  # i32[1]
    sm_scale: float

    def args(self) -> tuple[jax.Array, ...]:
        """The kernels' positional arguments: q, the pages, lengths and tables."""
        return (
            self.q,
            self.kv_pages,
            self.kv_lens,
            self.block_tables,
            self.cu_q_lens,
            self.num_seqs,
        )

    def scales(self) -> dict:
        """The kernels' scale keyword arguments: none for unquantized pages."""
        return {} if self.kv_scales is None else {"kv_scales": self.kv_scales}

    def split(self, part: int) -> tuple[jax.Array, jax.Array | None]:
        """K (`part=KEY`) or V pages `[P, Hkv, ps, D]` and their scales, apart, for the
        implementations that take them so (a copy)."""
        _, _, page_size, lanes = self.kv_pages.shape
        scales = None if self.kv_scales is None else self.kv_scales[:, :, part, :page_size]
        return self.kv_pages[..., kv_lanes(part, lanes // 2)], scales


def make_inputs(settings: Settings, batch: int, context: int, q_len: int, seed: int = 0) -> Inputs:
    """`batch` sequences with `context` cached tokens each, the last `q_len` of them new,
    on scattered pages (page 0 is left unused as the null page)."""
    ps = settings.page_size
    pages_per_seq = cdiv(context, ps)
    num_pages = 1 + batch * pages_per_seq
    keys = jax.random.split(jax.random.key(seed), 4)
    perm = 1 + jax.random.permutation(keys[0], num_pages - 1).astype(jnp.int32)
    shape = (num_pages, settings.num_kv_heads, ps, settings.head_dim)

    @jax.jit
    def pages(key):
        return jax.random.normal(key, shape, jnp.float32)

    k, v = pages(keys[1]), pages(keys[2])
    k_scales = v_scales = None
    if is_quantized(settings.page_dtype):
        (k, k_scales), (v, v_scales) = (
            quantize(k, settings.page_dtype),
            quantize(v, settings.page_dtype),
        )
    kv, kv_scales = pack_kv_pages(
        k.astype(settings.page_dtype),
        v.astype(settings.page_dtype),
        k_scales,
        v_scales,
        scale_lanes=scale_lanes(ps, jax.default_backend()),  # as the engine's cache
    )
    q = jax.random.normal(
        keys[3], (batch * q_len, settings.num_q_heads, settings.head_dim), settings.dtype
    )
    return Inputs(
        q=q, kv_pages=kv, kv_scales=kv_scales,
        kv_lens=jnp.full((batch,), context, jnp.int32),
        block_tables=perm.reshape(batch, pages_per_seq),
        cu_q_lens=jnp.arange(0, batch * q_len + 1, q_len, dtype=jnp.int32),
        num_seqs=jnp.asarray([batch], jnp.int32),
        sm_scale=1.0 / math.sqrt(settings.head_dim),
    )  # fmt: skip


def kv_bytes(inputs: Inputs, batch: int, context: int) -> int:
    """Bytes of K/V (and scales) that attention over `context` tokens per sequence must read."""
    _, num_kv_heads, _, head_dim = inputs.kv_pages.shape
    per_token = page_bytes(
        num_kv_heads=num_kv_heads, page_size=1, head_dim=head_dim, page_dtype=inputs.kv_pages.dtype
    )
    return batch * context * per_token


def causal_prefill_flops(batch: int, length: int, num_q_heads: int, head_dim: int) -> int:
    """Useful FLOPs of fresh causal prefills: query i sees i + 1 keys; QK^T and PV."""
    return 2 * 2 * batch * num_q_heads * head_dim * length * (length + 1) // 2
