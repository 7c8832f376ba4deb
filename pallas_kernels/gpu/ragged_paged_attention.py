"""Ragged paged attention on NVIDIA GPUs: Pallas kernels with the Triton lowering.

One call serves any mixed batch by composing two kernels (bodies in `kernel.py`):

* decode sequences (q_len == 1) go to a split-K decode kernel, grid
  `(S, Hkv, num_splits)`: each program reads a contiguous share of one sequence's pages
  for one KV head, with the G = Hq / Hkv query heads of that KV head as the M dim of the
  dots (GQA and MQA use the tensor cores); the splits' partial `(acc, max, denominator)`
  are merged by a log-sum-exp combine in jnp. With one split the kernel writes the
  normalized output itself.
* every other live sequence (a prefill or a prefill chunk) goes to a prefill kernel, grid
  `(query blocks, Hkv)`: each program takes a block of one sequence's query tokens times
  the G heads and loops over the pages that block can see with an online softmax.

The outputs are merged per row in jnp; padding rows are exact zeros.

Limits (ValueError at trace time): head_dim in (64, 128, 256); the shared contract's page
sizes (powers of two in [8, 1024]). Triton tensors must be powers of two and a
tensor-core dot needs M, N, K >= 16, so KV blocks are powers of two >= 16 tokens: pages of
8 tokens are read several to a block, pages larger than a block a slice at a time, and a
group G that is not a power of two is padded (masked rows). float8_e4m3fn pages need a
GPU of compute capability 8.9 or newer (Triton's conversion); H100/H200 are 9.0. Large
groups (G > 64, e.g. MQA with many heads) give decode tiles of G rows: correct, but with
more registers per program than the defaults are tuned for.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from ..contract import (
    AttentionInputs,
    AttentionShapes,
    attention_op,
    compute_dtype,
    is_quantized,
    token_layout,
)
from ..layout import cdiv
from .jax_compat import plgpu
from .kernel import KernelConfig, decode_kernel, decode_tile_rows, prefill_kernel

SUPPORTED_HEAD_DIMS = (64, 128, 256)
MIN_BLOCK = 16  # smallest M, N and K of a Triton tensor-core dot
MAX_KV_BLOCK = 512
MAX_SPLITS = 64
# The automatic split count aims for this many decode programs: two waves on an
# H100/H200 (132 SMs), so a batch of a few long sequences still fills the GPU.
_TARGET_DECODE_PROGRAMS = 2 * 132
# Shared memory the default KV blocks may fill with their pipelined K and V tiles: about
# half of an H100/H200's 228 KiB, leaving room for the Q tile and the dots' staging.
KV_TILE_BUDGET_BYTES = 128 * 1024
# Dynamic shared memory one CUDA block may use on an H100/H200 (sm_90: 227 KiB opt-in).
SHARED_MEMORY_LIMIT_BYTES = 227 * 1024
# Smallest M of Hopper's warpgroup dot (wgmma), which Triton uses for 16-bit dots on sm_90.
WGMMA_MIN_ROWS = 64


def _is_power_of_two(x) -> bool:
    return isinstance(x, int) and x > 0 and not x & (x - 1)


def _next_power_of_two(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _floor_power_of_two(x: int) -> int:
    return 1 << max(0, x.bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tunables of `ragged_paged_attention_gpu`; None picks a default for the call.

    Hashable and validated on construction; `resolve` fills in the defaults for a call's
    shapes. A KV block is the number of cached tokens one inner-loop step reads: `kv_block //
    page_size` whole pages when pages are smaller than the block, a slice of one page when
    they are larger. Every block size is a power of two (Triton tensors must be).

    Attributes:
      decode_kv_block: KV tokens per step of the decode kernel, in [16, 512]. Default:
        the largest of 128, 64, 32, 16 whose `num_stages` buffered K and V tiles fit
        KV_TILE_BUDGET_BYTES of shared memory (128 for bf16 and head_dim 128).
      num_splits: KV splits per decode sequence (split-K), in [1, 64]. Default: enough
        splits for about two waves of `(S, Hkv, splits)` programs on a 132-SM GPU.
      prefill_block_m: rows of a prefill tile, in (query token, query head) pairs: a
        tile holds `max(1, prefill_block_m // Gp)` tokens of one sequence, Gp being G
        rounded up to a power of two. At least 16.
      prefill_kv_block: KV tokens per step of the prefill kernel, in [16, 512]. Default:
        as decode_kv_block, at most 64.
      decode_num_warps, prefill_num_warps: Triton warps per program (1 to 16, powers of two).
      num_stages: Triton software-pipelining stages of both kernels' KV loops (>= 1).
      check_shared_memory: reject, in `resolve` (not when interpreting), block sizes whose
        kernels' estimated shared memory (`shared_memory_bytes`) exceeds
        SHARED_MEMORY_LIMIT_BYTES. False only for compiling such configurations anyway
        (`paxkv.tools.kernel_compile`): they compile, but a GPU refuses to launch them.
    """

    decode_kv_block: int | None = None
    num_splits: int | None = None
    prefill_block_m: int = 64
    prefill_kv_block: int | None = None
    decode_num_warps: int = 4
    prefill_num_warps: int = 4
    num_stages: int = 2
    check_shared_memory: bool = True

    def __post_init__(self):
        for name in ("decode_kv_block", "prefill_kv_block"):
            value = getattr(self, name)
            if value is not None and (
                not _is_power_of_two(value) or not MIN_BLOCK <= value <= MAX_KV_BLOCK
            ):
                raise ValueError(
                    f"BlockSizes.{name}={value!r} must be None or a power of two in "
                    f"[{MIN_BLOCK}, {MAX_KV_BLOCK}]"
                )
        if not _is_power_of_two(self.prefill_block_m) or self.prefill_block_m < MIN_BLOCK:
            raise ValueError(
                f"BlockSizes.prefill_block_m={self.prefill_block_m!r} must be a power of two >= {MIN_BLOCK}"
            )
        if self.num_splits is not None and (
            not isinstance(self.num_splits, int) or not 1 <= self.num_splits <= MAX_SPLITS
        ):
            raise ValueError(
                f"BlockSizes.num_splits={self.num_splits!r} must be None or an int in [1, {MAX_SPLITS}]"
            )
        for name in ("decode_num_warps", "prefill_num_warps"):
            value = getattr(self, name)
            if not _is_power_of_two(value) or value > 16:
                raise ValueError(f"BlockSizes.{name}={value!r} must be a power of two in [1, 16]")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"BlockSizes.num_stages={self.num_stages!r} must be an int >= 1")
        if not isinstance(self.check_shared_memory, bool):
            raise ValueError(
                f"BlockSizes.check_shared_memory={self.check_shared_memory!r} must be a bool"
            )

    def resolve(
        self, shapes: AttentionShapes, q_dtype, page_dtype, *, interpret: bool = False
    ) -> BlockSizes:
        """These block sizes with every None replaced by its default for `shapes`.

        Raises ValueError, before anything is compiled, if a kernel's estimated shared
        memory exceeds SHARED_MEMORY_LIMIT_BYTES, unless `check_shared_memory` is False or
        the kernels run in the interpreter (`interpret`), which has no shared memory.
        """
        itemsize = compute_dtype(q_dtype, page_dtype).itemsize
        tile_bytes = self.num_stages * 2 * shapes.head_dim * itemsize
        fitting = max(MIN_BLOCK, _floor_power_of_two(KV_TILE_BUDGET_BYTES // tile_bytes))
        decode_kv_block = self.decode_kv_block or min(128, fitting)
        num_splits = self.num_splits
        if num_splits is None:
            max_blocks = cdiv(shapes.pages_per_seq * shapes.page_size, decode_kv_block)
            programs = max(1, shapes.max_num_seqs * shapes.num_kv_heads)
            num_splits = max(
                1, min(cdiv(_TARGET_DECODE_PROGRAMS, programs), max_blocks, MAX_SPLITS)
            )
        resolved = dataclasses.replace(
            self,
            decode_kv_block=decode_kv_block,
            num_splits=num_splits,
            prefill_kv_block=self.prefill_kv_block or min(64, fitting),
        )
        if self.check_shared_memory and not interpret:
            _check_shared_memory(shapes, resolved, q_dtype, page_dtype)
        return resolved


def kernel_tiles(shapes: AttentionShapes, bs: BlockSizes) -> dict[str, tuple[int, int, int]]:
    """`(kv_block, rows, num_warps)` of the decode and the prefill kernel's tiles for
    resolved block sizes `bs`: rows is M, the query rows of one program's tile."""
    gp = _next_power_of_two(shapes.group_size)
    return {
        "decode": (bs.decode_kv_block, decode_tile_rows(gp), bs.decode_num_warps),
        "prefill": (bs.prefill_kv_block, prefill_tile_tokens(bs, gp) * gp, bs.prefill_num_warps),
    }


def prefill_tile_tokens(bs: BlockSizes, group_padded: int) -> int:
    """Query tokens of one prefill tile: `prefill_block_m` rows of `group_padded` heads."""
    return max(1, bs.prefill_block_m // group_padded)


def shared_memory_bytes(
    kernel: str,
    *,
    kv_block: int,
    rows: int,
    head_dim: int,
    q_dtype,
    page_dtype,
    num_stages: int,
    num_warps: int,
) -> int:
    """Estimated dynamic shared memory of one program of `kernel` ("decode" or "prefill"),
    in bytes, as Triton allocates it for sm_90.

    A tile of `rows` query rows meets KV blocks of `kv_block` tokens; q_dtype and
    page_dtype give the dots' operand dtype (`contract.compute_dtype`). The terms are the
    buffers the compiled kernels hold in shared memory, read off the compiled figures of
    `paxkv.tools.kernel_compile` (committed in `paxkv/tools/gpu_kernel_resources.json`,
    against which the estimate is tested: never under them, at most 25% over):

    * num_stages 1 (no pipelining): the K and V tiles as stored, and with quantized
      pages their dequantized copies (two float32 tiles for float32 dots; for 16-bit
      dots a term fitted to the figures: up to 4 KiB in decode, half the stored tiles
      in prefill);
    * 16-bit dots on tiles of at least WGMMA_MIN_ROWS rows (Hopper's wgmma): the K and
      V tiles double-buffered (Triton pipelines those loads at most two deep here,
      whatever num_stages >= 2), the Q tile and 512 bytes; the probabilities stay in
      registers;
    * smaller tiles (mma.sync) and float32 dots (FMA): one K and one V tile, the Q tile
      and the probabilities in the operand dtype, and with quantized float32 dots one
      dequantized float32 tile;
    * quantized pages: their K and V scales; 1 KiB of reduction scratch per kernel
      body with more than 4 warps.

    Calibrated on decode tiles of 16 and 64 rows and prefill tiles of 16 to 128 rows.
    """
    compute = compute_dtype(q_dtype, page_dtype)
    quantized = is_quantized(page_dtype)
    page_bytes, compute_bytes = np.dtype(page_dtype).itemsize, compute.itemsize
    kv = 2 * kv_block * head_dim * page_bytes
    f32_tile = kv_block * head_dim * 4
    if num_stages == 1:
        if not quantized:
            return kv
        if compute_bytes == 4:
            return kv + 2 * f32_tile + 1024
        return kv + (min(kv, 4096) if kernel == "decode" else kv // 2)
    q_tile, p_tile = rows * head_dim * compute_bytes, rows * kv_block * compute_bytes
    scales = 2 * kv_block * 4 if quantized else 0
    dequantized = f32_tile if quantized and compute_bytes == 4 else 0
    scratch = 1024 if num_warps > 4 else 0
    if compute_bytes == 2 and rows >= WGMMA_MIN_ROWS:
        return 2 * kv + q_tile + scales + 2 * scratch + 512
    return kv + q_tile + p_tile + scales + dequantized + scratch


def _check_shared_memory(shapes: AttentionShapes, bs: BlockSizes, q_dtype, page_dtype) -> None:
    for kernel, (kv_block, rows, num_warps) in kernel_tiles(shapes, bs).items():
        estimate = shared_memory_bytes(
            kernel, kv_block=kv_block, rows=rows, head_dim=shapes.head_dim, q_dtype=q_dtype,
            page_dtype=page_dtype, num_stages=bs.num_stages, num_warps=num_warps,
        )  # fmt: skip
        if estimate > SHARED_MEMORY_LIMIT_BYTES:
            raise ValueError(
                f"{bs} needs about {estimate / 1024:.0f} KiB of shared memory in the {kernel} "
                f"kernel (kv_block={kv_block}, {rows} rows, head_dim={shapes.head_dim}, "
                f"{np.dtype(page_dtype).name} pages, num_stages={bs.num_stages}) but a GPU block "
                f"may use {SHARED_MEMORY_LIMIT_BYTES // 1024} KiB; lower the kv block, num_stages "
                f"or prefill_block_m"
            )


def check_kernel_limits(shapes: AttentionShapes) -> None:
    """Limits of the GPU kernels beyond the shared input contract (which already requires
    a power-of-two page size in [8, 1024]): head_dim in SUPPORTED_HEAD_DIMS. Pages of 8
    tokens are read several per KV block, so every dot keeps dims >= 16."""
    if shapes.head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim={shapes.head_dim} must be one of {SUPPORTED_HEAD_DIMS} for the GPU kernel"
        )


def _decode_only_check(cu_q_lens, num_seqs) -> None:
    if isinstance(cu_q_lens, jax.core.Tracer) or isinstance(num_seqs, jax.core.Tracer):
        return
    n = int(np.asarray(num_seqs)[0])
    q_lens = np.diff(np.asarray(cu_q_lens)[: n + 1])
    if np.any(q_lens > 1):
        s = int(np.argmax(q_lens > 1))
        raise ValueError(f"decode_only=True but sequence {s} has q_len={q_lens[s]} > 1")


@attention_op
def ragged_paged_attention_gpu(
    inputs: AttentionInputs,
    *,
    block_sizes: BlockSizes = BlockSizes(),
    decode_only: bool = False,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D], q.dtype
    """Ragged paged attention with the semantics of `ragged_paged_attention_reference`.

    Same arguments, result and guarantees as the reference (see `attention_op` for the
    calling convention), plus the keywords below. Pages `[P, Hkv, ps, D]` (float, or
    int8/float8 with per-token-per-head scales `f32[P, Hkv, ps]`, dequantized in the
    kernel); packed ragged queries delimited by `cu_q_lens`; causal within each chunk,
    optional sliding window (pages wholly before the window are skipped) and soft-cap;
    padding rows and rows that see nothing are exact zeros. Dots run in float32 (IEEE,
    never TF32) when q or the pages are float32 (or q and the pages are different 16-bit
    dtypes), else in q's 16-bit dtype with float32 accumulation; quantized pages convert
    exactly to q's dtype (`contract.compute_dtype`).

    Args:
      block_sizes: static tunables; fields left None are picked for the call
        (`BlockSizes.resolve`).
      decode_only: static promise that every live sequence has q_len <= 1, which skips
        the prefill kernel. Checked when the lengths are concrete; under `jit` a broken
        promise leaves the rows of longer chunks zero.
      interpret: run the kernels in the Pallas interpreter (any backend, e.g. the CPU).

    Raises:
      ValueError: at trace time, for inputs `attention_inputs` rejects, head_dim not
        in SUPPORTED_HEAD_DIMS, a `block_sizes` that is not a BlockSizes, or (not
        interpreting) block sizes whose kernels would exceed a GPU block's shared memory.
    """
    check_kernel_limits(inputs.shapes)
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"{block_sizes=} must be a BlockSizes")
    if decode_only:
        _decode_only_check(inputs.cu_q_lens, inputs.num_seqs)
    shapes = inputs.shapes
    if shapes.num_tokens == 0 or shapes.max_num_seqs == 0 or shapes.pages_per_seq == 0:
        return jnp.zeros_like(inputs.q)  # no row can see a cached token
    return _ragged_paged_attention_gpu(
        inputs,
        block_sizes=block_sizes.resolve(
            shapes, inputs.q.dtype, inputs.k_pages.dtype, interpret=interpret
        ),
        decode_only=bool(decode_only),
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("block_sizes", "decode_only", "interpret"))
def _ragged_paged_attention_gpu(
    inputs: AttentionInputs,
    *,
    block_sizes: BlockSizes,  # resolved: no None left
    decode_only: bool,
    interpret: bool,
) -> jax.Array:
    q, shapes = inputs.q, inputs.shapes
    cu_q_lens = inputs.cu_q_lens
    group = shapes.group_size

    def config(kv_block):
        return KernelConfig(
            num_q_heads=shapes.num_q_heads,
            group_size=group,
            group_padded=_next_power_of_two(group),
            page_size=shapes.page_size,
            kv_block=kv_block,
            sm_scale=inputs.sm_scale,
            soft_cap=inputs.soft_cap,
            sliding_window=inputs.sliding_window,
            compute_dtype=compute_dtype(q.dtype, inputs.k_pages.dtype),
            quantized=shapes.quantized,
        )

    seq_of_row, _, row_valid = token_layout(
        cu_q_lens, inputs.kv_lens, inputs.num_seqs, shapes.num_tokens
    )
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    row_q_len = q_lens[seq_of_row]

    per_seq = _decode(inputs, config(block_sizes.decode_kv_block), block_sizes, interpret)
    out = jnp.where((row_valid & (row_q_len == 1))[:, None, None], per_seq[seq_of_row], 0)
    if not decode_only:
        prefill = _prefill(inputs, config(block_sizes.prefill_kv_block), block_sizes, interpret)
        out = jnp.where((row_valid & (row_q_len > 1))[:, None, None], prefill, out)
    return out.astype(q.dtype)


def _decode(
    inputs: AttentionInputs, cfg: KernelConfig, block_sizes: BlockSizes, interpret: bool
) -> jax.Array:
    """Decode attention per sequence: `[S, Hq, D]`, valid for decode sequences only."""
    q, shapes = inputs.q, inputs.shapes
    splits = block_sizes.num_splits
    s, hq, d = shapes.max_num_seqs, shapes.num_q_heads, shapes.head_dim
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((s, hq, d), q.dtype)
    else:
        out_shape = (
            jax.ShapeDtypeStruct((splits, s, hq, d), jnp.float32),
            jax.ShapeDtypeStruct((splits, s, hq), jnp.float32),
            jax.ShapeDtypeStruct((splits, s, hq), jnp.float32),
        )
    result = pl.pallas_call(
        functools.partial(decode_kernel, cfg=cfg, num_splits=splits),
        out_shape=out_shape,
        grid=(s, shapes.num_kv_heads, splits),
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.decode_num_warps, num_stages=block_sizes.num_stages
        ),
        interpret=interpret,
        name="ragged_paged_attention_decode",
    )(inputs.kv_lens, inputs.block_tables, inputs.cu_q_lens, inputs.num_seqs, *_kv_refs(inputs))
    if splits == 1:
        return result
    return combine_splits(*result)


def combine_splits(acc: jax.Array, row_max: jax.Array, denom: jax.Array) -> jax.Array:
    """Merges split-K partials with a log-sum-exp rescale.

    acc f32[K, ..., D] (unnormalized weighted values), row_max f32[K, ...] (each split's
    max logit, -inf when it saw nothing), denom f32[K, ...] (its softmax denominator, 0
    when it saw nothing). Returns `sum_k e^(max_k - M) acc_k / sum_k e^(max_k - M) denom_k`
    with M the max over splits, and exact zeros where no split saw anything.
    """
    top = jnp.max(row_max, axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.where(denom > 0, jnp.exp(row_max - top[None]), 0.0)
    total = jnp.sum(weight * denom, axis=0)
    out = jnp.sum(weight[..., None] * acc, axis=0)
    return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def prefill_blocks(
    cu_q_lens: jax.Array, num_seqs: jax.Array, rows: int, num_blocks: int
) -> tuple[jax.Array, jax.Array]:
    """Query blocks of the prefill kernel: `(block_seq i32[NB], block_index i32[NB])`.

    Each live sequence with q_len > 1 gets `cdiv(q_len, rows)` consecutive blocks; block b
    belongs to sequence `block_seq[b]` as its `block_index[b]`-th block. Blocks past the
    last one have `block_seq = -1`.
    """
    max_num_seqs = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    prefill = (jnp.arange(max_num_seqs) < num_seqs[0]) & (q_lens > 1)
    counts = jnp.where(prefill, pl.cdiv(q_lens, rows), 0)
    ends = jnp.cumsum(counts)
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, b, side="right"), max_num_seqs - 1).astype(jnp.int32)
    live = b < ends[-1]
    block_seq = jnp.where(live, seq, -1)
    block_index = jnp.where(live, b - (ends[seq] - counts[seq]), 0)
    return block_seq.astype(jnp.int32), block_index.astype(jnp.int32)


