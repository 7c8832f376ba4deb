"""Block sizes of the GPU kernels: the tunables, their defaults, and the shared-memory
estimate that rejects a setting before it is compiled.

The defaults and the estimate come from the compiler's own figures
(`python -m benchmarks.kernel_compile`, the committed `gpu_kernel_resources.json`): the
estimate is checked against them over the grid (never under, at most 25% over).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..contract import (
    AttentionShapes,
    compute_dtype,
    is_quantized,
)
from ..layout import SCALE_DTYPE, cdiv
from .kernel import decode_tile_rows

SUPPORTED_HEAD_DIMS = (64, 128, 256)
MIN_BLOCK = 16  # smallest M, N and K of a Triton tensor-core dot
MAX_KV_BLOCK = 512
MAX_SPLITS = 64
# KV tokens per share of a split decode sequence under `deterministic=True` (the
# dispatch's `BlockSizes.split_tokens`): a 4096-token sequence is cut into 8 shares.
DETERMINISTIC_SPLIT_TOKENS = 512
# The split plan aims for this many decode programs: two waves on an H100/H200 (132
# SMs), so a batch of a few long sequences still fills the GPU.
TARGET_DECODE_PROGRAMS = 2 * 132
# Shared memory the default KV blocks may fill with their pipelined K and V tiles: about
# half of an H100/H200's 228 KiB, leaving room for the Q tile and the dots' staging.
KV_TILE_BUDGET_BYTES = 128 * 1024
# Dynamic shared memory one CUDA block may use on an H100/H200 (sm_90: 227 KiB opt-in).
SHARED_MEMORY_LIMIT_BYTES = 227 * 1024
# Smallest M of Hopper's warpgroup dot (wgmma), which Triton uses for 16-bit dots on sm_90.
WGMMA_MIN_ROWS = 64


def _is_power_of_two(x) -> bool:
    return isinstance(x, int) and x > 0 and not x & (x - 1)


def next_power_of_two(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
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
        64 tokens (int8/fp8 pages: 4096 / head_dim tokens), halved until `num_stages`
        buffered K and V tiles fit KV_TILE_BUDGET_BYTES of shared memory. Larger blocks
        cost registers (the gathered tiles' addresses, and the dequantized tiles); the
        defaults compile without spills for bf16 queries (`benchmarks.kernel_compile
        --subset=ci`: bf16 pages at head_dim 128, 83 registers with 4 warps; int8 and
        fp8 pages at head_dim 128, 111 and 99 with 8 warps; 4 warps spill there).
      num_splits: most KV splits of one decode sequence (split-K), in [1, 64]; the
        split plan cuts the live decodes' KV blocks into about TARGET_DECODE_PROGRAMS
        programs each call, never more than this many per sequence (1: no split, no
        combine). Default: 64, or the KV blocks of the longest sequence the table holds.
      split_tokens: None (default): the split plan sizes the shares from every live
        decode's length (about TARGET_DECODE_PROGRAMS programs a call), so where a
        sequence's KV reduction is cut, and so its rounding, depends on its batch-mates.
        A power of two >= 16: every decode sequence is cut into shares of
        `max(split_tokens, cdiv(its blocks, num_splits) blocks)` KV tokens (at least one
        block), a plan from its own length only, and the shares are merged in a fixed
        order: its output is then bitwise the same in any batch (`deterministic=True`
        of the dispatch), at the cost of a grid of `S * num_splits` programs and a
        serial combine.
      prefill_block_m: rows of a prefill tile, in (query token, query head) pairs: a
        tile holds `max(1, prefill_block_m // Gp)` tokens of one sequence, Gp being G
        rounded up to a power of two. A power of two >= 16. Default: 128 for 16-bit dots
        with head_dim <= 128, else 64.
      prefill_kv_block: KV tokens per step of the prefill kernel, in [16, 512]. Default:
        64 tokens (int8/fp8 pages: 4096 / head_dim tokens, at least 32), halved as
        decode_kv_block is; int8 and fp8 at head_dim 128 spill at 64 tokens, not at 32.
      decode_num_warps, prefill_num_warps: Triton warps per program (1 to 16, powers of
        two). Default: 8 for tiles of 128 rows or more, or whose f32 accumulator
        (rows x head_dim) or K/V block (kv_block x head_dim) holds 128 x 128 values or
        more, or, with quantized pages (whose K/V blocks the registers also hold
        dequantized), whose K/V block holds at least 32 x 128 values; else 4 (see
        `_default_warps` for the compiled figures behind the rule).
      num_stages: Triton software-pipelining stages of both kernels' KV loops (>= 1).
      check_shared_memory: reject, in `resolve` (not when interpreting), block sizes whose
        kernels' estimated shared memory (`shared_memory_bytes`) exceeds
        SHARED_MEMORY_LIMIT_BYTES. False only for compiling such configurations anyway
        (`benchmarks.kernel_compile`): they compile, but a GPU refuses to launch them.
    """

    decode_kv_block: int | None = None
    num_splits: int | None = None
    split_tokens: int | None = None
    prefill_block_m: int | None = None
    prefill_kv_block: int | None = None
    decode_num_warps: int | None = None
    prefill_num_warps: int | None = None
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
        if self.split_tokens is not None and (
            not _is_power_of_two(self.split_tokens) or self.split_tokens < MIN_BLOCK
        ):
            raise ValueError(
                f"BlockSizes.split_tokens={self.split_tokens!r} must be None or a power of two "
                f">= {MIN_BLOCK}"
            )
        if self.prefill_block_m is not None and (
            not _is_power_of_two(self.prefill_block_m) or self.prefill_block_m < MIN_BLOCK
        ):
            raise ValueError(
                f"BlockSizes.prefill_block_m={self.prefill_block_m!r} must be None or a power "
                f"of two >= {MIN_BLOCK}"
            )
        if self.num_splits is not None and (
            not isinstance(self.num_splits, int) or not 1 <= self.num_splits <= MAX_SPLITS
        ):
            raise ValueError(
                f"BlockSizes.num_splits={self.num_splits!r} must be None or an int in [1, {MAX_SPLITS}]"
            )
        for name in ("decode_num_warps", "prefill_num_warps"):
            value = getattr(self, name)
            if value is not None and (not _is_power_of_two(value) or value > 16):
                raise ValueError(
                    f"BlockSizes.{name}={value!r} must be None or a power of two in [1, 16]"
                )
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"BlockSizes.num_stages={self.num_stages!r} must be an int >= 1")
        if not isinstance(self.check_shared_memory, bool):
            raise ValueError(
                f"BlockSizes.check_shared_memory={self.check_shared_memory!r} must be a bool"
            )

    @property
    def split_blocks(self) -> int | None:
        """`split_tokens` in decode KV blocks (at least one), of resolved block sizes."""
        if self.split_tokens is None:
            return None
        return max(1, self.split_tokens // self.decode_kv_block)

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
        # Quantized pages: K/V blocks of 4096 values, whose dequantized copies the
        # registers hold (64, 32, 16 tokens at head_dim 64, 128, 256).
        decode_default = 4096 // shapes.head_dim if shapes.quantized else 64
        decode_kv_block = self.decode_kv_block or min(decode_default, fitting)
        max_blocks = cdiv(shapes.pages_per_seq * shapes.page_size, decode_kv_block)
        gp = next_power_of_two(shapes.group_size)
        block_m = self.prefill_block_m or (128 if itemsize == 2 and shapes.head_dim <= 128 else 64)
        prefill_rows = max(1, block_m // gp) * gp
        # Quantized pages at head_dim >= 128: 32 tokens, as their dequantized tiles spill
        # at 64 (int8 and fp8 prefill, head_dim 128, 8 warps: 4 to 20 bytes compiled).
        prefill_default = max(32, 4096 // shapes.head_dim) if shapes.quantized else 64
        prefill_kv_block = self.prefill_kv_block or min(prefill_default, fitting)
        resolved = dataclasses.replace(
            self,
            decode_kv_block=decode_kv_block,
            num_splits=self.num_splits or max(1, min(max_blocks, MAX_SPLITS)),
            prefill_block_m=block_m,
            prefill_kv_block=prefill_kv_block,
            decode_num_warps=self.decode_num_warps
            or _default_warps(
                decode_tile_rows(gp), decode_kv_block, shapes.head_dim, shapes.quantized
            ),
            prefill_num_warps=self.prefill_num_warps
            or _default_warps(prefill_rows, prefill_kv_block, shapes.head_dim, shapes.quantized),
        )
        if self.check_shared_memory and not interpret:
            _check_shared_memory(shapes, resolved, q_dtype, page_dtype)
        return resolved


def _default_warps(rows: int, kv_block: int, head_dim: int, quantized: bool) -> int:
    """Warps of a tile of `rows` query rows over KV blocks of `kv_block` tokens: 8 from
    128 rows, or from 128 x 128 values in the accumulator or a K/V block, or (quantized
    pages, whose K and V blocks the registers also hold dequantized) from a K/V block of
    32 x 128 values; else 4. The quantized default decode blocks (64 x 64, 32 x 128,
    16 x 256) compile to fewer registers at 8 warps (119 -> 73, 128 -> 111, 142 -> 128
    with bf16 queries; one-off compiles, the 8-warp figures are in
    `benchmarks/gpu_kernel_resources.json`), and 4 warps spill at head_dim 128 and,
    under float32 queries, 256."""
    if rows >= 128 or max(rows, kv_block) * head_dim >= 128 * 128:
        return 8
    return 8 if quantized and kv_block * head_dim >= 32 * 128 else 4


def kernel_tiles(shapes: AttentionShapes, bs: BlockSizes) -> dict[str, tuple[int, int, int]]:
    """`(kv_block, rows, num_warps)` of the decode and the prefill kernel's tiles for
    resolved block sizes `bs`: rows is M, the query rows of one program's tile."""
    gp = next_power_of_two(shapes.group_size)
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
    `benchmarks.kernel_compile` (committed in `benchmarks/gpu_kernel_resources.json`,
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
      body with more than 4 warps; and on wgmma tiles with KV blocks of 16 tokens, the
      dequantized K and V tiles (int8 and fp8 at head_dim 256, G=64: 64 KiB compiled
      where the terms above give 48).
    * a float32 query met in a 16-bit dtype (quantized pages): at least the Q tile in
      float32, up to 8 KiB per warp, which the conversion before the loop stages in
      shared memory (the compiled figure is the larger of the two phases; the per-warp
      cap is fitted: a 1-warp 16 x 256 tile stages 8 of its 16 KiB).

    Calibrated on decode tiles of 16 and 64 rows and prefill tiles of 16 to 128 rows.
    """
    compute = compute_dtype(q_dtype, page_dtype)
    q_bytes = np.dtype(q_dtype).itemsize
    if q_bytes > compute.itemsize:
        loop = shared_memory_bytes(
            kernel, kv_block=kv_block, rows=rows, head_dim=head_dim, q_dtype=compute,
            page_dtype=page_dtype, num_stages=num_stages, num_warps=num_warps,
        )  # fmt: skip
        return max(loop, min(rows * head_dim * q_bytes, num_warps * 8192))
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
    scales = 2 * kv_block * SCALE_DTYPE.itemsize if quantized else 0
    dequantized = f32_tile if quantized and compute_bytes == 4 else 0
    scratch = 1024 if num_warps > 4 else 0
    if compute_bytes == 2 and rows >= WGMMA_MIN_ROWS:
        staged = 2 * kv_block * head_dim * compute_bytes if quantized and kv_block < 32 else 0
        return 2 * kv + q_tile + scales + staged + 2 * scratch + 512
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
