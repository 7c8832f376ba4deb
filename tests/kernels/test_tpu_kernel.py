"""The TPU (Mosaic) ragged paged attention kernel, run in the Pallas TPU interpreter on
the CPU, against the reference over the shared grid.

The interpreter fills uninitialised VMEM with NaN and raises on out-of-bounds reads,
so a kernel that reads a scratch slot it never wrote, or a page the block table does
not name for a live token, fails here. Each interpreted call costs a few seconds,
mostly compilation: the default run takes every grid point once with the default
block sizes and a few with small ones; the `slow` sweep takes all combinations.
"""

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import GRID, TOLERANCES, make_case, tolerance
from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # race detector's `races`
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from paxkv.pallas_kernels.contract import AttentionShapes
from paxkv.pallas_kernels.reference import ragged_paged_attention_reference as reference
from paxkv.pallas_kernels.tpu import BlockSizes, ragged_paged_attention_tpu
from paxkv.pallas_kernels.tpu import kernel as kernel_module
from paxkv.pallas_kernels.tpu import ragged_paged_attention as rpa_module
from paxkv.pallas_kernels.tpu.block_sizes import chip_info
from paxkv.pallas_kernels.tpu.kernel import core_item

INTERPRET = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")
POINTS = {p.name: p for p in GRID}
# Small blocks: several page blocks per item (double buffering), sequences split
# into several items, one KV head per step.
SMALL = BlockSizes(pages_per_block=2, queries_per_block=3, kv_heads_per_block=1)
DECODE = BlockSizes(decode=True)


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    # The interpreter keeps global state after a kernel raises; never let one test's
    # failure leak into the next.
    yield
    pltpu.reset_tpu_interpret_mode_state()


def _check(point, case, out, expected=None):
    if expected is None:
        expected = reference(*case.args(), **point.attention_kwargs(case))
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    expected = np.asarray(expected.astype(jnp.float32))
    assert np.all(np.isfinite(out)), "poisoned pages, scratch or padding leaked into the output"
    tol = tolerance(case.q.dtype, case.kv_pages.dtype)
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)
    # Padding rows are exactly zero.
    assert np.all(out[int(case.cu_q_lens[case.num_seqs[0]]) :] == 0)


def _run(fn, point, case, **kwargs):
    kwargs.setdefault("interpret", INTERPRET)
    return fn(*case.args(), **point.attention_kwargs(case), **kwargs)


@pytest.mark.parametrize("point", GRID, ids=lambda p: p.name)
def test_kernel_matches_reference(point):
    case = point.case(seed=0)
    _check(point, case, _run(ragged_paged_attention_tpu, point, case))


@pytest.mark.parametrize(
    "name",
    [
        "prefill-gqa2-d64-p32-window",
        "mixed-gqa8-d128-p16-softcap-window",
        "mixed-gqa2-d64-p8-int8",
        "long-mqa-d128-p16-int8-window",
        "prefill-gqa4-d64-p16-sinks-window",
        "mixed-gqa2-d128-p8-int8-softcap-window-sinks",
    ],
)
def test_small_blocks(name):
    point = POINTS[name]
    case = point.case(seed=1)
    _check(point, case, _run(ragged_paged_attention_tpu, point, case, block_sizes=SMALL))


@pytest.mark.parametrize(
    "name",
    [
        "decode-gqa2-d64-p32-int8-softcap",
        "decode-mqa-d128-p8-softcap",
        "mixed-gqa4-d128-p16-bf16",
        "decode-gqa8-d64-p16-sinks",
        "long-gqa4-d64-p32-sinks-window",
    ],
)
def test_decode_path(name):
    # Exact on any batch, prefill rows included; built for q_len == 1.
    point = POINTS[name]
    case = point.case(seed=2)
    _check(point, case, _run(ragged_paged_attention_tpu, point, case, block_sizes=DECODE))


