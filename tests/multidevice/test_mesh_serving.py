"""The engine on a mesh of 8 CPU devices: the tiny model (4 q heads, 2 KV heads) served
on one device, on model:2 (KV heads split) and on model:8 (KV heads replicated), and as
two model:4 replicas; outputs, shardings, capacity and compilations."""

import dataclasses
import functools
import os
import socket
import subprocess
import sys
from subprocess import PIPE

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from multidevice_env import xla_flags

from paxkv import SamplingParams
from paxkv.engine import Engine, EngineConfig
from paxkv.models import load_model
from paxkv.planner import capacity as plan
from paxkv.planner import parameters
from paxkv.sharding import shardings
from paxkv.sharding.mesh_shape import MeshShape

PS = 8
# Per-device KV bytes: 48 pages of the tiny model on one device (2 layers x K, V x 2
# heads x 8 tokens x 64 x 4 bytes = 16 KiB a page).
BUDGET = 48 * 16384
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, ignore_eos=True, seed=3)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, n).tolist() for n in lengths]


# Mixed: decode-sized to several pages, and two sharing a 16-token prefix (prefix cache).
PROMPTS = _prompts(0, (1, 5, 8, 9, 17, 40))
PROMPTS += [PROMPTS[-1][:16] + p for p in _prompts(1, (3, 11))]


@pytest.fixture(scope="module")
def tiny():
    config, model, _ = load_model("tiny", dtype="float32", seed=0)
    return config, model


def _config(num_pages: int, token_buckets=(16, 64)) -> EngineConfig:
    return EngineConfig(
        num_pages=num_pages,
        page_size=PS,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        token_buckets=token_buckets,
        seq_buckets=(8,),
        page_buckets=(16,),
    )


def _run(engine, prompts, params=GREEDY, prefix="r"):
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", {"prompt_token_ids": p}, params)
    done = engine.run_until_done()
    return [done[f"{prefix}{i}"].outputs[0] for i in range(len(prompts))]


class Served:
    """An engine sized from the per-device budget, warmed up, then run on PROMPTS."""

    def __init__(self, model, config, mesh_shape: MeshShape | None):
        self.shape = mesh_shape or MeshShape()
        self.mesh = None if mesh_shape is None else shardings.make_mesh(mesh_shape)
        self.num_pages = plan.num_pages_for_budget(
            config, kv_budget_bytes=BUDGET, page_size=PS, mesh=self.shape
        )
        self.engine = Engine(model, _config(self.num_pages), mesh=self.mesh)
        self.engine.warmup()
        self.warm_compilations = self.engine.num_compilations
        self.outputs = _run(self.engine, PROMPTS)
        self.sampled = _run(self.engine, PROMPTS[:3], SAMPLED, prefix="s")


@functools.cache
def _served(model, config, shape: str | None) -> Served:
    return Served(model, config, None if shape is None else MeshShape.parse(shape))


@pytest.fixture(scope="module")
def served(tiny):
    config, model = tiny
    return lambda shape: _served(model, config, shape)


MESHES = ["model:2", "model:8"]


