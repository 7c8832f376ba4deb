"""The GPU (Pallas Triton) ragged paged attention kernel against the reference.

Everything runs in the Pallas interpreter on the CPU; `test_lowers_to_triton` also lowers
every grid point for CUDA and verifies the Triton IR, so lowering problems show up here
rather than on the GPU.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import GRID, TOLERANCES, GridPoint, make_case, tolerance

from paxkv.pallas_kernels.contract import AttentionShapes, attention_inputs, compute_dtype
from paxkv.pallas_kernels.gpu import BlockSizes, ragged_paged_attention_gpu
from paxkv.pallas_kernels.gpu.block_sizes import TARGET_DECODE_PROGRAMS
from paxkv.pallas_kernels.gpu.jax_compat import triton_kernels_in, triton_lowering_target
from paxkv.pallas_kernels.gpu.kernel import KernelConfig, interior_blocks, visible_range
from paxkv.pallas_kernels.gpu.ragged_paged_attention import (
    combine_splits,
    decode_items,
    decode_plan,
)
from paxkv.pallas_kernels.reference import ragged_paged_attention_reference as reference

# float16 is not in the shared table: 4x its output rounding (2^-11), as bf16's 2e-2 is of
# bf16's 2^-8 rounding.
_TOLERANCES = {**TOLERANCES, np.dtype(np.float16): 2e-3}
_POINTS = {p.name: p for p in GRID}


def kernel(*args, **kwargs):
    return ragged_paged_attention_gpu(*args, **kwargs, interpret=True)


@functools.cache
def _expected(point: GridPoint, seed: int) -> np.ndarray:
    case = point.case(seed)
    out = reference(*case.args(), **point.attention_kwargs(case))
    return np.asarray(out.astype(jnp.float32))


def _check(point: GridPoint, seed: int = 0, **kwargs) -> np.ndarray:
    case = point.case(seed)
    out = np.asarray(
        kernel(*case.args(), **point.attention_kwargs(case), **kwargs).astype(jnp.float32)
    )
    assert np.all(np.isfinite(out)), "poisoned pages or padding leaked into the output"
    tol = tolerance(case.q.dtype, case.kv_pages.dtype, _TOLERANCES)
    np.testing.assert_allclose(out, _expected(point, seed), rtol=tol, atol=tol)
    assert np.all(out[int(case.cu_q_lens[case.num_seqs[0]]) :] == 0), (
        "padding rows must be exact zeros"
    )
    return out


@pytest.mark.parametrize("point", GRID, ids=lambda p: p.name)
def test_matches_reference_over_grid(point):
    _check(point)


# Shapes the shared grid does not reach: a group of 3 (padded to 4), head_dim 256, pages
# larger than a KV block, e5m2 and float16 pages, q and pages of different dtypes, and
# prefill tiles with mask-free interior KV blocks between a window edge and the causal
# edge (bf16 tiles of 64 tokens, a window of 200).
EXTRA = [
    GridPoint("mixed-gqa3-d256-p64-e5m2-window", (1, 3, 70), (90, 3, 200), 6, 2, 256, 64,
              page_dtype="float8_e5m2", sliding_window=100),
    GridPoint("mixed-gqa6-d128-p128-f16-softcap", (1, 40, 1), (300, 40, 129), 12, 2, 128, 128,
              dtype="float16", soft_cap=15.0),
    GridPoint("mixed-mha-d64-p8-bf16q-f32pages", (1, 9, 17), (33, 9, 40), 2, 2, 64, 8,
              dtype="bfloat16", page_dtype="float32"),
    GridPoint("mixed-gqa2-d128-p16-bf16-softcap-window200", (1, 300, 130), (700, 600, 130), 4,
              2, 128, 16, dtype="bfloat16", soft_cap=20.0, sliding_window=200),
]  # fmt: skip


@pytest.mark.parametrize("point", EXTRA, ids=lambda p: p.name)
def test_matches_reference_beyond_grid(point):
    _check(point)


@pytest.mark.parametrize(
    "block_sizes",
    [
        # KV blocks smaller than a page (a slice of one page per step) and 2-token tiles.
        BlockSizes(decode_kv_block=16, prefill_kv_block=16, prefill_block_m=16),
        # KV blocks of many pages, wide prefill tiles, more warps and stages.
        BlockSizes(
            decode_kv_block=256,
            prefill_kv_block=128,
            prefill_block_m=128,
            decode_num_warps=8,
            prefill_num_warps=8,
            num_stages=3,
        ),
    ],
    ids=["small-blocks", "large-blocks"],
)
@pytest.mark.parametrize(
    "name",
    [
        "mixed-gqa8-d128-p16-softcap-window",
        "mixed-gqa2-d64-p8-int8",
        "mixed-gqa2-d128-p8-int8-softcap-window-sinks",
    ],
)
def test_block_sizes_do_not_change_the_result(name, block_sizes):
    _check(_POINTS[name], block_sizes=block_sizes)


def test_interior_and_edge_blocks_with_small_kv_blocks():
    # KV blocks of 16 tokens: many mask-free blocks per tile, with window and soft cap.
    _check(EXTRA[3], block_sizes=BlockSizes(decode_kv_block=16, prefill_kv_block=16))


@pytest.mark.parametrize(
    "name, splits",
    # decode-mha has sequences of 1 to 3 KV blocks, so most of its 8 splits have none;
    # long-gqa2's 66 blocks split unevenly in 5. With sinks, only the share holding a
    # sequence's first KV block counts its sink (the window skips the first pages).
    [
        ("decode-mha-d64-p16", 8),
        ("long-gqa2-d64-p32", 5),
        ("decode-gqa8-d64-p16-sinks", 8),
        ("long-gqa4-d64-p32-sinks-window", 5),
    ],
)
def test_split_counts_agree(name, splits):
    point = _POINTS[name]
    one, many = (
        _check(point, block_sizes=BlockSizes(decode_kv_block=32, num_splits=k)) for k in (1, splits)
    )
    np.testing.assert_allclose(many, one, rtol=2e-6, atol=2e-6)


def _shapes(head_dim, max_num_seqs, num_kv_heads, pages_per_seq=2048, quantized=False):
    return AttentionShapes(
        num_tokens=max_num_seqs, num_q_heads=4 * num_kv_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, num_pages=10_000, page_size=16, max_num_seqs=max_num_seqs,
        pages_per_seq=pages_per_seq, quantized=quantized,
    )  # fmt: skip


def test_default_block_sizes_fit_the_call():
    def resolved(*args, dtype=jnp.bfloat16, page_dtype=None, **kwargs):
        shapes = _shapes(*args, quantized=page_dtype is not None)
        r = BlockSizes(**kwargs).resolve(shapes, dtype, page_dtype or dtype)
        return r.decode_kv_block, r.prefill_kv_block, r.num_splits

    # num_splits caps the splits of one sequence; the plan picks them from the live work.
    assert resolved(128, 1, 8) == (64, 64, 64)
    assert resolved(128, 256, 8) == (64, 64, 64)
    assert resolved(256, 4, 2, dtype=jnp.float32) == (32, 32, 64)  # f32 tiles: smaller blocks
    assert resolved(128, 4, 2, page_dtype=jnp.int8) == (32, 32, 64)  # dequantized tiles
    assert resolved(64, 4, 2, page_dtype=jnp.int8) == (64, 64, 64)
    assert resolved(128, 1, 1, decode_kv_block=16, num_splits=3) == (16, 64, 3)
    small = _shapes(128, 1, 1, pages_per_seq=4)
    assert BlockSizes().resolve(small, jnp.bfloat16, jnp.bfloat16).num_splits == 1


@pytest.mark.parametrize(
    "head_dim, dtype, page_dtype, tiles",
    [
        # (prefill_block_m, decode warps, prefill warps): 128-row prefill tiles with 8
        # warps for 16-bit dots up to head_dim 128; 64 rows (8 warps) at head_dim 256.
        (64, jnp.bfloat16, None, (128, 4, 8)),
        (128, jnp.bfloat16, None, (128, 4, 8)),
        (256, jnp.bfloat16, None, (64, 8, 8)),
        (128, jnp.float32, None, (64, 4, 4)),
        # Quantized pages: 8 decode warps for the dequantized K/V blocks of 32 x 128
        # values (64 x 64, 32 x 128, 16 x 256): 4 warps spill at head_dim 128, and at
        # 256 under float32 queries.
        (64, jnp.bfloat16, jnp.int8, (128, 8, 8)),
        (128, jnp.bfloat16, jnp.int8, (128, 8, 8)),
        (128, jnp.bfloat16, jnp.float8_e4m3fn, (128, 8, 8)),
        (256, jnp.bfloat16, jnp.int8, (64, 8, 8)),
    ],
)
def test_default_tiles_and_warps(head_dim, dtype, page_dtype, tiles):
    shapes = _shapes(head_dim, 8, 2, quantized=page_dtype is not None)
    r = BlockSizes().resolve(shapes, dtype, page_dtype or dtype)
    assert (r.prefill_block_m, r.decode_num_warps, r.prefill_num_warps) == tiles


def _decode_inputs(kv_lens, max_num_seqs, num_kv_heads=2, q_lens=None, page_size=16):
    """Length arrays of a batch padded to max_num_seqs (padding rows hold junk lengths)."""
    n = len(kv_lens)
    q_lens = np.ones(n, np.int32) if q_lens is None else np.asarray(q_lens, np.int32)
    pages_per_seq = -(-max(kv_lens) // page_size)
    cu_q_lens = np.full(max_num_seqs + 1, q_lens.sum(), np.int32)
    cu_q_lens[: n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    lens = np.full(max_num_seqs, pages_per_seq * page_size, np.int32)
    lens[:n] = kv_lens
    return attention_inputs(
        jnp.zeros((int(q_lens.sum()), 4 * num_kv_heads, 64), jnp.bfloat16),
        jnp.zeros((8, num_kv_heads, page_size, 2 * 64), jnp.bfloat16),
        jnp.asarray(lens),
        jnp.ones((max_num_seqs, pages_per_seq), jnp.int32),
        jnp.asarray(cu_q_lens),
        jnp.asarray([n], jnp.int32),
        sm_scale=0.125,
    )


def _plan(inputs, num_splits=64, kv_block=64):
    cfg = KernelConfig(
        num_q_heads=inputs.shapes.num_q_heads, group_size=4, group_padded=4,
        page_size=inputs.shapes.page_size, kv_block=kv_block, sm_scale=0.125, soft_cap=None,
        sliding_window=None, compute_dtype=jnp.dtype(jnp.bfloat16), quantized=False,
    )  # fmt: skip
    item_seq, lo, hi, split = (np.asarray(x) for x in decode_plan(inputs, cfg, num_splits))
    assert len(item_seq) == decode_items(inputs.shapes, num_splits)
    return item_seq, lo, hi, split


def _shares(item_seq, lo, hi, seq):
    return [(int(a), int(b)) for a, b in zip(lo[item_seq == seq], hi[item_seq == seq], strict=True)]


def test_split_plan_follows_the_live_decodes_not_the_padding():
    # One live sequence of 4096 tokens (64 blocks) in a batch padded to 256 sequences:
    # the static split count from the padded capacity gave it 1 program per KV head;
    # the plan cuts it into TARGET_DECODE_PROGRAMS / Hkv shares of 1 block each (at most
    # num_splits), whatever the padding rows' lengths.
    item_seq, lo, hi, split = _plan(_decode_inputs([4096], 256))
    assert TARGET_DECODE_PROGRAMS // 2 >= 64
    assert _shares(item_seq, lo, hi, 0) == [(b, b + 1) for b in range(64)]
    assert split.tolist() == [True] + [False] * 255
    assert np.all(item_seq[64:] == -1)
    # num_splits caps the shares per sequence.
    item_seq, lo, hi, _ = _plan(_decode_inputs([4096], 256), num_splits=5)
    assert _shares(item_seq, lo, hi, 0) == [(0, 13), (13, 26), (26, 39), (39, 52), (52, 64)]


def test_split_plan_leaves_a_full_batch_whole():
    # 256 live decodes of 32 blocks: 8192 blocks already make about 30 waves; each
    # sequence is one item, written by the kernel directly.
    item_seq, lo, hi, split = _plan(_decode_inputs([2048] * 256, 256))
    assert not split.any()
    assert item_seq[:256].tolist() == list(range(256)) and np.all(item_seq[256:] == -1)
    assert np.all(lo[:256] == 0) and np.all(hi[:256] == 32)


def test_split_plan_mixed_lengths_and_prefills():
    # Chunks of cdiv(total, target) = 2 blocks, or 3 for the 192-block sequence (at most
    # 64 shares); the 1-block sequence stays whole, and the prefill chunk (q_len 5) and
    # the empty sequence get no item.
    kv_lens, q_lens = [64 * 64 * 3, 5, 64, 0, 640], [1, 5, 1, 0, 1]
    item_seq, lo, hi, split = _plan(_decode_inputs(kv_lens, 6, q_lens=q_lens), num_splits=64)
    assert -(-(192 + 1 + 10) // (TARGET_DECODE_PROGRAMS // 2)) == 2
    assert _shares(item_seq, lo, hi, 0) == [(b, b + 3) for b in range(0, 192, 3)]
    assert _shares(item_seq, lo, hi, 2) == [(0, 1)]
    assert _shares(item_seq, lo, hi, 4) == [(b, b + 2) for b in range(0, 10, 2)]
    assert _shares(item_seq, lo, hi, 1) == [] and _shares(item_seq, lo, hi, 3) == []
    assert split.tolist() == [True, False, False, False, True, False]


@pytest.mark.parametrize("sinks", [False, True])
def test_one_live_decode_in_a_padded_batch_matches_the_reference(sinks):
    # 1 live decode (with window and soft cap) among 40 padded sequences whose lengths
    # and tables are junk: split into one share per KV block, merged, and nothing read
    # from the padding; with sinks, counted once.
    case = make_case(0, q_lens=(1,), kv_lens=(700,), num_q_heads=4, num_kv_heads=2,
                     head_dim=64, page_size=16, pad_seqs=39, sinks=sinks)  # fmt: skip
    kwargs = dict(sm_scale=case.sm_scale, soft_cap=20.0, sliding_window=300, **case.array_kwargs())
    out = np.asarray(kernel(*case.args(), **kwargs, decode_only=True))
    assert np.all(np.isfinite(out)) and np.all(out[1:] == 0)
    expected = np.asarray(reference(*case.args(), **kwargs))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_combine_splits_matches_one_softmax():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 12)).astype(np.float32) * 4  # [rows, kv]
    values = rng.standard_normal((12, 8)).astype(np.float32)
    # Split the kv axis unevenly, with an empty split and a row that sees nothing.
    visible = np.ones((2, 12), bool)
    visible[1] = False
    bounds = [(0, 5), (5, 5), (5, 12)]
    accs, maxes, denoms = [], [], []
    for lo, hi in bounds:
        s = np.where(visible[:, lo:hi], logits[:, lo:hi], -np.inf)
        row_max = s.max(axis=1, initial=-np.inf)
        p = np.where(
            visible[:, lo:hi], np.exp(s - np.where(np.isfinite(row_max), row_max, 0)[:, None]), 0
        )
        accs.append(p @ values[lo:hi])
        maxes.append(row_max)
        denoms.append(p.sum(axis=1))
    # The shares of segment 1, after a share of segment 0 and before two shares no
    # segment owns (-1 and past the end), whose NaN must not be read.
    nan_acc, nan_row = np.full((2, 8), np.nan, np.float32), np.full(2, np.nan, np.float32)
    accs = [accs[0] * 3, *accs, nan_acc, nan_acc]
    maxes = [maxes[0], *maxes, nan_row, nan_row]
    denoms = [denoms[0], *denoms, nan_row, nan_row]
    segment = jnp.asarray([0, 1, 1, 1, -1, 3], jnp.int32)
    out = np.asarray(
        combine_splits(
            *(jnp.asarray(np.stack(x)) for x in (accs, maxes, denoms)), segment, num_segments=3
        )
    )
    weights = np.exp(logits[0] - logits[0].max())
    np.testing.assert_allclose(out[1, 0], weights @ values / weights.sum(), rtol=1e-6)
    assert np.all(out[1, 1] == 0)
    np.testing.assert_allclose(out[0, 0], 3 * accs[1][0] / denoms[1][0], rtol=1e-6)
    assert np.all(out[0, 1] == 0)
    assert np.all(out[2] == 0)  # no share


def test_decode_only_hint():
    point = _POINTS["decode-gqa2-d64-p32-int8-softcap"]
    out = _check(point, decode_only=True)
    np.testing.assert_array_equal(out, _check(point))
    case = _POINTS["mixed-gqa2-d64-p8-int8"].case(0)
    with pytest.raises(ValueError, match=re.escape("decode_only=True but sequence 2 has q_len=5")):
        kernel(
            *case.args(),
            **_POINTS["mixed-gqa2-d64-p8-int8"].attention_kwargs(case),
            decode_only=True,
        )


def test_poisoned_and_garbage_entries_do_not_change_output():
    point = _POINTS["mixed-gqa8-d64-p16-fp8-window"]
    case = point.case(seed=2)
    poisoned = np.asarray(kernel(*case.args(), **point.attention_kwargs(case)))

    def clean(x):
        y = np.asarray(x, np.float32)
        return np.where(np.isnan(y), 123.0, y).astype(x.dtype)

    # Finite garbage in place of NaN, and block-table entries past each sequence's pages
    # that name no page at all: neither may be read.
    tables = case.block_tables.copy()
    needed = -(-case.kv_lens // case.page_size)
    for s in range(tables.shape[0]):
        if s >= case.num_seqs[0]:
            tables[s] = 10**6
        tables[s, needed[s] :] = -7
    cleaned = dataclasses.replace(
        case,
        q=clean(case.q),
        kv_pages=clean(case.kv_pages),
        kv_scales=clean(case.kv_scales),
        block_tables=tables,
    )
    out = np.asarray(kernel(*cleaned.args(), **point.attention_kwargs(cleaned)))
    assert np.all(np.isfinite(poisoned))
    np.testing.assert_array_equal(poisoned, out)


def test_empty_sequences_and_no_live_sequences_give_zeros():
    case = make_case(
        3,
        q_lens=(0, 1, 4),
        kv_lens=(0, 9, 4),
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=64,
        page_size=8,
    )
    out = np.asarray(kernel(*case.args(), sm_scale=case.sm_scale))
    expected = np.asarray(reference(*case.args(), sm_scale=case.sm_scale))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert np.all(out[5:] == 0)
    args = list(case.args())
    args[5] = jnp.asarray([0], jnp.int32)  # num_seqs = 0: every row is padding
    assert np.all(np.asarray(kernel(*args, sm_scale=case.sm_scale)) == 0)


def test_under_user_jit():
    point = _POINTS["mixed-gqa2-d64-p8-int8"]
    case = point.case(seed=0)
    kwargs = point.attention_kwargs(case)
    scales = {"kv_scales": kwargs.pop("kv_scales")}
    fn = jax.jit(lambda *a, **s: kernel(*a, **s, **kwargs))
    tol = tolerance(case.q.dtype, case.kv_pages.dtype, _TOLERANCES)
    np.testing.assert_allclose(
        np.asarray(fn(*case.args(), **scales)), _expected(point, 0), rtol=tol, atol=tol
    )


@pytest.mark.parametrize(
    "window, kv_block, page_size",
    [(None, 64, 16), (1, 64, 16), (40, 64, 16), (40, 16, 64), (300, 128, 8), (5, 16, 16)],
)
def test_window_loop_starts_at_first_visible_page(window, kv_block, page_size):
    cfg = KernelConfig(
        num_q_heads=1,
        group_size=1,
        group_padded=1,
        page_size=page_size,
        kv_block=kv_block,
        sm_scale=1.0,
        soft_cap=None,
        sliding_window=window,
        compute_dtype=jnp.dtype(jnp.float32),
        quantized=False,
    )
    for first_pos, last_pos in [(0, 0), (7, 7), (100, 100), (100, 131), (1000, 1063)]:
        lo, hi, start, num_blocks = (
            int(x) for x in visible_range(jnp.int32(first_pos), jnp.int32(last_pos), cfg)
        )
        assert (lo, hi) == (0 if window is None else max(0, first_pos - window + 1), last_pos)
        assert start // page_size == lo // page_size, "the loop must start in the page holding lo"
        assert start <= lo and start % min(kv_block, page_size) == 0
        assert start + (num_blocks - 1) * kv_block <= hi < start + num_blocks * kv_block

        # Interior blocks: exactly those whose every position every row sees.
        full_lo, full_hi = (
            int(x)
            for x in interior_blocks(
                jnp.int32(first_pos), jnp.int32(last_pos), jnp.int32(start),
                jnp.int32(num_blocks), cfg,
            )
        )  # fmt: skip
        rows = np.arange(first_pos, last_pos + 1)[:, None]
        for block in range(num_blocks):
            j = start + block * kv_block + np.arange(kv_block)[None, :]
            seen = (j <= rows) & (window is None or j > rows - window)
            assert (full_lo <= block < full_hi) == bool(seen.all()), (first_pos, last_pos, block)


def _valid_args():
    case = make_case(
        5, q_lens=(1, 3), kv_lens=(10, 3), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8
    )
    return list(case.args()), case.sm_scale


def _with_head_dim(args, head_dim):
    args[0] = jnp.zeros((*args[0].shape[:2], head_dim))
    args[1] = jnp.zeros((*args[1].shape[:3], 2 * head_dim))


@pytest.mark.parametrize(
    "mutate, kwargs, message",
    [
        (lambda a: _with_head_dim(a, 96), {}, "head_dim=96 must be one of (64, 128, 256)"),
        (lambda a: _with_head_dim(a, 32), {}, "head_dim=32"),
        (None, {"block_sizes": dict(decode_kv_block=48)}, "BlockSizes.decode_kv_block=48"),
        (None, {"block_sizes": dict(prefill_kv_block=8)}, "BlockSizes.prefill_kv_block=8"),
        (
            None,
            {"block_sizes": dict(prefill_kv_block=1024)},
            "BlockSizes.prefill_kv_block=1024",
        ),
        (None, {"block_sizes": dict(prefill_block_m=8)}, "BlockSizes.prefill_block_m=8"),
        (None, {"block_sizes": dict(num_splits=0)}, "BlockSizes.num_splits=0"),
        (None, {"block_sizes": dict(decode_num_warps=3)}, "BlockSizes.decode_num_warps=3"),
        (None, {"block_sizes": dict(num_stages=0)}, "BlockSizes.num_stages=0"),
        (None, {"block_sizes": (64, 64)}, "block_sizes=(64, 64) must be a BlockSizes"),
        # The shared contract is checked first.
        (lambda a: a.__setitem__(1, a[1][..., 1:]), {}, "kv_pages.shape[3]"),
        (lambda a: a.__setitem__(3, a[3][:, :1]), {}, "block_tables too narrow"),
    ],
)
def test_bad_input_names_the_argument(mutate, kwargs, message):
    args, sm_scale = _valid_args()
    if mutate is not None:
        mutate(args)
    with pytest.raises(ValueError, match=re.escape(message)):
        if isinstance(kwargs.get("block_sizes"), dict):  # BlockSizes validate on construction
            kwargs = {"block_sizes": BlockSizes(**kwargs["block_sizes"])}
        kernel(*args, sm_scale=sm_scale, **kwargs)


LOWERING_VARIANTS = [(p, None) for p in GRID + EXTRA] + [
    (_POINTS["mixed-gqa8-d128-p16-softcap-window"], BlockSizes(decode_kv_block=16, num_splits=4)),
    (_POINTS["mixed-gqa4-d128-p16-bf16"], BlockSizes(decode_kv_block=256, prefill_block_m=128)),
    (EXTRA[0], BlockSizes(prefill_kv_block=16, prefill_block_m=16)),
]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # JAX >= 0.11 deprecates Pallas Triton
@pytest.mark.parametrize(
    "point, block_sizes",
    LOWERING_VARIANTS,
    ids=[p.name + ("" if b is None else "-tuned") for p, b in LOWERING_VARIANTS],
)
def test_lowers_to_triton(point, block_sizes):
    case = point.case(0)
    kwargs = point.attention_kwargs(case)
    if block_sizes is not None:
        kwargs["block_sizes"] = block_sizes
    scales = {k: kwargs.pop(k) for k in ("kv_scales",) if k in kwargs}
    fn = jax.jit(lambda *a, **s: ragged_paged_attention_gpu(*a, **s, **kwargs))
    args = case.args()  # made outside: no concrete array may be created under the abstract mesh
    with triton_lowering_target("NVIDIA H200"):
        lowered = fn.trace(*args, **scales).lower(lowering_platforms=("cuda",))
    modules = triton_kernels_in(lowered)
    assert [re.search(r"tt.func public @(\w+)", m).group(1) for m in modules] == [
        "ragged_paged_attention_decode",
        "ragged_paged_attention_prefill",
    ]
    for module in modules:
        assert "tt.dot" in module
        if compute_dtype(case.q.dtype, case.kv_pages.dtype) == np.float32:  # never TF32
            assert "inputPrecision = tf32" not in module


def _random_point(rng, i: int) -> GridPoint:
    num_kv_heads = int(rng.choice([1, 2, 4]))
    group = int(rng.choice([1, 2, 3, 4, 5, 8, 16]))
    page_size = int(rng.choice([8, 16, 32, 64, 128]))
    n = int(rng.integers(1, 5))
    kv_lens = rng.integers(1, 6 * page_size, size=n)
    q_lens = [int(rng.choice([1, rng.integers(1, k + 1)])) for k in kv_lens]
    dtype, page_dtype = [
        ("float32", None),
        ("bfloat16", None),
        ("float16", None),
        ("float32", "int8"),
        ("bfloat16", "int8"),
        ("bfloat16", "float8_e4m3fn"),
        ("float32", "float8_e5m2"),
    ][int(rng.integers(7))]
    return GridPoint(
        f"random-{i}",
        tuple(q_lens),
        tuple(int(k) for k in kv_lens),
        group * num_kv_heads,
        num_kv_heads,
        int(rng.choice([64, 128, 256])),
        page_size,
        dtype=dtype,
        page_dtype=page_dtype,
        soft_cap=float(rng.choice([0, 10.0])) or None,
        sliding_window=int(rng.choice([0, 1, 13, 2 * page_size + 3])) or None,
    )


@pytest.mark.slow
@pytest.mark.parametrize("i", range(40))
def test_random_sweep(i):
    rng = np.random.default_rng(1000 + i)
    point = _random_point(rng, i)
    block_sizes = BlockSizes(
        decode_kv_block=int(rng.choice([16, 64, 128])),
        num_splits=int(rng.choice([1, 2, 5])),
        prefill_block_m=int(rng.choice([16, 64])),
        prefill_kv_block=int(rng.choice([16, 32, 128])),
    )
    _check(point, seed=i, block_sizes=block_sizes)
