"""Compile-time resource report of the GPU kernels for an H200 (sm_90), without a GPU.

Each configuration of a grid (query dtype x KV cache dtype x head_dim x block sizes) is
lowered for the `cuda` platform on the CPU; the Triton module of each Pallas kernel is
taken from the lowering (`jax_compat.triton_kernels`) and compiled by the `triton`
package (the `compile` extra; it ships `ptxas`) for `GPUTarget("cuda", 90, 32)` down to a
cubin. The report gives, per kernel, the registers per thread and spill bytes from
`ptxas -v`, the dynamic shared memory Triton allocates, and the kernel wrapper's own
shared-memory estimate, against the H200's 227 KiB per block.

    python -m benchmarks.kernel_compile                      # the whole grid, markdown
    python -m benchmarks.kernel_compile --subset=ci          # defaults, every KV dtype, D 128/256
    python -m benchmarks.kernel_compile --subset=sinks       # the grid's attention-sink cases
    python -m benchmarks.kernel_compile --json_out=benchmarks/gpu_kernel_resources.json

These are compiled figures, not measured speed. XLA compiles the same module with the
Triton it bundles, so its figures may differ somewhat from the `triton` package's; the
Triton IR itself is jaxlib's. Configurations that `BlockSizes` rejects (their estimate
exceeds the limit) are compiled anyway, with the check bypassed, so the report shows what
they would need.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import json
import multiprocessing
import os
import re
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from absl import app, flags, logging

from paxkv.pallas_kernels.layout import KV_CACHE_DTYPES, SCALE_DTYPE, resolve_kv_cache_dtype

if TYPE_CHECKING:
    from paxkv.pallas_kernels.gpu.jax_compat import TritonKernel

# Where the committed figures live; the resource-estimate unit test reads them.
FIGURES_PATH = os.path.join(os.path.dirname(__file__), "gpu_kernel_resources.json")
TARGET_ARCH = 90  # H100/H200
TARGET_DEVICE_KIND = "NVIDIA H200"

BLOCK_VARIANTS: dict[str, dict[str, Any]] = {
    # BlockSizes() with nothing set: resolved for the call's shapes.
    "default": {},
    # The smallest of everything BlockSizes accepts (num_stages 1: no pipelining).
    "small": {
        "decode_kv_block": 16,
        "prefill_kv_block": 16,
        "prefill_block_m": 16,
        "decode_num_warps": 1,
        "prefill_num_warps": 1,
        "num_stages": 1,
    },
    # Wide decode blocks (256 tokens), 3 stages, 8 warps: the setting issue 16 found
    # needing 401 KiB of shared memory (bf16, head_dim 256) before the masked V load.
    "wide_decode": {
        "decode_kv_block": 256,
        "num_stages": 3,
        "decode_num_warps": 8,
        "prefill_num_warps": 8,
    },
    # Large tiles, deep pipelines, many warps: the settings issue 16 found not to fit.
    "large": {
        "decode_kv_block": 256,
        "prefill_kv_block": 256,
        "prefill_block_m": 128,
        "decode_num_warps": 8,
        "prefill_num_warps": 8,
        "num_stages": 3,
    },
}
Q_DTYPES = ("bfloat16", "float32")
HEAD_DIMS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class CompileCase:
    """One kernel configuration of the grid: the call's dtypes, head_dim and block sizes.

    The shapes around them are fixed (8 sequences, 2 KV heads, G = group_size query heads
    per KV head, pages of 16 tokens): shared memory and registers depend on the tiles
    (G sets the decode tile's rows), and on the page arrays' size only past 4 GiB, where
    Pallas's Triton lowering switches their offsets to 64 bits (`num_pages`, default
    8 x 64 + 1: a stacked cache of scanned layers is one array for all layers).
    `sinks` compiles the kernels with attention sinks, `sliding_window` with a window.
    """

    q_dtype: str
    kv_cache_dtype: str  # a KV_CACHE_DTYPES name; "auto": pages in the query's dtype
    head_dim: int
    blocks: str  # a BLOCK_VARIANTS name
    group_size: int = 4
    num_pages: int | None = None
    sinks: bool = False
    sliding_window: int | None = None

    @property
    def name(self) -> str:
        """A label such as `bfloat16/int8/d128/default` (`.../g8/sinks/w128` with sinks and
        a window)."""
        group = "" if self.group_size == 4 else f"/g{self.group_size}"
        pages = "" if self.num_pages is None else f"/p{self.num_pages}"
        sinks = "/sinks" if self.sinks else ""
        window = "" if self.sliding_window is None else f"/w{self.sliding_window}"
        return (
            f"{self.q_dtype}/{self.kv_cache_dtype}/d{self.head_dim}/{self.blocks}"
            f"{group}{pages}{sinks}{window}"
        )


def grid() -> list[CompileCase]:
    """Every combination of Q_DTYPES, KV_CACHE_DTYPES, HEAD_DIMS and BLOCK_VARIANTS at
    G = 4, less float32 queries with the "wide_decode" and "large" blocks (their f32 tiles
    exceed the limit several times over, and ptxas takes minutes and gigabytes on each);
    the defaults of bfloat16 queries at G = 64; and with attention sinks, the defaults of
    bfloat16 queries over every KV dtype and head dim, and gpt-oss-20b's attention (G = 8,
    head_dim 64, a window of 128) over every KV dtype."""
    return (
        [
            CompileCase(q, kv, d, b)
            for q in Q_DTYPES
            for kv in KV_CACHE_DTYPES
            for d in HEAD_DIMS
            for b in BLOCK_VARIANTS
            if q != "float32" or b in ("default", "small")
        ]
        + [
            # G = 64: decode tiles of 64 rows, which Triton gives Hopper's warpgroup dots.
            CompileCase("bfloat16", kv, d, "default", group_size=64)
            for kv in KV_CACHE_DTYPES
            for d in HEAD_DIMS
        ]
        + [
            CompileCase("bfloat16", kv, d, "default", sinks=True)
            for kv in KV_CACHE_DTYPES
            for d in HEAD_DIMS
        ]
        + [gpt_oss_attention(kv) for kv in KV_CACHE_DTYPES]
    )


def gpt_oss_attention(kv_cache_dtype: str) -> CompileCase:
    """gpt-oss-20b's attention at the defaults: G = 64 / 8, head_dim 64, sinks, and the
    window of its sliding layers (128)."""
    return CompileCase(
        "bfloat16", kv_cache_dtype, 64, "default", group_size=8, sinks=True, sliding_window=128
    )


def ci_subset() -> list[CompileCase]:
    """The representative set CI compiles: defaults for bf16 queries over every
    KV_CACHE_DTYPES page dtype at head_dim 128 and 256, and with sinks, gpt-oss-20b's
    attention over bf16 pages and bf16 queries at head_dim 128 over int8 pages."""
    return [
        CompileCase("bfloat16", kv, d, "default") for kv in KV_CACHE_DTYPES for d in (128, 256)
    ] + [gpt_oss_attention("auto"), CompileCase("bfloat16", "int8", 128, "default", sinks=True)]


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """Compiled figures of one kernel (per program: one CUDA block)."""

    case: str  # CompileCase.name
    q_dtype: str
    page_dtype: str  # the pages' dtype name
    head_dim: int
    kernel: str  # "decode" or "prefill"
    num_warps: int
    num_stages: int
    kv_block: int
    rows: int  # M: query rows of the tile
    registers: int  # per thread
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int  # dynamic shared memory Triton allocates
    estimate_bytes: int  # the wrapper's shared-memory estimate

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON object."""
        return dataclasses.asdict(self)


