"""Quantized weights on a mesh of forced CPU devices: the values split as their kernels,
the scales as their output channels (replicated for row-parallel projections), KV heads
repeated for model:4 with their scales, experts by expert; every request's tokens and
logprobs those of one device, with nothing compiled after warm-up."""

import numpy as np
import pytest
from engine_configs import small_config
from flax import nnx

from paxkv import SamplingParams
from paxkv.engine import Engine
from paxkv.models import load_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


def _spec(engine, *names):
    for path, var in nnx.to_flat_state(engine.runner.target.params):
        if all(n in path for n in names):
            return tuple(var.get_value().sharding.spec)
    raise KeyError(names)


@pytest.mark.parametrize(
    ("preset", "model_axis"),
    # model:4 repeats the KV heads (with their scales) and splits the rest; model:2 of
    # the dense model is a slow test (CI's time).
    [pytest.param("tiny", 2, marks=pytest.mark.slow), ("tiny", 4), ("tiny-mixtral", 2)],
)
def test_quantized_weights_on_a_mesh_equal_one_device(preset, model_axis):
    from paxkv.sharding import shardings
    from paxkv.sharding.mesh_shape import MeshShape

    config, model, _ = load_model(preset, dtype="float32", seed=0, quantization="int8")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, 7 + 6 * i).tolist() for i in range(4)]
    results = {}
    for name, mesh in (("one", None), ("mesh", shardings.make_mesh(MeshShape(model=model_axis)))):
        engine = Engine(model, small_config(64), mesh=mesh)
        engine.warmup()
        compiled = engine.num_compilations
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
        results[name] = engine.run_until_done()
        assert engine.num_compilations == compiled
        if mesh is not None:
            assert _spec(engine, "q_proj", "kernel")[-1] == "model"
            assert _spec(engine, "q_proj", "kernel_scale")[-1] == "model"
            assert _spec(engine, "o_proj", "kernel")[-2] == "model"
            assert _spec(engine, "o_proj", "kernel_scale") in ((), (None, None))
    for i in range(len(prompts)):
        one, mesh = results["one"][str(i)].outputs[0], results["mesh"][str(i)].outputs[0]
        assert mesh.token_ids == one.token_ids
        np.testing.assert_allclose(mesh.cumulative_logprob, one.cumulative_logprob, atol=1e-4)
