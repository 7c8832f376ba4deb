"""Ragged paged attention on NVIDIA GPUs: Pallas kernels with the Triton lowering.

One call serves any mixed batch by composing two kernels (bodies in `kernel.py`, block
sizes and the shared-memory estimate in `block_sizes.py`):

* decode sequences (q_len == 1) go to a split-K decode kernel, grid
  `(work items, Hkv)`: each program reads a contiguous share of one sequence's pages
  for one KV head, with the G = Hq / Hkv query heads of that KV head as the M dim of the
  dots (GQA and MQA use the tensor cores). The shares come from a split plan computed
  from the live lengths each call (`decode_plan`, after FlashInfer's): the grid is
  static, sized for the padded batch, and the live decodes' KV blocks are cut into
  about two waves of programs, so one long sequence in a batch padded to 256 is split
  as finely as it would be alone. A sequence left whole is written, normalized, by its
  one program; the shares of a split one are merged by a log-sum-exp combine in jnp.
* every other live sequence (a prefill or a prefill chunk) goes to a prefill kernel, grid
  `(query blocks, Hkv)`: each program takes a block of one sequence's query tokens times
  the G heads and loops over the pages that block can see with an online softmax.

Both kernels write their rows into one output buffer (aliased from one kernel to the
next); padding rows are exact zeros. Attention sinks (`sinks f32[Hq]`) are one more
input of both kernels, added to each row's softmax state after its KV loop by the
program holding the sequence's first KV block (`kernel._add_sinks`).

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
)
from ..layout import cdiv
from .block_sizes import (
    TARGET_DECODE_PROGRAMS,
    BlockSizes,
    check_kernel_limits,
    next_power_of_two,
    prefill_tile_tokens,
)
from .jax_compat import plgpu
from .kernel import KernelConfig, decode_kernel, kv_views, prefill_kernel, visible_range


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
    block_sizes: BlockSizes = BlockSizes(),  # noqa: B008 - frozen: one shared default is safe
    decode_only: bool = False,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D], q.dtype
    """Ragged paged attention with the semantics of `ragged_paged_attention_reference`.

    Same arguments, result and guarantees as the reference (see `attention_op` for the
    calling convention), plus the keywords below. Pages `[P, Hkv, ps, 2 * D]`, each
    token's key then its value (float, or int8/float8 with per-token-per-head scales
    `bf16[P, Hkv, 2, L]`, each head's key scales then its value scales, dequantized in
    the kernel); packed ragged queries delimited by `cu_q_lens`; causal within each chunk,
    optional sliding window (pages wholly before the window are skipped) and soft-cap;
    padding rows and rows that see nothing are exact zeros. Dots take the operand dtype
    `contract.compute_dtype` gives, always with float32 accumulation: q's 16-bit dtype
    for pages of that dtype or int8/float8 pages; bfloat16 for int8/float8 pages under a
    float32 q; float32 (IEEE, never TF32) for every other mix.

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
            shapes, inputs.q.dtype, inputs.kv_pages.dtype, interpret=interpret
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
    group = shapes.group_size

    def config(kv_block):
        return KernelConfig(
            num_q_heads=shapes.num_q_heads,
            group_size=group,
            group_padded=next_power_of_two(group),
            page_size=shapes.page_size,
            kv_block=kv_block,
            sm_scale=inputs.sm_scale,
            soft_cap=inputs.soft_cap,
            sliding_window=inputs.sliding_window,
            compute_dtype=compute_dtype(q.dtype, inputs.kv_pages.dtype),
            quantized=shapes.quantized,
            sinks=inputs.sinks is not None,
        )

    out = _decode(
        inputs, jnp.zeros_like(q), config(block_sizes.decode_kv_block), block_sizes, interpret
    )
    if not decode_only:
        out = _prefill(inputs, out, config(block_sizes.prefill_kv_block), block_sizes, interpret)
    return out


