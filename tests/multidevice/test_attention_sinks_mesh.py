"""Attention sinks through `paged_attention` on a mesh of 8 CPU devices: each device's
query heads meet their own sinks, whether the KV heads are split (model:2, model:4) or
replicated (model:8 over 4 KV heads)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv.kv_cache import PagedKVCache, paged_attention
from paxkv.measure.page_tables import page_table_from_host
from paxkv.models.layers import dense_causal_attention
from paxkv.sharding import shardings
from paxkv.sharding.mesh_shape import MeshShape

PS, HQ, HKV, D, LEN = 8, 16, 4, 64, 21


@pytest.mark.parametrize("model", [2, 4, 8])
def test_sinks_follow_the_query_heads_on_a_mesh(model):
    mesh = shardings.make_mesh(MeshShape(model=model))
    rng = np.random.default_rng(model)
    q, k, v = (jnp.asarray(rng.standard_normal((LEN, h, D)), jnp.float32) for h in (HQ, HKV, HKV))
    sinks = jnp.asarray(rng.uniform(-2.0, 6.0, HQ), jnp.float32)  # distinct per head
    cache = PagedKVCache.create(
        num_layers=1, num_pages=6, num_kv_heads=HKV, page_size=PS, head_dim=D, dtype=jnp.float32
    )
    table = page_table_from_host(
        [[4, 1, 3]], [LEN], [LEN], page_size=PS, max_num_seqs=2, pages_per_seq=3
    )
    step = jax.jit(
        lambda q, k, v, cache, table: paged_attention(
            0, q, k, v, cache, table, sm_scale=D**-0.5, sliding_window=5, soft_cap=None,
            num_kv_heads=HKV, mesh=mesh, backend="xla", sinks=sinks,
        )
    )  # fmt: skip
    out, _ = step(q, k, v, cache, table)
    assert shardings.head_vector_spec(HKV, mesh) == (
        jax.sharding.PartitionSpec("model") if HKV % model == 0 else jax.sharding.PartitionSpec()
    )
    expected = dense_causal_attention(q, k, v, sm_scale=D**-0.5, sliding_window=5, sinks=sinks)
    np.testing.assert_allclose(np.asarray(out[:LEN]), np.asarray(expected), rtol=1e-5, atol=1e-5)