@pytest.mark.parametrize("shape", MESHES)
def test_greedy_outputs_match_one_device(served, shape):
    one, mesh = served(None), served(shape)
    for a, b in zip(one.outputs, mesh.outputs, strict=True):
        assert b.token_ids == a.token_ids
        np.testing.assert_allclose(b.token_logprobs, a.token_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", [None, *MESHES])
def test_nothing_recompiles_after_warmup(served, shape):
    s = served(shape)
    assert s.warm_compilations > 0
    assert s.engine.num_compilations == s.warm_compilations
    assert all(len(c.token_ids) == SAMPLED.max_tokens for c in s.sampled)


def _specs(engine) -> dict[str, P]:
    return {
        ".".join(str(getattr(k, "key", k)) for k in path[:-1]): x.sharding.spec
        for path, x in jax.tree_util.tree_leaves_with_path(engine.runner.params)
    }


COLUMN, ROW, REPLICATED = P(None, "model"), P("model", None), P()


def test_weight_shardings_with_kv_heads_split(served):
    specs = _specs(served("model:2").engine)
    expected = {
        "embed_tokens.embedding": ROW,  # [V, h], split over the vocabulary
        "lm_head.kernel": COLUMN,  # [h, V]
        "norm.weight": REPLICATED,
    }
    for i in range(2):
        layer = f"layers.{i}"
        expected |= {
            f"{layer}.self_attn.q_proj.kernel": COLUMN,
            f"{layer}.self_attn.k_proj.kernel": COLUMN,
            f"{layer}.self_attn.v_proj.kernel": COLUMN,
            f"{layer}.self_attn.o_proj.kernel": ROW,
            f"{layer}.mlp.gate_proj.kernel": COLUMN,
            f"{layer}.mlp.up_proj.kernel": COLUMN,
            f"{layer}.mlp.down_proj.kernel": ROW,
            f"{layer}.input_layernorm.weight": REPLICATED,
            f"{layer}.post_attention_layernorm.weight": REPLICATED,
        }
    assert specs == expected


def test_weight_shardings_with_kv_heads_replicated(served):
    specs = _specs(served("model:8").engine)
    attention = {k: v for k, v in specs.items() if ".self_attn." in k}
    assert len(attention) == 8 and set(attention.values()) == {REPLICATED}  # 2 KV heads, 8 devices
    assert specs["layers.0.mlp.gate_proj.kernel"] == COLUMN  # 256 features split 8 ways
    assert specs["layers.0.mlp.down_proj.kernel"] == ROW
    assert specs["embed_tokens.embedding"] == ROW


@pytest.mark.parametrize("shape", MESHES)
def test_weights_per_device_are_the_plans(served, tiny, shape):
    config, _ = tiny
    s = served(shape)
    device = s.mesh.devices.flat[0]
    held = sum(
        shard.data.nbytes
        for x in jax.tree_util.tree_leaves(s.engine.runner.params)
        for shard in x.addressable_shards
        if shard.device == device
    )
    assert held == parameters.weights_bytes(config, mesh=s.shape)


@pytest.mark.parametrize(
    "shape, spec, local_heads", [("model:2", COLUMN, 1), ("model:8", REPLICATED, 2)]
)
def test_page_shardings(served, shape, spec, local_heads):
    s = served(shape)  # after its runs: the step's outputs keep the placement
    cache = s.engine.kv_cache
    for pages in cache.kv:
        assert pages.sharding.spec == spec
        assert pages.sharding.mesh == s.mesh
        assert {shard.data.shape for shard in pages.addressable_shards} == {
            (s.num_pages, local_heads, PS, 128)
        }


def test_pool_grows_with_devices_at_a_fixed_per_device_budget(served):
    one, split, replicated = served(None), served("model:2"), served("model:8")
    assert split.num_pages == 2 * one.num_pages  # 1 of 2 KV heads per device
    assert replicated.num_pages == one.num_pages  # every device holds both heads
    for s in (one, split, replicated):
        assert s.engine.pool.num_pages == s.num_pages
        leaves = jax.tree_util.tree_leaves(s.engine.kv_cache)
        devices = {shard.device for x in leaves for shard in x.addressable_shards}
        held = [
            sum(sh.data.nbytes for x in leaves for sh in x.addressable_shards if sh.device == d)
            for d in devices
        ]
        assert len(set(held)) == 1  # every device alike
        one_page = held[0] // s.num_pages
        assert held[0] <= BUDGET < held[0] + one_page  # the budget, to a page


def test_data_parallel_replicas_serve_independently(tiny):
    config, model = tiny
    mesh = shardings.make_mesh(MeshShape(model=4, data=2))
    replicas = shardings.replica_meshes(mesh)
    assert [r.shape for r in replicas] == [{"data": 1, "model": 4}] * 2
    assert not set(replicas[0].devices.flat) & set(replicas[1].devices.flat)
    with pytest.raises(ValueError, match="one Engine per"):
        Engine(model, _config(16), mesh=mesh)
    with pytest.raises(ValueError, match="holds devices of 2 replicas"):
        shardings.process_replica(mesh)
    # Each replica its own engine (scheduler, pool, cache) on its own devices; one step
    # shape each, as every replica compiles its own.
    engines = [Engine(model, _config(32, token_buckets=(64,)), mesh=r) for r in replicas]
    halves = [PROMPTS[:4], PROMPTS[4:]]
    outputs = [_run(e, half) for e, half in zip(engines, halves, strict=True)]
    for e, r in zip(engines, replicas, strict=True):
        assert e.kv_cache.kv[0].sharding.mesh == r
    expected = _served(model, config, None).outputs
    got = outputs[0] + outputs[1]
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]


