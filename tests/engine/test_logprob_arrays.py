"""Log-probabilities as arrays: `CompletionOutput.logprobs_array` and `RequestOutput.scores`
on the tiny model, against the outputs' own dicts (exactly) and a dense forward pass's
log_softmax (the teacher-forced oracle of `test_scoring`)."""

import collections
import dataclasses

import numpy as np
import pytest
from test_scoring import ATOL, _dense_logprobs, _engine, _tokens

from paxkv import RequestOutputKind, SamplingParams

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind
N = 2
MAX_TOKENS = 11
MODES = {
    "sync": {},
    "async, 3 decode steps per call": {"async_scheduling": True, "num_decode_steps": 3},
}


def _all_outputs(engine, requests):
    """Adds `requests` (`{id: (prompt, params)}`) and runs the engine to the end: every
    output of every request (those queued before too), by request id."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    outputs = collections.defaultdict(list)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def _check_array(c):
    """c's array is f32[len(token_ids)] holding exactly its dicts' chosen values."""
    a = c.logprobs_array
    assert a.dtype == np.float32 and a.shape == (len(c.token_ids),)
    chosen = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)]
    assert a.tolist() == chosen  # the engine's floats are f32 values: no rounding
    return a


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_array_is_the_dicts_and_matches_dense(tiny, mode):
    config, model, _ = tiny
    prompts = [_tokens(config.vocab_size, n, s) for s, n in ((1, 5), (2, 19))]
    # Sampled (the chosen token is rarely in the top 2) and greedy (always is, rank 1).
    bases = {
        "sampled": SamplingParams(temperature=1.0, seed=3, n=N, logprobs=2),
        "greedy": SamplingParams(temperature=0.0, n=N, logprobs=2),
    }
    requests = {}
    for j, prompt in enumerate(prompts):
        for name, base in bases.items():
            for kind in RequestOutputKind:
                params = dataclasses.replace(
                    base, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=kind
                )
                requests[f"{j}/{name}/{kind.name}"] = (prompt, params)
        plain = SamplingParams(max_tokens=4, ignore_eos=True)  # no logprobs: the deferred path
        requests[f"{j}/plain"] = (prompt, plain)
    outputs = _all_outputs(_engine(model, **MODES[mode]), requests)

    for j, prompt in enumerate(prompts):
        assert all(c.logprobs_array is None for o in outputs[f"{j}/plain"] for c in o.outputs)
        for name in bases:
            cumulative, delta, final = (outputs[f"{j}/{name}/{k.name}"] for k in RequestOutputKind)
            assert len(final) == 1 and final[0].finished
            for o in cumulative + delta + final:
                for c in o.outputs:
                    _check_array(c)
            assert [c.token_ids for c in final[0].outputs] == [
                c.token_ids for c in cumulative[-1].outputs
            ]
            for i in range(N):
                whole = cumulative[-1].outputs[i]
                parts = [c for o in delta for c in o.outputs if c.index == i]
                joined, last = np.concatenate([c.logprobs_array for c in parts]), parts[-1]
                assert [t for c in parts for t in c.token_ids] == whole.token_ids
                # The same floats as the sum the engine keeps (from its per-token
                # logprobs, not the dicts), added in the same order.
                assert sum(joined.tolist()) == last.cumulative_logprob
                assert sum(whole.logprobs_array.tolist()) == whole.cumulative_logprob
                # The kinds ran in other rows of the batch: equal up to rounding.
                np.testing.assert_allclose(joined, whole.logprobs_array, atol=ATOL)
                np.testing.assert_allclose(
                    final[0].outputs[i].logprobs_array, whole.logprobs_array, atol=ATOL
                )
                tokens = whole.token_ids
                assert len(tokens) == MAX_TOKENS
                dense = _dense_logprobs(model, prompt + tokens)
                expect = [dense[len(prompt) + p - 1, t] for p, t in enumerate(tokens)]
                np.testing.assert_allclose(whole.logprobs_array, expect, atol=ATOL)


def test_logprobs_array_of_no_tokens(tiny):
    config, model, _ = tiny
    engine = _engine(model)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, logprobs=1)
    engine.add_request("none", {"prompt_token_ids": _tokens(config.vocab_size, 6, 4)}, params)
    c = engine.run_until_done()["none"].outputs[0]
    assert c.token_ids == [] and c.logprobs_array.shape == (0,)
    assert c.logprobs_array.dtype == np.float32


def _check_scores(out, prompt, first):
    """`out.scores` is f32[len(prompt) - first], exactly the actual tokens' values of
    `out.prompt_logprobs` from position `first` on."""
    assert out.prompt_logprobs[:first] == [None] * first
    assert out.scores.dtype == np.float32 and out.scores.shape == (len(prompt) - first,)
    actual = [out.prompt_logprobs[p][prompt[p]].logprob for p in range(first, len(prompt))]
    assert out.scores.tolist() == actual


@pytest.mark.parametrize("k", [0, 3])
def test_scores_are_prompt_logprobs_as_an_array(tiny, k):
    config, model, _ = tiny
    prompt = _tokens(config.vocab_size, 23, 6)
    prefix, completion = _tokens(config.vocab_size, 9, 7), _tokens(config.vocab_size, 6, 8)
    engine = _engine(model, max_num_batched_tokens=16)  # chunked prefills
    requests = {
        kind.name: (
            prompt,
            SamplingParams(max_tokens=3, prompt_logprobs=k, ignore_eos=True, output_kind=kind),
        )
        for kind in RequestOutputKind
    }
    requests["plain"] = (prompt, SamplingParams(max_tokens=3, logprobs=0, ignore_eos=True))
    engine.add_score_request("score", prefix, completion, top_logprobs=k)
    outputs = _all_outputs(engine, requests)

    dense = _dense_logprobs(model, prompt)
    expect = [dense[p - 1, prompt[p]] for p in range(1, len(prompt))]
    assert all(o.scores is None and o.prompt_logprobs is None for o in outputs["plain"])
    for kind in (CUMULATIVE, FINAL_ONLY):
        for out in outputs[kind.name]:
            _check_scores(out, prompt, 1)
            np.testing.assert_allclose(out.scores, expect, atol=ATOL)
    # A delta carries them once, in its first output.
    first, *rest = outputs[DELTA.name]
    _check_scores(first, prompt, 1)
    np.testing.assert_allclose(first.scores, expect, atol=ATOL)
    assert all(o.scores is None and o.prompt_logprobs is None for o in rest)

    [score] = outputs["score"]
    _check_scores(score, prefix + completion, len(prefix))
    dense = _dense_logprobs(model, prefix + completion)
    expect = [dense[len(prefix) + j - 1, t] for j, t in enumerate(completion)]
    np.testing.assert_allclose(score.scores, expect, atol=ATOL)
