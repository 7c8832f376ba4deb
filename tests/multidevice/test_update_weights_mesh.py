"""`Engine.update_weights` on a mesh of forced CPU devices: the tiny model (2 KV heads)
on model:2 (KV heads split) and model:4 (each KV head repeated twice by the runner);
new weights given in the model's own layout, as host arrays or in a trainer's sharding
(fully sharded over the first axis), give the outputs of an engine built fresh from
them on the same mesh, with no recompilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_configs import small_config
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from paxkv import SamplingParams
from paxkv.engine import Engine
from paxkv.models import load_model
from paxkv.sharding import shardings
from paxkv.sharding.mesh_shape import MeshShape

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [np.random.default_rng(i).integers(1, 256, n).tolist() for i, n in enumerate((5, 19, 27))]


def _run(engine, tag):
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": p}, GREEDY)
    done = engine.run_until_done()
    return [done[f"{tag}{i}"].outputs[0].token_ids for i in range(len(PROMPTS))]


@pytest.mark.parametrize("model_axis", [2, 4])
def test_update_on_a_mesh(model_axis):
    _, model, _ = load_model("tiny", dtype="float32", seed=0)
    rng = np.random.default_rng(1)
    host = jax.tree.map(
        lambda x: (np.asarray(x) * 1.01 + rng.normal(0, 0.02, x.shape)).astype(x.dtype),
        nnx.to_pure_dict(nnx.state(model, nnx.Param)),
    )
    new_model = nnx.clone(model)
    state = nnx.state(new_model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, host))
    nnx.update(new_model, state)
    mesh = shardings.make_mesh(MeshShape(model=model_axis))
    expected = _run(Engine(new_model, small_config(64), mesh=mesh), "fresh")
    # A trainer's layout: every array split over all 8 devices on its first axis.
    fsdp = NamedSharding(shardings.make_mesh(MeshShape(model=8)), P("model"))
    trainer = jax.tree.map(lambda x: jax.device_put(x, fsdp), host)
    for tree in (host, trainer):
        engine = Engine(model, small_config(64), mesh=mesh)
        old = _run(engine, "a")
        _run(engine, "warm")
        compiled = engine.num_compilations
        engine.update_weights(tree)
        assert _run(engine, "b") == expected != old
        assert engine.num_compilations == compiled
        leaf = engine.runner.params["layers"][0]["self_attn"]["k_proj"]["kernel"]
        assert leaf.shape == (128, 2 * 64 * max(1, model_axis // 2))
        assert leaf.sharding.spec == P(None, "model")


@pytest.mark.parametrize("model_axis", [2, 4])
def test_get_weights_is_the_models_layout_and_round_trips(model_axis):
    # On model:4 the engine holds each KV head twice; get_weights gives one of each.
    from paxkv import LLM

    _, model, _ = load_model("tiny", dtype="float32", seed=0)
    mesh = shardings.make_mesh(MeshShape(model=model_axis))
    llm = LLM.from_model(model, mesh=mesh, warmup=False, config=small_config(64))
    got = llm.get_weights()
    want = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b))
    old = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    ]
    assert llm.update_weights(got) == 1  # what it gives, it takes back
    new = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    ]
    assert new == old