def work_items(counts: jax.Array, num_items: int) -> tuple[jax.Array, jax.Array]:
    """Consecutive work items for sequences that need `counts[s]` each (i32[S]):
    `(item_seq i32[W], item_index i32[W])` with W = num_items. Item w belongs to sequence
    `item_seq[w]` as its `item_index[w]`-th; items past the last have `item_seq = -1`
    (index 0). `num_items` must be at least `sum(counts)`."""
    ends = jnp.cumsum(counts)
    w = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right"), counts.shape[0] - 1)
    seq = seq.astype(jnp.int32)
    live = w < ends[-1]
    index = (w - (ends[seq] - counts[seq])).astype(jnp.int32)
    return jnp.where(live, seq, -1), jnp.where(live, index, 0)


def decode_items(shapes: AttentionShapes, num_splits: int, own_length: bool = False) -> int:
    """W, the static number of decode work items: enough for any plan `decode_plan` makes.

    Each sequence gets at most num_splits items; and with chunks of at least
    `cdiv(total, target)` blocks, sum_s cdiv(blocks_s, chunk) < target + S, target being
    TARGET_DECODE_PROGRAMS per KV head. A plan from each sequence's own length
    (`own_length`) has no such bound: S * num_splits.
    """
    s = shapes.max_num_seqs
    if num_splits == 1 or own_length:
        return s * num_splits
    target = cdiv(TARGET_DECODE_PROGRAMS, shapes.num_kv_heads)
    return min(s * num_splits, target + s)


