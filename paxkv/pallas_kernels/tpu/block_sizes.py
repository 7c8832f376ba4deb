"""The TPU kernel's static tunables (`BlockSizes`) and the on-chip memory they must fit."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from ..contract import AttentionShapes, compute_dtype
from ..layout import SCALE_DTYPE, cdiv
from .kernel import STATS_LANES

# VMEM and SMEM of the smallest supported TensorCore (v4: 16 MiB, 1 MiB); used when no
# TPU is attached (interpret mode, CPU) so that what passes there fits every chip.
FALLBACK_VMEM_CAPACITY_BYTES = 16 * 1024 * 1024
FALLBACK_SMEM_CAPACITY_BYTES = 1024 * 1024
FALLBACK_MXU_WIDTH = 128
FALLBACK_NUM_CORES = 1
# Share of VMEM / SMEM the kernel's buffers may take; the rest is left to Mosaic's
# internal scratch and spills.
BUDGET_FRACTION = 0.75
# Rows of one sublane tile for 32-bit data: the M dimension is padded to it.
SUBLANES = 8
LANES = 128
# Decode items per grid step by default (`BlockSizes.items_per_step`).
DECODE_ITEMS_PER_STEP = 8


@dataclasses.dataclass(frozen=True)
class ChipInfo:
    """What the defaults and the VMEM check need to know about the target."""

    vmem_capacity_bytes: int
    smem_capacity_bytes: int
    mxu_width: int
    num_cores: int = FALLBACK_NUM_CORES  # TensorCores per device (a megacore's 2)

    @property
    def vmem_budget_bytes(self) -> int:
        """VMEM the kernel's buffers may take."""
        return int(self.vmem_capacity_bytes * BUDGET_FRACTION)

    @property
    def smem_budget_bytes(self) -> int:
        """SMEM the scalar-prefetched arrays may take."""
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
                info.vmem_capacity_bytes,
                info.smem_capacity_bytes,
                info.mxu_column_size,
                getattr(info, "num_cores", FALLBACK_NUM_CORES),
            )
    return ChipInfo(FALLBACK_VMEM_CAPACITY_BYTES, FALLBACK_SMEM_CAPACITY_BYTES, FALLBACK_MXU_WIDTH)


def _round_up(x: int, m: int) -> int:
    return cdiv(x, m) * m


def tile_rows(queries_per_block: int, group_size: int) -> int:
    """M: rows of one work item's query tile per KV head, padded to a sublane tile."""
    return _round_up(queries_per_block * group_size, SUBLANES)


