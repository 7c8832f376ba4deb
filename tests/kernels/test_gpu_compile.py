"""The GPU kernels' shared-memory estimate and rejection against the compiled figures.

The committed figures (`benchmarks/gpu_kernel_resources.json`, written by
`python -m benchmarks.kernel_compile --json_out=...`) come from compiling every kernel of
the grid to an sm_90 cubin with the `triton` package. The estimate must bound them from
above, tightly; the compile test redoes a representative set when `triton` is installed
(the `compile` extra).
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import kernel_compile
from paxkv.pallas_kernels.contract import AttentionShapes
from paxkv.pallas_kernels.gpu import BlockSizes
from paxkv.pallas_kernels.gpu.block_sizes import (
    SHARED_MEMORY_LIMIT_BYTES,
    shared_memory_bytes,
)

with open(kernel_compile.FIGURES_PATH) as _f:
    FIGURES = json.load(_f)


def _estimate(row: dict) -> int:
    return shared_memory_bytes(
        row["kernel"], kv_block=row["kv_block"], rows=row["rows"], head_dim=row["head_dim"],
        q_dtype=np.dtype(jnp.dtype(row["q_dtype"])), page_dtype=np.dtype(jnp.dtype(row["page_dtype"])),
        num_stages=row["num_stages"], num_warps=row["num_warps"],
    )  # fmt: skip


def test_figures_cover_the_grid():
    cases = {row["case"] for row in FIGURES["kernels"]}
    assert cases == {case.name for case in kernel_compile.grid()}
    assert len(FIGURES["kernels"]) == 2 * len(cases)  # decode and prefill


@pytest.mark.parametrize("row", FIGURES["kernels"], ids=lambda r: f"{r['case']}-{r['kernel']}")
def test_estimate_bounds_compiled_shared_memory(row):
    estimate, compiled = _estimate(row), row["shared_bytes"]
    assert compiled <= estimate <= 1.25 * compiled, f"{estimate=} {compiled=}"


def _shapes(head_dim: int, group_size: int = 4) -> AttentionShapes:
    return AttentionShapes(
        num_tokens=64, num_q_heads=2 * group_size, num_kv_heads=2, head_dim=head_dim,
        num_pages=513, page_size=16, max_num_seqs=8, pages_per_seq=64, quantized=False,
    )  # fmt: skip


# Issue 16's offender (bf16 pages, head_dim 256): decode 401 KiB before the masked V load,
# 273 KiB after; and the largest tiles with int8 pages: prefill 324 KiB.
OFFENDERS = [
    (
        jnp.bfloat16,
        BlockSizes(decode_kv_block=256, num_stages=3, decode_num_warps=8, prefill_num_warps=8),
        "decode kernel (kv_block=256, 16 rows",
    ),
    (
        jnp.int8,
        BlockSizes(**kernel_compile.BLOCK_VARIANTS["large"]),
        "prefill kernel (kv_block=256, 128 rows",
    ),
]


@pytest.mark.parametrize("page_dtype, block_sizes, where", OFFENDERS, ids=["bf16", "int8"])
def test_rejects_configurations_past_the_shared_memory_limit(page_dtype, block_sizes, where):
    with pytest.raises(ValueError) as error:
        block_sizes.resolve(_shapes(256), jnp.bfloat16, page_dtype)
    message = str(error.value)
    assert where in message and "head_dim=256" in message and "num_stages=3" in message
    assert f"may use {SHARED_MEMORY_LIMIT_BYTES // 1024} KiB" in message
    estimate_kib = int(message.split("needs about ")[1].split(" KiB")[0])
    assert estimate_kib * 1024 > SHARED_MEMORY_LIMIT_BYTES


def test_interpreter_has_no_shared_memory_limit():
    page_dtype, block_sizes, _ = OFFENDERS[0]
    resolved = block_sizes.resolve(_shapes(256), jnp.bfloat16, page_dtype, interpret=True)
    assert resolved.decode_kv_block == 256


def test_rejected_exactly_where_the_compiled_kernel_does_not_fit():
    for row in FIGURES["kernels"]:
        fits = row["shared_bytes"] <= SHARED_MEMORY_LIMIT_BYTES
        assert (_estimate(row) <= SHARED_MEMORY_LIMIT_BYTES) == fits, row["case"]


def test_check_can_be_bypassed_for_the_compile_report():
    bypassed = BlockSizes(
        decode_kv_block=256, num_stages=3, decode_num_warps=8, check_shared_memory=False
    )
    assert bypassed.resolve(_shapes(256), jnp.bfloat16, jnp.bfloat16).decode_kv_block == 256
    with pytest.raises(ValueError, match="check_shared_memory"):
        BlockSizes(check_shared_memory=1)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("page_dtype", [None, jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("group_size", [1, 4, 8, 32])
def test_defaults_fit(head_dim, q_dtype, page_dtype, group_size):
    BlockSizes().resolve(_shapes(head_dim, group_size), q_dtype, page_dtype or q_dtype)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # JAX >= 0.11 deprecates Pallas Triton
@pytest.mark.filterwarnings("ignore::UserWarning")  # triton's fp-fusion default notice
@pytest.mark.parametrize("case", kernel_compile.ci_subset(), ids=lambda c: c.name)
def test_compiles_for_sm90_within_the_estimate(case):
    pytest.importorskip("triton")
    results = kernel_compile.compile_case(case)
    assert [r.kernel for r in results] == ["decode", "prefill"]
    for r in results:
        assert 0 < r.registers <= 255
        assert r.spill_store_bytes == r.spill_load_bytes == 0, r  # the defaults never spill
        assert r.shared_bytes <= r.estimate_bytes <= SHARED_MEMORY_LIMIT_BYTES
