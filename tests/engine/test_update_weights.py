"""`Engine.update_weights`: new parameters in place, checked against an engine built
fresh from them (token for token, f32), with no recompilation; weight versions, the
prefix cache, the policies for requests in flight, pause/resume, bad trees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_configs import small_config
from flax import nnx

from paxkv import LLM, SamplingParams
from paxkv.engine import Engine
from paxkv.models import load_model, save_hf_checkpoint
from paxkv.models.layer_stack import with_scan_layers

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
_RNG = np.random.default_rng(7)
PROMPTS = [_RNG.integers(1, 256, n).tolist() for n in (5, 19, 27)]
PROMPTS.append([*PROMPTS[2][:16], 3, 4, 5])  # shares two pages with PROMPTS[2]


def _perturbed(model) -> dict:
    """The model's parameters * 1.01 + noise, as a plain dict of host NumPy arrays."""
    rng = np.random.default_rng(1)
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return jax.tree.map(
        lambda x: (np.asarray(x) * 1.01 + rng.normal(0, 0.02, x.shape)).astype(x.dtype), state
    )


def _model_with(model, params: dict):
    """A copy of `model` holding `params`."""
    copy = nnx.clone(model)
    nnx.replace_by_pure_dict(state := nnx.state(copy, nnx.Param), jax.tree.map(jnp.asarray, params))
    nnx.update(copy, state)
    return copy


def _run(engine, prompts=PROMPTS, params=GREEDY, tag="r") -> dict[str, tuple]:
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    done = engine.run_until_done()
    return {rid: (done[rid].outputs[0].token_ids, done[rid].weight_versions) for rid in ids}


def _tokens(results: dict) -> list:
    return [tokens for tokens, _ in results.values()]


@pytest.fixture(scope="module")
def new_weights(tiny):
    _, model, _ = tiny
    params = _perturbed(model)
    fresh = Engine(_model_with(model, params), small_config(64))
    return params, _tokens(_run(fresh))


def test_update_matches_a_fresh_engine_without_recompiling(tiny, new_weights):
    _, model, _ = tiny
    params, expected = new_weights
    engine = Engine(model, small_config(64))
    engine.warmup()
    before = _run(engine, tag="a")
    _run(engine, tag="warm")  # every signature a step meets after its first
    compiled = engine.num_compilations
    hits = engine.scheduler.kv_cache_manager.prefix_cache.hits
    assert engine.update_weights(params) == 1 == engine.weight_version
    after = _run(engine, tag="b")
    assert _tokens(after) == expected
    assert _tokens(after) != _tokens(before)
    assert engine.num_compilations == compiled
    assert {v for _, v in before.values()} == {(0,)}
    assert {v for _, v in after.values()} == {(1,)}
    # PROMPTS were cached before the update: only PROMPTS[3]'s share of PROMPTS[2] hits.
    assert engine.scheduler.kv_cache_manager.prefix_cache.hits - hits == 16
    assert engine.pool.num_cached > 0


def test_bad_trees_change_nothing(tiny):
    _, model, _ = tiny
    engine = Engine(model, small_config(64))
    before = _tokens(_run(engine, tag="a"))
    params = engine.runner.params
    good = _perturbed(model)
    q = ("layers", 0, "self_attn", "q_proj", "kernel")

    def edited(path, value):
        tree = jax.tree.map(lambda x: x, good)
        node = tree
        for k in path[:-1]:
            node = node[k]
        if value is None:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        return tree

    cases = [
        (edited(q, None), r"lack 1 parameter.*layers\.0\.self_attn\.q_proj\.kernel"),
        (edited(("layers", 0, "extra"), np.ones(3, np.float32)), r"layers\.0\.extra"),
        (
            edited(q, good["layers"][0]["self_attn"]["q_proj"]["kernel"].T),
            r"layers\.0\.self_attn\.q_proj\.kernel: expected shape \(128, 256\) float32, "
            r"got shape \(256, 128\) float32",
        ),
        (
            edited(q, good["layers"][0]["self_attn"]["q_proj"]["kernel"].astype(np.float64)),
            r"q_proj\.kernel: expected shape \(128, 256\) float32, got shape \(128, 256\) float64",
        ),
        (edited(q, "weights"), r"q_proj\.kernel: expected an array .*, got a str"),
    ]
    nan = good["layers"][1]["mlp"]["up_proj"]["kernel"].copy()
    nan[3, 4] = np.nan
    cases.append(
        (
            edited(("layers", 1, "mlp", "up_proj", "kernel"), nan),
            r"layers\.1\.mlp\.up_proj\.kernel holds non-finite",
        )
    )
    for tree, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.update_weights(tree)
    with pytest.raises(ValueError, match="policy"):
        engine.update_weights(good, policy="later")
    assert engine.weight_version == 0
    assert engine.runner.params is params
    assert _tokens(_run(engine, tag="b")) == before


def _pointers(tree) -> set[int]:
    return {x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)}