@pytest.mark.parametrize(
    "name",
    [
        "mixed-gqa2-d64-p8-int8",
        "mixed-gqa8-d128-p16-softcap-window",
        "decode-mqa-d128-p8-softcap",
        "mixed-gqa4-d64-p16-bf16-sinks",
    ],
)
def test_several_items_per_step(name):
    # Three items a step (the step's last item starts the next step's first block;
    # padding items fill the last step), small blocks: items of several page blocks.
    point = POINTS[name]
    case = point.case(seed=4)
    three = dataclasses.replace(SMALL, items_per_step=3)
    _check(point, case, _run(ragged_paged_attention_tpu, point, case, block_sizes=three))


@pytest.mark.parametrize("items_per_step", [1, 3])
def test_no_race_on_two_cores(items_per_step):
    # Grid (2 cores, 2 head blocks, items / 2 / k): each core's items start the next
    # one's copies; the cores share nothing but the inputs.
    point = POINTS["mixed-gqa2-d64-p8-int8"]
    case = point.case(seed=3)
    params = pltpu.InterpretParams(
        detect_races=True, num_cores_or_threads=2, random_seed=7, uninitialized_memory="nan"
    )
    two_cores = dataclasses.replace(SMALL, num_cores=2, items_per_step=items_per_step)
    out = _run(ragged_paged_attention_tpu, point, case, block_sizes=two_cores, interpret=params)
    out = jax.block_until_ready(out)
    assert interpret_pallas_call.races is not None, "the race detector did not run"
    assert not interpret_pallas_call.races.races_found
    _check(point, case, out)


def test_two_short_decodes_go_to_both_cores():
    # Two live decodes in a batch padded to 8 sequences: item slots for 2 cores, and
    # each core's items (dealt round robin) hold one live decode.
    cu_q_lens = jnp.asarray([0, 1, 2, 2, 2, 2, 2, 2, 2], jnp.int32)
    items = rpa_module.num_work_items(8, 8, 1)
    _, _, rows, _ = rpa_module._work_items(cu_q_lens, jnp.asarray([2]), items, 1)
    live = {
        core: [w for w in range(items // 2) if rows[core_item(core, w, 2)] > 0] for core in (0, 1)
    }
    assert live == {0: [0], 1: [0]}


@pytest.mark.parametrize("page_dtype, copies", [(None, 64), (np.int8, 128)], ids=["bf16", "int8"])
def test_one_dma_per_page_for_k_and_v(monkeypatch, page_dtype, copies):
    # A decode over 1024 tokens at page size 16 (64 pages, one block): one copy per page
    # for its K and V together, and one more for its scales when quantized (with K and V
    # apart, before the `[P, Hkv, ps, 2 * D]` layout: 128 and 256). Counted as the
    # interpreter runs them.
    started = []

    class Counted:
        def __init__(self, copy):
            self.copy = copy

        def start(self):
            jax.debug.callback(lambda: started.append(1))
            self.copy.start()

        def wait(self):
            self.copy.wait()

    page_copy = kernel_module.page_copy
    monkeypatch.setattr(kernel_module, "page_copy", lambda *a, **k: Counted(page_copy(*a, **k)))
    rpa_module._ragged_paged_attention.clear_cache()  # retrace with the counting copies
    case = make_case(
        0, q_lens=(1,), kv_lens=(1024,), num_q_heads=2, num_kv_heads=1, head_dim=64,
        page_size=16, dtype=jnp.bfloat16, page_dtype=page_dtype, pad_seqs=0, pad_tokens=0,
    )  # fmt: skip
    out = ragged_paged_attention_tpu(
        *case.args(), sm_scale=case.sm_scale, **case.array_kwargs(),
        block_sizes=BlockSizes(64, 1, 1), interpret=INTERPRET,
    )  # fmt: skip
    jax.block_until_ready(out)
    rpa_module._ragged_paged_attention.clear_cache()
    assert len(started) == copies
    np.testing.assert_allclose(
        np.asarray(out, np.float32),
        np.asarray(reference(*case.args(), sm_scale=case.sm_scale, **case.array_kwargs()), np.float32),
        rtol=TOLERANCES[np.dtype(jnp.bfloat16)], atol=TOLERANCES[np.dtype(jnp.bfloat16)],
    )  # fmt: skip


def test_race_detector_sees_a_planted_race():
    # Guards the assertion above: two cores writing one output block is reported.
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + pl.program_id(0).astype(jnp.float32)

    block = pl.BlockSpec((8, 128), lambda i: (0, 0))
    racy = pl.pallas_call(
        kernel,
        grid=(2,),
        in_specs=[block],
        out_specs=block,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=(pltpu.PARALLEL,)),
        interpret=pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2),
    )
    jax.block_until_ready(racy(jnp.ones((8, 128), jnp.float32)))
    assert interpret_pallas_call.races.races_found


