"""The attention implementations the kernel benchmark times on one batch
(`kernel_cases.Inputs`): each builder returns a function of no arguments that runs one
call, or a string saying why the implementation cannot run here.

* `paxkv_fn`: our kernel for the backend (the GPU kernel, interpreted, on the CPU);
* `jax_pallas_fn`: JAX's bundled Pallas kernel, on a copy of the cache in its layout;
* `dense_attention_fn`: XLA attention over a contiguous copy of the cache.
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks.kernel_cases import Inputs
from paxkv.pallas_kernels.layout import KEY, VALUE
from paxkv.pallas_kernels.quantization import dequantize


def _dequantized(inputs: Inputs) -> tuple[jax.Array, jax.Array]:
    (k, k_scales), (v, v_scales) = inputs.split(KEY), inputs.split(VALUE)
    if k_scales is None:
        return k, v
    return (
        dequantize(k, k_scales).astype(inputs.q.dtype),
        dequantize(v, v_scales).astype(inputs.q.dtype),
    )


def dense_attention_fn(
    inputs: Inputs, batch: int, context: int, q_len: int
) -> Callable[[], jax.Array]:
    """XLA attention over a contiguous copy of the cache (`[S, Hkv, L, D]`), causal."""
    k, v = _dequantized(inputs)
    _, num_kv_heads, _, head_dim = k.shape

    def contiguous(pages):  # [P, Hkv, ps, D] -> [S, Hkv, L, D]
        x = pages[inputs.block_tables]  # [S, pages_per_seq, Hkv, ps, D]
        x = x.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, -1, head_dim)
        return x[:, :, :context]

    k, v = jax.block_until_ready((contiguous(k), contiguous(v)))
    q = inputs.q.reshape(batch, q_len, num_kv_heads, -1, head_dim)  # [S, q, Hkv, G, D]
    q_pos = context - q_len + jnp.arange(q_len)

    @jax.jit
    def attend(q, k, v):
        s = (
            jnp.einsum("sqhgd,shld->shgql", q, k, preferred_element_type=jnp.float32)
            * inputs.sm_scale
        )
        s = jnp.where(jnp.arange(context)[None, :] <= q_pos[:, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        o = jnp.einsum("shgql,shld->sqhgd", p, v, preferred_element_type=jnp.float32)
        return o.reshape(batch * q_len, -1, head_dim).astype(q.dtype)

    return lambda: attend(q, k, v)


def paxkv_fn(
    inputs: Inputs, *, decode: bool, items_per_step: int | None = None
) -> Callable[[], jax.Array] | str:
    """Our kernel for the default backend (the GPU kernel, interpreted, on the CPU). On
    TPU, decode rows use the decode block sizes; `items_per_step` (TPU only) sets how
    many work items a grid step runs (`tpu.BlockSizes`)."""
    backend = jax.default_backend()
    if items_per_step is not None and backend != "tpu":
        return "n/a: TPU only (work items per grid step)"
    if items_per_step is not None and not decode:
        return "n/a: prefill runs one item per grid step by default"
    if backend == "tpu":
        module = importlib.import_module("paxkv.pallas_kernels.tpu.ragged_paged_attention")
        tpu = importlib.import_module("paxkv.pallas_kernels.tpu")
        block_sizes = tpu.BlockSizes(decode=decode, items_per_step=items_per_step)
        kernel, extra = module.ragged_paged_attention_tpu, {"block_sizes": block_sizes}
    else:
        module = importlib.import_module("paxkv.pallas_kernels.gpu.ragged_paged_attention")
        kernel, extra = module.ragged_paged_attention_gpu, {"decode_only": decode}
        extra["interpret"] = backend != "gpu"
    kwargs = dict(sm_scale=inputs.sm_scale, **inputs.scales(), **extra)
    fn = jax.jit(lambda *args: kernel(*args, **kwargs))
    args = inputs.args()
    return lambda: fn(*args)


def jax_pallas_fn(inputs: Inputs, *, decode: bool) -> Callable[[], jax.Array] | str:
    """JAX's bundled Pallas paged attention on the same inputs (its layout is a copy made
    here, outside the timing), or a string saying why it cannot run."""
    backend = jax.default_backend()
    if inputs.kv_scales is not None:
        return "n/a: quantized pages"
    if backend == "tpu":
        return _jax_tpu_ragged_fn(inputs)
    if not decode:
        return "n/a: the bundled GPU kernel is decode only"
    with warnings.catch_warnings():  # deprecated from JAX 0.11
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module("jax.experimental.pallas.ops.gpu.paged_attention")
    pages_per_seq = inputs.block_tables.shape[1]
    # Its constraints: pages_per_seq divisible by k_splits, and the split by the block.
    k_splits = math.gcd(16, pages_per_seq)
    per_block = math.gcd(8, pages_per_seq // k_splits)
    k = jnp.swapaxes(inputs.split(KEY)[0], 0, 1)  # [Hkv, P, ps, D]
    v = jnp.swapaxes(inputs.split(VALUE)[0], 0, 1)
    q = inputs.q * jnp.asarray(inputs.sm_scale, inputs.q.dtype)  # it applies no sm_scale
    fn = jax.jit(
        lambda q, k, v, tables, lens: module.paged_attention(
            q, k, v, tables, lens, k_splits=k_splits, pages_per_compute_block=per_block,
            interpret=backend != "gpu",
        )
    )  # fmt: skip
    k, v = jax.block_until_ready((k, v))
    return lambda: fn(q, k, v, inputs.block_tables, inputs.kv_lens)


def _jax_tpu_ragged_fn(inputs: Inputs) -> Callable[[], jax.Array]:
    module = importlib.import_module("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
    # Its cache is [P, ps, 2 * Hkv, D] with K and V interleaved along the heads.
    k = jnp.swapaxes(inputs.split(KEY)[0], 1, 2)
    v = jnp.swapaxes(inputs.split(VALUE)[0], 1, 2)
    kv = jnp.stack([k, v], axis=3).reshape(*k.shape[:2], -1, k.shape[3])
    kv = jax.block_until_ready(kv)
    fn = jax.jit(lambda *a: module.ragged_paged_attention(*a, sm_scale=inputs.sm_scale))
    args = (inputs.q, kv, inputs.kv_lens, inputs.block_tables, inputs.cu_q_lens, inputs.num_seqs)
    return lambda: fn(*args)