def _inputs(case: CompileCase):
    """Abstract arguments of one call at the case's dtypes: (positional, keyword arrays)."""
    import jax
    import jax.numpy as jnp

    q_dtype = np.dtype(jnp.dtype(case.q_dtype))
    page_dtype = resolve_kv_cache_dtype(case.kv_cache_dtype, q_dtype)
    seqs, hkv, ps, pages_per_seq = 8, 2, 16, 64
    num_pages, tokens = case.num_pages or seqs * pages_per_seq + 1, 64
    s = jax.ShapeDtypeStruct
    i32 = np.dtype(np.int32)
    args = (
        s((tokens, hkv * case.group_size, case.head_dim), q_dtype),
        s((num_pages, hkv, ps, 2 * case.head_dim), page_dtype),  # each token's key, then value
        s((seqs,), i32),
        s((seqs, pages_per_seq), i32),
        s((seqs + 1,), i32),
        s((1,), i32),
    )
    arrays = {}
    if case.kv_cache_dtype != "auto":
        arrays["kv_scales"] = s((num_pages, hkv, 2, ps), SCALE_DTYPE)
    if case.sinks:
        arrays["sinks"] = s((hkv * case.group_size,), np.dtype(np.float32))
    return args, arrays


def lower_case(case: CompileCase) -> list[TritonKernel]:
    """The case's Triton kernels (decode, then prefill), lowered for an H200 on this
    machine; the shared-memory check is bypassed so that rejected configurations can be
    compiled too."""
    import jax

    from paxkv.pallas_kernels.gpu import BlockSizes, ragged_paged_attention_gpu
    from paxkv.pallas_kernels.gpu.jax_compat import triton_kernels, triton_lowering_target

    block_sizes = BlockSizes(**BLOCK_VARIANTS[case.blocks], check_shared_memory=False)
    args, arrays = _inputs(case)
    fn = jax.jit(
        lambda *a, **s: ragged_paged_attention_gpu(
            *a, **s, sm_scale=0.125, sliding_window=case.sliding_window, block_sizes=block_sizes
        )
    )
    with triton_lowering_target(TARGET_DEVICE_KIND):
        lowered = fn.trace(*args, **arrays).lower(lowering_platforms=("cuda",))
    return triton_kernels(lowered)