@pytest.mark.parametrize(
    "name", ["long-mqa-d128-p16-int8-window", "long-gqa4-d64-p32-sinks-window"]
)
def test_pages_outside_the_window_and_table_are_never_fetched(name):
    # Every block-table entry the kernel must not dereference is made out of range;
    # the interpreter raises on any out-of-bounds DMA. Under jit the shared value
    # checks (which would reject such a table) are skipped, as in a serving step.
    point = POINTS[name]
    case = point.case(seed=4)
    expected = reference(*case.args(), **point.attention_kwargs(case))
    ps, window = case.page_size, point.sliding_window
    tables = case.block_tables.copy()
    bad = case.kv_pages.shape[0] + 1000
    for s in range(tables.shape[0]):
        if s >= case.num_seqs[0]:
            tables[s] = bad
            continue
        kv_len = int(case.kv_lens[s])
        q_len = int(case.cu_q_lens[s + 1] - case.cu_q_lens[s])
        first_visible = max(0, kv_len - q_len - window + 1)
        pages = np.arange(tables.shape[1])
        tables[s, ((pages + 1) * ps <= first_visible) | (pages * ps >= kv_len)] = bad
    assert np.sum(tables == bad) > 100  # most of the long sequences' pages are skipped
    poisoned = dataclasses.replace(case, block_tables=tables)
    kwargs = point.attention_kwargs(case)
    fn = jax.jit(
        lambda *args: ragged_paged_attention_tpu(
            *args, **kwargs, block_sizes=SMALL, interpret=INTERPRET
        )
    )
    _check(point, case, fn(*poisoned.args()), expected)


def test_empty_sequences_and_no_live_sequences_give_zeros():
    case = make_case(
        5,
        q_lens=(0, 1, 0),
        kv_lens=(0, 9, 4),
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=64,
        page_size=8,
    )
    out = np.asarray(
        ragged_paged_attention_tpu(*case.args(), sm_scale=case.sm_scale, interpret=INTERPRET)
    )
    expected = np.asarray(reference(*case.args(), sm_scale=case.sm_scale))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert np.all(out[1:] == 0) and np.all(np.isfinite(out))
    args = list(case.args())
    args[5] = jnp.asarray([0], jnp.int32)  # num_seqs = 0: every row is padding
    out = np.asarray(ragged_paged_attention_tpu(*args, sm_scale=case.sm_scale, interpret=INTERPRET))
    assert np.all(out == 0)


def _valid_args(head_dim=64, dtype=np.float32):
    case = make_case(
        6,
        q_lens=(1, 3),
        kv_lens=(10, 3),
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=8,
        dtype=dtype,
    )
    return list(case.args()), case.sm_scale


def test_head_dim_must_be_supported():
    args, sm_scale = _valid_args(head_dim=96)
    with pytest.raises(ValueError, match=re.escape("head_dim=96 must be one of (64, 128, 256)")):
        ragged_paged_attention_tpu(*args, sm_scale=sm_scale, interpret=INTERPRET)


def test_shared_validation_runs_first():
    args, sm_scale = _valid_args()
    args[2] = args[2].at[1].set(2)  # kv_lens
    with pytest.raises(ValueError, match=re.escape("kv_len=2 is smaller than its q_len=3")):
        ragged_paged_attention_tpu(*args, sm_scale=sm_scale, interpret=INTERPRET)


