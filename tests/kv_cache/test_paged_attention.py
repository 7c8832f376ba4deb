"""`paged_attention`, every model's per-layer call into the cache: attention sinks through
it against the dense oracle (`models.layers.dense_causal_attention`), prefill then decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv.kv_cache import PagedKVCache, paged_attention
from paxkv.measure.page_tables import page_table_from_host
from paxkv.models.layers import dense_causal_attention

PS, HQ, HKV, D = 8, 8, 2, 64


def attention_steps(q, k, v, *, sinks, sliding_window, backend, mesh=None):
    """A 19-token prompt prefilled in pages [5, 2, 7], then its 20th token decoded (page
    7, offset 3), through `paged_attention` on layer 1 of a two-layer cache; the
    attention of all 20 rows `[20, Hq, D]`."""
    cache = PagedKVCache.create(
        num_layers=2, num_pages=9, num_kv_heads=HKV, page_size=PS, head_dim=D, dtype=jnp.float32
    )
    kwargs = dict(
        sm_scale=D**-0.5,
        sliding_window=sliding_window,
        soft_cap=None,
        num_kv_heads=HKV,
        mesh=mesh,
        backend=backend,
        sinks=sinks,
    )
    step = jax.jit(lambda *a: paged_attention(1, *a, **kwargs))
    outs = []
    for rows, kv_len in ((slice(0, 19), 19), (slice(19, 20), 20)):
        q_len = rows.stop - rows.start
        table = page_table_from_host(
            [[5, 2, 7]], [kv_len], [q_len], page_size=PS, max_num_seqs=2, pages_per_seq=4
        )
        out, cache = step(q[rows], k[rows], v[rows], cache, table)
        outs.append(out[:q_len])
    return jnp.concatenate(outs)


def _qkv_sinks(seed):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((20, h, D)), jnp.float32) for h in (HQ, HKV, HKV))
    sinks = jnp.asarray(rng.uniform(-2.0, 6.0, HQ), jnp.float32)
    return q, k, v, sinks


@pytest.mark.parametrize("backend", ["reference", "xla"])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_sinks_through_the_cache_match_dense_attention(backend, sliding_window):
    q, k, v, sinks = _qkv_sinks(0)
    got = attention_steps(q, k, v, sinks=sinks, sliding_window=sliding_window, backend=backend)
    expected = dense_causal_attention(
        q, k, v, sm_scale=D**-0.5, sliding_window=sliding_window, sinks=sinks
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    # The sinks change the result: the oracle sees them.
    plain = dense_causal_attention(q, k, v, sm_scale=D**-0.5, sliding_window=sliding_window)
    assert float(jnp.max(jnp.abs(plain - expected))) > 0.1


def test_dense_oracle_with_sinks_by_hand():
    # One head, two keys with logits [0, ln 3] for the second query and a sink ln 4: the
    # weights are [1, 3] / 8 (the sink's 4 / 8 weights nothing).
    q = jnp.array([[[1.0, 0.0]], [[1.0, 0.0]]])
    k = jnp.array([[[0.0, 0.0]], [[np.log(3.0), 0.0]]])
    v = jnp.array([[[4.0, 0.0]], [[0.0, 8.0]]])
    out = dense_causal_attention(
        q, k, v, sm_scale=1.0, sliding_window=None, sinks=jnp.array([np.log(4.0)])
    )
    np.testing.assert_allclose(np.asarray(out[:, 0]), [[0.8, 0.0], [0.5, 3.0]], rtol=1e-6)
