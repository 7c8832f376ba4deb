"""Mesh shapes, the sharding rules, and sharding-aware capacity, on one device.

The engine on a real mesh of 8 devices is `tests/multidevice/` (run by test_multidevice.py).
"""

import functools
import json
import math
import subprocess
import sys
from subprocess import PIPE

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from paxkv.models import PRESETS, init_model
from paxkv.planner import capacity as plan
from paxkv.planner import kv_budget, parameters
from paxkv.planner.capacity_report import build_report
from paxkv.planner.workloads import Workload
from paxkv.sharding import shardings
from paxkv.sharding.mesh_shape import MeshShape

TINY = PRESETS["tiny"]


@pytest.mark.parametrize(
    "text, shape",
    [
        ("model:4,data:2", MeshShape(model=4, data=2)),
        ("data:2, model:4", MeshShape(model=4, data=2)),
        ("model:8", MeshShape(model=8)),
        ("data:3", MeshShape(data=3)),
    ],
)
def test_parse_mesh(text, shape):
    assert MeshShape.parse(text) == shape
    assert MeshShape.parse(str(shape)) == shape


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "'' is not axis:size"),
        ("model4", "'model4' is not axis:size"),
        ("model:", "'model:' is not axis:size"),
        ("gpu:2", "unknown mesh axis 'gpu'; the axes are data and model"),
        ("model:2,model:4", "mesh axis 'model' is given twice"),
        ("model:two", "mesh axis model size 'two' is not an integer"),
        ("model:0", "mesh axis model=0 must be a positive integer"),
        ("model:4,data:-1", "mesh axis data=-1 must be a positive integer"),
    ],
)
def test_parse_mesh_errors(text, match):
    with pytest.raises(ValueError, match=match):
        MeshShape.parse(text)


def test_kv_heads_split_only_when_they_divide():
    assert MeshShape(model=4).kv_heads_per_device(8) == 2
    assert MeshShape(model=8).kv_heads_per_device(8) == 1
    assert MeshShape(model=16).kv_heads_per_device(8) == 8  # replicated
    assert MeshShape(model=4).kv_heads_per_device(6) == 6


@functools.cache
def _abstract_params(name: str):
    _, params = nnx.split(nnx.eval_shape(lambda: init_model(PRESETS[name])))
    return params


def _specs(name: str, model: int) -> dict[str, P]:
    config = PRESETS[name]
    mesh = AbstractMesh((1, model), ("data", "model"))
    specs = shardings.param_specs(_abstract_params(name), config, mesh)
    return {
        ".".join(str(getattr(k, "key", k)) for k in path[:-1]): spec
        for path, spec in jax.tree_util.tree_leaves_with_path(
            specs, is_leaf=lambda x: isinstance(x, P)
        )
    }


def test_megatron_rules_on_llama_8b():
    specs = _specs("llama-3.1-8b", 8)
    col, row = P(None, "model"), P("model", None)
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert specs[f"layers.3.self_attn.{proj}.kernel"] == col
    assert specs["layers.3.self_attn.o_proj.kernel"] == row
    assert specs["layers.3.mlp.gate_proj.kernel"] == specs["layers.3.mlp.up_proj.kernel"] == col
    assert specs["layers.3.mlp.down_proj.kernel"] == row
    assert specs["embed_tokens.embedding"] == row and specs["lm_head.kernel"] == col
    assert specs["norm.weight"] == specs["layers.3.input_layernorm.weight"] == P()


def test_experts_split_by_expert_else_inside_each_expert():
    # 8 experts on model:8: one expert per device (expert parallelism).
    specs = _specs("mixtral-8x7b", 8)
    moe = "layers.3.block_sparse_moe"
    for name in ("w1", "w2", "w3"):
        assert specs[f"{moe}.experts.{name}"] == P("model", None, None)
    assert specs[f"{moe}.gate.kernel"] == P()  # the router, replicated
    assert specs["layers.3.self_attn.q_proj.kernel"] == P(None, "model")
    # model:16 does not divide 8 experts: each expert's 14336 features split instead.
    specs = _specs("mixtral-8x7b", 16)
    assert specs[f"{moe}.experts.w1"] == specs[f"{moe}.experts.w3"] == P(None, None, "model")
    assert specs[f"{moe}.experts.w2"] == P(None, "model", None)
    # Qwen3-MoE: its names, 128 experts over 8, q/k norms replicated.
    specs = _specs("qwen3-30b-a3b", 8)
    assert specs["layers.0.mlp.experts.down_proj"] == P("model", None, None)
    assert specs["layers.0.self_attn.q_norm.weight"] == specs["layers.0.mlp.gate.kernel"] == P()