def test_vmem_budget_is_checked_before_compiling(monkeypatch):
    def must_not_compile(*args, **kwargs):
        raise AssertionError("the kernel was built for an over-budget configuration")

    monkeypatch.setattr(rpa_module, "_ragged_paged_attention", must_not_compile)
    args, sm_scale = _valid_args()
    huge = BlockSizes(pages_per_block=4096, queries_per_block=256, kv_heads_per_block=2)
    with pytest.raises(
        ValueError, match=r"needs [\d.]+ MiB of VMEM .* budget is 12.00 MiB; shrink pages_per_block"
    ):
        ragged_paged_attention_tpu(*args, sm_scale=sm_scale, block_sizes=huge, interpret=INTERPRET)


def test_block_table_must_fit_smem():
    args, sm_scale = _valid_args()
    args[3] = jnp.pad(args[3], ((0, 0), (0, 200_000 - args[3].shape[1])))  # block_tables
    with pytest.raises(ValueError, match="bytes of SMEM but the budget is 786432"):
        ragged_paged_attention_tpu(*args, sm_scale=sm_scale, interpret=INTERPRET)


def test_bad_block_sizes():
    args, sm_scale = _valid_args()
    with pytest.raises(
        ValueError, match=re.escape("kv_heads_per_block=3 must divide num_kv_heads=2")
    ):
        ragged_paged_attention_tpu(
            *args, sm_scale=sm_scale, block_sizes=BlockSizes(2, 2, 3), interpret=INTERPRET
        )
    with pytest.raises(ValueError, match=re.escape("BlockSizes.pages_per_block=0")):
        BlockSizes(0, 2, 1)
    with pytest.raises(ValueError, match=re.escape("BlockSizes.items_per_step=0")):
        BlockSizes(items_per_step=0)


def test_float16_is_rejected_for_hardware_but_interpreted():
    args, sm_scale = _valid_args(dtype=np.float16)
    args[1] = args[1].astype(jnp.float16)  # kv_pages
    with pytest.raises(ValueError, match="float16 is not supported on TPU"):
        ragged_paged_attention_tpu(*args, sm_scale=sm_scale)
    out = ragged_paged_attention_tpu(*args, sm_scale=sm_scale, interpret=INTERPRET)
    expected = reference(*args, sm_scale=sm_scale)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(expected, np.float32), rtol=2e-3, atol=2e-3
    )


def test_defaults_fit_the_budget_for_a_large_model():
    shapes = AttentionShapes(
        num_tokens=8192,
        num_q_heads=64,
        num_kv_heads=8,
        head_dim=256,
        num_pages=4096,
        page_size=256,
        max_num_seqs=256,
        pages_per_seq=512,
        quantized=True,
    )
    chip = chip_info(interpret=True)
    for decode in (False, True):
        bs = BlockSizes(decode=decode).resolve(shapes, jnp.bfloat16, jnp.int8, chip=chip)
        assert bs.resolve(shapes, jnp.bfloat16, jnp.int8, chip=chip) == bs  # within budget
        assert bs.queries_per_block == (1 if decode else 16)


def test_under_user_jit_matches_eager():
    point = POINTS["mixed-gqa2-d64-p8-int8"]
    case = point.case(seed=8)
    kwargs = point.attention_kwargs(case)
    scales = {"kv_scales": kwargs.pop("kv_scales")}
    fn = jax.jit(lambda *a, **s: ragged_paged_attention_tpu(*a, **s, **kwargs, interpret=INTERPRET))
    np.testing.assert_array_equal(
        np.asarray(fn(*case.args(), **scales)),
        np.asarray(
            ragged_paged_attention_tpu(*case.args(), **kwargs, **scales, interpret=INTERPRET)
        ),
    )


SWEEP_BLOCKS = [
    BlockSizes(1, 1, 1),
    BlockSizes(2, 3, 1),
    BlockSizes(3, 5, 2),
    BlockSizes(8, 16, 1),
]


