"""The engine end to end on the tiny model: token-for-token against a dense forward pass."""

import functools

import jax
import numpy as np
import pytest
from engine_configs import PAGE_SIZE, small_config

from paxkv import LLM, SamplingParams
from paxkv.engine import Engine
from paxkv.host.sequence import PLACEHOLDER_TOKEN as PLACEHOLDER

PS = PAGE_SIZE
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


DENSE_LEN = 128


@functools.cache
def _dense_fn(model):
    # Causal, so zero padding at the end changes none of the earlier rows' logits; one
    # fixed length compiles once.
    return jax.jit(lambda tokens: model.dense_logits(tokens))


def _engine(model, tokenizer=None, **kw):
    return Engine(model, small_config(**({"num_pages": 64} | kw)), tokenizer=tokenizer)


def _run(engine, prompts, params=GREEDY):
    """Final outputs of `prompts`, in order; `params` is one for all or one per prompt."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    done = engine.run_until_done()
    return [done[str(i)] for i in range(len(prompts))]


def _dense_greedy(model, prompt, n):
    tokens, logprobs = list(prompt), []
    for _ in range(n):
        padded = np.zeros(DENSE_LEN, np.int32)
        padded[: len(tokens)] = tokens
        logits = np.asarray(_dense_fn(model)(padded)[len(tokens) - 1], np.float64)
        nxt = int(np.argmax(logits))
        logprobs.append(
            float(logits[nxt] - np.log(np.exp(logits - logits.max()).sum()) - logits.max())
        )
        tokens.append(nxt)
    return tokens[len(prompt) :], logprobs


def _prompts(vocab, seed=0):
    rng = np.random.default_rng(seed)
    # Lengths 1, page - 1, page, page + 1 and long (several pages, chunked by the budget).
    return [rng.integers(0, vocab, size=n).tolist() for n in (1, PS - 1, PS, PS + 1, 90)]


def test_greedy_matches_dense_forward_token_for_token(tiny):
    config, model, _ = tiny
    prompts = _prompts(config.vocab_size)
    outs = _run(_engine(model), prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        expected, logprobs = _dense_greedy(model, prompt, GREEDY.max_tokens)
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].finish_reason == "length"
        np.testing.assert_allclose(out.outputs[0].token_logprobs, logprobs, rtol=1e-4, atol=1e-4)


def test_preemption_and_pool_size_do_not_change_outputs(tiny):
    config, model, _ = tiny
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (17, 20, 9, 25, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    big = _engine(model)
    reference = [o.outputs[0].token_ids for o in _run(big, prompts, params)]
    assert big.stats()["num_preemptions"] == 0
    # 14 usable pages of 8 tokens: each sequence fits alone (at most 49 tokens, 7 pages),
    # but together they need 31 pages by the end.
    small = _engine(model, num_pages=15)
    got = [o.outputs[0].token_ids for o in _run(small, prompts, params)]
    assert small.stats()["num_preemptions"] > 0
    assert got == reference
    assert small.pool.num_in_use == 0
    small.pool.check_invariants()


def test_no_recompilation_after_warmup(tiny):
    config, model, _ = tiny
    # Bucket shapes no other test compiles, since engines share compilations.
    engine = _engine(
        model,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        token_buckets=(24, 48),
        seq_buckets=(6,),
        page_buckets=(8, 16),
    )
    engine.warmup()
    warm = engine.num_compilations
    # One forward program per (token, sequence, page) bucket (4), a penalty sampler per
    # (sequence, page) bucket (2), a scoring sampler per (token, sequence) bucket (2) and
    # a token-mask sampler (structured outputs) per sequence bucket (1).
    assert warm == 9
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (3, 50, 17, 1, 33, 8)]
    _run(engine, prompts, SamplingParams(temperature=0.8, max_tokens=5, seed=1))
    assert engine.num_compilations == warm


def test_seed_reproduces_sample(tiny):
    _config, model, _ = tiny
    prompt = [[5, 6, 7]]
    sampled = lambda seed: _run(
        _engine(model), prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=seed)
    )[0]
    a, b, c = sampled(11), sampled(11), sampled(12)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].token_ids != c.outputs[0].token_ids


def test_bad_requests_are_rejected_and_others_unaffected(tiny):
    config, model, _ = tiny
    engine = _engine(model)
    good = [1, 2, 3]
    engine.add_request("good", {"prompt_token_ids": good}, GREEDY)
    engine.step()  # the good request is running when the bad ones arrive
    bad = [
        ({"prompt_token_ids": []}, GREEDY, "the prompt is empty"),
        (
            {"prompt_token_ids": [1, config.vocab_size]},
            GREEDY,
            f"token id {config.vocab_size} at position 1",
        ),
        ({"prompt_token_ids": [-1]}, GREEDY, "token id -1 at position 0"),
        ({"prompt_token_ids": [1] * 129}, GREEDY, "longer than max_model_len=128"),
        ({"prompt_token_ids": [1] * 125}, GREEDY, "exceeds max_model_len=128"),
        ("a string", GREEDY, "needs a tokenizer"),
        (42, GREEDY, "a prompt must be a str or a dict"),
    ]
    for i, (prompt, params, message) in enumerate(bad):
        with pytest.raises(ValueError, match=message):
            engine.add_request(f"bad{i}", prompt, params)
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", {"prompt_token_ids": good}, GREEDY)
    done = engine.run_until_done()
    assert list(done) == ["good"]
    assert done["good"].outputs[0].token_ids == _dense_greedy(model, good, GREEDY.max_tokens)[0]
    assert engine.pool.num_in_use == 0


def test_abort_frees_pages_and_reports(tiny):
    _config, model, _ = tiny
    engine = _engine(model)
    engine.add_request("a", {"prompt_token_ids": list(range(40))}, GREEDY)
    engine.add_request("b", {"prompt_token_ids": [1, 2]}, GREEDY)
    engine.step()
    assert engine.pool.num_in_use > 0
    engine.abort("a")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finished and outs["a"].outputs[0].finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_in_use == 0
    engine.pool.check_invariants()
    engine.abort("a")  # finished already: a no-op, as in vLLM
    engine.abort("never-submitted")
    assert not engine.has_unfinished() and engine.step() == []


def test_llm_api_generate_and_stream(tiny):
    llm = LLM(
        model="tiny",
        warmup=False,
        dtype="float32",
        num_pages=64,
        page_size=PS,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
    )
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(["def f(x):", {"prompt_token_ids": [10, 20, 30]}], params)
    assert [o.request_id for o in outs] == ["0", "1"]
    assert outs[0].prompt == "def f(x):" and outs[0].prompt_token_ids == list(b"def f(x):")
    assert len(outs[0].outputs[0].token_ids) == 5 and isinstance(outs[0].outputs[0].text, str)
    assert outs[0].metrics.ttft is not None and outs[0].num_cached_tokens == 0
    streamed = [o for o in llm.generate_stream(["def f(x):"], params)]
    assert [len(o.outputs[0].token_ids) for o in streamed] == [1, 2, 3, 4, 5]
    assert (
        streamed[-1].finished and streamed[-1].outputs[0].token_ids == outs[0].outputs[0].token_ids
    )
    with pytest.raises(ValueError, match=r"prompt 1: .*the prompt is empty"):
        llm.generate(["ok", {"prompt_token_ids": []}], params)
    assert not llm.engine.has_unfinished()
    with pytest.raises(TypeError, match="unknown arguments"):
        LLM(model="tiny", num_page=3)


def test_prefix_caching_on_and_off_give_identical_outputs(tiny):
    config, model, _ = tiny
    rng = np.random.default_rng(5)
    system = rng.integers(0, config.vocab_size, size=27).tolist()  # 3 full pages + 3 tokens
    prompts = [system + rng.integers(0, config.vocab_size, size=n).tolist() for n in (1, 4, 9, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    off = _run(_engine(model, enable_prefix_caching=False), prompts, params)
    engine = _engine(model)
    # The first request fills the cache; the rest arrive after it.
    first = _run(engine, prompts[:1], params)
    for i, p in enumerate(prompts[1:]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    rest = sorted(engine.run_until_done().values(), key=lambda o: o.request_id)
    on = first + rest
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert all(o.num_cached_tokens == 24 for o in on[1:])  # the 3 full system-prompt pages
    assert all(o.num_cached_tokens == 0 for o in off)
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == 3 * 24


def test_cache_salt_isolates_tenants(tiny):
    _config, model, _ = tiny
    engine = _engine(model)
    prompt = {"prompt_token_ids": list(range(30))}
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = {}
    for rid, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1")):
        engine.add_request(rid, prompt, params, cache_salt=salt)
        outs.update(engine.run_until_done())
    assert outs["b"].num_cached_tokens == 0 and outs["c"].num_cached_tokens == 24
    assert (
        outs["a"].outputs[0].token_ids
        == outs["b"].outputs[0].token_ids
        == outs["c"].outputs[0].token_ids
    )


def test_parallel_sampling_n(tiny):
    _config, model, _ = tiny
    engine = _engine(model)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=7, ignore_eos=True)
    (out,) = _run(engine, [list(range(20))], params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per completion
    assert engine.pool.num_in_use == 0


def test_stats_and_prometheus_exposition(tiny):
    prometheus_client = pytest.importorskip("prometheus_client")
    from paxkv.engine.metrics import PrometheusCollector, format_log_line

    _config, model, _ = tiny
    engine = _engine(model)
    prompts = [list(range(20)), [*list(range(20)), 5, 6], [9, 9]]
    outs = _run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    stats = engine.stats()
    assert stats["generation_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs) == 12
    assert stats["prompt_tokens"] == 20 + 22 + 2
    assert stats["requests_finished"] == {"length": 3}
    assert stats["num_requests_running"] == 0 and stats["kv_pages_in_use"] == 0
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ):
        s = stats[name]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"]
    assert 0 < stats["host_overhead_fraction"] < 1 and stats["num_steps"] > 0
    assert "running=0 waiting=0" in format_log_line(stats)
    registry = prometheus_client.CollectorRegistry()
    registry.register(PrometheusCollector(engine.stats))
    text = prometheus_client.generate_latest(registry).decode()
    assert "paxkv:generation_tokens_total 12.0" in text
    assert 'paxkv:request_success_total{finished_reason="length"} 3.0' in text
    assert 'paxkv:time_to_first_token_seconds{quantile="0.5"}' in text


@pytest.mark.parametrize("num_steps", [4, 8])
def test_multi_step_decode_matches_single_steps(tiny, num_steps):
    config, model, _ = tiny
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (3, 17, 9, 25, 12, 30)]
    # Greedy, with per-request limits that end sequences mid-loop, and a stop token.
    single = _engine(model)
    base = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
    reference = _run(single, prompts, base)
    stop_at = reference[2].outputs[0].token_ids[5]  # the 6th token of request 2
    params = [
        base,
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=11, stop_token_ids=[stop_at], ignore_eos=True),
        SamplingParams(temperature=0.7, max_tokens=13, seed=4, ignore_eos=True),
        base,
        base,
    ]

    def run(engine):
        return [o.outputs[0] for o in _run(engine, prompts, params)]

    one = run(_engine(model))
    # 15 usable pages: preemption happens while the loop reserves pages ahead.
    for kw in ({}, {"num_pages": 15}):
        multi = _engine(model, num_decode_steps=num_steps, **kw)
        got = run(multi)
        assert [c.token_ids for c in got] == [c.token_ids for c in one]
        assert [c.finish_reason for c in got] == [c.finish_reason for c in one]
        assert multi.stats()["num_decode_loops"] > 0
        assert multi.pool.num_in_use == 0  # nothing reserved ahead is leaked
        multi.pool.check_invariants()
        if kw:
            assert multi.stats()["num_preemptions"] > 0
    assert one[2].finish_reason == "stop" and one[2].token_ids[-1] == stop_at
    assert one[1].finish_reason == "length" and len(one[1].token_ids) == 3


def test_async_scheduling_matches_sync(tiny):
    config, model, _ = tiny
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (3, 17, 9, 25, 12, 30)]
    sync_ref = _run(
        _engine(model), prompts, SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
    )
    stop_at = sync_ref[2].outputs[0].token_ids[4]
    params = [
        SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=11, stop_token_ids=[stop_at], ignore_eos=True),
        SamplingParams(temperature=0.9, max_tokens=9, seed=3, ignore_eos=True, logprobs=0),
        SamplingParams(
            temperature=0.0, max_tokens=4, stop_token_ids=[sync_ref[4].outputs[0].token_ids[3]]
        ),
        SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),
    ]

    def run(engine):
        return [o.outputs[0] for o in _run(engine, prompts, params)]

    expected = run(_engine(model))
    assert expected[2].finish_reason == "stop" and expected[4].finish_reason == "stop"
    for kw in ({}, {"num_pages": 12}):  # with and without preemption
        engine = _engine(model, async_scheduling=True, **kw)
        got = run(engine)
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
        assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
        np.testing.assert_allclose(
            got[3].token_logprobs, expected[3].token_logprobs, rtol=1e-5, atol=1e-5
        )
        assert PLACEHOLDER not in [t for c in got for t in c.token_ids]
        assert engine.pool.num_in_use == 0
        engine.pool.check_invariants()
        if kw:
            assert engine.stats()["num_preemptions"] > 0


def test_async_abort_in_flight(tiny):
    _, model, _ = tiny
    engine = _engine(model, async_scheduling=True)
    engine.add_request("a", {"prompt_token_ids": list(range(20))}, GREEDY)
    engine.add_request("b", {"prompt_token_ids": [4, 5]}, GREEDY)
    engine.step()
    engine.step()  # a and b are decoding, one step in flight
    engine.abort("a")
    outs = engine.run_until_done()
    assert outs["a"].outputs[0].finish_reason == "abort"
    assert outs["b"].outputs[0].token_ids == _dense_greedy(model, [4, 5], GREEDY.max_tokens)[0]
    assert engine.pool.num_in_use == 0


def test_multi_step_decode_promises_one_row_per_sequence(tiny, monkeypatch):
    """The N-step loop tells the attention call every sequence decodes one token
    (`decode_only=True`, which lets the GPU kernel skip its prefill grid); one-step
    calls, which may hold prefill chunks, do not."""
    from paxkv.kv_cache import attention as paged

    seen = []
    attention = paged.ragged_paged_attention

    def spy(*args, decode_only=False, **kw):
        seen.append(decode_only)
        return attention(*args, decode_only=decode_only, **kw)

    monkeypatch.setattr(paged, "ragged_paged_attention", spy)
    config, model, _ = tiny
    # Shapes no other test compiles, so both steps are traced here (with the spy).
    engine = _engine(model, num_decode_steps=3, page_size=16, page_buckets=(8,))
    prompts = _prompts(config.vocab_size)[:4]
    outs = _run(engine, prompts)
    assert engine.stats()["num_decode_loops"] > 0
    assert set(seen) == {True, False}  # the loop promised it, the one-step call did not
    expected = [_dense_greedy(model, p, GREEDY.max_tokens)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == expected
