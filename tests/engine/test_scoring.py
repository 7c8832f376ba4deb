"""Prompt logprobs and teacher-forced scoring on the tiny model, against a dense forward
pass's log_softmax (f32, computed in float64 from the dense logits)."""

import functools

import jax
import numpy as np
import pytest
from engine_configs import PAGE_SIZE, small_config

from paxkv import SamplingParams
from paxkv.engine import Engine
from paxkv.engine.fake_runner import FakeRunner

DENSE_LEN = 128
ATOL = 1e-5  # f32 paged attention vs. f32 dense attention, both from the same weights
K = 5


@functools.cache
def _dense_fn(model):
    return jax.jit(lambda tokens: model.dense_logits(tokens))


def _dense_logprobs(model, tokens):
    """f64[len(tokens), V]: log_softmax of the dense model's logits after each prefix."""
    padded = np.zeros(DENSE_LEN, np.int32)
    padded[: len(tokens)] = tokens
    logits = np.asarray(_dense_fn(model)(padded)[: len(tokens)], np.float64)
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def _engine(model, **kw):
    return Engine(model, small_config(**({"num_pages": 64, "max_logprobs": K} | kw)))


def _tokens(vocab, n, seed):
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def _check_prompt_logprobs(model, prompt, out, k):
    """`out.prompt_logprobs` against the dense oracle: the actual token's logprob and
    rank, and the top-k ids (numpy argsort) and logprobs."""
    dense = _dense_logprobs(model, prompt)
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for pos in range(1, len(prompt)):
        row = dense[pos - 1]
        order = np.argsort(-row, kind="stable")
        d = entries[pos]
        actual = d[prompt[pos]]
        np.testing.assert_allclose(actual.logprob, row[prompt[pos]], atol=ATOL)
        assert actual.rank == 1 + int(np.sum(row > row[prompt[pos]]))
        for r, t in enumerate(order[:k].tolist(), 1):
            np.testing.assert_allclose(d[t].logprob, row[t], atol=ATOL)
            if t != prompt[pos]:
                assert d[t].rank == r
        assert set(d) == set(order[:k].tolist()) | {prompt[pos]}
    np.testing.assert_allclose(
        out.scores, [dense[p - 1, prompt[p]] for p in range(1, len(prompt))], atol=ATOL
    )