@pytest.mark.slow
@pytest.mark.parametrize("block_sizes", SWEEP_BLOCKS, ids=str)
@pytest.mark.parametrize("point", GRID, ids=lambda p: p.name)
def test_sweep_block_sizes(point, block_sizes):
    if point.num_kv_heads % block_sizes.kv_heads_per_block:
        block_sizes = dataclasses.replace(block_sizes, kv_heads_per_block=1)
    case = point.case(seed=9)
    _check(point, case, _run(ragged_paged_attention_tpu, point, case, block_sizes=block_sizes))


@pytest.mark.slow
@pytest.mark.parametrize("point", GRID, ids=lambda p: p.name)
def test_sweep_decode_path_and_races(point):
    case = point.case(seed=10)
    params = pltpu.InterpretParams(
        detect_races=True, num_cores_or_threads=2, random_seed=11, uninitialized_memory="nan"
    )
    out = jax.block_until_ready(
        _run(ragged_paged_attention_tpu, point, case, block_sizes=DECODE, interpret=params)
    )
    assert not interpret_pallas_call.races.races_found
    _check(point, case, out)


# Compiles the kernel with the real Mosaic compiler for TPU chips that are not
# attached (deviceless, through libtpu's compile-only client). Needs the libtpu that
# matches the installed jax (`jax[tpu]` pins it): importable, or installed with
# `pip install --target DIR libtpu==...` and DIR given as PAXKV_LIBTPU_DIR.
_DEVICELESS_PRELUDE = """
import re, sys
import jax, numpy as np, ml_dtypes
from jax.experimental import topologies
from paxkv.pallas_kernels.contract import attention_inputs
from paxkv.pallas_kernels.layout import SCALE_DTYPE, scale_lanes
from paxkv.pallas_kernels.tpu import BlockSizes
from paxkv.pallas_kernels.tpu.block_sizes import chip_info, vmem_bytes
from paxkv.pallas_kernels.tpu.ragged_paged_attention import _ragged_paged_attention

CONFIGS = [  # q, pages, page_size, D, Hq, Hkv, BlockSizes, soft_cap, window(, sinks)
    ("float32", "float32", 8, 64, 4, 4, BlockSizes(3, 16, 2), None, None),
    ("bfloat16", "bfloat16", 16, 128, 8, 2, BlockSizes(8, 16, 2), 30.0, 64),
    ("bfloat16", "bfloat16", 32, 64, 4, 4, BlockSizes(16, 1, 4), None, None),
    ("bfloat16", "int8", 16, 128, 8, 2, BlockSizes(4, 16, 1), 30.0, 64),
    ("float32", "float8_e4m3fn", 128, 256, 8, 1, BlockSizes(2, 8, 1), None, None),
    ("bfloat16", "float8_e5m2", 256, 128, 6, 2, BlockSizes(2, 5, 2), None, 300),
    # Work items dealt to two TensorCores (a megacore), decode and quantized prefill.
    ("bfloat16", "bfloat16", 16, 128, 8, 2, BlockSizes(8, 1, 2, True, 2), None, None),
    ("bfloat16", "int8", 16, 128, 8, 2, BlockSizes(4, 16, 1, False, 2), 30.0, 64),
    # One KV head per device (heads split over a mesh), pages of 64: scales [P, 1, 2, 128].
    ("bfloat16", "int8", 64, 128, 8, 1, BlockSizes(2, 1, 1, True), None, None),
] + [  # the defaults (BlockSizes() resolved for the shapes) at head_dim 128 and 256
    ("bfloat16", pages, 16, d, 8, 2, BlockSizes(), None, None)
    for pages in ("bfloat16", "int8", "float8_e4m3fn")
    for d in (128, 256)
]
SINK_CONFIGS = [  # attention sinks: gpt-oss-20b's heads (64 / 8, D 64, window 128) at the
    # defaults, decode with int8 pages and soft-cap, and f32 with two heads a block
    ("bfloat16", "bfloat16", 16, 64, 64, 8, BlockSizes(), None, 128, True),
    ("bfloat16", "int8", 16, 128, 8, 2, BlockSizes(decode=True), 30.0, 64, True),
    ("float32", "float32", 8, 64, 4, 4, BlockSizes(3, 16, 2), None, None, True),
]
dtype = lambda name: np.dtype(getattr(ml_dtypes, name, None) or name)


# `(mesh, args, fn(limit), estimate)` for one config on `chip`: `fn(limit)` is the kernel
# under that VMEM limit, with the defaults resolved as off a TPU (the fallback chip
# figures); `estimate` gets `vmem_bytes`'s parts once it is traced.
def build(chip, config):
    qd, pd, ps, d, hq, hkv, bs, cap, win, *sinks = config
    topo = topologies.get_topology_desc(topology_name=chip, platform="tpu")
    mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dtype(dt), sharding=sharding)
    t, s, p, pps = 40, 4, 64, 32
    quantized = pd in ("int8", "float8_e4m3fn", "float8_e5m2")
    args = [spec((t, hq, d), qd), spec((p, hkv, ps, 2 * d), pd),
            spec((s,), "int32"), spec((s, pps), "int32"), spec((s + 1,), "int32"),
            spec((1,), "int32")]
    scales = (p, hkv, 2, scale_lanes(ps, "tpu"))  # as a TPU cache lays them out
    args += [spec(scales, SCALE_DTYPE.name) if quantized else None]
    args += [spec((hq,), "float32") if sinks and sinks[0] else None]
    estimate = {}

    def fn(limit):
        def kernel(*a):
            inputs = attention_inputs(*a[:6], kv_scales=a[6], sinks=a[7], sm_scale=0.1,
                                      soft_cap=cap, sliding_window=win)
            resolved = bs.resolve(inputs.shapes, dtype(qd), dtype(pd), chip=chip_info(True))
            estimate.update(vmem_bytes(inputs.shapes, resolved, dtype(qd), dtype(pd)))
            estimate["block_sizes"] = resolved
            return _ragged_paged_attention(
                inputs, block_sizes=resolved, vmem_limit_bytes=limit, interpret=False)
        return kernel

    return mesh, args, fn, estimate


# The compiled HLO text (or the VMEM error's text when `limit` is too small), estimate.
def compile_under(chip, config, limit):
    mesh, args, fn, estimate = build(chip, config)
    try:
        with jax.sharding.set_mesh(mesh):
            return jax.jit(fn(limit)).lower(*args).compile().as_text(), estimate
    except Exception as e:  # Mosaic's "Scoped allocation with size ..." names the need
        if "vmem" not in str(e).lower():
            raise
        return str(e), estimate


# The size of the scoped VMEM allocation a too-small limit was refused for.
def scoped_bytes(error):
    m = re.search(r"Scoped allocation with size ([0-9.]+)([KMG]?)", error)
    return float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)]


SCRATCH = ("K/V page buffers", "scale buffers", "softmax state")
"""

