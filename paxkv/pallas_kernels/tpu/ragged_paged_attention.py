"""Ragged paged attention on TPU (Mosaic): the validating wrapper that builds the grid.

The semantics are exactly those of `ragged_paged_attention_reference`; the kernel body
is in `kernel.py`, the block sizes and the VMEM budget they must fit in `block_sizes.py`.

Layout. The batch is cut into work items: live sequence s with `q_len` new tokens
becomes `ceil(q_len / queries_per_block)` items of at most `queries_per_block`
consecutive rows. The grid is `(cores, Hkv / kv_heads_per_block, NB / cores)`, with `NB`
a static bound on the number of items (rounded up to a multiple of the cores): core c
runs items `c, c + cores, c + 2 cores, ...` (so two short decodes land on different
TensorCores of a megacore), head block by head block, in order, and each of its steps
starts the DMA of the next step's first KV block during its own last one, so no item
begins with a cold copy. Only the core axis is parallel. Before the kernel the query rows are
gathered into item slots `[Hkv, NB, M, D]`, where the `M` rows of a slot are the
item's tokens x the `G = Hq / Hkv` query heads of one KV head (zero-padded); the
kernel's output slots are scattered back to `[T, Hq, D]` after it. Both moves fuse
with the head transpose that the `[M, D]` tile needs anyway.

Sinks. Attention sinks (`sinks f32[Hq]`) go to the kernel whole, in SMEM; each item
starts its rows' online softmax from their query heads' sinks (`kernel._start_softmax`).

Decode. `BlockSizes(decode=True)` picks defaults for batches of single-token rows: one
token per item (`M = G` rounded up to 8, so no rows are wasted on other sequences'
queries) and larger page blocks. It stays exact for any batch, only slower on prefill
chunks, which it walks one token at a time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..contract import AttentionInputs, AttentionShapes, attention_op, compute_dtype, token_layout
from ..layout import SCALE_DTYPE
from .block_sizes import BlockSizes, ChipInfo, chip_info, tile_rows, vmem_bytes
from .kernel import STATS_LANES, KernelConfig, ragged_paged_attention_kernel

SUPPORTED_HEAD_DIMS = (64, 128, 256)


def check_smem(
    shapes: AttentionShapes, bs: BlockSizes, chip: ChipInfo, sinks: bool = False
) -> None:
    """Raises ValueError if the arrays in SMEM overflow it: the block table (S x
    pages_per_seq int32) is by far the largest; `sinks` adds Hq float32 sink logits. `bs`
    is resolved."""
    s = shapes.max_num_seqs
    items = num_item_slots(shapes.num_tokens, s, bs)
    sink_words = shapes.num_q_heads if sinks else 0
    needed = 4 * (s + s * shapes.pages_per_seq + s + 1 + 1 + 3 * items + 1 + sink_words)
    if needed > chip.smem_budget_bytes:
        raise ValueError(
            f"the scalar-prefetched block table (S={s} x pages_per_seq={shapes.pages_per_seq} "
            f"int32), lengths and {items} work items need {needed} bytes of SMEM but the budget "
            f"is {chip.smem_budget_bytes}; split the batch or narrow the block table"
        )


def check_kernel_limits(shapes: AttentionShapes, q_dtype, page_dtype, *, interpret) -> None:
    """Limits of this kernel beyond the shared input contract.

    head_dim must be one of SUPPORTED_HEAD_DIMS and page_size at least 8 (the shared
    contract already makes it a power of two). Compiled for a real TPU (not
    interpreting), float16 queries or pages are rejected: Mosaic has no float16
    vector loads on any TPU generation. No page_size limit beyond the shared one is
    needed on hardware: every page dtype compiles for page_size 8 to 128 on v5e,
    v5p, v6e and TPU7x (deviceless Mosaic compile); a page_size below the dtype's
    sublane tile (16 rows for 16-bit, 32 for 8-bit data) compiles to a relayout of
    each block and is slower, not wrong.
    """
    if shapes.head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={shapes.head_dim} must be one of {SUPPORTED_HEAD_DIMS}")
    if shapes.page_size < 8:
        raise ValueError(f"page_size={shapes.page_size} must be at least 8")
    if interpret:
        return
    f16 = jnp.dtype(jnp.float16)
    if f16 in (jnp.dtype(q_dtype), jnp.dtype(page_dtype)):
        raise ValueError(
            f"q.dtype={jnp.dtype(q_dtype)}, kv_pages.dtype={jnp.dtype(page_dtype)}: float16 is not "
            f"supported on TPU (Mosaic has no float16 vector loads); use bfloat16"
        )


def _work_items(cu_q_lens, num_seqs, num_items: int, queries_per_block: int):
    """Splits live sequences into items of at most `queries_per_block` rows.

    Returns `(seq i32[NB], start i32[NB], rows i32[NB], first_item i32[S])`: item b
    covers rows `start : start + rows` of sequence `seq`'s chunk; items past the last
    one have `rows = 0`. `first_item[s]` is the index of sequence s's first item.
    """
    bq = queries_per_block
    max_num_seqs = cu_q_lens.shape[0] - 1
    live = jnp.arange(max_num_seqs) < num_seqs[0]
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    counts = pl.cdiv(q_lens, bq)
    ends = jnp.cumsum(counts).astype(jnp.int32)
    first_item = ends - counts
    b = jnp.arange(num_items, dtype=jnp.int32)
    used = b < ends[-1]
    seq = jnp.where(used, jnp.minimum(jnp.searchsorted(ends, b, side="right"), max_num_seqs - 1), 0)
    seq = seq.astype(jnp.int32)
    start = jnp.where(used, (b - first_item[seq]) * bq, 0)
    rows = jnp.where(used, jnp.clip(q_lens[seq] - start, 0, bq), 0)
    return seq, start.astype(jnp.int32), rows.astype(jnp.int32), first_item


def num_work_items(num_tokens: int, max_num_seqs: int, queries_per_block: int) -> int:
    """Static bound on the number of items: each has at least one row, and at most
    one per sequence is partial."""
    bq = queries_per_block
    return max(1, min(num_tokens, (num_tokens + max_num_seqs * (bq - 1)) // bq))


def num_item_slots(num_tokens: int, max_num_seqs: int, bs: BlockSizes) -> int:
    """Item slots of the grid (NB): the bound on work items rounded up to whole grid
    steps on every core (`num_cores x items_per_step` items a round); `bs` is resolved."""
    per_round = bs.num_cores * bs.items_per_step
    return (
        pl.cdiv(num_work_items(num_tokens, max_num_seqs, bs.queries_per_block), per_round)
        * per_round
    )


@functools.partial(jax.jit, static_argnames=("block_sizes", "vmem_limit_bytes", "interpret"))
def _ragged_paged_attention(
    inputs: AttentionInputs,
    *,
    block_sizes: BlockSizes,  # resolved: no None left
    vmem_limit_bytes: int,
    interpret: bool | pltpu.InterpretParams,
) -> jax.Array:
    q, kv_pages, cu_q_lens = inputs.q, inputs.kv_pages, inputs.cu_q_lens
    kv_lens, num_seqs = inputs.kv_lens, inputs.num_seqs
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = inputs.shapes.num_kv_heads, inputs.shapes.page_size
    max_num_seqs, pages_per_seq = inputs.block_tables.shape
    quantized = inputs.shapes.quantized
    g = num_q_heads // num_kv_heads
    bs = block_sizes
    bq, hb = bs.queries_per_block, bs.kv_heads_per_block
    rows = tile_rows(bq, g)
    cores, k = bs.num_cores, bs.items_per_step
    num_items = num_item_slots(num_tokens, max_num_seqs, bs)
    per_core = num_items // cores
    item_seq, item_start, item_rows, first_item = _work_items(cu_q_lens, num_seqs, num_items, bq)

    # Query rows into item slots [Hkv, NB, M, D]: slot row r = token r // G, head r % G.
    i = jnp.arange(bq, dtype=jnp.int32)
    token = cu_q_lens[item_seq][:, None] + item_start[:, None] + i  # [NB, bq]
    in_item = i < item_rows[:, None]
    q_items = jnp.where(in_item[:, :, None, None], q[jnp.clip(token, 0, num_tokens - 1)], 0)
    q_items = q_items.reshape(num_items, bq, num_kv_heads, g, head_dim).transpose(2, 0, 1, 3, 4)
    q_items = q_items.reshape(num_kv_heads, num_items, bq * g, head_dim)
    q_items = jnp.pad(q_items, ((0, 0), (0, 0), (0, rows - bq * g), (0, 0)))
    # Each core's items contiguous, in the order it runs them: [Hkv, cores, per_core, M, D],
    # slot [c, w] holding item core_item(c, w) = w * cores + c; a step's k items are a block.
    q_items = q_items.reshape(num_kv_heads, per_core, cores, rows, head_dim).swapaxes(1, 2)

    cfg = KernelConfig(
        page_size=page_size,
        pages_per_block=bs.pages_per_block,
        kv_heads_per_block=hb,
        group_size=g,
        rows=rows,
        pages_per_seq=pages_per_seq,
        sm_scale=inputs.sm_scale,
        soft_cap=inputs.soft_cap,
        sliding_window=inputs.sliding_window,
        quantized=quantized,
        compute_dtype=compute_dtype(q.dtype, kv_pages.dtype),
        items_per_step=k,
        sinks=inputs.sinks is not None,
    )
    item_block = pl.BlockSpec((hb, None, k, rows, head_dim), lambda c, h, w, *_: (h, c, w, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    in_specs = [item_block, hbm] + ([hbm] if quantized else [])
    sinks = () if inputs.sinks is None else (inputs.sinks,)
    in_specs += [pl.BlockSpec(memory_space=pltpu.SMEM)] * len(sinks)  # f32[Hq], whole
    ppb = bs.pages_per_block
    # K and V of hb heads of ppb pages, double-buffered.
    scratch = [pltpu.VMEM((2, ppb, hb, page_size, 2 * head_dim), kv_pages.dtype)]
    if quantized:
        # The block's heads of a page: as stored (double-buffered), then K's and V's
        # widened to float32 (see kernel.py). The widened buffers' leading unit axis is
        # there for Mosaic: it reshapes one head's `[ppb, ps]` scales to `[1, N]` when
        # loaded from a rank-4 buffer, and rejects the same reshape from a rank-3 one.
        lanes = inputs.shapes.scale_lanes
        scratch += [pltpu.VMEM((2, ppb, hb, 2, lanes), SCALE_DTYPE)]
        scratch += [pltpu.VMEM((1, ppb, hb, page_size), jnp.float32)] * 2
    scratch += [
        pltpu.SemaphoreType.DMA((2 if quantized else 1, 2)),
        pltpu.SMEM((1,), jnp.int32),  # the slot of the next step's first block
        pltpu.VMEM((hb, rows, STATS_LANES), jnp.float32),  # running max m
        pltpu.VMEM((hb, rows, STATS_LANES), jnp.float32),  # running sum l
        pltpu.VMEM((hb, rows, head_dim), jnp.float32),  # accumulator
    ]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=7,
        grid=(cores, num_kv_heads // hb, per_core // k),
        in_specs=in_specs,
        out_specs=item_block,
        scratch_shapes=scratch,
    )
    kernel = functools.partial(ragged_paged_attention_kernel, cfg=cfg)
    out_items = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_items.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=(pltpu.PARALLEL, pltpu.ARBITRARY, pltpu.ARBITRARY),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        interpret=interpret,
    )(
        kv_lens,
        inputs.block_tables.reshape(-1),
        cu_q_lens,
        num_seqs,
        item_seq,
        item_start,
        item_rows,
        q_items,
        kv_pages,
        *inputs.scales,
        *sinks,
    )

    # Item slots back to packed rows: row t at offset o in sequence s sits in slot
    # first_item[s] * bq + o of the flattened items.
    out_items = out_items.swapaxes(1, 2).reshape(num_kv_heads, num_items, rows, head_dim)
    out_items = out_items[:, :, : bq * g].reshape(num_kv_heads, num_items, bq, g, head_dim)
    out_rows = out_items.transpose(1, 2, 0, 3, 4).reshape(num_items * bq, num_q_heads, head_dim)
    seq, _, valid = token_layout(cu_q_lens, kv_lens, num_seqs, num_tokens)
    slot = first_item[seq] * bq + jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[seq]
    out = out_rows[jnp.clip(slot, 0, num_items * bq - 1)]
    return jnp.where(valid[:, None, None], out, jnp.zeros_like(out))


@attention_op
def ragged_paged_attention_tpu(
    inputs: AttentionInputs,
    *,
    block_sizes: BlockSizes = BlockSizes(),  # noqa: B008 - frozen: one shared default is safe
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # [T, Hq, D], q.dtype
    """Ragged paged attention on TPU, for mixed decode / prefill / chunked-prefill batches.

    Same arguments, result and guarantees as `ragged_paged_attention_reference` (see
    its docstring for the semantics and `attention_op` for the calling convention),
    plus two keywords. `block_sizes`: the static tunables; fields left None are picked
    for the attached chip (`BlockSizes.resolve`), and `BlockSizes(decode=True)` picks
    them for decode batches. `interpret`: run the kernel in the Pallas TPU interpreter
    (pass `pltpu.InterpretParams(...)` to choose its checks).

    Raises:
      ValueError: everything `attention_inputs` rejects; a head_dim outside
        SUPPORTED_HEAD_DIMS or, on a real TPU, float16 (`check_kernel_limits`);
        block sizes that do not divide the heads or whose buffers exceed the chip's
        VMEM budget; a block table too large for SMEM. All before compiling.
    """
    shapes, q_dtype, page_dtype = inputs.shapes, inputs.q.dtype, inputs.kv_pages.dtype
    check_kernel_limits(shapes, q_dtype, page_dtype, interpret=interpret)
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"{block_sizes=} must be a tpu.BlockSizes")
    chip = chip_info(interpret)
    block_sizes = block_sizes.resolve(shapes, q_dtype, page_dtype, chip=chip)
    check_smem(shapes, block_sizes, chip, sinks=inputs.sinks is not None)
    needed = sum(vmem_bytes(shapes, block_sizes, q_dtype, page_dtype).values())
    if shapes.num_tokens == 0:
        return jnp.zeros(inputs.q.shape, q_dtype)
    return _ragged_paged_attention(
        inputs,
        block_sizes=block_sizes,
        # Headroom over the estimate for Mosaic's own scratch, within the chip.
        vmem_limit_bytes=min(chip.vmem_capacity_bytes, needed + chip.vmem_capacity_bytes // 8),
        interpret=interpret,
    )
