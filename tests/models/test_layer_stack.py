"""Scanned layers (`scan_layers`): the same model held stacked and run as one `lax.scan`.

The scanned model is checked against the looped one it was stacked from: dense logits,
the engine's greedy tokens (against the dense forward pass), quantized pages, multi-step
and async decoding, preemption; checkpoints read and written in either layout; and
the compiled program no larger for a deeper model.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_configs import PAGE_SIZE, small_config
from flax import nnx

from paxkv import SamplingParams
from paxkv.engine import Engine
from paxkv.engine.device.step import FORWARD, Carried, abstract_step_batch
from paxkv.kv_cache import PagedKVCache
from paxkv.measure.page_tables import page_table_from_host
from paxkv.models import (
    PRESETS,
    init_model,
    layer_stack,
    load_hf_checkpoint,
    restore_params,
    save_hf_checkpoint,
    save_params,
)
from paxkv.models.gemma_config import every_nth_full

PS = PAGE_SIZE


@pytest.fixture(scope="module")
def models():
    loop = init_model(PRESETS["tiny"].replace(dtype="float32"), seed=0)
    return loop, layer_stack.with_scan_layers(loop, True)


def _params(model):
    """Every parameter as NumPy, the layers one by one, keyed by path."""
    state = nnx.state(layer_stack.with_scan_layers(model, False), nnx.Param)
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state)}


def _assert_same_params(a, b):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for path in pa:
        np.testing.assert_array_equal(pa[path], pb[path], err_msg=str(path))


def test_stacking_keeps_every_parameter(models):
    loop, scan = models
    layers = scan.layers
    assert scan.config.scan_layers and not loop.config.scan_layers
    assert (layers.period, layers.repeats, len(layers.tail)) == (1, 2, 0)
    assert layers.blocks[0].self_attn.q_proj.kernel.get_value().shape == (2, 128, 256)
    _assert_same_params(loop, scan)
    back = layer_stack.with_scan_layers(scan, False)
    assert isinstance(back.layers, nnx.List) and len(back.layers) == 2
    _assert_same_params(back, loop)


def test_dense_logits_match_the_loop(models):
    loop, scan = models
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, 40), jnp.int32)
    np.testing.assert_allclose(scan.dense_logits(tokens), loop.dense_logits(tokens), atol=2e-5)


def test_stacked_cache_writes_where_the_per_layer_cache_does(models):
    loop, scan = models
    rng = np.random.default_rng(1)
    table = page_table_from_host(
        [[3, 1], [2]], [13, 5], [6, 5], page_size=PS, max_num_seqs=3, pages_per_seq=4
    )
    new = [jnp.asarray(rng.normal(size=(11, 2, 64)), jnp.float32) for _ in range(4)]
    for kv_dtype in ("auto", "int8"):
        flat = PagedKVCache.for_model(loop.config, 5, PS, kv_dtype)
        stacked = PagedKVCache.for_model(scan.config, 5, PS, kv_dtype)
        assert stacked.stacked and stacked.kv[0].shape == (10, 2, PS, 128)
        assert (stacked.num_pages, stacked.num_slots, stacked.num_layers) == (5, 2, 2)
        for layer in (0, 1):
            flat = flat.write(layer, new[2 * layer], new[2 * layer + 1], table)
            # A traced layer index, as inside the scan.
            write = jax.jit(lambda c, i, k, v: c.write(i, k, v, table))
            stacked = write(stacked, jnp.int32(layer), new[2 * layer], new[2 * layer + 1])
        for name in ("kv",) + (("kv_scales",) if flat.quantized else ()):
            per_layer = np.concatenate([np.asarray(x) for x in getattr(flat, name)])
            np.testing.assert_array_equal(per_layer, np.asarray(getattr(stacked, name)[0]))
        kw = stacked.attention_kwargs(1, table)
        np.testing.assert_array_equal(kw["block_tables"], np.asarray(table.block_tables) + 5)


def _engine(model, **kw):
    return Engine(model, small_config(**({"num_pages": 64} | kw)))


def _run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = engine.run_until_done()
    assert engine.pool.num_in_use == 0
    engine.pool.check_invariants()
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def _dense_greedy(model, prompt, n):
    step = jax.jit(model.dense_logits)
    tokens = list(prompt)
    for _ in range(n):
        padded = np.zeros(128, np.int32)
        padded[: len(tokens)] = tokens
        tokens.append(int(np.argmax(step(padded)[len(tokens) - 1])))
    return tokens[len(prompt) :]


def test_engine_greedy_matches_dense_forward(models):
    loop, scan = models
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (1, 7, 8, 9, 90, 25)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = [_dense_greedy(loop, p, 10) for p in prompts]
    for kw in ({}, {"num_decode_steps": 4}, {"enable_prefix_caching": False}):
        assert _run(_engine(scan, **kw), prompts, params) == expected, kw
    # 14 usable pages: each sequence fits alone, together they need 31 by the end.
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (17, 20, 9, 25, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [_dense_greedy(loop, p, 24) for p in prompts]
    for kw in ({}, {"num_decode_steps": 4}, {"async_scheduling": True}):
        engine = _engine(scan, num_pages=15, **kw)
        assert _run(engine, prompts, params) == expected, kw
        assert engine.stats()["num_preemptions"] > 0


def test_quantized_pages_give_the_loops_tokens(models):
    loop, scan = models
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (5, 33, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # int8 only: fp8 differs in how a row is quantized, not in how scanned layers
    # write and read the scales (fp8: the kernel tests and test_state's write round trip).
    want = _run(_engine(loop, kv_cache_dtype="int8"), prompts, params)
    assert _run(_engine(scan, kv_cache_dtype="int8"), prompts, params) == want


def test_checkpoints_load_and_save_in_either_layout(models, tmp_path):
    loop, scan = models
    # Shards of ~100 KB: the layers of one stacked parameter lie in several files.
    save_hf_checkpoint(loop, tmp_path / "hf", max_shard_bytes=100_000)
    stats = {}
    config, stacked = load_hf_checkpoint(tmp_path / "hf", scan_layers=True, stats=stats)
    assert (
        config.scan_layers and stacked.layers.blocks[0].mlp.up_proj.kernel.get_value().shape[0] == 2
    )
    _assert_same_params(stacked, loop)
    # Every tensor read once, whole.
    on_disk = sum(x.nbytes for x in _params(loop).values())
    assert stats["bytes_read"] == on_disk
    save_hf_checkpoint(scan, tmp_path / "hf_from_scan")
    _, again = load_hf_checkpoint(tmp_path / "hf_from_scan")
    _assert_same_params(again, loop)
    save_params(scan, tmp_path / "orbax")
    for scan_layers in (True, False):
        restored = restore_params(loop.config.replace(scan_layers=scan_layers), tmp_path / "orbax")
        assert restored.config.scan_layers == scan_layers
        _assert_same_params(restored, loop)


def _lowered_step(config, num_pages=64):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: init_model(config)))
    cache = jax.eval_shape(lambda: PagedKVCache.for_model(config, num_pages, PS))
    batch, _ = abstract_step_batch(16, 8, 4, PS)
    prev = jax.ShapeDtypeStruct((16,), jnp.int32)
    carried = Carried(prev, prev)
    return FORWARD.trace(graphdef, params, cache, batch, carried, attention_backend="auto").lower()


def test_a_deeper_model_lowers_to_the_same_program():
    # The program's text, not a timing: scanned, 2 and 12 layers lower to one body
    # (the same size up to the constants' digits); looped, the body is repeated.
    tiny = PRESETS["tiny"]
    size = lambda layers, scan: len(
        _lowered_step(tiny.replace(num_layers=layers, scan_layers=scan)).as_text()
    )
    assert abs(size(12, True) - size(2, True)) < 0.02 * size(2, True)
    assert size(12, False) > 2 * size(2, False)


def test_step_updates_the_stacked_cache_in_place():
    config = PRESETS["tiny"].replace(scan_layers=True)
    compiled = _lowered_step(config, num_pages=4096).compile()
    cache_bytes = PagedKVCache.for_model(config, 4096, PS).nbytes
    memory = compiled.memory_analysis()
    # A copy of the cache (or of one layer's pages) would show as temporary memory.
    assert memory.temp_size_in_bytes < cache_bytes / 16, (memory.temp_size_in_bytes, cache_bytes)
    assert memory.alias_size_in_bytes >= cache_bytes  # donated: the output is the input


def test_period_of_the_layer_kinds():
    assert layer_stack.period([None] * 5) == 1
    assert layer_stack.period([4, None] * 3) == 2
    assert layer_stack.period([4] * 5 + [None] + [4] * 2) == 6  # Gemma 3, cut short
    assert layer_stack.period([4, None, None]) == 3


def _gemma(name, **changes):
    config = PRESETS[name].replace(dtype="float32", **changes)
    loop = init_model(config, seed=1)
    return loop, layer_stack.with_scan_layers(loop, True)


@pytest.mark.parametrize(
    "name, layers, shape",
    [
        ("tiny-gemma2", 5, (2, 2, 1)),  # sliding, full: period 2, twice, then one
        ("tiny-gemma3", 6, (6, 1, 0)),  # five sliding to one full: period 6
        ("tiny-gemma3", 8, (6, 1, 2)),  # one period of six scanned, then two looped
    ],
)
def test_gemma_scans_over_the_period_of_its_windows(name, layers, shape):
    n = PRESETS[name].layer_types.index("full_attention") + 1
    # A window of 16 tokens, which the prompts outgrow.
    loop, scan = _gemma(
        name, num_layers=layers, layer_types=every_nth_full(layers, n), sliding_window=16
    )
    layers = scan.layers
    assert (layers.period, layers.repeats, len(layers.tail)) == shape
    _assert_same_params(loop, scan)
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, 256, 70), jnp.int32)
    np.testing.assert_allclose(scan.dense_logits(tokens), loop.dense_logits(tokens), atol=2e-5)
    # Hybrid pages (window groups let pages go) for every shape; uniform pages and
    # multi-step decode once (they do not depend on how the layers are grouped).
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (3, 20, 41, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [_dense_greedy(loop, p, 8) for p in prompts]
    engine_kwargs = [{}]
    if shape == (2, 2, 1):
        engine_kwargs += [{"hybrid_kv_cache": False}, {"num_decode_steps": 4}]
    for kw in engine_kwargs:
        engine = _engine(scan, num_pages=128, **kw)
        assert engine.kv_cache.stacked
        assert _run(engine, prompts, params) == expected, kw


_CACHED_WARMUP = """
import sys, jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
hits = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
)
from paxkv.engine import Engine, EngineConfig
from paxkv.models import load_model
_, model, _ = load_model("tiny", dtype="float32", scan_layers=True)
config = EngineConfig(num_pages=32, page_size=8, max_num_seqs=4, max_num_batched_tokens=16,
                      max_model_len=64, token_buckets=(16,), seq_buckets=(4,), page_buckets=(8,))
Engine(model, config).warmup()
print("hits", len(hits))
"""


def test_scanned_steps_load_from_the_compilation_cache(tmp_path):
    # Two processes: the second finds the scanned step in the persistent cache.
    import subprocess
    import sys

    run = lambda: subprocess.run(
        [sys.executable, "-c", _CACHED_WARMUP, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout.split()[-1]
    assert int(run()) == 0
    assert any(tmp_path.iterdir())
    assert int(run()) > 0