_DEVICELESS_COMPILE = (
    _DEVICELESS_PRELUDE
    + """
chips = sys.argv[1:]
for i, chip in enumerate(chips):
    for config in CONFIGS + SINK_CONFIGS:
        qd, pd, ps, d, hq, hkv, bs, cap, win, *_ = config
        hlo, estimate = compile_under(chip, config, 32 * 2**20)
        # The pages reach the kernel in the layout XLA gives them: no relayout copy of the
        # cache before the call (head_dim 64 at `[.., ps, D]` had one). Their scales
        # too, unless their minor axis is under 128 lanes (page sizes under 64).
        copied = lambda shape: any(" copy(" in l and shape in l.split("copy(")[0]
                                   for l in hlo.splitlines())
        assert not copied(f"[64,{hkv},{ps},{2 * d}]")
        lanes = scale_lanes(ps, "tpu")
        if pd not in ("bfloat16", "float32"):
            assert copied(f"[64,{hkv},2,{lanes}]") == (lanes < 128)
        if i == 0:
            # The estimate's scratch buffers are what Mosaic allocates (VMEM tiling is the
            # same on every chip here): its error under a 4 KiB limit names the size.
            error, _ = compile_under(chip, config, 4096)
            scratch = sum(estimate[k] for k in SCRATCH)
            assert abs(scratch - scoped_bytes(error)) <= 0.01 * scratch, (config, estimate, error[-300:])
        print("compiled", chip, *config, estimate["block_sizes"], flush=True)
"""
)

