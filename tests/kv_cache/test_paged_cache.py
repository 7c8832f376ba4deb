"""The device KV cache (`paxkv.kv_cache`): the functional write, the cache pytree and the page table."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from paxkv.kv_cache import PagedKVCache
from paxkv.measure.page_tables import page_table_from_host
from paxkv.pallas_kernels.kv_write import write_kv_pages
from paxkv.pallas_kernels.layout import KEY, NULL_PAGE, SCALE_DTYPE, VALUE, page_bytes
from paxkv.pallas_kernels.quantization import dequantize
from paxkv.pallas_kernels.reference import ragged_paged_attention_reference

PAGE = 8


def _table():
    # Sequence 0 prefills 10 tokens into pages [3, 5]; sequence 1 decodes its 12th
    # token (position 11) into page 6 (its second page); sequence 2 chunks 4 tokens
    # at positions 4..7 of page 2. Two padding rows follow.
    return page_table_from_host(
        [[3, 5], [1, 6], [2]],
        [10, 12, 8],
        [10, 1, 4],
        page_size=PAGE,
        max_num_seqs=4,
        pages_per_seq=3,
    )


def _expected_slots():
    return [(3, i) for i in range(8)] + [(5, 0), (5, 1), (6, 3)] + [(2, i) for i in range(4, 8)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_sets_exactly_the_named_slots(dtype):
    rng = np.random.default_rng(0)
    shape = (8, 2, PAGE, 2 * 64)  # each token's row: its key, then its value
    kv0 = jnp.asarray(rng.standard_normal(shape), dtype)
    new_k = jnp.asarray(rng.standard_normal((17, 2, 64)), dtype)
    new_v = jnp.asarray(rng.standard_normal((17, 2, 64)), dtype)
    table = _table()
    kv, scales = write_kv_pages(kv0, new_k, new_v, *table.kernel_args())
    assert scales is None
    kv, kv0 = np.asarray(kv), np.asarray(kv0)
    touched = np.zeros(shape[:1] + shape[2:3], bool)
    for t, (page, off) in enumerate(_expected_slots()):
        np.testing.assert_array_equal(kv[page, :, off, :64], np.asarray(new_k[t]))
        np.testing.assert_array_equal(kv[page, :, off, 64:], np.asarray(new_v[t]))
        touched[page, off] = True
    # Every other row, the null page included, is bit-for-bit unchanged; padding rows
    # 15 and 16 went nowhere.
    np.testing.assert_array_equal(
        kv.transpose(0, 2, 1, 3)[~touched], kv0.transpose(0, 2, 1, 3)[~touched]
    )


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_write_round_trips_within_quantization_error(kv_cache_dtype):
    rng = np.random.default_rng(1)
    cache = PagedKVCache.create(
        num_layers=2,
        num_pages=8,
        num_kv_heads=2,
        page_size=PAGE,
        head_dim=64,
        kv_cache_dtype=kv_cache_dtype,
    )
    new = jnp.asarray(rng.standard_normal((17, 2, 64)) * 3, jnp.float32)
    assert all(s.dtype == SCALE_DTYPE for s in cache.kv_scales)
    out = cache.write(1, new, -new, _table())
    assert all(s.dtype == SCALE_DTYPE for s in out.kv_scales)
    # Layer 0 untouched.
    np.testing.assert_array_equal(np.asarray(out.kv[0]), np.asarray(cache.kv[0]))
    kv, scales = out.kv[1], out.kv_scales[1]
    for t, (page, off) in enumerate(_expected_slots()):
        stored = dequantize(kv[page, :, off, :64], scales[page, :, KEY, off])
        amax = np.abs(np.asarray(new[t])).max(axis=-1, keepdims=True)
        # The stored scale (max|x| / dtype_max rounded to bfloat16) is the step: int8
        # rounds to the nearest one (scale / 2). e4m3 keeps 3 mantissa bits (2^-4
        # relative) down to its subnormals, whose spacing is 2^-9 (in units of the scale).
        scale = np.asarray(scales[page, :, KEY, off]).astype(np.float32)[:, None]
        if kv_cache_dtype == "int8":
            bound = scale / 2
        else:
            bound = np.maximum(np.abs(np.asarray(new[t])) * 2.0**-4, scale * 2.0**-10)
        assert np.all(np.abs(np.asarray(stored) - np.asarray(new[t])) <= bound + 1e-7)
        np.testing.assert_array_equal(
            np.asarray(scales[page, :, KEY, off]),
            (amax[:, 0] / (127 if kv_cache_dtype == "int8" else 448)).astype(ml_dtypes.bfloat16),
        )
        stored_v = dequantize(kv[page, :, off, 64:], scales[page, :, VALUE, off])
        np.testing.assert_array_equal(np.asarray(stored_v), -np.asarray(stored))
    untouched = np.ones((8, 2, PAGE), bool)  # [page, KEY/VALUE, offset]
    for page, off in _expected_slots():
        untouched[page, :, off] = False
    np.testing.assert_array_equal(np.asarray(scales).transpose(0, 2, 3, 1)[untouched], 1.0)


def test_donated_write_is_in_place():
    cache = PagedKVCache.create(
        num_layers=2, num_pages=64, num_kv_heads=2, page_size=PAGE, head_dim=64, dtype=jnp.float32
    )
    table = _table()
    new = jnp.ones((17, 2, 64), jnp.float32)
    step = jax.jit(lambda c, t, k, v: c.write(0, k, v, t), donate_argnums=0)
    before = [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(cache)]
    old_leaves = jax.tree_util.tree_leaves(cache)
    out = step(cache, table, new, new)
    assert all(x.is_deleted() for x in old_leaves), "the cache was not donated"
    after = [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(out)]
    assert after == before, "the write copied the cache instead of updating it in place"
    assert float(out.kv[0][3, 0, 0, 0]) == 1.0


def test_written_cache_feeds_attention():
    # Prefill through the write, then attention over the cache equals attention over
    # the dense K/V of the prompt.
    rng = np.random.default_rng(2)
    cache = PagedKVCache.create(
        num_layers=1, num_pages=6, num_kv_heads=1, page_size=PAGE, head_dim=64, dtype=jnp.float32
    )
    table = page_table_from_host(
        [[4, 2]], [11], [11], page_size=PAGE, max_num_seqs=2, pages_per_seq=3
    )
    q, k, v = (jnp.asarray(rng.standard_normal((11, 1, 64)), jnp.float32) for _ in range(3))
    cache = cache.write(0, k, v, table)
    out = ragged_paged_attention_reference(
        q,
        **cache.layer(0),
        **table.kernel_kwargs(),
        sm_scale=0.125,
    )
    logits = (
        np.einsum("qd,kd->qk", np.asarray(q[:, 0], np.float64), np.asarray(k[:, 0], np.float64))
        * 0.125
    )
    logits = np.where(np.tril(np.ones((11, 11), bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    dense = (w / w.sum(-1, keepdims=True)) @ np.asarray(v[:, 0], np.float64)
    np.testing.assert_allclose(np.asarray(out[:, 0]), dense, rtol=1e-5, atol=1e-5)


def test_page_table_padding_and_errors():
    table = _table()
    np.testing.assert_array_equal(np.asarray(table.block_tables[3]), [NULL_PAGE] * 3)
    np.testing.assert_array_equal(np.asarray(table.cu_q_lens), [0, 10, 11, 15, 15])
    np.testing.assert_array_equal(np.asarray(table.num_seqs), [3])
    leaves, treedef = jax.tree_util.tree_flatten(table)
    assert len(leaves) == 4 and jax.tree_util.tree_unflatten(treedef, leaves).page_size == PAGE
    with pytest.raises(ValueError, match=re.escape("kv_len=17 needs more than its 2 pages")):
        page_table_from_host([[1, 2]], [17], [1], page_size=PAGE, max_num_seqs=2, pages_per_seq=3)
    with pytest.raises(ValueError, match="max_num_seqs=1"):
        page_table_from_host(
            [[1], [2]], [1, 1], [1, 1], page_size=PAGE, max_num_seqs=1, pages_per_seq=3
        )
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
        PagedKVCache.create(
            num_layers=1,
            num_pages=2,
            num_kv_heads=1,
            page_size=8,
            head_dim=64,
            kv_cache_dtype="int4",
        )


def test_write_rejects_mismatched_heads():
    cache = PagedKVCache.create(
        num_layers=1, num_pages=8, num_kv_heads=2, page_size=PAGE, head_dim=64
    )
    with pytest.raises(ValueError, match=re.escape("new_k.shape")):
        cache.write(0, jnp.ones((17, 3, 64)), jnp.ones((17, 3, 64)), _table())


def test_page_bytes_and_nbytes_agree():
    # On TPU the scales of pages of 64 are padded to 128 lanes (`layout.scale_lanes`),
    # and counted.
    cases = [("auto", None, 16), ("int8", None, 16), ("int8", "tpu", 16), ("int8", "cpu", 64)]
    for kv, platform, ps in [*cases, ("int8", "tpu", 64)]:
        cache = PagedKVCache.create(
            num_layers=3, num_pages=5, num_kv_heads=2, page_size=ps, head_dim=64,
            kv_cache_dtype=kv, platform=platform,
        )  # fmt: skip
        per_page = page_bytes(
            num_kv_heads=2, page_size=ps, head_dim=64, page_dtype=cache.kv[0].dtype,
            platform=platform,
        )  # fmt: skip
        assert cache.nbytes == 3 * 5 * per_page
        if kv == "int8":
            lanes = 128 if (platform, ps) == ("tpu", 64) else ps
            assert cache.kv_scales[0].shape == (5, 2, 2, lanes)


def test_tpu_cache_with_small_pages_warns_of_the_scales_copy(caplog):
    # Under page size 64 a TPU cache keeps its scales unpadded, which XLA relays out
    # before every attention call: said once, where the cache is made.
    kw = dict(num_layers=1, num_pages=3, num_kv_heads=2, head_dim=64, kv_cache_dtype="int8")
    with caplog.at_level("WARNING"):
        PagedKVCache.create(**kw, page_size=16, platform="tpu")
    assert any("page_size >= 64 avoids the copy" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING"):
        PagedKVCache.create(**kw, page_size=64, platform="tpu")
        PagedKVCache.create(**kw, page_size=16, platform="cpu")
    assert not any("avoids the copy" in r.getMessage() for r in caplog.records)
