"""The host KV tier on a mesh of forced CPU devices: pages sharded over the model axis
(KV heads repeated by the runner on model:4) go to host memory whole
and come back in the cache's own shardings, giving a device hit's tokens and logprobs,
with nothing compiled after warm-up."""

import jax
import numpy as np
import pytest
from engine_configs import small_config

from paxkv import SamplingParams
from paxkv.engine import Engine
from paxkv.models import load_model
from paxkv.sharding import shardings
from paxkv.sharding.mesh_shape import MeshShape

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


def _go(engine, rid, prompt):
    engine.add_request(rid, {"prompt_token_ids": prompt}, GREEDY)
    return engine.run_until_done()[rid]


# model:4 repeats each of the tiny model's 2 KV heads (model:2 splits them: the same
# page layout, tested by the other mesh tests).
@pytest.mark.parametrize("model_axis", [4])
def test_restored_pages_on_a_mesh_give_a_device_hit(model_axis):
    config, model, _ = load_model("tiny", dtype="float32", seed=0)
    mesh = shardings.make_mesh(MeshShape(model=model_axis))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, 41).tolist()
    follow = prompt + rng.integers(0, config.vocab_size, 3).tolist()
    floods = [rng.integers(0, config.vocab_size, 40).tolist() for _ in range(6)]
    results = {}
    for name, pages, gib in (("large", 96, 0.0), ("tier", 24, 0.001)):
        engine = Engine(model, small_config(pages, kv_host_cache_gib=gib), mesh=mesh)
        engine.warmup()
        compiled = engine.num_compilations
        shardings_before = jax.tree.map(lambda a: a.sharding, engine.kv_cache)
        _go(engine, "a", prompt)
        for i, f in enumerate(floods if gib else []):
            _go(engine, f"f{i}", f)
        results[name] = _go(engine, "b", follow)
        assert engine.num_compilations == compiled
        assert jax.tree.map(lambda a: a.sharding, engine.kv_cache) == shardings_before
        assert engine.pool.num_in_use == 0
        if gib:
            assert engine.stats()["kv_offload_pages_to_device"] == 5
    large, tier = results["large"], results["tier"]
    assert tier.num_cached_tokens == large.num_cached_tokens == 40
    assert tier.outputs[0].token_ids == large.outputs[0].token_ids
    assert tier.outputs[0].cumulative_logprob == large.outputs[0].cumulative_logprob