def decode_plan(
    inputs: AttentionInputs, cfg: KernelConfig, num_splits: int, split_blocks: int | None = None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The decode kernel's split plan for this call's live lengths.

    Returns `(item_seq, item_lo, item_hi i32[W], split bool[S])`: work item w covers KV
    blocks `[item_lo[w], item_hi[w])` (of the loop `visible_range` describes) of decode
    sequence `item_seq[w]` (-1: idle; a sequence's items are consecutive); `split[s]`
    says sequence s has more than one item. With `split_blocks=None` the live decodes' blocks are cut
    into chunks of `max(cdiv(total, target), cdiv(blocks_s, num_splits))` blocks, target
    being TARGET_DECODE_PROGRAMS per KV head: about two waves of programs whatever the
    padded batch, and at most num_splits items per sequence (FlashInfer's plan picks its
    KV chunk size from the live lengths alike). With `split_blocks`, chunks of
    `max(split_blocks, cdiv(blocks_s, num_splits))` blocks: sequence s's cut depends on
    its own length only (`BlockSizes.split_tokens`).
    """
    shapes = inputs.shapes
    s = shapes.max_num_seqs
    w = decode_items(shapes, num_splits, own_length=split_blocks is not None)
    q_lens = inputs.cu_q_lens[1:] - inputs.cu_q_lens[:-1]
    decode = (jnp.arange(s) < inputs.num_seqs[0]) & (q_lens == 1)
    last = inputs.kv_lens - 1
    blocks = jnp.where(decode, visible_range(last, last, cfg)[3], 0)
    if split_blocks is None:
        target = cdiv(TARGET_DECODE_PROGRAMS, shapes.num_kv_heads)
        least = pl.cdiv(jnp.sum(blocks), target)
    else:
        least = split_blocks
    chunk = jnp.maximum(jnp.maximum(least, pl.cdiv(blocks, num_splits)), 1)
    counts = pl.cdiv(blocks, chunk)
    item_seq, index = work_items(counts, w)
    seq = jnp.maximum(item_seq, 0)
    item_lo = jnp.minimum(index * chunk[seq], blocks[seq])
    item_hi = jnp.minimum(item_lo + chunk[seq], blocks[seq])
    return item_seq, item_lo, item_hi, counts > 1


def _decode(
    inputs: AttentionInputs,
    out: jax.Array,
    cfg: KernelConfig,
    block_sizes: BlockSizes,
    interpret: bool,
) -> jax.Array:
    """`out` [T, Hq, D] with the rows of decode sequences written."""
    shapes = inputs.shapes
    splits, own = block_sizes.num_splits, block_sizes.split_blocks
    w, hq, d = decode_items(shapes, splits, own is not None), shapes.num_q_heads, shapes.head_dim
    item_seq, item_lo, item_hi, split = decode_plan(inputs, cfg, splits, own)
    out_shape = [jax.ShapeDtypeStruct(out.shape, out.dtype)]
    if splits > 1:
        out_shape += [
            jax.ShapeDtypeStruct((w, hq, d), jnp.float32),
            jax.ShapeDtypeStruct((w, hq), jnp.float32),
            jax.ShapeDtypeStruct((w, hq), jnp.float32),
        ]
    result = pl.pallas_call(
        functools.partial(decode_kernel, cfg=cfg, split=splits > 1),
        out_shape=out_shape,
        grid=(w, shapes.num_kv_heads),
        input_output_aliases={0: 0},
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.decode_num_warps, num_stages=block_sizes.num_stages
        ),
        interpret=interpret,
        name="ragged_paged_attention_decode",
    )(
        out,
        item_seq,
        item_lo,
        item_hi,
        inputs.kv_lens,
        inputs.block_tables,
        inputs.cu_q_lens,
        *_kv_refs(inputs),
    )
    if splits == 1:
        return result[0]
    out, acc, row_max, denom = result
    # The shares of split sequences, merged into their rows; other rows are left as the
    # kernel wrote them.
    if own is None:
        share_seq = jnp.where(split[jnp.maximum(item_seq, 0)], item_seq, -1)
        merged = combine_splits(acc, row_max, denom, share_seq, shapes.max_num_seqs)
    else:
        merged = combine_in_order(acc, row_max, denom, item_seq, shapes.max_num_seqs, splits)
    rows = jnp.where(split, inputs.cu_q_lens[:-1], shapes.num_tokens)
    return out.at[rows].set(merged.astype(out.dtype), mode="drop")


def combine_splits(
    acc: jax.Array, row_max: jax.Array, denom: jax.Array, segment: jax.Array, num_segments: int
) -> jax.Array:
    """Merges split-K partials that belong to the same segment with a log-sum-exp rescale.

    acc f32[W, ..., D] (unnormalized weighted values), row_max f32[W, ...] (each share's
    max logit, -inf when it saw nothing), denom f32[W, ...] (its softmax denominator, 0
    when it saw nothing); segment i32[W] names the segment of each share, and shares
    outside `[0, num_segments)` are ignored (their values are never read into the result,
    so they may be anything, NaN included). Returns f32[num_segments, ..., D]: `sum_k
    e^(max_k - M) acc_k / sum_k e^(max_k - M) denom_k` over the segment's shares, M being
    their max, and exact zeros where no share saw anything.
    """
    valid = (segment >= 0) & (segment < num_segments)
    ids = jnp.where(valid, segment, num_segments)  # past the end: dropped by the sums

    def per_share(x):
        return valid.reshape(valid.shape + (1,) * (x.ndim - 1))

    saw = per_share(denom) & (denom > 0)
    row_max = jnp.where(saw, row_max, -jnp.inf)
    top = jax.ops.segment_max(row_max, ids, num_segments, indices_are_sorted=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.where(saw, jnp.exp(row_max - top[jnp.minimum(ids, num_segments - 1)]), 0.0)
    total = jax.ops.segment_sum(
        jnp.where(saw, weight * denom, 0.0), ids, num_segments, indices_are_sorted=True
    )
    weighted = jnp.where(saw[..., None], weight[..., None] * acc, 0.0)
    out = jax.ops.segment_sum(weighted, ids, num_segments, indices_are_sorted=True)
    return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def combine_in_order(
    acc: jax.Array,
    row_max: jax.Array,
    denom: jax.Array,
    item_seq: jax.Array,
    num_seqs: int,
    max_shares: int,
) -> jax.Array:
    """`combine_splits` for shares laid out as `work_items` lays them (each sequence's
    consecutive), summed share after share: each sequence's result depends on its own
    shares only (no float scatter-add, whose order a GPU does not fix).

    acc f32[W, Hq, D], row_max, denom f32[W, Hq] as `combine_splits` takes them;
    item_seq i32[W] the sequence of each share (-1: none), at most `max_shares` (static)
    per sequence. Returns f32[num_seqs, Hq, D]; rows of sequences with fewer than two
    shares are zeros (their kernel program wrote them).
    """
    ids = jnp.where(item_seq >= 0, item_seq, num_seqs)  # idle items: past the end, dropped
    counts = jnp.zeros(num_seqs, jnp.int32).at[ids].add(1, mode="drop")
    first = jnp.cumsum(counts) - counts  # i32[S]: the item of each sequence's first share
    split = counts > 1

    def share(k):  # share k of every sequence: (ok bool[S, Hq], max, denom, acc)
        ok = split & (k < counts)
        w = jnp.where(ok, first + k, 0)
        d = denom[w]
        saw = ok[:, None] & (d > 0)
        return saw, jnp.where(saw, row_max[w], -jnp.inf), d, acc[w]

    top = jnp.full(row_max.shape[1:], -jnp.inf)[None].repeat(counts.shape[0], 0)
    top = jax.lax.fori_loop(0, max_shares, lambda k, t: jnp.maximum(t, share(k)[1]), top)
    top = jnp.where(jnp.isfinite(top), top, 0.0)

    def add(k, carry):
        total, out = carry
        saw, m, d, a = share(k)
        weight = jnp.where(saw, jnp.exp(m - top), 0.0)
        return total + weight * jnp.where(saw, d, 0.0), out + jnp.where(
            saw[..., None], weight[..., None] * a, 0.0
        )

    zeros = jnp.zeros((counts.shape[0], *acc.shape[1:]), jnp.float32)
    total, out = jax.lax.fori_loop(0, max_shares, add, (zeros[..., 0], zeros))
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
    return work_items(jnp.where(prefill, pl.cdiv(q_lens, rows), 0), num_blocks)


def _prefill(
    inputs: AttentionInputs,
    out: jax.Array,
    cfg: KernelConfig,
    block_sizes: BlockSizes,
    interpret: bool,
) -> jax.Array:
    """`out` [T, Hq, D] with the rows of sequences with q_len > 1 written."""
    shapes = inputs.shapes
    rows = prefill_tile_tokens(block_sizes, cfg.group_padded)
    t = shapes.num_tokens
    # Prefill sequences have q_len >= 2, so there are at most T // 2 of them, and each
    # adds at most one partly filled block.
    num_blocks = cdiv(t, rows) + min(shapes.max_num_seqs, t // 2)
    block_seq, block_index = prefill_blocks(inputs.cu_q_lens, inputs.num_seqs, rows, num_blocks)
    return pl.pallas_call(
        functools.partial(prefill_kernel, cfg=cfg, rows=rows),
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        grid=(num_blocks, shapes.num_kv_heads),
        input_output_aliases={0: 0},
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.prefill_num_warps, num_stages=block_sizes.num_stages
        ),
        interpret=interpret,
        name="ragged_paged_attention_prefill",
    )(
        out,
        block_seq,
        block_index,
        inputs.kv_lens,
        inputs.block_tables,
        inputs.cu_q_lens,
        *_kv_refs(inputs),
    )


def _kv_refs(inputs: AttentionInputs) -> tuple[jax.Array, ...]:
    """The operands both kernels take after their scalars: q, the pages and their scales
    (in the kernels' view, `kv_views`), and the sinks when the call has them."""
    sinks = () if inputs.sinks is None else (inputs.sinks,)
    return (inputs.q, *kv_views(inputs.kv_pages, inputs.kv_scales), *sinks)