def test_a_rule_that_does_not_split_falls_through_to_the_next():
    assert shardings.kernel_spec(shardings.EXPERT, 3) == P("model", None, None)
    assert shardings.kernel_spec(shardings.EXPERT, 2, bias=True) == P("model", None)
    assert shardings.kernel_spec(shardings.ROW, 3, bias=True) == P()
    config = PRESETS["tiny-mixtral"].replace(num_experts=6)  # 128 features each
    mesh = AbstractMesh((1, 4), ("data", "model"))
    spec = lambda name, shape: shardings.param_spec(("experts", name), shape, config, mesh)
    assert spec("w1", (6, 128, 128)) == P(None, None, "model")
    assert spec("w2", (6, 128, 128)) == P(None, "model", None)
    odd = config.replace(intermediate_size=6)  # neither divides by 4: replicated
    assert shardings.param_spec(("experts", "w1"), (6, 128, 6), odd, mesh) == P()


def test_attention_replicates_with_fewer_kv_heads_than_devices():
    specs = _specs("qwen2.5-7b", 8)  # 4 KV heads; q/k/v carry biases
    attention = {k: s for k, s in specs.items() if ".self_attn." in k}
    assert "layers.0.self_attn.q_proj.bias" in attention
    assert set(attention.values()) == {P()}
    assert specs["layers.0.mlp.gate_proj.kernel"] == P(None, "model")
    split = _specs("qwen2.5-7b", 4)
    assert split["layers.0.self_attn.k_proj.bias"] == P("model")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_plan_counts_the_sharded_parameters(name):
    config = PRESETS[name]
    params = _abstract_params(name)
    shapes = [x.shape for x in jax.tree_util.tree_leaves(params)]
    for model in (1, 2, 4, 8, 16):
        mesh = AbstractMesh((1, model), ("data", "model"))
        specs = jax.tree_util.tree_leaves(
            shardings.param_specs(params, config, mesh), is_leaf=lambda x: isinstance(x, P)
        )
        held = sum(
            math.prod(shape) // (model if "model" in spec else 1)
            for shape, spec in zip(shapes, specs, strict=True)
        )
        assert held == parameters.num_parameters_per_device(config, MeshShape(model=model)), model
        if model == 1:
            assert held == parameters.num_parameters(config)


def test_pages_per_device_budget():
    budget = 48 * 16384  # 48 pages of the tiny model on one device
    pages = lambda **mesh: plan.num_pages_for_budget(
        TINY, kv_budget_bytes=budget, page_size=8, mesh=MeshShape(**mesh)
    )
    assert pages() == 48
    assert pages(model=2) == 96  # each device holds 1 of the 2 KV heads
    assert pages(model=8) == 48  # replicated: both heads on every device
    assert pages(model=2, data=4) == 96  # per replica
    assert plan.num_pages_for_budget(
        TINY, kv_budget_bytes=budget, page_size=8, kv_cache_dtype="int8"
    ) == budget // (2 * 2 * 2 * 8 * (64 + 2))  # int8 entries and a bf16 scale per token-head


