"""An exception inside a step (KeyboardInterrupt included) leaves the `LLM` usable.

A step that raises after its KV cache was donated leaves the runner with deleted
buffers: the engine must replace the cache, abort the requests whose KV was in it,
return their pages and forget the prefix cache (its pages' contents are gone). One that
raises before the cache is donated loses nothing. Either way the next `generate` must
agree token for token with a fresh `LLM` that never failed.
"""

import jax
import pytest

from paxkv import LLM, SamplingParams

SMALL = dict(num_pages=64, page_size=8, max_num_seqs=4, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Six prompts sharing two full pages (16 tokens), so the prefix cache holds pages, and
# more prompts than max_num_seqs, so some wait while others run.
SHARED = list(range(3, 19))
PROMPTS = [{"prompt_token_ids": [*SHARED, 40 + i, 50 + i]} for i in range(6)]


def make_llm(**kwargs):
    return LLM("tiny", dtype="float32", max_model_len=64, warmup=False, **(SMALL | kwargs))


@pytest.fixture(scope="module")
def expected():
    """The oracle: greedy tokens of a fresh LLM that never failed."""
    return [o.outputs[0].token_ids for o in make_llm().generate(PROMPTS, GREEDY, use_tqdm=False)]


def interrupt_step(monkeypatch, runner, *, after_calls: int, donate: bool, program="forward"):
    """Makes the `after_calls`-th later call of the runner's step program `program`
    raise KeyboardInterrupt: after the real call ran (its cache donated, its result
    dropped) or before it (nothing donated)."""
    real = runner._program
    calls = []

    def compiled_program(name, key):
        compiled = real(name, key)
        if name != program:
            return compiled

        def call(*args):
            calls.append(1)
            if len(calls) < after_calls:
                return compiled(*args)
            monkeypatch.setattr(runner, "_program", real)  # once
            if donate:
                jax.block_until_ready(compiled(*args))
            raise KeyboardInterrupt

        return call

    monkeypatch.setattr(runner, "_program", compiled_program)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


# One step per call, synchronous or async; and the multi-step decode loop, interrupted
# in its first call (prefills done, every sequence decoding).
MODES = {
    "sync": ({}, "forward", 3),
    "async": ({"async_scheduling": True}, "forward", 3),
    "loop": ({"num_decode_steps": 4}, "loop", 1),
}


@pytest.mark.parametrize("mode", MODES)
def test_a_step_interrupted_after_donating_the_cache_loses_only_its_requests(
    monkeypatch, expected, mode
):
    settings, fn, after_calls = MODES[mode]
    llm = make_llm(**settings)
    engine, pool = llm.engine, llm.engine.pool
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    assert pool.num_cached > 0  # the shared pages, cached

    interrupt_step(monkeypatch, engine.runner, after_calls=after_calls, donate=True, program=fn)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not any(a.is_deleted() for a in jax.tree.leaves(engine.kv_cache))
    assert pool.num_cached == 0  # no page of the lost cache can be found
    assert pool.num_in_use == 0 and pool.num_free == pool.num_usable
    pool.check_invariants()
    # The interrupted call's requests end aborted: the running ones with why.
    reported = engine.step()
    assert {o.request_id for o in reported} == {str(i) for i in range(6, 12)}
    assert {o.outputs[0].finish_reason for o in reported} == {"abort"}
    errors = [o.error for o in reported if o.error is not None]
    assert errors and set(errors) == {"the KV cache was lost: a step raised KeyboardInterrupt"}
    assert not engine.has_unfinished()

    # Usable again, with nothing stale: equal to the fresh LLM, token for token.
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    assert pool.num_in_use == 0 and llm.stats()["kv_pages_in_use"] == 0
    pool.check_invariants()


def test_a_step_interrupted_before_the_call_loses_nothing(monkeypatch, expected):
    llm = make_llm()
    engine, pool = llm.engine, llm.engine.pool
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    cached = pool.num_cached
    interrupt_step(monkeypatch, engine.runner, after_calls=2, donate=False)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    # The cache was never given away: kept whole, prefix cache included.
    assert pool.num_cached >= cached
    reported = engine.step()  # the call's own requests, aborted by generate
    assert {o.outputs[0].finish_reason for o in reported} == {"abort"}
    assert all(o.error is None for o in reported)
    assert pool.num_in_use == 0
    hits = llm.stats()["prefix_cache_hits"]
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    assert llm.stats()["prefix_cache_hits"] > hits  # the cached pages served, correctly
    pool.check_invariants()


def test_an_interrupt_aborts_only_the_running_requests_of_other_callers(monkeypatch, expected):
    """A request added straight to the engine that was waiting when the cache was lost
    holds no KV: it goes on and completes as the oracle's."""
    llm = make_llm(max_num_seqs=1)
    engine = llm.engine
    engine.add_request("running", PROMPTS[0], GREEDY)
    engine.add_request("waiting", PROMPTS[1], GREEDY)
    interrupt_step(monkeypatch, engine.runner, after_calls=2, donate=True)
    with pytest.raises(KeyboardInterrupt):
        engine.run_until_done()
    final = engine.run_until_done()
    assert final["running"].outputs[0].finish_reason == "abort"
    assert final["running"].error == "the KV cache was lost: a step raised KeyboardInterrupt"
    assert final["waiting"].outputs[0].token_ids == expected[1]
    assert engine.pool.num_in_use == 0
