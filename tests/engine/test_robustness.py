"""Hostile input at the boundary, and aborts at every point of the async pipeline.

Every bad value is rejected with a message that names the field and shows the value,
while a good request in flight finishes with exactly its solo output and no page leaks.
"""

import math

import numpy as np
import pytest
from test_engine import GREEDY, PLACEHOLDER, _dense_greedy, _engine

from paxkv import LLM, SamplingParams
from paxkv.models import ByteTokenizer

BAD_SAMPLING = [
    ({"max_tokens": 1.5}, TypeError, r"max_tokens must be an integer, got 1\.5"),
    ({"max_tokens": None}, TypeError, r"max_tokens must be an integer, got None"),
    ({"max_tokens": 0}, ValueError, r"max_tokens=0 must be in \[1, inf\]"),
    ({"n": True}, TypeError, r"n must be an integer, got True"),
    ({"top_k": 2.5}, TypeError, r"top_k must be an integer, got 2\.5"),
    ({"top_k": -2}, ValueError, r"top_k=-2"),
    ({"seed": 1.5}, TypeError, r"seed must be an integer, got 1\.5"),
    ({"seed": 2**31}, ValueError, r"seed=2147483648"),
    ({"temperature": math.inf}, ValueError, r"temperature=inf must be finite"),
    ({"temperature": "hot"}, TypeError, r"temperature must be a number, got 'hot'"),
    ({"top_p": 0.0}, ValueError, r"top_p=0\.0 must be in \(0, 1\]"),
    ({"min_p": math.nan}, ValueError, r"min_p=nan must be finite"),
    ({"stop_token_ids": [-1]}, ValueError, r"stop_token_ids\[0\]=-1"),
    ({"stop_token_ids": [2.0]}, TypeError, r"stop_token_ids\[0\] must be an integer"),
    ({"stop_token_ids": "ab"}, TypeError, r"stop_token_ids must be a list of ints"),
    ({"ignore_eos": 1}, TypeError, r"ignore_eos must be a bool, got 1"),
    ({"logprobs": "yes"}, TypeError, r"logprobs must be an integer, got 'yes'"),
    ({"logprobs": True}, TypeError, r"logprobs must be an integer k .* got True"),
    ({"logprobs": -1}, ValueError, r"logprobs=-1 must be in \[0, inf\]"),
    ({"presence_penalty": 2.5}, ValueError, r"presence_penalty=2\.5 must be in \[-2, 2\]"),
    ({"frequency_penalty": "x"}, TypeError, r"frequency_penalty must be a number, got 'x'"),
    ({"frequency_penalty": math.inf}, ValueError, r"frequency_penalty=inf must be finite"),
    ({"repetition_penalty": 0.0}, ValueError, r"repetition_penalty=0\.0 must be > 0"),
    ({"repetition_penalty": None}, TypeError, r"repetition_penalty must be a number, got None"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_SAMPLING)
def test_sampling_params_fields_are_typed(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_numpy_integers_are_integers():
    p = SamplingParams(max_tokens=np.int32(3), top_k=np.int64(2), stop_token_ids=np.array([1, 2]))
    assert (p.max_tokens, p.top_k, p.stop_token_ids) == (3, 2, (1, 2))
    assert type(p.max_tokens) is int and all(type(t) is int for t in p.stop_token_ids)


BAD_REQUESTS = [
    (
        dict(prompt={"prompt_token_ids": [1.7]}),
        TypeError,
        r"prompt_token_ids\[0\] must be an integer, got 1\.7",
    ),
    (
        dict(prompt={"prompt_token_ids": None}),
        TypeError,
        r"prompt_token_ids must be a list of ints, got None",
    ),
    (
        dict(prompt={"prompt_token_ids": "a"}),
        TypeError,
        r"prompt_token_ids must be a list of ints, got 'a'",
    ),
    (
        dict(prompt={"prompt_token_ids": [True]}),
        TypeError,
        r"prompt_token_ids\[0\] must be an integer, got True",
    ),
    (dict(prompt={"prompt_token_ids": np.array([[1]])}), TypeError, r"1-D integer array"),
    (dict(cache_salt=["x"]), TypeError, r"cache_salt must be a str or None, got \['x'\]"),
    (dict(priority="high"), TypeError, r"priority must be an integer, got 'high'"),
    (dict(priority=None), TypeError, r"priority must be an integer, got None"),
    (dict(arrival_time="now"), TypeError, r"arrival_time must be a number, got 'now'"),
    (dict(arrival_time=math.nan), ValueError, r"arrival_time=nan must be finite"),
    (dict(request_id=["r"]), TypeError, r"request_id must be a str or None, got \['r'\]"),
    (dict(params={"max_tokens": 3}), TypeError, r"params must be a SamplingParams, got dict"),
]


@pytest.mark.parametrize(("overrides", "error", "message"), BAD_REQUESTS)
def test_bad_arguments_rejected_while_a_good_request_runs(tiny, overrides, error, message):
    _, model, _ = tiny
    engine = _engine(model)
    good = [3, 1, 4, 1, 5]
    engine.add_request("good", {"prompt_token_ids": good}, GREEDY)
    engine.step()  # running when the bad one arrives
    args = dict(request_id="bad", prompt={"prompt_token_ids": [1, 2]}, params=GREEDY)
    args |= overrides
    request_id, prompt, params = args.pop("request_id"), args.pop("prompt"), args.pop("params")
    with pytest.raises(error, match=message):
        engine.add_request(request_id, prompt, params, **args)
    final = engine.run_until_done()
    assert list(final) == ["good"]
    assert final["good"].outputs[0].token_ids == _dense_greedy(model, good, GREEDY.max_tokens)[0]
    assert engine.pool.num_in_use == 0
    engine.pool.check_invariants()


def test_auto_ids_never_collide_with_chosen_ones(tiny):
    _, model, _ = tiny
    engine = _engine(model)
    engine.add_request("0", {"prompt_token_ids": [1]}, GREEDY)
    engine.add_request("1", {"prompt_token_ids": [1]}, GREEDY)
    auto = engine.add_request(None, {"prompt_token_ids": [1]}, GREEDY)
    assert auto not in ("0", "1")
    assert set(engine.run_until_done()) == {"0", "1", auto}


@pytest.mark.parametrize("abort_after", [0, 1, 2, 3, 4, 5])
def test_async_abort_at_every_point(tiny, abort_after):
    """Abort after k steps of the async pipeline: reported once, as aborted, with real
    tokens only (its text decodes), and the other request is untouched."""
    _, model, _ = tiny
    engine = _engine(model, tokenizer=ByteTokenizer(), async_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [7, 8, 9]}, params)
    engine.add_request("b", {"prompt_token_ids": [4, 5]}, params)
    for _ in range(abort_after):
        engine.step()
    engine.abort("a")
    reports, b = [], None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == "a":
                reports.append(o)
            elif o.finished:
                b = o
    assert [o.finished for o in reports] == [True]
    assert b.outputs[0].token_ids == _dense_greedy(model, [4, 5], 6)[0]
    a = reports[0].outputs[0]
    assert a.finish_reason == "abort" and PLACEHOLDER not in a.token_ids
    expected = _dense_greedy(model, [7, 8, 9], 6)[0]
    assert a.token_ids == expected[: len(a.token_ids)]
    assert a.text == ByteTokenizer().decode(a.token_ids)
    assert engine.pool.num_in_use == 0
    engine.pool.check_invariants()


def test_generate_stream_closed_early_with_async_scheduling():
    llm = LLM(
        model="tiny",
        warmup=False,
        dtype="float32",
        num_pages=64,
        page_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
        async_scheduling=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    stream = llm.generate_stream(["def f(x):", "import "], params)
    first = next(stream)
    assert PLACEHOLDER not in first.outputs[0].token_ids
    stream.close()
    assert not llm.engine.has_unfinished() and llm.engine.pool.num_in_use == 0
    llm.engine.pool.check_invariants()


BAD_SETTINGS = [
    (dict(page_size=3), ValueError, r"page_size=3 must be a power of two in \[8, 1024\]"),
    (dict(page_size=8.0), TypeError, r"page_size must be an integer, got 8\.0"),
    (dict(attention_backend="cuda"), ValueError, r"attention_backend='cuda' must be one of"),
    (dict(max_model_len=0), ValueError, r"max_model_len=0 must be in \[1, inf\]"),
    (dict(kv_cache_dtype="int4"), ValueError, r"kv_cache_dtype='int4' must be one of"),
    (dict(watermark=1.5), ValueError, r"watermark=1\.5 must be in \[0, 1\)"),
    (dict(num_pages=None), TypeError, r"num_pages must be an integer, got None"),
    (dict(enable_prefix_caching="no"), TypeError, r"enable_prefix_caching must be a bool"),
    (dict(token_buckets=(16, 0)), ValueError, r"token_buckets\[1\]=0"),
    (dict(max_num_seqs=3, seq_buckets=(4,)), ValueError, r"seq_buckets=\(4,\) .* max_num_seqs=3"),
    (dict(kv_host_cache_gib=-1), ValueError, r"kv_host_cache_gib=-1 must be >= 0"),
    (dict(max_loras=0), ValueError, r"max_loras=0 must be in \[1, inf\]"),
    (dict(max_lora_rank=-2), ValueError, r"max_lora_rank=-2 must be in \[1, inf\]"),
    (dict(enable_lora="yes"), TypeError, r"enable_lora must be a bool"),
    (dict(lora_method="punica"), ValueError, r"lora_method='punica' must be 'auto', 'gather'"),
    (dict(kv_host_cache_gib="1"), TypeError, r"kv_host_cache_gib must be a number"),
    (
        dict(kv_host_cache_gib=1, enable_prefix_caching=False),
        ValueError,
        r"kv_host_cache_gib=1.* needs enable_prefix_caching=True",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_SETTINGS)
def test_engine_settings_fail_when_given(kwargs, error, message):
    from paxkv.engine import EngineConfig

    with pytest.raises(error, match=message):
        EngineConfig(**kwargs)


def test_settings_checked_against_the_model_and_platform(tiny):
    config, model, _ = tiny
    too_long = config.max_position_embeddings + 1
    with pytest.raises(ValueError, match=rf"max_model_len={too_long} exceeds the model's"):
        _engine(model, max_model_len=too_long)
    with pytest.raises(
        ValueError, match=r"attention_backend='tpu' needs a TPU; this platform is 'cpu'"
    ):
        _engine(model, attention_backend="tpu")


def test_n_is_bounded_by_the_engine_at_once():
    """`n` past `EngineConfig.max_n` (128 by default, as the server's limit) is refused
    at submit, before any completion is made; a smaller limit is a setting."""

    from paxkv.engine import Engine, EngineConfig
    from paxkv.engine.fake_runner import FakeRunner

    engine = Engine(None, EngineConfig(), runner=lambda c: FakeRunner(64, c))
    with pytest.raises(
        ValueError, match=r"SamplingParams\.n=1000000 exceeds the engine's max_n=128"
    ):
        engine.add_request("huge", {"prompt_token_ids": [1, 2]}, SamplingParams(n=10**6))
    assert not engine.has_unfinished()
    small = Engine(None, EngineConfig(max_n=2), runner=lambda c: FakeRunner(64, c))
    with pytest.raises(ValueError, match=r"n=3 exceeds the engine's max_n=2"):
        small.add_request("three", {"prompt_token_ids": [1]}, SamplingParams(n=3, max_tokens=2))
    small.add_request("two", {"prompt_token_ids": [1]}, SamplingParams(n=2, max_tokens=2))
    out = small.run_until_done()["two"]
    assert len(out.outputs) == 2
    with pytest.raises(ValueError, match="max_n=0"):
        EngineConfig(max_n=0)