def _prefill(
    inputs: AttentionInputs, cfg: KernelConfig, block_sizes: BlockSizes, interpret: bool
) -> jax.Array:
    """Prefill attention `[T, Hq, D]`, valid for rows of sequences with q_len > 1 only."""
    q, shapes = inputs.q, inputs.shapes
    rows = prefill_tile_tokens(block_sizes, cfg.group_padded)
    t = shapes.num_tokens
    # Prefill sequences have q_len >= 2, so there are at most T // 2 of them, and each
    # adds at most one partly filled block.
    num_blocks = cdiv(t, rows) + min(shapes.max_num_seqs, t // 2)
    block_seq, block_index = prefill_blocks(inputs.cu_q_lens, inputs.num_seqs, rows, num_blocks)
    return pl.pallas_call(
        functools.partial(prefill_kernel, cfg=cfg, rows=rows),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(num_blocks, shapes.num_kv_heads),
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.prefill_num_warps, num_stages=block_sizes.num_stages
        ),
        interpret=interpret,
        name="ragged_paged_attention_prefill",
    )(
        block_seq,
        block_index,
        inputs.kv_lens,
        inputs.block_tables,
        inputs.cu_q_lens,
        *_kv_refs(inputs),
    )


def _kv_refs(inputs: AttentionInputs) -> tuple[jax.Array, ...]:
    """The operands both kernels take after their scalars: q, the pages, their scales."""
    return (inputs.q, inputs.k_pages, inputs.v_pages, *inputs.scales)