_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_kernel(ir: str, *, num_warps: int, num_stages: int) -> tuple[int, int, int, int]:
    """Compiles one Triton module (MLIR text) to an sm_90 cubin with the `triton` package.

    Returns `(registers per thread, spill store bytes, spill load bytes, dynamic shared
    memory bytes)`, the first three from `ptxas -v`. Needs no GPU.
    """
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ir)
        log = io.StringIO()
        # A fresh cache directory: a cached kernel would skip ptxas and its log.
        with knobs.cache.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.cache.dir = tmp
            knobs.nvidia.dump_ptxas_log = True
            compiled = triton.compile(
                path,
                target=GPUTarget("cuda", TARGET_ARCH, 32),
                options={
                    "num_warps": num_warps,
                    "num_stages": num_stages,
                    "enable_fp_fusion": True,
                },
            )
    text = log.getvalue()
    registers, spills = _PTXAS_REGISTERS.search(text), _PTXAS_SPILLS.search(text)
    if registers is None or spills is None:
        raise RuntimeError(f"no ptxas -v figures in the compile log:\n{text}")
    return (
        int(registers.group(1)),
        int(spills.group(1)),
        int(spills.group(2)),
        int(compiled.metadata.shared),
    )


def compile_case(case: CompileCase) -> list[KernelResources]:
    """Lowers and compiles one case: the figures of its decode and prefill kernels."""
    import jax.numpy as jnp

    from paxkv.pallas_kernels.contract import AttentionShapes
    from paxkv.pallas_kernels.gpu import BlockSizes
    from paxkv.pallas_kernels.gpu.block_sizes import kernel_tiles, shared_memory_bytes

    q_dtype = np.dtype(jnp.dtype(case.q_dtype))
    page_dtype = resolve_kv_cache_dtype(case.kv_cache_dtype, q_dtype)
    (q, kv_pages, kv_lens, block_tables, *_), _ = _inputs(case)
    shapes = AttentionShapes(
        num_tokens=q.shape[0], num_q_heads=q.shape[1], num_kv_heads=kv_pages.shape[1],
        head_dim=case.head_dim, num_pages=kv_pages.shape[0], page_size=kv_pages.shape[2],
        max_num_seqs=kv_lens.shape[0], pages_per_seq=block_tables.shape[1],
        quantized=case.kv_cache_dtype != "auto",
    )  # fmt: skip
    resolved = BlockSizes(**BLOCK_VARIANTS[case.blocks], check_shared_memory=False).resolve(
        shapes, q_dtype, page_dtype
    )
    tiles = kernel_tiles(shapes, resolved)
    results = []
    for kernel in lower_case(case):
        kind = kernel.name.removeprefix("ragged_paged_attention_")
        kv_block, rows, num_warps = tiles[kind]
        registers, spill_stores, spill_loads, shared = compile_kernel(
            kernel.ir, num_warps=kernel.num_warps, num_stages=kernel.num_stages
        )
        estimate = shared_memory_bytes(
            kind, kv_block=kv_block, rows=rows, head_dim=case.head_dim, q_dtype=q_dtype,
            page_dtype=page_dtype, num_stages=kernel.num_stages, num_warps=num_warps,
        )  # fmt: skip
        record = KernelResources(
            case=case.name, q_dtype=q_dtype.name, page_dtype=page_dtype.name,
            head_dim=case.head_dim, kernel=kind, num_warps=kernel.num_warps,
            num_stages=kernel.num_stages, kv_block=kv_block, rows=rows,
            registers=registers, spill_store_bytes=spill_stores,
            spill_load_bytes=spill_loads, shared_bytes=shared, estimate_bytes=estimate,
        )  # fmt: skip
        results.append(record)
    return results


