"""LoRA adapters on a mesh of forced CPU devices: the slot arrays split as their
projections' kernels (B of the column-parallel projections by output, A of the
row-parallel ones by input), KV heads repeated for model:4 in B of k and v as in their
kernels, and every request's tokens and logprobs those of one device, adapters mixed
in a batch, with nothing compiled after warm-up."""

import numpy as np
import pytest
from engine_configs import small_config
from peft_adapters import random_loras

from paxkv import SamplingParams
from paxkv.engine import Engine
from paxkv.models import load_model
from paxkv.sharding import shardings
from paxkv.sharding.mesh_shape import MeshShape

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


def _serve(engine, submissions):
    for i, (prompt, lora) in enumerate(submissions):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY, lora_request=lora)
    return engine.run_until_done()


def _spec(engine, *names):
    from flax import nnx

    for path, var in nnx.to_flat_state(engine.runner.target.params):
        if all(n in path for n in names):
            return tuple(var.get_value().sharding.spec)
    raise KeyError(names)


# model:4 repeats the KV heads (B of k and v with them) and splits the rest; model:2
# (a plain split) is a slow test (CI's time).
@pytest.mark.parametrize("model_axis", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_adapters_on_a_mesh_equal_one_device(model_axis, tmp_path):
    config, model, _ = load_model("tiny", dtype="float32", seed=0)
    loras = random_loras(tmp_path, config, (1, 2, 3))
    rng = np.random.default_rng(0)
    submissions = [
        (rng.integers(0, config.vocab_size, 9 + 5 * i).tolist(), [*loras, None][i % 4])
        for i in range(8)
    ]
    results = {}
    lora_config = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    for name, mesh in (("one", None), ("mesh", shardings.make_mesh(MeshShape(model=model_axis)))):
        engine = Engine(model, small_config(96, **lora_config), mesh=mesh)
        engine.warmup()
        compiled = engine.num_compilations
        results[name] = _serve(engine, submissions)
        assert engine.num_compilations == compiled
        assert engine.stats()["lora_evictions"] > 0
        if mesh is not None:
            assert _spec(engine, "q_proj", "lora_b")[-1] == "model"
            assert _spec(engine, "q_proj", "lora_a")[-2] is None
            assert _spec(engine, "down_proj", "lora_a")[-2] == "model"
            assert _spec(engine, "down_proj", "lora_b")[-1] is None
    for i in range(len(submissions)):
        one, mesh = results["one"][str(i)].outputs[0], results["mesh"][str(i)].outputs[0]
        assert mesh.token_ids == one.token_ids
        np.testing.assert_allclose(mesh.cumulative_logprob, one.cumulative_logprob, atol=1e-4)
