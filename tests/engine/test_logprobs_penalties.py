"""Top-k logprobs and penalties through the engine, against a dense forward pass.

The reference runs the model densely over prompt + outputs, applies the penalties by a
plain loop over the vocabulary, and takes the argmax (greedy) or reads the log-softmax
(logprobs). The engine must agree token for token in every execution mode: one step per
call, N decode steps per call, async scheduling, prefix-cache hits and preemption.
"""

import numpy as np
import pytest
from test_engine import DENSE_LEN, _dense_fn, _engine, _run
from test_sampling import _penalised_reference

from paxkv import SamplingParams


def _dense_logits(model, tokens):
    padded = np.zeros(DENSE_LEN, np.int32)
    padded[: len(tokens)] = tokens
    return np.asarray(_dense_fn(model)(padded)[len(tokens) - 1], np.float64)


def _dense_penalised_greedy(model, prompt, params):
    outputs = []
    for _ in range(params.max_tokens):
        logits = _dense_logits(model, [*prompt, *outputs])
        outputs.append(int(np.argmax(_penalised_reference(logits, set(prompt), outputs, params))))
    return outputs


PENALTIES = [
    dict(repetition_penalty=1.8),
    dict(presence_penalty=1.2, frequency_penalty=0.7),
    dict(frequency_penalty=2.0, repetition_penalty=1.2),
    dict(),  # no penalty, batched with penalised requests
]

MODES = {
    "one step per call": {},
    "4 decode steps per call": {"num_decode_steps": 4},
    "async scheduling": {"async_scheduling": True},
    "preemption": {"num_pages": 14},
}


@pytest.fixture(scope="module")
def penalty_case(tiny):
    config, model, _ = tiny
    rng = np.random.default_rng(21)
    # Prompts drawn from a few tokens so that penalties bite; two share a prefix that the
    # prefix cache serves to the later one.
    shared = rng.integers(0, 6, size=17).tolist()
    prompts = [
        [*shared, 1, 2],
        rng.integers(0, 6, size=9).tolist(),
        [*shared, 3],
        rng.integers(0, config.vocab_size, size=24).tolist(),
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kw) for kw in PENALTIES
    ]
    expected = [
        _dense_penalised_greedy(model, p, sp) for p, sp in zip(prompts, params, strict=True)
    ]
    plain = [
        _dense_penalised_greedy(model, p, SamplingParams(temperature=0.0, max_tokens=12))
        for p in prompts[:3]
    ]
    assert plain != expected[:3]  # the penalties change what greedy picks
    return model, prompts, params, expected


@pytest.mark.parametrize("mode", MODES)
def test_penalties_match_dense_reference(penalty_case, mode):
    model, prompts, params, expected = penalty_case
    engine = _engine(model, **MODES[mode])
    engine.add_request("0", {"prompt_token_ids": prompts[0]}, params[0])
    engine.step()  # prefills request 0, whose full pages request 2 then finds cached
    for i in range(1, len(prompts)):
        engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params[i])
    done = engine.run_until_done()
    got = [done[str(i)] for i in range(len(prompts))]
    assert [o.outputs[0].token_ids for o in got] == expected
    assert got[2].num_cached_tokens == 16
    if mode == "preemption":
        assert engine.stats()["num_preemptions"] > 0
    assert engine.pool.num_in_use == 0


@pytest.mark.parametrize("mode", MODES)
def test_top_logprobs_match_dense_softmax(tiny, mode):
    config, model, _ = tiny
    rng = np.random.default_rng(22)
    prompts = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (5, 19, 11)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.9, seed=5, max_tokens=7, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # none asked
    ]
    got = _run(_engine(model, **MODES[mode]), prompts, params)
    for out, prompt, sp in zip(got, prompts, params, strict=True):
        c = out.outputs[0]
        if sp.logprobs is None:
            assert c.logprobs is None and c.cumulative_logprob is None
            continue
        assert len(c.logprobs) == len(c.token_ids) == 7
        for j, (entries, token) in enumerate(zip(c.logprobs, c.token_ids, strict=True)):
            dense = _dense_logits(model, [*prompt, *c.token_ids[:j]])
            dense = dense - dense.max()
            dense -= np.log(np.exp(dense).sum())
            order = np.argsort(-dense, kind="stable")
            top = order[: sp.logprobs].tolist()
            assert set(entries) == {*top, token}
            for rank, t in enumerate(top, 1):
                assert entries[t].rank == rank
            for t, lp in entries.items():
                np.testing.assert_allclose(lp.logprob, dense[t], atol=2e-4)
            assert entries[token].rank == 1 + int(np.sum(dense > dense[token] + 1e-6))
            assert entries[token].decoded_token is None  # no tokenizer
        np.testing.assert_allclose(c.cumulative_logprob, sum(c.token_logprobs), rtol=1e-6)


def test_logprobs_beyond_max_logprobs_are_rejected(tiny):
    _, model, _ = tiny
    engine = _engine(model, max_logprobs=2)
    with pytest.raises(ValueError, match=r"logprobs=3 exceeds the engine's max_logprobs=2"):
        engine.add_request("r", {"prompt_token_ids": [1]}, SamplingParams(logprobs=3))
    assert not engine.has_unfinished()