def compile_cases(cases: Sequence[CompileCase], workers: int = 2) -> list[KernelResources]:
    """`compile_case` over `cases` in `workers` processes, in the order of `cases`."""
    if workers <= 1:
        return [r for case in cases for r in compile_case(case)]
    context = multiprocessing.get_context("spawn")  # JAX's threads do not survive a fork
    results = []
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        for case, case_results in zip(cases, pool.map(compile_case, cases), strict=True):
            logging.info("compiled %s", case.name)
            results.extend(case_results)
    return results


def kib(x: int) -> str:
    """Bytes as KiB with one decimal."""
    return f"{x / 1024:.1f}"


def to_markdown(results: Sequence[KernelResources], limit_bytes: int) -> str:
    """The figures as a markdown table, one row per kernel."""
    lines = [
        "| configuration | kernel | warps | stages | KV block | M | registers | spill st/ld (B) "
        "| shared (KiB) | estimate (KiB) | fits |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        fits = "yes" if r.shared_bytes <= limit_bytes else f"**no** (> {kib(limit_bytes)})"
        lines.append(
            f"| {r.case} | {r.kernel} | {r.num_warps} | {r.num_stages} | {r.kv_block} | {r.rows} "
            f"| {r.registers} | {r.spill_store_bytes}/{r.spill_load_bytes} | {kib(r.shared_bytes)} "
            f"| {kib(r.estimate_bytes)} | {fits} |"
        )
    return "\n".join(lines)


def figures_json(results: Sequence[KernelResources]) -> dict[str, Any]:
    """The figures with the versions that produced them, as written to FIGURES_PATH."""
    import jaxlib
    import triton

    return {
        "target": f"sm_{TARGET_ARCH} ({TARGET_DEVICE_KIND})",
        "jaxlib": jaxlib.__version__,
        "triton": triton.__version__,
        "kernels": [r.to_json() for r in results],
    }


def define_flags() -> None:
    """Defines the command's flags; called only when run as a script, so that importing
    this module (the tests do) defines no global absl flags."""
    flags.DEFINE_enum("subset", "grid", ["grid", "ci", "sinks"], "Which configurations to compile.")
    flags.DEFINE_integer(
        "num_pages", None, "Pages of the (abstract) page arrays; unset: 513 (8 x 64 + 1)."
    )
    flags.DEFINE_integer("workers", 2, "Processes compiling in parallel.")
    flags.DEFINE_string("json_out", None, "Also write the figures as JSON to this path.")


def main(argv: list[str]) -> None:
    """Compiles the chosen configurations and prints the markdown table."""
    del argv
    from paxkv.pallas_kernels.gpu.block_sizes import SHARED_MEMORY_LIMIT_BYTES

    cases = {
        "grid": grid,
        "ci": ci_subset,
        "sinks": lambda: [c for c in grid() if c.sinks],
    }[flags.FLAGS.subset]()
    if flags.FLAGS.num_pages is not None:
        cases = [dataclasses.replace(c, num_pages=flags.FLAGS.num_pages) for c in cases]
    start = time.perf_counter()
    results = compile_cases(cases, flags.FLAGS.workers)
    logging.info("compiled %d kernels in %.0f s", len(results), time.perf_counter() - start)
    print(to_markdown(results, SHARED_MEMORY_LIMIT_BYTES))
    if flags.FLAGS.json_out:
        with open(flags.FLAGS.json_out, "w") as f:
            json.dump(figures_json(results), f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    define_flags()
    app.run(main)
