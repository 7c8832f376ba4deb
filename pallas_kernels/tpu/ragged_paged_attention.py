"""Ragged paged attention on TPU (Mosaic): the validating wrapper that builds the grid.

The semantics are exactly those of `ragged_paged_attention_reference`; the kernel body
is in `ragged_paged_attention_kernel.py`.

Layout. The batch is cut into work items: live sequence s with `q_len` new tokens
becomes `ceil(q_len / queries_per_block)` items of at most `queries_per_block`
consecutive rows. The grid is `(Hkv / kv_heads_per_block, NB)`, with `NB` a static
bound on the number of items; both dimensions are parallel (every step is
independent, so a megacore splits them freely). Before the kernel the query rows are
gathered into item slots `[Hkv, NB, M, D]`, where the `M` rows of a slot are the
item's tokens x the `G = Hq / Hkv` query heads of one KV head (zero-padded); the
kernel's output slots are scattered back to `[T, Hq, D]` after it. Both moves fuse
with the head transpose that the `[M, D]` tile needs anyway.

Decode. `ragged_paged_attention_tpu_decode` is the same kernel with defaults for
batches of single-token rows: one token per item (`M = G` rounded up to 8, so no
rows are wasted on other sequences' queries) and larger page blocks. It stays exact
for any batch, only slower on prefill chunks, which it walks one token at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..contract import AttentionShapes, check_attention_inputs, token_layout
from .kernel import STATS_LANES, KernelConfig, ragged_paged_attention_kernel

SUPPORTED_HEAD_DIMS = (64, 128, 256)
# VMEM and SMEM of the smallest supported TensorCore (v4: 16 MiB, 1 MiB); used when no
# TPU is attached (interpret mode, CPU) so that what passes there fits every chip.
FALLBACK_VMEM_CAPACITY_BYTES = 16 * 1024 * 1024
FALLBACK_SMEM_CAPACITY_BYTES = 1024 * 1024
FALLBACK_MXU_WIDTH = 128
# Share of VMEM / SMEM the kernel's buffers may take; the rest is left to Mosaic's
# internal scratch and spills.
BUDGET_FRACTION = 0.75
# Rows of one sublane tile for 32-bit data: the M dimension is padded to it.
SUBLANES = 8
LANES = 128


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tunables of the TPU kernel.

    pages_per_block: KV pages fetched per DMA round and consumed per online-softmax
      step (the K/V VMEM buffers hold 2 x this many pages per KV head).
    queries_per_block: query tokens of one sequence per grid step; the matmul M
      dimension is this x `Hq / Hkv`.
    kv_heads_per_block: KV heads per grid step; must divide Hkv.
    """

    pages_per_block: int
    queries_per_block: int
    kv_heads_per_block: int

    def __post_init__(self):
        for name in ("pages_per_block", "queries_per_block", "kv_heads_per_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockSizes.{name}={value!r} must be a positive int")


@dataclasses.dataclass(frozen=True)
class ChipInfo:
    """What the defaults and the VMEM check need to know about the target."""

    vmem_capacity_bytes: int
    smem_capacity_bytes: int
    mxu_width: int

    @property
    def vmem_budget_bytes(self) -> int:
        return int(self.vmem_capacity_bytes * BUDGET_FRACTION)

    @property
    def smem_budget_bytes(self) -> int:
        return int(self.smem_capacity_bytes * BUDGET_FRACTION)