def test_capacity_per_device_and_in_total():
    model = PRESETS["llama-3.1-8b"]
    common = dict(
        kv_budget_bytes=20 * kv_budget.GIB,
        page_size=16,
        lengths=np.array([1024]),
        max_model_len=8192,
    )
    one = plan.plan_capacity(model, **common)
    mesh = plan.plan_capacity(model, mesh=MeshShape(model=4, data=2), **common)
    assert mesh.kv_heads_per_device == 2 and mesh.page_bytes * 4 == one.page_bytes
    assert mesh.num_pages == 4 * one.num_pages  # per replica
    assert mesh.paged_concurrency >= 4 * one.paged_concurrency
    assert mesh.total_num_pages == 2 * mesh.num_pages
    assert mesh.total_paged_concurrency == 2 * mesh.paged_concurrency
    assert mesh.total_kv_budget_bytes == 8 * 20 * kv_budget.GIB
    assert mesh.num_devices == 8
    data = mesh.to_dict()
    assert data["total_num_pages"] == mesh.total_num_pages and data["model_parallel"] == 4


def test_report_on_a_mesh():
    model = PRESETS["llama-3.1-8b"]
    mesh = MeshShape(model=4, data=2)
    weights = parameters.weights_bytes(model, mesh=mesh)
    assert weights < parameters.weights_bytes(model) / 3.9
    report = build_report(
        model,
        name="llama-3.1-8b",
        budget=kv_budget.KVBudget.on_device("v6e", weights_bytes=weights, kv_fraction=0.9),
        workload=Workload("fixed", prompt_len=512, output_len=512),
        page_size=16,
        max_model_len=8192,
        mesh=mesh,
    )
    text = report.to_markdown()
    assert (
        "- mesh: model:4,data:2 = 8 devices, 2 replicas of 4; 8 KV heads split 2 per device" in text
    )
    auto = report.plans["auto"]
    assert f"{auto.total_num_pages} pages, {auto.total_paged_concurrency} paged" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["mesh"] == {"model": 4, "data": 2, "num_devices": 8}


def test_launch_flags():
    plan_app = [sys.executable, "-m", "paxkv.launch.plan", "--setup=tiny", "--kv_budget_gib=0.01"]
    generate = [sys.executable, "-m", "paxkv.launch.generate", "--prompt=a"]
    argvs = {
        "ok": [*plan_app, "--mesh=model:2,data:2"],
        "bad": [*plan_app, "--mesh=model:4,tp:2"],
        "stray": [*generate, "--process_id=1", "--num_processes=2"],
        "too_big": [*generate, "--mesh=model:2"],  # one CPU device here
    }
    procs = {k: subprocess.Popen(a, stdout=PIPE, stderr=PIPE, text=True) for k, a in argvs.items()}
    runs = {k: (*p.communicate(timeout=120), p.returncode) for k, p in procs.items()}
    out, err, rc = runs["ok"]
    assert rc == 0, err
    assert "- mesh: model:2,data:2 = 4 devices, 2 replicas of 2; 2 KV heads split 1" in out
    expected_errors = {
        "bad": "error: --mesh=model:4,tp:2: unknown mesh axis 'tp'",
        "stray": "error: --num_processes, --process_id only apply with --jax_distributed",
        "too_big": "error: mesh model:2,data:1 needs 2 devices, and 1 are visible",
    }
    for name, message in expected_errors.items():
        _, err, rc = runs[name]
        assert rc == 2 and message in err, (name, err)


@pytest.mark.parametrize(
    "name", ["tiny", "tiny-mixtral", "tiny-gpt-oss", "tiny-gemma3", "qwen2.5-7b"]
)
def test_plan_counts_the_sharded_bytes_of_quantized_weights(name):
    pytest.importorskip("qwix")
    from paxkv.models.quantized_weights import quantize_model

    def quantized():
        model = init_model(PRESETS[name])
        quantize_model(model, "int8")
        return model

    _, params = nnx.split(nnx.eval_shape(quantized))
    config = PRESETS[name].replace(quantization="int8")
    leaves = jax.tree_util.tree_leaves(params)
    for model in (1, 2, 4, 8):
        mesh = AbstractMesh((1, model), ("data", "model"))
        specs = jax.tree_util.tree_leaves(
            shardings.param_specs(params, config, mesh), is_leaf=lambda x: isinstance(x, P)
        )
        held = sum(
            math.prod(x.shape) // (model if "model" in spec else 1) * x.dtype.itemsize
            for x, spec in zip(leaves, specs, strict=True)
        )
        assert held == parameters.weights_bytes(config, mesh=MeshShape(model=model)), model