@pytest.mark.parametrize("budget", [64, 16], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_match_dense(tiny, budget):
    config, model, _ = tiny
    engine = _engine(model, max_num_batched_tokens=budget, token_buckets=(16, 64))
    prompts = [_tokens(config.vocab_size, n, s) for s, n in enumerate((1, 7, 9, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = engine.run_until_done()
    for i, p in enumerate(prompts):
        out = done[str(i)]
        assert len(out.outputs[0].token_ids) == 2  # generation goes on after the scoring
        _check_prompt_logprobs(model, p, out, K)


def test_prompt_logprobs_take_no_prefix_hits(tiny):
    config, model, _ = tiny
    engine = _engine(model)
    prompt = _tokens(config.vocab_size, 40, 3)
    engine.add_request("warm", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
    engine.run_until_done()
    params = SamplingParams(max_tokens=0, prompt_logprobs=K)
    engine.add_request("again", {"prompt_token_ids": prompt}, params)
    out = engine.run_until_done()["again"]
    assert out.num_cached_tokens == 0  # every position was computed
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    _check_prompt_logprobs(model, prompt, out, K)


@pytest.mark.parametrize("budget", [64, 16], ids=["one-chunk", "chunked"])
def test_score_matches_dense_and_shares_cached_prompt(tiny, budget):
    config, model, _ = tiny
    engine = _engine(model, max_num_batched_tokens=budget)
    prompt = _tokens(config.vocab_size, 3 * PAGE_SIZE + 2, 5)
    completions = [_tokens(config.vocab_size, n, 10 + n) for n in (1, 5, 13)]
    # A first request caches the prompt's pages; the scores then reuse them.
    engine.add_request("warm", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
    engine.run_until_done()
    for i, c in enumerate(completions):
        engine.add_score_request(f"s{i}", prompt, c)
    done = engine.run_until_done()
    for i, c in enumerate(completions):
        out = done[f"s{i}"]
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
        assert out.num_cached_tokens == 3 * PAGE_SIZE  # the prompt's full pages: shared
        dense = _dense_logprobs(model, prompt + c)
        expect = [dense[len(prompt) + j - 1, t] for j, t in enumerate(c)]
        assert out.scores.dtype == np.float32 and out.scores.shape == (len(c),)
        np.testing.assert_allclose(out.scores, expect, atol=ATOL)
        assert out.prompt_logprobs[: len(prompt)] == [None] * len(prompt)
    assert not engine.scheduler.has_unfinished()


def test_score_frees_its_pages(tiny):
    config, model, _ = tiny
    engine = _engine(model, enable_prefix_caching=False)
    free = engine.pool.num_free
    engine.add_score_request("s", _tokens(config.vocab_size, 20, 1), [1, 2, 3])
    out = engine.run_until_done()["s"]
    assert out.finished and out.scores.shape == (3,)
    assert engine.pool.num_free == free and not engine.scheduler.has_unfinished()


def test_int8_pages_score_close_to_f32(tiny):
    """int8 K/V (per-page-row scales) perturb the attention inputs by about 1/254 of
    each row's max magnitude; on the tiny model that moves a logprob by well under
    0.05 nats, so the tolerance is 0.05 against the engine's own unquantized scores."""
    config, model, _ = tiny
    prompt = _tokens(config.vocab_size, 30, 7)
    comp = _tokens(config.vocab_size, 20, 8)
    scores = {}
    for dtype in ("auto", "int8"):
        engine = _engine(model, kv_cache_dtype=dtype)
        engine.add_score_request("s", prompt, comp)
        scores[dtype] = engine.run_until_done()["s"].scores
    dense = _dense_logprobs(model, prompt + comp)
    np.testing.assert_allclose(
        scores["auto"], [dense[len(prompt) + j - 1, t] for j, t in enumerate(comp)], atol=ATOL
    )
    np.testing.assert_allclose(scores["int8"], scores["auto"], atol=0.05)
    assert not np.array_equal(scores["int8"], scores["auto"])  # it did quantize


def test_async_scheduling_scores_like_sync(tiny):
    config, model, _ = tiny
    prompt = _tokens(config.vocab_size, 19, 11)
    comp = _tokens(config.vocab_size, 9, 12)
    out = {}
    for mode in (False, True):
        engine = _engine(model, async_scheduling=mode, max_num_batched_tokens=16)
        engine.add_score_request("s", prompt, comp)
        p = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1, ignore_eos=True)
        engine.add_request("g", {"prompt_token_ids": prompt}, p)
        out[mode] = engine.run_until_done()
    np.testing.assert_array_equal(out[True]["s"].scores, out[False]["s"].scores)
    np.testing.assert_array_equal(out[True]["g"].scores, out[False]["g"].scores)
    assert out[True]["g"].outputs[0].token_ids == out[False]["g"].outputs[0].token_ids


def test_compile_count_flat_across_score_lengths(tiny):
    _config, model, _ = tiny
    engine = _engine(model)
    rng = np.random.default_rng(0)

    def score_round(lengths):
        for i, (p, c) in enumerate(lengths):
            engine.add_score_request(
                str(i), rng.integers(0, 64, p).tolist(), rng.integers(0, 64, c).tolist()
            )
        engine.run_until_done()

    score_round([(5, 3), (20, 30)])  # scored rows in buckets 16 and 64
    before = engine.num_compilations
    for _ in range(3):
        score_round([(int(rng.integers(1, 10)), int(rng.integers(1, 6)))])
        score_round([(int(rng.integers(10, 30)), int(rng.integers(20, 30)))])
    assert engine.num_compilations == before


def test_bad_scoring_input_names_the_field(tiny):
    config, model, _ = tiny
    engine = _engine(model)
    v = config.vocab_size
    with pytest.raises(ValueError, match=r"completion_token_ids\[1\]"):
        engine.add_score_request("a", [1, 2], [3, v])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\]"):
        engine.add_score_request("a", [-1], [3])
    with pytest.raises(ValueError, match=r"completion_token_ids.*max_model_len=128"):
        engine.add_score_request("a", [1] * 100, [2] * 29)
    with pytest.raises(ValueError, match=r"prompt_logprobs=6 exceeds .*max_logprobs=5"):
        engine.add_request("a", {"prompt_token_ids": [1, 2]}, SamplingParams(prompt_logprobs=6))
    with pytest.raises(ValueError, match="prompt_logprobs=-1"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)
    assert not engine.has_unfinished()  # nothing was queued


def test_fake_runner_host_path_scores():
    """The whole host path of a score request, with no model: fake scores of -1."""
    engine = Engine(None, small_config(64), runner=lambda cfg: FakeRunner(100, cfg))
    engine.add_score_request("s", list(range(10)), list(range(20, 50)))
    out = engine.run_until_done()["s"]
    np.testing.assert_array_equal(out.scores, np.full(30, -1.0, np.float32))
    assert [d and next(iter(d)) for d in out.prompt_logprobs[10:]] == list(range(20, 50))


def test_llm_score_pairs_strings_and_ids(tiny):
    from paxkv import LLM

    config, model, _ = tiny
    llm = LLM("tiny", dtype="float32", warmup=False, config=small_config(64, max_logprobs=K))
    prompt = _tokens(config.vocab_size, 20, 21)
    comps = [_tokens(config.vocab_size, n, 30 + n) for n in (4, 9)]
    # Two completions of one prompt (repeated: they share its cached pages), and a
    # string pair (the tiny model's tokenizer is bytes).
    got = llm.score([prompt, prompt, "def f(x):"], [comps[0], comps[1], " return x"])
    for p, c, s in zip([prompt, prompt], comps, got, strict=False):
        dense = _dense_logprobs(model, p + c)
        np.testing.assert_allclose(
            s, [dense[len(p) + j - 1, t] for j, t in enumerate(c)], atol=ATOL
        )
    p, c = list(b"def f(x):"), list(b" return x")
    dense = _dense_logprobs(model, p + c)
    np.testing.assert_allclose(
        got[2], [dense[len(p) + j - 1, t] for j, t in enumerate(c)], atol=ATOL
    )
    with pytest.raises(ValueError, match=r"pair 1: completion_token_ids\[0\]"):
        llm.score([prompt, prompt], [comps[0], [config.vocab_size]])
    assert not llm.engine.has_unfinished()  # the valid pair before it was withdrawn


def test_a_bad_top_logprobs_names_itself():
    from paxkv.engine import EngineConfig
    from paxkv.engine.fake_runner import FakeRunner

    engine = Engine(None, EngineConfig(), runner=lambda c: FakeRunner(64, c))
    with pytest.raises(TypeError, match="top_logprobs must be an integer, got None"):
        engine.add_score_request(None, [1, 2], [3], top_logprobs=None)
    with pytest.raises(ValueError, match="top_logprobs=-1"):
        engine.add_score_request(None, [1, 2], [3], top_logprobs=-1)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_score_request_whose_last_chunk_scores_nothing_is_reported(async_scheduling):
    """9 tokens in chunks of 8: both scored rows (the completion's 2 tokens) are in the
    first chunk, and the last chunk, which scores nothing, ends the request. Under async
    scheduling its final output was never reported (the request kept forever)."""
    from paxkv.engine import EngineConfig

    config = EngineConfig(
        num_pages=32,
        page_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        max_model_len=64,
        async_scheduling=async_scheduling,
        log_stats_interval_s=0,
    )
    engine = Engine(None, config, runner=lambda c: FakeRunner(256, c))
    engine.add_score_request("s", list(range(1, 8)), [4, 5])
    done = engine.run_until_done()
    assert done["s"].finished and len(done["s"].scores) == 2
    assert engine.requests.get("s") is None and not engine.has_unfinished()