def chip_info(interpret) -> ChipInfo:
    """The attached TPU's VMEM and MXU width; fallback constants off-TPU or interpreting."""
    if not interpret:
        try:
            is_tpu = pltpu.is_tpu_device()
        except (RuntimeError, ValueError):
            is_tpu = False
        if is_tpu:
            info = pltpu.get_tpu_info()
            return ChipInfo(
                info.vmem_capacity_bytes, info.smem_capacity_bytes, info.mxu_column_size
            )
    return ChipInfo(FALLBACK_VMEM_CAPACITY_BYTES, FALLBACK_SMEM_CAPACITY_BYTES, FALLBACK_MXU_WIDTH)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _sublane_tile(dtype) -> int:
    """Rows of one VMEM tile of `dtype`: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return SUBLANES * 4 // jnp.dtype(dtype).itemsize


def _vmem_array_bytes(shape, dtype) -> int:
    """Bytes of a VMEM array, its two minor dims padded to whole tiles."""
    *lead, rows, cols = (1, *shape) if len(shape) == 1 else shape
    padded = _round_up(rows, _sublane_tile(dtype)) * _round_up(cols, LANES)
    return math.prod(lead) * padded * jnp.dtype(dtype).itemsize


def matmul_dtype(q_dtype, page_dtype, quantized: bool) -> np.dtype:
    """The dtype fed to the matrix unit; accumulation is always float32.

    8-bit K/V values are exact in any float query dtype, so they meet the query in its
    own dtype; float pages of the query's dtype too; any other mix goes through f32.
    """
    q_dtype, page_dtype = np.dtype(q_dtype), np.dtype(page_dtype)
    if quantized or page_dtype == q_dtype:
        return q_dtype
    return np.dtype(np.float32)


def _rows(queries_per_block: int, group_size: int) -> int:
    return _round_up(queries_per_block * group_size, SUBLANES)


def vmem_bytes(shapes: AttentionShapes, bs: BlockSizes, q_dtype, page_dtype) -> dict[str, int]:
    """VMEM the kernel needs for `bs`, by part (tile-padded)."""
    hb, d, ps, ppb = bs.kv_heads_per_block, shapes.head_dim, shapes.page_size, bs.pages_per_block
    n = ppb * ps
    rows = _rows(bs.queries_per_block, shapes.group_size)
    mm = matmul_dtype(q_dtype, page_dtype, shapes.quantized)
    parts = {
        "K/V page buffers": 2 * _vmem_array_bytes((2, ppb, hb, ps, d), page_dtype),
        "scale buffers": (
            2 * _vmem_array_bytes((2, ppb, hb, ps), jnp.float32) if shapes.quantized else 0
        ),
        # q in, out: each double-buffered by the Pallas pipeline.
        "q/out blocks": 2 * 2 * _vmem_array_bytes((hb, rows, d), q_dtype),
        "softmax state": 2 * _vmem_array_bytes((hb, rows, STATS_LANES), jnp.float32)
        + _vmem_array_bytes((hb, rows, d), jnp.float32),
        # One head at a time: logits and probabilities, K and V cast for the MXU.
        "temporaries": 3 * _vmem_array_bytes((rows, n), jnp.float32)
        + (2 * _vmem_array_bytes((n, d), mm) if mm != np.dtype(page_dtype) else 0),
    }
    return parts


def _vmem_error(shapes, bs, q_dtype, page_dtype, budget) -> str | None:
    parts = vmem_bytes(shapes, bs, q_dtype, page_dtype)
    total = sum(parts.values())
    if total <= budget:
        return None
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    detail = ", ".join(f"{k} {mib(v)}" for k, v in parts.items() if v)
    return (
        f"{bs} needs {mib(total)} of VMEM ({detail}) but the per-core budget is {mib(budget)}; "
        f"shrink pages_per_block (the K/V buffers grow with pages_per_block x page_size="
        f"{shapes.page_size} x kv_heads_per_block x D={shapes.head_dim}), then kv_heads_per_block "
        f"or queries_per_block"
    )


def check_block_sizes(shapes: AttentionShapes, bs: BlockSizes, q_dtype, page_dtype, chip: ChipInfo):
    """Raises ValueError, before anything is compiled, if `bs` cannot run on `chip`."""
    if shapes.num_kv_heads % bs.kv_heads_per_block:
        raise ValueError(
            f"BlockSizes.kv_heads_per_block={bs.kv_heads_per_block} must divide "
            f"num_kv_heads={shapes.num_kv_heads}"
        )
    error = _vmem_error(shapes, bs, q_dtype, page_dtype, chip.vmem_budget_bytes)
    if error:
        raise ValueError(error)


def check_smem(shapes: AttentionShapes, bs: BlockSizes, chip: ChipInfo) -> None:
    """Raises ValueError if the scalar-prefetched arrays overflow SMEM: the block table
    (S x pages_per_seq int32) is by far the largest."""
    s = shapes.max_num_seqs
    items = num_work_items(shapes.num_tokens, s, bs.queries_per_block)
    needed = 4 * (s + s * shapes.pages_per_seq + s + 1 + 1 + 3 * items)
    if needed > chip.smem_budget_bytes:
        raise ValueError(
            f"the scalar-prefetched block table (S={s} x pages_per_seq={shapes.pages_per_seq} "
            f"int32), lengths and {items} work items need {needed} bytes of SMEM but the budget "
            f"is {chip.smem_budget_bytes}; split the batch or narrow the block table"
        )


def default_block_sizes(
    shapes: AttentionShapes, q_dtype, page_dtype, *, decode: bool, chip: ChipInfo
) -> BlockSizes:
    """Block sizes for `chip`: about one MXU width of rows (one token for decode) and
    512 (decode: 1024) KV positions per block, all KV heads per step; then halved,
    heads first, until the VMEM budget holds them."""
    g = shapes.group_size
    queries = 1 if decode else max(1, min(shapes.num_tokens, chip.mxu_width // g))
    kv_tokens = 1024 if decode else 512
    pages = max(1, min(shapes.pages_per_seq, kv_tokens // shapes.page_size))
    heads = shapes.num_kv_heads
    while True:
        bs = BlockSizes(pages, queries, heads)
        if _vmem_error(shapes, bs, q_dtype, page_dtype, chip.vmem_budget_bytes) is None:
            return bs
        if heads > 1:
            heads = max(h for h in range(1, heads) if shapes.num_kv_heads % h == 0)
        elif pages > 1:
            pages //= 2
        elif queries > 1:
            queries //= 2
        else:
            raise ValueError(_vmem_error(shapes, bs, q_dtype, page_dtype, chip.vmem_budget_bytes))


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
            f"q.dtype={jnp.dtype(q_dtype)}, k_pages.dtype={jnp.dtype(page_dtype)}: float16 is not "
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
    counts = (q_lens + bq - 1) // bq
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


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "block_sizes",
        "vmem_limit_bytes",
        "interpret",
    ),
)
def _ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    k_scales,
    v_scales,
    *,
    sm_scale,
    soft_cap,
    sliding_window,
    block_sizes,
    vmem_limit_bytes,
    interpret,
):
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_pages.shape
    max_num_seqs, pages_per_seq = block_tables.shape
    quantized = k_scales is not None
    g = num_q_heads // num_kv_heads
    bs = block_sizes
    bq, hb = bs.queries_per_block, bs.kv_heads_per_block
    rows = _rows(bq, g)
    num_items = num_work_items(num_tokens, max_num_seqs, bq)
    item_seq, item_start, item_rows, first_item = _work_items(cu_q_lens, num_seqs, num_items, bq)

    # Query rows into item slots [Hkv, NB, M, D]: slot row r = token r // G, head r % G.
    i = jnp.arange(bq, dtype=jnp.int32)
    token = cu_q_lens[item_seq][:, None] + item_start[:, None] + i  # [NB, bq]
    in_item = i < item_rows[:, None]
    q_items = jnp.where(in_item[:, :, None, None], q[jnp.clip(token, 0, num_tokens - 1)], 0)
    q_items = q_items.reshape(num_items, bq, num_kv_heads, g, head_dim).transpose(2, 0, 1, 3, 4)
    q_items = q_items.reshape(num_kv_heads, num_items, bq * g, head_dim)
    q_items = jnp.pad(q_items, ((0, 0), (0, 0), (0, rows - bq * g), (0, 0)))

    cfg = KernelConfig(
        page_size=page_size,
        pages_per_block=bs.pages_per_block,
        kv_heads_per_block=hb,
        group_size=g,
        rows=rows,
        pages_per_seq=pages_per_seq,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        quantized=quantized,
        matmul_dtype=matmul_dtype(q.dtype, k_pages.dtype, quantized),
    )
    item_block = pl.BlockSpec((hb, None, rows, head_dim), lambda h, b, *_: (h, b, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    in_specs = [item_block, hbm, hbm] + ([hbm, hbm] if quantized else [])
    ppb = bs.pages_per_block
    scratch = [pltpu.VMEM((2, ppb, hb, page_size, head_dim), k_pages.dtype)] * 2
    if quantized:
        scratch += [pltpu.VMEM((2, ppb, hb, page_size), jnp.float32)] * 2
    scratch += [
        pltpu.SemaphoreType.DMA((4 if quantized else 2, 2)),
        pltpu.VMEM((hb, rows, STATS_LANES), jnp.float32),  # running max m
        pltpu.VMEM((hb, rows, STATS_LANES), jnp.float32),  # running sum l
        pltpu.VMEM((hb, rows, head_dim), jnp.float32),  # accumulator
    ]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=7,
        grid=(num_kv_heads // hb, num_items),
        in_specs=in_specs,
        out_specs=item_block,
        scratch_shapes=scratch,
    )
    kernel = functools.partial(ragged_paged_attention_kernel, cfg=cfg)
    scales = (k_scales, v_scales) if quantized else ()
    out_items = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_items.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=(pltpu.PARALLEL, pltpu.PARALLEL),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        interpret=interpret,
    )(
        kv_lens,
        block_tables.reshape(-1),
        cu_q_lens,
        num_seqs,
        item_seq,
        item_start,
        item_rows,
        q_items,
        k_pages,
        v_pages,
        *scales,
    )

    # Item slots back to packed rows: row t at offset o in sequence s sits in slot
    # first_item[s] * bq + o of the flattened items.
    out_items = out_items[:, :, : bq * g].reshape(num_kv_heads, num_items, bq, g, head_dim)
    out_rows = out_items.transpose(1, 2, 0, 3, 4).reshape(num_items * bq, num_q_heads, head_dim)
    seq, _, valid = token_layout(cu_q_lens, kv_lens, num_seqs, num_tokens)
    slot = first_item[seq] * bq + jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[seq]
    out = out_rows[jnp.clip(slot, 0, num_items * bq - 1)]
    return jnp.where(valid[:, None, None], out, jnp.zeros_like(out))


def _attention(
    q,
    k_pages,
    v_pages,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale,
    soft_cap,
    sliding_window,
    k_scales,
    v_scales,
    block_sizes,
    interpret,
    decode,
):
    shapes = check_attention_inputs(
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        k_scales=k_scales,
        v_scales=v_scales,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    check_kernel_limits(shapes, q.dtype, k_pages.dtype, interpret=interpret)
    chip = chip_info(interpret)
    if block_sizes is None:
        block_sizes = default_block_sizes(shapes, q.dtype, k_pages.dtype, decode=decode, chip=chip)
    else:
        check_block_sizes(shapes, block_sizes, q.dtype, k_pages.dtype, chip)
    check_smem(shapes, block_sizes, chip)
    needed = sum(vmem_bytes(shapes, block_sizes, q.dtype, k_pages.dtype).values())
    if shapes.num_tokens == 0:
        return jnp.zeros(q.shape, q.dtype)
    return _ragged_paged_attention(
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        k_scales,
        v_scales,
        sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=sliding_window,
        block_sizes=block_sizes,
        # Headroom over the estimate for Mosaic's own scratch, within the chip.
        vmem_limit_bytes=min(chip.vmem_capacity_bytes, needed + chip.vmem_capacity_bytes // 8),
        interpret=interpret,
    )


def ragged_paged_attention_tpu(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, Hkv, ps, D]
    v_pages: jax.Array,  # [P, Hkv, ps, D]
    kv_lens: jax.Array,  # i32[S]
    block_tables: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scales: jax.Array | None = None,  # f32[P, Hkv, ps]
    v_scales: jax.Array | None = None,  # f32[P, Hkv, ps]
    block_sizes: BlockSizes | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # [T, Hq, D], q.dtype
    """Ragged paged attention on TPU, for mixed decode / prefill / chunked-prefill batches.

    Same arguments, result and guarantees as `ragged_paged_attention_reference` (see
    its docstring for the semantics). `block_sizes=None` picks defaults for the
    attached chip (`default_block_sizes`); `interpret` runs the kernel in the Pallas
    TPU interpreter (pass `pltpu.InterpretParams(...)` to choose its checks).

    Raises:
      ValueError: everything `check_attention_inputs` rejects; a head_dim outside
        SUPPORTED_HEAD_DIMS or, on a real TPU, float16 (`check_kernel_limits`);
        block sizes that do not divide the heads or whose buffers exceed the chip's
        VMEM budget; a block table too large for SMEM. All before compiling.
    """
    return _attention(
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        k_scales=k_scales,
        v_scales=v_scales,
        block_sizes=block_sizes,
        interpret=interpret,
        decode=False,
    )


def ragged_paged_attention_tpu_decode(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, Hkv, ps, D]
    v_pages: jax.Array,  # [P, Hkv, ps, D]
    kv_lens: jax.Array,  # i32[S]
    block_tables: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scales: jax.Array | None = None,  # f32[P, Hkv, ps]
    v_scales: jax.Array | None = None,  # f32[P, Hkv, ps]
    block_sizes: BlockSizes | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # [T, Hq, D], q.dtype
    """`ragged_paged_attention_tpu` with defaults for decode batches (every q_len 1).

    One query token per grid step, so each step's M rows are one sequence's G query
    heads and none are spent on other sequences; 1024 KV positions per page block.
    The result is exact for any batch; prefill rows just cost one step each.
    """
    return _attention(
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        k_scales=k_scales,
        v_scales=v_scales,
        block_sizes=block_sizes,
        interpret=interpret,
        decode=True,
    )
