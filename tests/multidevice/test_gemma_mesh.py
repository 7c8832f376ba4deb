"""Gemma 3 and Qwen3 on a mesh: their q/k norms and Gemma's four norms per layer load
per device slice (replicated), and greedy outputs on model:2 equal one device's (Gemma 3
also with its layers scanned, loaded straight into stacked shardings)."""

import numpy as np
import pytest
from flax import nnx

from paxkv import LLM, SamplingParams
from paxkv.models import PRESETS, init_model, save_hf_checkpoint
from paxkv.sharding import shardings
from paxkv.sharding.mesh_shape import MeshShape

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize(
    "name, scan_layers", [("tiny-gemma3", False), ("tiny-gemma3", True), ("tiny-qwen3", False)]
)
def test_greedy_on_model_2_equals_one_device(name, scan_layers, tmp_path):
    config = PRESETS[name].replace(sliding_window=8) if "gemma" in name else PRESETS[name]
    model = init_model(config, seed=4)
    # Norm weights away from their identity values, so a norm lost on a shard shows.
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if "norm" in str(path[-2]):
            var.set_value(var.get_value() + 0.3)
    save_hf_checkpoint(model, tmp_path)
    prompts = [np.random.default_rng(0).integers(1, 256, n).tolist() for n in (3, 20, 37)]
    prompts = [{"prompt_token_ids": p} for p in prompts]
    kw = dict(warmup=False, num_pages=64, page_size=8, max_model_len=128)
    one = LLM(model=str(tmp_path), **kw).generate(prompts, GREEDY, use_tqdm=False)
    mesh = shardings.make_mesh(MeshShape.parse("model:2"))
    llm = LLM(model=str(tmp_path), mesh=mesh, scan_layers=scan_layers, **kw)
    assert llm.engine.runner.model_config.scan_layers == scan_layers
    sharded = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sharded] == [o.outputs[0].token_ids for o in one]