# The least VMEM limit Mosaic compiles each config under (bisected to 4 KiB), against the
# whole estimate. Slow (about a dozen compiles per config); run on demand.
_VMEM_MINIMUM = (
    _DEVICELESS_PRELUDE
    + """
CONFIGS += [(q, pd, 16, d, 8 * h, h, BlockSizes(decode=True), None, None)
            for q, pd, d, h in [("bfloat16", "bfloat16", 64, 8), ("bfloat16", "int8", 64, 8),
                                 ("float32", "float32", 128, 2), ("float32", "int8", 128, 2)]]
CONFIGS += [("float32", pd, 16, 128, 8, 2, BlockSizes(), None, None) for pd in ("float32", "int8")]
chip = sys.argv[1]
for config in CONFIGS:
    lo, hi = 4096, 64 * 2**20
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        text, estimate = compile_under(chip, config, mid)
        lo, hi = (lo, mid) if "HloModule" in text else (mid, hi)
    total = sum(v for k, v in estimate.items() if k != "block_sizes")
    print(f"minimum {hi} estimate {total}", *config[:6], estimate["block_sizes"], flush=True)
"""
)


def _libtpu_dir():
    if os.environ.get("PAXKV_LIBTPU_DIR"):
        return os.environ["PAXKV_LIBTPU_DIR"]
    spec = importlib.util.find_spec("libtpu")
    return None if spec is None else os.path.dirname(os.path.dirname(spec.origin))


def _deviceless_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_libtpu_dir(), env.get("PYTHONPATH")]))
    # A single-host slice, so libtpu needs no metadata server.
    env.update(
        TPU_ACCELERATOR_TYPE="v5litepod-4", TPU_WORKER_HOSTNAMES="localhost", TPU_SKIP_MDS_QUERY="1"
    )
    return env


@pytest.mark.slow
@pytest.mark.skipif(_libtpu_dir() is None, reason="needs libtpu for a deviceless Mosaic compile")
def test_compiles_for_tpu_deviceless():
    # The oldest and newest generations paxkv targets (v6e and v5p: `-m slow -k
    # every_generation`).
    _compile_deviceless(["v5e:2x2", "tpu7x:2x2x1"], timeout_s=900)


@pytest.mark.slow
@pytest.mark.skipif(_libtpu_dir() is None, reason="needs libtpu for a deviceless Mosaic compile")
def test_compiles_for_every_generation_deviceless():
    _compile_deviceless(["v5e:2x2", "v6e:2x2", "v5p:2x2x1", "tpu7x:2x2x1"], timeout_s=1800)


def _compile_deviceless(chips: list[str], timeout_s: int) -> None:
    """Every config compiles for each of `chips` (`_DEVICELESS_COMPILE`)."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_DEVICELESS_COMPILE), *chips],
        env=_deviceless_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled") == 18 * len(chips)


@pytest.mark.slow
@pytest.mark.skipif(_libtpu_dir() is None, reason="needs libtpu for a deviceless Mosaic compile")
def test_vmem_estimate_covers_mosaics_minimum():
    # `vmem_bytes` against the least limit Mosaic compiles under (v5e): never under it,
    # and at most 25% over it where it is at least 900 KiB (the block sizes the budget
    # decides). Smaller configs can be far over: Mosaic keeps their temporaries in the
    # 256 KiB of vector registers.
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_VMEM_MINIMUM), "v5e:2x2"],
        env=_deviceless_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("minimum")]
    assert len(rows) == 21, result.stdout
    for row in rows:
        print(" ".join(row))  # the README's table: `-s` shows them
        minimum, estimate = int(row[1]), int(row[3])
        assert estimate >= minimum, row
        if minimum >= 900 * 1024:
            assert estimate <= 1.25 * minimum, row
