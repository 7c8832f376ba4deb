"""The reference oracle against an independent float64 loop and hand-computed values."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import GRID, TOLERANCES, make_case, naive_attention

from paxkv.pallas_kernels.kv_write import pack_kv_pages
from paxkv.pallas_kernels.reference import ragged_paged_attention_reference as reference


def _i32(*xs):
    return jnp.asarray(xs, jnp.int32)


@pytest.mark.parametrize("point", GRID, ids=lambda p: p.name)
def test_reference_matches_naive_float64_loop(point):
    case = point.case(seed=1)
    out = reference(*case.args(), **point.attention_kwargs(case))
    expected = naive_attention(case, soft_cap=point.soft_cap, sliding_window=point.sliding_window)
    out = np.asarray(out.astype(jnp.float32))
    assert np.all(np.isfinite(out)), "poisoned pages or padding leaked into the output"
    tol = TOLERANCES[np.dtype(case.q.dtype)]
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)
    # Padding rows are exactly zero.
    assert np.all(out[int(case.cu_q_lens[case.num_seqs[0]]) :] == 0)


def test_hand_computed_two_tokens():
    # One sequence, one head, D=2, page_size 8; kv = [k0, k1] in page 3, rows 0 and 1,
    # each row a key then a value. logits of row 1 are [0, ln 3] -> weights [1/4, 3/4].
    q = jnp.array([[[1.0, 0.0]], [[1.0, 0.0]]])  # [T=2, Hq=1, D=2]
    kv = jnp.full((4, 1, 8, 4), jnp.nan)
    kv = kv.at[3, 0, 0].set([0.0, 0.0, 4.0, 0.0]).at[3, 0, 1].set([np.log(3.0), 0.0, 0.0, 8.0])
    args = (q, kv, _i32(2), _i32([3]), _i32(0, 2), _i32(1))
    out = reference(*args, sm_scale=1.0)
    # Row 0 is causal: it sees only k0.
    np.testing.assert_allclose(out[:, 0], [[4.0, 0.0], [1.0, 6.0]], rtol=1e-6)
    # A window of 1: each row sees only itself.
    out = reference(*args, sm_scale=1.0, sliding_window=1)
    np.testing.assert_allclose(out[:, 0], [[4.0, 0.0], [0.0, 8.0]], rtol=1e-6)
    # Soft-cap c: logits become [0, c * tanh(ln 3 / c)].
    c = 0.5
    w1 = 1.0 / (1.0 + np.exp(-c * np.tanh(np.log(3.0) / c)))
    out = reference(*args, sm_scale=1.0, soft_cap=c)
    np.testing.assert_allclose(out[1, 0], [4.0 * (1 - w1), 8.0 * w1], rtol=1e-6)
    # Decode of the second token alone (q_len 1, kv_len 2) matches row 1 of the prefill.
    out = reference(q[1:], kv, _i32(2), _i32([3]), _i32(0, 1), _i32(1), sm_scale=1.0)
    np.testing.assert_allclose(out[0, 0], [1.0, 6.0], rtol=1e-6)


def test_hand_computed_sinks():
    # The two-token case above with a sink per head: row 1's logits [0, ln 3] and a sink
    # logit ln 4 give weights [1, 3, 4] / 8 (the sink's 4/8 weights no value); the sink
    # is neither scaled by sm_scale nor soft-capped.
    q = jnp.array([[[2.0, 0.0], [2.0, 0.0]], [[2.0, 0.0], [2.0, 0.0]]])  # [T=2, Hq=2, D=2]
    kv = jnp.full((4, 1, 8, 4), jnp.nan)
    kv = kv.at[3, 0, 0].set([0.0, 0.0, 4.0, 0.0]).at[3, 0, 1].set([np.log(3.0), 0.0, 0.0, 8.0])
    args = (q, kv, _i32(2), _i32([3]), _i32(0, 2), _i32(1))
    sinks = jnp.array([np.log(4.0), -np.inf], jnp.float32)
    out = reference(*args, sm_scale=0.5, sinks=sinks)
    np.testing.assert_allclose(out[1, 0], [4.0 / 8, 3.0 * 8 / 8], rtol=1e-6)
    # Row 0 sees k0 only: weights [1, 4] / 5.
    np.testing.assert_allclose(out[0, 0], [4.0 / 5, 0.0], rtol=1e-6)
    # A sink of -inf is no sink, exactly.
    no_sink = reference(*args, sm_scale=0.5)
    np.testing.assert_array_equal(np.asarray(out[:, 1]), np.asarray(no_sink[:, 1]))
    # A large sink against soft-capped logits: the sink is not capped.
    c = 0.5
    x1 = c * np.tanh(np.log(3.0) / c)
    out = reference(*args, sm_scale=0.5, soft_cap=c, sinks=jnp.array([5.0, 5.0]))
    denom = 1.0 + np.exp(x1) + np.exp(5.0)
    np.testing.assert_allclose(out[1, 0], [4.0 / denom, 8.0 * np.exp(x1) / denom], rtol=1e-6)
    # Sinks of a bfloat16 parameter are taken as float32 (exactly).
    rounded = sinks.astype(jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(reference(*args, sm_scale=0.5, sinks=rounded)),
        np.asarray(reference(*args, sm_scale=0.5, sinks=rounded.astype(jnp.float32))),
    )


def test_sinks_leave_padding_and_unseen_rows_zero():
    case = make_case(
        3, q_lens=(0, 1), kv_lens=(0, 9), num_q_heads=4, num_kv_heads=1, head_dim=64,
        page_size=8, sinks=True,
    )  # fmt: skip
    out = np.asarray(reference(*case.args(), sm_scale=case.sm_scale, **case.array_kwargs()))
    assert np.all(out[1:] == 0) and np.all(np.isfinite(out)) and np.any(out[0] != 0)


@pytest.mark.parametrize("point", [GRID[6], GRID[7], GRID[14]], ids=lambda p: p.name)
def test_poisoned_pages_do_not_change_output(point):
    case = point.case(seed=2)
    poisoned = reference(*case.args(), **point.attention_kwargs(case))

    # The same batch with every poisoned value replaced by finite garbage.
    def clean(x):
        if x is None or (
            not np.issubdtype(np.asarray(x).dtype, np.floating) and x.dtype.kind != "V"
        ):
            return x
        y = np.asarray(x, np.float32)
        return np.where(np.isnan(y), 123.0, y).astype(x.dtype)

    cleaned = dataclasses.replace(
        case,
        q=clean(case.q),
        kv_pages=clean(case.kv_pages),
        kv_scales=clean(case.kv_scales),
    )
    out = reference(*cleaned.args(), **point.attention_kwargs(cleaned))
    assert np.all(np.isfinite(np.asarray(poisoned)))
    np.testing.assert_array_equal(np.asarray(poisoned), np.asarray(out))


def test_empty_sequences_and_no_live_sequences_give_zeros():
    case = make_case(
        3, q_lens=(0, 1), kv_lens=(0, 9), num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=8
    )
    out = np.asarray(reference(*case.args(), sm_scale=case.sm_scale))
    assert np.all(out[1:] == 0) and np.all(np.isfinite(out))
    args = list(case.args())
    args[5] = _i32(0)  # num_seqs = 0: every row is padding
    out = np.asarray(reference(*args, sm_scale=case.sm_scale))
    assert np.all(out == 0)


def test_reference_under_user_jit():
    point = GRID[7]
    case = point.case(seed=4)
    kwargs = point.attention_kwargs(case)
    scales = {"kv_scales": kwargs.pop("kv_scales")}
    fn = jax.jit(lambda *a, **s: reference(*a, **s, **kwargs))
    np.testing.assert_array_equal(
        np.asarray(fn(*case.args(), **scales)),
        np.asarray(reference(*case.args(), **kwargs, **scales)),
    )


def _valid_args():
    case = make_case(
        5, q_lens=(1, 3), kv_lens=(10, 3), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8
    )
    return list(case.args()), case.sm_scale


_ARG = {
    "q": 0,
    "kv_pages": 1,
    "kv_lens": 2,
    "block_tables": 3,
    "cu_q_lens": 4,
    "num_seqs": 5,
}
_BAD_INPUTS = [
    # (replacements of named arguments, given the valid ones; expected message)
    (lambda a: {"q": a["q"][:, :3]}, "num_q_heads=3"),
    (lambda a: {"q": a["q"][:, :, :32]}, "head_dim mismatch"),
    (lambda a: {"kv_pages": a["kv_pages"][..., :127]}, "kv_pages.shape[3]=127 must be 2 * D=128"),
    (lambda a: {"kv_pages": a["kv_pages"][:, :, :6]}, "page_size=6"),
    (lambda a: {"kv_pages": jnp.zeros((7, 2, 12, 128))}, "page_size=12"),
    (
        lambda a: {"kv_pages": a["kv_pages"][..., None]},
        "kv_pages must be [P, Hkv, page_size, 2 * D]",
    ),
    (lambda a: {"block_tables": a["block_tables"][:, :1]}, "block_tables too narrow"),
    (lambda a: {"kv_lens": a["kv_lens"].astype(jnp.float32)}, "kv_lens.dtype"),
    (lambda a: {"cu_q_lens": a["cu_q_lens"][:-1]}, "cu_q_lens.shape"),
    (lambda a: {"kv_lens": a["kv_lens"].at[1].set(2)}, "kv_len=2 is smaller than its q_len=3"),
    (lambda a: {"block_tables": a["block_tables"].at[0, 0].set(10_000)}, "outside [0, P="),
    (lambda a: {"num_seqs": _i32(7)}, "num_seqs=7"),
    (
        lambda a: {"kv_pages": a["kv_pages"].astype(jnp.int8)},
        "kv_scales is required",
    ),
    (lambda a: {"sinks": jnp.zeros(3)}, "sinks.shape=(3,) must be [Hq]=(4,)"),
    (lambda a: {"sinks": jnp.zeros((1, 4))}, "sinks.shape=(1, 4) must be [Hq]=(4,)"),
    (lambda a: {"sinks": jnp.zeros(4, jnp.int32)}, "sinks.dtype=int32 must be a float dtype"),
]


@pytest.mark.parametrize("replace, message", _BAD_INPUTS, ids=[m for _, m in _BAD_INPUTS])
def test_bad_input_names_the_argument(replace, message):
    args, sm_scale = _valid_args()
    named = {name: args[i] for name, i in _ARG.items()}
    kwargs = {}
    for name, value in replace(named).items():
        if name in _ARG:
            args[_ARG[name]] = value
        else:
            kwargs[name] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        reference(*args, sm_scale=sm_scale, **kwargs)


def test_bad_window_and_softcap():
    args, sm_scale = _valid_args()
    with pytest.raises(ValueError, match="sliding_window=0"):
        reference(*args, sm_scale=sm_scale, sliding_window=0)
    with pytest.raises(ValueError, match=re.escape("soft_cap=-1.0")):
        reference(*args, sm_scale=sm_scale, soft_cap=-1.0)


def _assert_same_scales(actual: np.ndarray, desired: np.ndarray) -> None:
    """Equal bfloat16 scales, NaN (the poisoned ones) matching NaN: compared in
    float32, which holds every bfloat16 exactly and whose NaNs NumPy's assert matches
    (with ml_dtypes < 0.7 it does not treat bfloat16 as a float dtype)."""
    np.testing.assert_array_equal(actual.astype(np.float32), desired.astype(np.float32))


def test_pack_kv_pages_lays_out_separate_k_and_v():
    # Separate K/V pages (and scales) pack into the one array the kernels read: token
    # j's key then value in row j, each head's key scales then value scales, padded with
    # ones to the lanes asked for.
    case = GRID[7].case(seed=6)  # int8 pages
    ps, d, lanes = case.page_size, case.q.shape[2], case.kv_scales.shape[3]
    assert lanes > ps  # the case pads as a TPU cache does
    k, v = case.kv_pages[..., :d], case.kv_pages[..., d:]
    k_scales, v_scales = case.kv_scales[:, :, 0, :ps], case.kv_scales[:, :, 1, :ps]
    kv, scales = pack_kv_pages(*map(jnp.asarray, (k, v, k_scales, v_scales)), scale_lanes=lanes)
    np.testing.assert_array_equal(np.asarray(kv), case.kv_pages)
    assert scales.shape == case.kv_scales.shape
    _assert_same_scales(np.asarray(scales)[..., :ps], case.kv_scales[..., :ps])
    assert (np.asarray(scales)[..., ps:] == 1).all()
    _, scales = pack_kv_pages(*map(jnp.asarray, (k, v, k_scales, v_scales)))
    _assert_same_scales(np.asarray(scales), case.kv_scales[..., :ps])
    with pytest.raises(ValueError, match=f"scale_lanes={ps - 1} must be >= page_size={ps}"):
        pack_kv_pages(*map(jnp.asarray, (k, v, k_scales, v_scales)), scale_lanes=ps - 1)
    kv, scales = pack_kv_pages(jnp.asarray(k).astype(jnp.float32), jnp.asarray(v, jnp.float32))
    assert scales is None and kv.shape == case.kv_pages.shape
    with pytest.raises(ValueError, match=re.escape("k_pages.shape=(")):
        pack_kv_pages(jnp.asarray(k), jnp.asarray(v)[:, :1])
    with pytest.raises(ValueError, match="come together"):
        pack_kv_pages(jnp.asarray(k), jnp.asarray(v), jnp.asarray(k_scales))