@pytest.mark.parametrize("copy", [True, False])
def test_device_arrays_in_place_are_copied_or_held_and_checked_either_way(tiny, new_weights, copy):
    # A trainer's arrays, already in the engine's shardings: copied and checked in one
    # program (copy=True), or held as they are and checked (copy=False).
    _, model, _ = tiny
    params, expected = new_weights
    engine = Engine(model, small_config(64))
    on_device = jax.device_put(params, jax.devices()[0])
    nan = jax.tree.map(lambda x: x, on_device)
    nan["layers"][1]["mlp"]["up_proj"]["kernel"] = (
        on_device["layers"][1]["mlp"]["up_proj"]["kernel"].at[3, 4].set(jnp.nan)
    )
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj\.kernel holds non-finite"):
        engine.update_weights(nan, copy=copy)
    assert engine.weight_version == 0
    engine.update_weights(on_device, copy=copy)
    held = _pointers(on_device) & _pointers(nnx.state(engine.runner.params, nnx.Param))
    assert len(held) == (0 if copy else len(jax.tree.leaves(on_device)))
    if copy:  # the engine's weights are its own: the trainer may delete or donate its arrays
        jax.tree.map(lambda x: x.delete(), on_device)
    assert _tokens(_run(engine)) == expected


def test_scanned_model_takes_stacked_and_per_layer_trees(tiny):
    _, model, _ = tiny
    params = _perturbed(model)  # per layer: the tiny preset holds its layers one by one
    scanned = with_scan_layers(model, True)
    fresh = Engine(with_scan_layers(_model_with(model, params), True), small_config(64))
    expected = _tokens(_run(fresh))
    stacked = nnx.state(with_scan_layers(_model_with(model, params), True), nnx.Param)
    for tree in (params, stacked):
        engine = Engine(scanned, small_config(64))
        engine.update_weights(tree)
        assert _tokens(_run(engine)) == expected
    with pytest.raises(ValueError, match=r"layers\.1\.mlp"):
        Engine(scanned, small_config(64)).update_weights(
            {**params, "layers": {0: params["layers"][0]}}
        )


def _solo(engine, prompt, max_tokens):
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return _run(engine, [prompt], p, tag="solo")["solo0"][0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_policies(tiny, new_weights, async_scheduling):
    _, model, _ = tiny
    params, _ = new_weights
    old_engine = Engine(model, small_config(64))
    new_engine = Engine(_model_with(model, params), small_config(64))
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    a, b = PROMPTS[1], PROMPTS[0]

    def started(policy):
        engine = Engine(model, small_config(64, async_scheduling=async_scheduling))
        engine.add_request("a", {"prompt_token_ids": a}, long)
        seen = []
        for _ in range(4):
            seen += engine.step()
        engine.add_request("b", {"prompt_token_ids": b}, long)  # queued, not started
        engine.update_weights(params, policy=policy)
        done = {}
        while engine.has_unfinished():
            for out in seen + engine.step():
                if out.finished:
                    done[out.request_id] = out
            seen = []
        return done

    done = started("wait")
    assert done["a"].outputs[0].token_ids == _solo(old_engine, a, 12)
    assert done["a"].weight_versions == (0,)
    assert done["b"].outputs[0].token_ids == _solo(new_engine, b, 12)
    assert done["b"].weight_versions == (1,)

    done = started("abort")
    for rid in "ab":
        assert done[rid].outputs[0].finish_reason == "abort"
        assert "update_weights(policy='abort')" in done[rid].error
    assert done["a"].weight_versions == (0,)
    assert done["b"].weight_versions == () and done["b"].outputs[0].token_ids == []

    done = started("recompute")
    tokens = done["a"].outputs[0].token_ids
    old = _solo(old_engine, a, 12)
    k = next(i for i in range(12) if tokens[i] != old[i])  # where the new weights took over
    assert k > 0
    assert tokens[k:] == _solo(new_engine, a + old[:k], 12 - k)
    assert done["a"].weight_versions == (0, 1)
    assert done["b"].outputs[0].token_ids == _solo(new_engine, b, 12)


def test_pause_and_resume(tiny, new_weights):
    _, model, _ = tiny
    params, _ = new_weights
    engine = Engine(model, small_config(64))
    engine.add_request("a", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    engine.step()
    engine.pause()
    assert engine.paused
    computed = engine.scheduler.running[0].num_computed_tokens
    assert engine.step() == [] and engine.step() == []
    assert engine.scheduler.running[0].num_computed_tokens == computed
    with pytest.raises(RuntimeError, match="paused"):
        engine.run_until_done()
    with pytest.raises(ValueError, match="paused"):
        engine.update_weights(params)  # "wait" could never finish "a"
    assert engine.weight_version == 0
    assert engine.update_weights(params, policy="recompute") == 1  # a trainer's sync point
    engine.resume()
    done = engine.run_until_done()
    assert done["a"].weight_versions == (0, 1)


def test_llm_update_weights_from_a_checkpoint(tiny, new_weights, tmp_path):
    _, model, _ = tiny
    params, expected = new_weights
    save_hf_checkpoint(_model_with(model, params), tmp_path / "new")
    llm = LLM("tiny", dtype="float32", warmup=False, config=small_config(64))
    assert llm.update_weights(str(tmp_path / "new")) == 1
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert {o.weight_versions for o in outs} == {(1,)}
    _, other, _ = load_model("tiny-qwen3", dtype="float32")
    save_hf_checkpoint(other, tmp_path / "other")
    with pytest.raises(ValueError, match="another architecture"):
        llm.update_weights(tmp_path / "other")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ValueError, match=r"'.*empty' is not a checkpoint directory: .*config\.json"
    ):
        llm.update_weights(str(tmp_path / "empty"))
    assert llm.engine.weight_version == 1
