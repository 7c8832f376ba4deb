"""Mixtral, Qwen3-MoE and gpt-oss on a mesh of 8 CPU devices: greedy generation through
`LLM` equals transformers' token for token with the experts split over the devices
(expert parallelism on model:2 and model:8) or inside each expert (tensor parallelism,
model:4 with 6 experts); checkpoints load each device's experts only; the MoE block's collective
is one all-reduce (gpt-oss's block, biases and all, too)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_reference import greedy, write_checkpoint
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from paxkv import LLM, SamplingParams
from paxkv.models import PRESETS, load_hf_checkpoint
from paxkv.models import moe as moe_layer
from paxkv.sharding import shardings
from paxkv.sharding.mesh_shape import MeshShape

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CONFIGS = {
    "mixtral": PRESETS["tiny-mixtral"].replace(sliding_window=8),
    "qwen3-moe": PRESETS["tiny-qwen3-moe"],
    "mixtral-6-experts": PRESETS["tiny-mixtral"].replace(num_experts=6),
    "gpt-oss": PRESETS["tiny-gpt-oss"].replace(sliding_window=8),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each config's checkpoint, written by transformers, and its greedy tokens there."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, n).tolist() for n in (3, 20, 37)]
    out = {}
    for name, config in CONFIGS.items():
        path = tmp_path_factory.mktemp(name)
        reference = write_checkpoint(config, path)
        out[name] = path, prompts, [greedy(reference, p, GREEDY.max_tokens) for p in prompts]
    return out


EXPERT_PARALLEL = {
    name: P("model", None, None) for name in ("w1", "w2", "w3", "down_proj", "gate_up_proj")
}
TENSOR_PARALLEL = {"w1": P(None, None, "model"), "w3": P(None, None, "model")}
TENSOR_PARALLEL["w2"] = P(None, "model", None)


@pytest.mark.parametrize(
    "name, mesh, splits, scan_layers",
    [
        # CI runs one case per family and split; the rest are `-m slow` (CI's 25 minutes).
        pytest.param("mixtral", "model:2", EXPERT_PARALLEL, False, marks=pytest.mark.slow),
        ("mixtral", "model:8", EXPERT_PARALLEL, False),
        ("qwen3-moe", "model:8", EXPERT_PARALLEL, True),  # loaded stacked, [L, E, ...]
        ("mixtral-6-experts", "model:4", TENSOR_PARALLEL, False),
        ("gpt-oss", "model:2", EXPERT_PARALLEL, False),  # sinks split with the heads
        pytest.param("gpt-oss", "model:8", EXPERT_PARALLEL, True, marks=pytest.mark.slow),
    ],
)
def test_greedy_on_a_mesh_matches_transformers(checkpoints, name, mesh, splits, scan_layers):
    path, prompts, expected = checkpoints[name]
    mesh = shardings.make_mesh(MeshShape.parse(mesh))
    llm = LLM(
        model=str(path),
        mesh=mesh,
        scan_layers=scan_layers,
        warmup=False,
        num_pages=64,
        page_size=8,
        max_model_len=128,
    )
    params = nnx.to_flat_state(llm.engine.runner.params)
    experts = {str(p[-1]): v.get_value() for p, v in params if str(p[-2]) == "experts"}
    assert set(splits) & set(experts)
    for key, spec in splits.items():
        if key in experts:
            if scan_layers:
                spec = P(None, *spec)
            want = NamedSharding(mesh, spec)
            assert experts[key].sharding.is_equivalent_to(want, experts[key].ndim), key
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_each_device_reads_only_its_experts(checkpoints):
    path, _, _ = checkpoints["mixtral"]
    mesh = shardings.make_mesh(MeshShape.parse("model:8"))
    stats = {}
    config, model = load_hf_checkpoint(path, mesh=mesh, stats=stats)
    w1 = model.layers[0].block_sparse_moe.experts.w1.get_value()  # [8, 128, 128], 1 a device
    assert {s.data.shape for s in w1.addressable_shards} == {(1, 128, 128)}
    name = "model.layers.{}.block_sparse_moe.experts.{}.{}.weight"
    for layer in range(config.num_layers):
        for e in range(config.num_experts):
            for w in ("w1", "w2", "w3"):
                assert stats[name.format(layer, e, w)] == 128 * 128 * 4  # once, in all


GPT_OSS = moe_layer.ExpertForm.gpt_oss(limit=7.0, alpha=1.702)


@pytest.mark.parametrize(
    "form, num_experts, mesh",
    [
        (moe_layer.MIXTRAL, 8, "model:8"),
        (GPT_OSS, 8, "model:8"),  # biases split with their experts
        (GPT_OSS, 6, "model:4"),  # inside each expert: gate/up pairs kept together
    ],
    ids=["mixtral-expert-parallel", "gpt-oss-expert-parallel", "gpt-oss-tensor-parallel"],
)
def test_block_on_a_mesh_all_reduces_once(form, num_experts, mesh, monkeypatch):
    config = CONFIGS["mixtral"].replace(num_experts=num_experts)
    # gpt-oss's names are no family's yet: its rules, for this block.
    rules = shardings.param_rules(config) + moe_layer.sharding_rules(GPT_OSS)
    monkeypatch.setitem(shardings._PARAM_RULES, type(config), rules)
    mesh = shardings.make_mesh(MeshShape.parse(mesh))
    block = moe_layer.MoE(config, form, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(2)
    for _, var in nnx.to_flat_state(nnx.state(block, nnx.Param)):
        shape = var.get_value().shape
        var.set_value(
            jnp.asarray(
                rng.standard_normal(shape) / np.sqrt(shape[-2 if len(shape) > 1 else 0]),
                jnp.float32,
            )
        )
    graphdef, state = nnx.split(block)
    x = jax.random.normal(jax.random.key(1), (16, config.hidden_size))
    one = nnx.merge(graphdef, state)(x)[0]
    placed = jax.device_put(state, shardings.param_shardings(state, config, mesh))
    run = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, mesh=mesh)[0])
    np.testing.assert_allclose(run(placed, x), one, rtol=1e-5, atol=1e-5)
    hlo = run.lower(placed, x).compile().as_text()
    assert hlo.count("all-reduce(") == 1 and "all-gather" not in hlo and "all-to-all" not in hlo
    assert float(jnp.abs(one).max()) > 0.1
