"""`Engine.sleep` / `wake_up` (`paxkv.engine.sleep`): device memory released and placed
back (counted over the live device arrays), the same greedy tokens after waking with
nothing recompiled, sequences in flight preempted and finished as if never asleep, no
page leaked, requests that wait or are refused, dropped weights replaced by
`update_weights`, and the bad calls changing nothing."""

import gc
import threading

import jax
import numpy as np
import pytest
from engine_configs import small_config
from flax import nnx

from paxkv import LLM, SamplingParams
from paxkv.engine import Engine
from paxkv.engine.sleep import EngineAsleep

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], list(range(5, 45)), [7] * 20]


def _device_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays() if a.sharding.memory_kind == "device")


def _run(engine, tag, prompts=PROMPTS):
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": p}, GREEDY)
    done = engine.run_until_done()
    return [done[f"{tag}{i}"].outputs[0].token_ids for i in range(len(prompts))]


def _free(engine) -> bool:
    return engine.pool.num_in_use == 0


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_device_memory_and_wake_up_restores_it_without_recompiling(tiny, level):
    _, model, _ = tiny
    # The engine's own copy of the weights: those of a model the caller holds stay alive.
    engine = Engine(_own_copy(model), small_config(64))
    expected = _run(engine, "a")
    compiled = engine.num_compilations
    cache = sum(a.nbytes for a in jax.tree.leaves(engine.runner.kv_cache))
    params = sum(a.nbytes for a in jax.tree.leaves(nnx.state(engine.runner.params, nnx.Param)))
    before = _device_bytes()
    slept = engine.sleep(level=level)
    asleep = _device_bytes()
    assert slept["released_bytes"] == cache + (params if level == 2 else 0)
    assert before - asleep >= slept["released_bytes"]
    assert engine.asleep == level and engine.paused
    assert engine.pool.num_cached == 0  # the prefix cache forgot its pages: they are gone
    woke = engine.wake_up()
    assert woke["restored_bytes"] == slept["released_bytes"] == _device_bytes() - asleep
    assert engine.asleep == 0 and not engine.paused
    assert _run(engine, "b") == expected
    assert engine.num_compilations == compiled
    assert _free(engine)


def _own_copy(model):
    copy = nnx.clone(model)
    state = nnx.state(copy)
    nnx.update(copy, jax.tree.map(lambda x: x.copy(), state))
    return copy


def test_a_model_the_caller_holds_keeps_its_weights_and_they_are_not_counted(tiny):
    _, model, _ = tiny
    engine = Engine(model, small_config(64))  # shares the caller's arrays
    expected = _run(engine, "a")
    cache = sum(a.nbytes for a in jax.tree.leaves(engine.runner.kv_cache))
    assert engine.sleep(level=2)["released_bytes"] == cache
    assert all(not a.is_deleted() for a in jax.tree.leaves(nnx.state(model)))
    engine.wake_up()
    assert _run(engine, "b") == expected


def test_sequences_in_flight_recompute_after_waking_and_finish_the_same(tiny):
    _, model, _ = tiny
    engine = Engine(_own_copy(model), small_config(64))
    expected = _run(engine, "a")
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"b{i}", {"prompt_token_ids": p}, GREEDY)
    for _ in range(4):  # prefilled and a few tokens decoded
        engine.step()
    engine.sleep(level=2)
    assert len(engine.step()) == 0  # asleep: nothing runs
    engine.wake_up()
    done = engine.run_until_done()
    assert [done[f"b{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
    assert _free(engine)


def test_a_call_waits_for_wake_up_or_is_refused():
    llm = LLM(
        "tiny",
        warmup=False,
        num_pages=64,
        page_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
    )
    prompt = [{"prompt_token_ids": PROMPTS[1]}]
    expected = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.sleep(level=1)
    got = []
    waiter = threading.Thread(
        target=lambda: got.append(llm.generate(prompt, GREEDY, use_tqdm=False))
    )
    waiter.start()
    waiter.join(timeout=1.0)
    assert waiter.is_alive() and not got  # waiting, asleep
    llm.wake_up()
    waiter.join(timeout=60)
    assert got[0][0].outputs[0].token_ids == expected
    llm.sleep(level=1, requests="refuse")
    with pytest.raises(EngineAsleep, match=r"asleep \(sleep\(level=1, requests='refuse'\)\)"):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    with pytest.raises(EngineAsleep):
        llm.engine.add_request("x", {"prompt_token_ids": [1, 2]}, GREEDY)
    assert not llm.engine.has_unfinished()
    llm.wake_up()
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_dropped_weights_come_back_through_update_weights(tiny):
    _, model, _ = tiny
    engine = Engine(nnx.clone(model), small_config(64))
    expected = _run(engine, "a")
    weights = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    engine.sleep(level=2, weights="drop")
    with pytest.raises(ValueError, match="dropped the weights, and none came since"):
        engine.wake_up()
    assert engine.asleep == 2  # still asleep, nothing placed
    assert engine.update_weights(weights) == 1  # checked and placed in the device shardings
    engine.wake_up()
    assert _run(engine, "b") == expected


def test_bad_calls_change_nothing(tiny):
    _, model, _ = tiny
    engine = Engine(nnx.clone(model), small_config(64))
    for kwargs, message in [
        ({"level": 3}, "level=3 must be one of"),
        ({"level": True}, "level=True must be one of"),
        ({"weights": "disk"}, "weights='disk' must be one of"),
        ({"requests": "queue"}, "requests='queue' must be one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.sleep(**kwargs)
        assert engine.asleep == 0
    assert engine.wake_up() == {"restored_bytes": 0, "seconds": 0.0}  # awake: a no-op
    engine.sleep()
    with pytest.raises(ValueError, match=r"asleep already \(level 1\)"):
        engine.sleep(level=2)
    assert engine.asleep == 1
    engine.wake_up()
    assert len(_run(engine, "a")) == len(PROMPTS)
