"""Scanned layers on a mesh: a checkpoint read straight into stacked shardings, and the
engine's greedy outputs on model:2 (KV heads split), model:4 (KV heads repeated) and
model:8 (replicated) equal to the looped model's on one device."""

import dataclasses

import numpy as np
import pytest
from engine_configs import PAGE_SIZE, small_config
from flax import nnx

from paxkv import SamplingParams
from paxkv.engine import Engine
from paxkv.models import (
    PRESETS,
    init_model,
    layer_stack,
    restore_params,
    save_hf_checkpoint,
    save_params,
)
from paxkv.models.family import hf_name
from paxkv.models.weights import load_hf_checkpoint
from paxkv.sharding import shardings
from paxkv.sharding.mesh_shape import MeshShape

PS = PAGE_SIZE
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
CONFIG = small_config(48)
PROMPTS = [np.random.default_rng(n).integers(1, 256, n).tolist() for n in (1, 8, 9, 17, 40)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny model in f32, in several safetensors shards (its layers spread over them)."""
    path = tmp_path_factory.mktemp("ckpt")
    save_hf_checkpoint(
        init_model(PRESETS["tiny"].replace(dtype="float32"), seed=3), path, max_shard_bytes=200_000
    )
    return path


def _run(engine, prompts=PROMPTS):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    done = engine.run_until_done()
    assert engine.pool.num_in_use == 0
    return [done[str(i)].outputs[0] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def one_device(checkpoint):
    """The looped model on one device, and its greedy outputs."""
    _, model = load_hf_checkpoint(checkpoint)
    return model, _run(Engine(model, CONFIG))


@pytest.mark.parametrize("shape", ["model:2", "model:8"])
def test_stacked_parameters_load_into_their_shardings(checkpoint, one_device, shape):
    mesh = shardings.make_mesh(MeshShape.parse(shape))
    n = mesh.shape["model"]
    stats = {}
    config, model = load_hf_checkpoint(checkpoint, mesh=mesh, stats=stats, scan_layers=True)
    assert config.scan_layers
    state = nnx.state(model)
    want = shardings.param_shardings(state, config, mesh)
    for (path, got), (_, sharding) in zip(
        nnx.to_flat_state(state), nnx.to_flat_state(want), strict=True
    ):
        array, spec = got.get_value(), sharding.get_value().spec
        assert array.sharding == sharding.get_value(), path
        held = layer_stack.layer_paths(tuple(map(str, path)), config)
        if held is None:
            continue
        names, stacked = held
        assert stacked  # the tiny Llama: period 1, no tail
        assert spec[0] is None  # the layer axis is never split
        split = [i for i, axis in enumerate(spec) if axis is not None]
        for shard in array.addressable_shards:
            local = [d // n if i in split else d for i, d in enumerate(array.shape)]
            assert list(shard.data.shape) == local, path
        for layer_path in names:  # each layer's tensor read once in all when split
            read = stats[hf_name(layer_path)[0]]
            size = array.nbytes // config.num_layers
            assert read == size if split else size <= read <= n * size, layer_path
    loop, _ = one_device
    back = layer_stack.with_scan_layers(model, False)
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(back)), nnx.to_flat_state(nnx.state(loop)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), path)


@pytest.mark.parametrize(
    "shape, mode",
    [
        ("model:2", {}),
        ("model:2", {"num_decode_steps": 4}),
        ("model:2", {"async_scheduling": True}),
        ("model:4", {}),
        ("model:8", {}),
    ],
)
def test_greedy_outputs_match_the_looped_model_on_one_device(checkpoint, one_device, shape, mode):
    mesh = shardings.make_mesh(MeshShape.parse(shape))
    _, model = load_hf_checkpoint(checkpoint, mesh=mesh, scan_layers=True)
    engine = Engine(model, dataclasses.replace(CONFIG, **mode), mesh=mesh)
    assert engine.kv_cache.stacked and len(engine.kv_cache.kv) == 1
    heads = engine.model_config.num_kv_heads  # 4 on model:4: each KV head repeated twice
    assert heads == (4 if shape == "model:4" else 2)
    engine.warmup()
    warm = engine.num_compilations
    got = _run(engine)
    _, want = one_device
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids
        np.testing.assert_allclose(b.token_logprobs, a.token_logprobs, rtol=0, atol=1e-5)
    assert engine.num_compilations == warm
    pages = engine.kv_cache.kv[0]
    local = heads // 2 if shape == "model:2" else 1 if shape == "model:4" else heads
    assert {s.data.shape[1] for s in pages.addressable_shards} == {local}


def test_orbax_params_restore_into_stacked_shardings(one_device, tmp_path):
    # Saved layer by layer (either way); restored stacked on the host, then placed.
    loop, _ = one_device
    save_params(loop, tmp_path)
    mesh = shardings.make_mesh(MeshShape.parse("model:2"))
    config = loop.config.replace(scan_layers=True)
    model = restore_params(config, tmp_path, mesh=mesh)
    state = nnx.state(model)
    want = shardings.param_shardings(state, config, mesh)
    for (path, got), (_, sharding) in zip(
        nnx.to_flat_state(state), nnx.to_flat_state(want), strict=True
    ):
        assert got.get_value().sharding == sharding.get_value(), path
    back = layer_stack.with_scan_layers(model, False)
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(back)), nnx.to_flat_state(nnx.state(loop)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), path)