def _sublane_tile(dtype, rows: int) -> int:
    """Rows of the VMEM tile Mosaic gives an array of `dtype` whose second-minor axis has
    `rows`: the packing (1 row for 32-bit, 2 for 16-bit, 4 for 8-bit), doubled until it
    covers `rows` or reaches a full tile (8, 16, 32 rows). So `[.., 2, L]` bf16 scales
    take 2-row tiles and int8 pages of 16 rows 16-row ones (Mosaic's reported scoped
    allocations agree: `test_compiles_for_tpu_deviceless` checks them)."""
    packing = max(1, 4 // jnp.dtype(dtype).itemsize)
    tile = packing
    while tile < min(rows, SUBLANES * packing):
        tile *= 2
    return tile


def _vmem_array_bytes(shape, dtype) -> int:
    """Bytes of a VMEM array, its two minor dims padded to whole tiles."""
    *lead, rows, cols = (1, *shape) if len(shape) == 1 else shape
    padded = _round_up(rows, _sublane_tile(dtype, rows)) * _round_up(cols, LANES)
    return math.prod(lead) * padded * jnp.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tunables of `ragged_paged_attention_tpu`; None picks a default for the call.

    Hashable and validated on construction; `resolve` fills in the defaults for a call's
    shapes and chip and checks the result against the chip's VMEM budget.

    Attributes:
      pages_per_block: KV pages fetched per DMA round and consumed per online-softmax
        step (the K/V VMEM buffers hold 2 x this many pages per KV head). Default: 512
        KV positions' worth (1024 with `decode`).
      queries_per_block: query tokens of one sequence per grid step; the matmul M
        dimension is this x `Hq / Hkv`. Default: about one MXU width of rows (1 with
        `decode`).
      kv_heads_per_block: KV heads per grid step; must divide Hkv. Default: all of them.
      decode: pick the defaults for decode batches (every q_len 1): one query token per
        step, so no rows are spent on other sequences' queries, and larger page blocks.
        Exact for any batch; prefill chunks just cost one step per token.
      num_cores: TensorCores the work items are dealt to, round robin (the grid's
        parallel axis). Default: the attached TPU's (2 on a megacore: v4, v5p), 1 off-TPU.
      items_per_step: work items one grid step computes, one after the other (their
        query tiles are one block): fewer grid steps, each with a fixed cost, for
        batches of many short items. Default: 8 with `decode`, else 1.

    Defaults are halved, heads first, until the buffers fit the VMEM budget; fields
    given explicitly are kept as they are.
    """

    pages_per_block: int | None = None
    queries_per_block: int | None = None
    kv_heads_per_block: int | None = None
    decode: bool = False
    num_cores: int | None = None
    items_per_step: int | None = None

    def __post_init__(self):
        names = ("pages_per_block", "queries_per_block", "kv_heads_per_block", "num_cores")
        for name in (*names, "items_per_step"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"BlockSizes.{name}={value!r} must be None or a positive int")
        if not isinstance(self.decode, bool):
            raise ValueError(f"BlockSizes.decode={self.decode!r} must be a bool")

    def resolve(
        self, shapes: AttentionShapes, q_dtype, page_dtype, *, chip: ChipInfo
    ) -> BlockSizes:
        """These block sizes with every None replaced by its default for `shapes` on `chip`.

        Raises ValueError, before anything is compiled, if kv_heads_per_block does not
        divide Hkv or the buffers cannot fit the chip's VMEM budget.
        """
        hkv = shapes.num_kv_heads
        if self.kv_heads_per_block is not None and hkv % self.kv_heads_per_block:
            raise ValueError(
                f"BlockSizes.kv_heads_per_block={self.kv_heads_per_block} must divide "
                f"num_kv_heads={hkv}"
            )
        mxu_queries = max(1, min(shapes.num_tokens, chip.mxu_width // shapes.group_size))
        kv_tokens = 1024 if self.decode else 512
        queries = self.queries_per_block or (1 if self.decode else mxu_queries)
        pages = self.pages_per_block or max(
            1, min(shapes.pages_per_seq, kv_tokens // shapes.page_size)
        )
        heads = self.kv_heads_per_block or hkv
        while True:
            bs = dataclasses.replace(
                self,
                pages_per_block=pages,
                queries_per_block=queries,
                kv_heads_per_block=heads,
                num_cores=self.num_cores or chip.num_cores,
                items_per_step=self.items_per_step or (DECODE_ITEMS_PER_STEP if self.decode else 1),
            )
            error = _vmem_error(shapes, bs, q_dtype, page_dtype, chip.vmem_budget_bytes)
            if error is None:
                return bs
            if self.kv_heads_per_block is None and heads > 1:
                heads = max(h for h in range(1, heads) if hkv % h == 0)
            elif self.pages_per_block is None and pages > 1:
                pages //= 2
            elif self.queries_per_block is None and queries > 1:
                queries //= 2
            else:
                raise ValueError(error)


def vmem_bytes(shapes: AttentionShapes, bs: BlockSizes, q_dtype, page_dtype) -> dict[str, int]:
    """VMEM the kernel needs for resolved block sizes `bs`, by part (tile-padded)."""
    hb, d, ps, ppb = bs.kv_heads_per_block, shapes.head_dim, shapes.page_size, bs.pages_per_block
    n = ppb * ps
    rows = tile_rows(bs.queries_per_block, shapes.group_size)
    mm = compute_dtype(q_dtype, page_dtype)
    parts = {
        "K/V page buffers": _vmem_array_bytes((2, ppb, hb, ps, 2 * d), page_dtype),
        "scale buffers": (
            # The block's heads of a page, as stored and widened to float32 (`kernel.py`).
            _vmem_array_bytes((2, ppb, hb, 2, shapes.scale_lanes), SCALE_DTYPE)
            + 2 * _vmem_array_bytes((ppb, hb, ps), jnp.float32)
            if shapes.quantized
            else 0
        ),
        # q in, out: each double-buffered by the Pallas pipeline.
        "q/out blocks": 2 * 2 * bs.items_per_step * _vmem_array_bytes((hb, rows, d), q_dtype),
        "softmax state": 2 * _vmem_array_bytes((hb, rows, STATS_LANES), jnp.float32)
        + _vmem_array_bytes((hb, rows, d), jnp.float32),
        # Mosaic's internal scratch, one head at a time: logits and probabilities, the
        # block's K and V tiles as read from the buffers and, for another dot dtype,
        # as cast for the MXU.
        "temporaries": 3 * _vmem_array_bytes((rows, n), jnp.float32)
        + 2 * _vmem_array_bytes((n, d), page_dtype)
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