def test_launch_flags_set_the_default_mesh(served, tiny, tmp_path):
    from absl import flags

    from paxkv.engine import compile_cache
    from paxkv.launch import flags as launch_flags

    _, model = tiny
    split = served("model:2")
    cache_dir = jax.config.jax_compilation_cache_dir  # the suite's (tests/conftest.py)
    flags.FLAGS(["app", "--mesh=model:2", f"--compilation_cache_dir={tmp_path}"])
    try:
        assert launch_flags.init_runtime() == MeshShape(model=2)
        assert jax.config.jax_compilation_cache_dir == compile_cache.programs_dir(str(tmp_path))
        engine = Engine(model, _config(split.num_pages))  # no mesh given: the flag's
        assert engine.mesh == split.mesh
        assert engine.kv_cache.kv[0].sharding == split.engine.kv_cache.kv[0].sharding
        assert [c.token_ids for c in _run(engine, PROMPTS[:2])] == [
            c.token_ids for c in split.outputs[:2]
        ]
    finally:
        shardings.set_default_mesh(None)
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        flags.FLAGS.unparse_flags()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_serve_one_model_parallel_replica():
    """`--jax_distributed` over two CPU processes of 2 devices each, `model:4` spanning both
    (JAX's multi-controller runtime, gloo collectives), against one plain device."""
    generate = [
        sys.executable,
        "-m",
        "paxkv.launch.generate",
        "--prompt=def f(x):",
        "--max_tokens=5",
        "--temperature=0",
        "--num_pages=16",
        "--max_num_seqs=4",
        "--max_num_batched_tokens=16",  # one step shape: one compilation
        "--max_model_len=64",
    ]
    port = _free_port()
    distributed = [
        "--jax_distributed",
        f"--coordinator_address=localhost:{port}",
        "--num_processes=2",
        "--mesh=model:4",
    ]
    env = os.environ | {
        "XLA_FLAGS": xla_flags(2),
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
    }
    argvs = [generate, *([*generate, *distributed, f"--process_id={i}"] for i in range(2))]
    procs = [subprocess.Popen(a, stdout=PIPE, stderr=PIPE, text=True, env=env) for a in argvs]
    runs = [(*p.communicate(timeout=240), p.returncode) for p in procs]
    completions = []
    for out, err, rc in runs:
        assert rc == 0, err[-3000:]
        completions.append([line for line in out.splitlines() if "completion:" in line])
    assert len(completions[0]) == 1
    assert completions[1] == completions[2] == completions[0]


@pytest.mark.parametrize("mode", [{"num_decode_steps": 4}, {"async_scheduling": True}])
def test_multi_step_and_async_on_a_mesh_match_one_device(served, tiny, mode):
    """N decode steps per call and async scheduling on model:2 give the one-device
    greedy outputs, with no compilation after warm-up."""
    _, model = tiny
    one = served(None)
    mesh = shardings.make_mesh(MeshShape.parse("model:2"))
    config = dataclasses.replace(_config(one.num_pages), **mode)
    engine = Engine(model, config, mesh=mesh)
    engine.warmup()
    warm = engine.num_compilations
    got = _run(engine, PROMPTS)
    assert [c.token_ids for c in got] == [c.token_ids for c in one.outputs]
    assert engine.num_compilations == warm
    if "num_decode_steps" in mode:
        assert engine.stats()["num_decode_loops"] > 0
    assert engine.pool.num_in_use == 0


def test_kv_heads_repeated_when_the_model_axis_outnumbers_them(served, tiny):
    """The tiny model's 2 KV heads on model:4: each is repeated twice, every device holds
    the pages of one KV head (not both), the pool per device matches the planner, and the
    greedy outputs equal the one-device run."""
    config, model = tiny
    one = served(None)
    shape = MeshShape.parse("model:4")
    assert shape.kv_head_factor(config.num_kv_heads, config.num_heads) == 2
    assert shape.kv_heads_per_device(config.num_kv_heads, config.num_heads) == 1
    num_pages = plan.num_pages_for_budget(config, kv_budget_bytes=BUDGET, page_size=PS, mesh=shape)
    assert num_pages == 2 * one.num_pages  # half the heads per device: twice the pages
    engine = Engine(model, _config(num_pages), mesh=shardings.make_mesh(shape))
    assert engine.model_config.num_kv_heads == 4 and model.config.num_kv_heads == 2
    for layer in engine.kv_cache.kv:
        assert layer.shape[1] == 4
        for shard in layer.addressable_shards:
            assert shard.data.shape[1] == 1
    got = _run(engine, PROMPTS)
    assert [c.token_ids for c in got] == [c.token_ids for c in one.outputs]
    assert engine.pool.num_in_use == 0
