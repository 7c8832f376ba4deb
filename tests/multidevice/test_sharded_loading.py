"""Weights and pages created in their shardings from the start, never whole on one device."""

import numpy as np
import pytest
from flax import nnx

from paxkv import LLM, SamplingParams
from paxkv.models import PRESETS, init_model, save_hf_checkpoint
from paxkv.models.family import hf_name
from paxkv.models.weights import load_hf_checkpoint
from paxkv.sharding import shardings
from paxkv.sharding.mesh_shape import MeshShape

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny model (2 KV heads, MLP 256, vocab 256) in f32, in two safetensors shards."""
    path = tmp_path_factory.mktemp("ckpt")
    config = PRESETS["tiny"].replace(dtype="float32")
    save_hf_checkpoint(init_model(config, seed=3), path, max_shard_bytes=600_000)
    return path


def _flat(model):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("shape", ["model:2", "model:8"])
def test_each_device_reads_and_holds_only_its_shard(checkpoint, shape):
    mesh = shardings.make_mesh(MeshShape.parse(shape))
    n = mesh.shape["model"]
    one_stats, stats = {}, {}
    _, one = load_hf_checkpoint(checkpoint, stats=one_stats)
    config, sharded = load_hf_checkpoint(checkpoint, mesh=mesh, stats=stats)
    want = shardings.param_shardings(nnx.state(sharded), config, mesh)
    for (path, got), (_, sharding) in zip(
        nnx.to_flat_state(nnx.state(sharded)), nnx.to_flat_state(want), strict=True
    ):
        array = got.get_value()
        assert array.sharding == sharding.get_value(), path
        split = [i for i, axis in enumerate(sharding.get_value().spec) if axis is not None]
        for shard in array.addressable_shards:
            local = list(array.shape)
            for i in split:
                local[i] //= n
            assert list(shard.data.shape) == local, path
        # A split tensor is read once in all, each device its part; a replicated one
        # at most once per device.
        read = stats[hf_name(path)[0]]
        assert read == array.nbytes if split else array.nbytes <= read <= n * array.nbytes
        assert one_stats[hf_name(path)[0]] == array.nbytes
    for name, value in _flat(one).items():
        np.testing.assert_array_equal(np.asarray(_flat(sharded)[name]), np.asarray(value))


def test_random_weights_are_initialised_in_their_shardings():
    mesh = shardings.make_mesh(MeshShape.parse("model:2"))
    config = PRESETS["tiny"].replace(dtype="float32")
    sharded, one = init_model(config, seed=5, mesh=mesh), init_model(config, seed=5)
    want = shardings.param_shardings(nnx.state(sharded), config, mesh)
    for (path, got), (_, sharding) in zip(
        nnx.to_flat_state(nnx.state(sharded)), nnx.to_flat_state(want), strict=True
    ):
        assert got.get_value().sharding == sharding.get_value(), path
    for name, value in _flat(one).items():
        np.testing.assert_allclose(np.asarray(_flat(sharded)[name]), np.asarray(value), atol=1e-6)


def test_llm_on_a_mesh_loads_sharded_and_matches_one_device(checkpoint):
    kw = dict(
        warmup=False,
        num_pages=64,
        page_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=128,
    )
    mesh = shardings.make_mesh(MeshShape.parse("model:2"))
    prompts = [{"prompt_token_ids": [5, 9, 200, 7]}, {"prompt_token_ids": list(range(1, 30))}]
    solo = LLM(str(checkpoint), **kw)
    meshed = LLM(str(checkpoint), mesh=mesh, **kw)
    for path, var in nnx.to_flat_state(meshed.engine.runner.params):
        assert len(var.get_value().sharding.device_set) == 2, path
    cache = meshed.engine.kv_cache
    assert cache.kv[0].sharding.spec == shardings.kv_head_spec(2, mesh)
    for shard in cache.kv[0].addressable_shards:
        assert shard.data.shape[1] == 1  # one of the 2 KV heads per device
    a = solo.generate(prompts, GREEDY, use_tqdm=False)
    b = meshed.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
