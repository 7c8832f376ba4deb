"""`SamplingParams.logit_bias` and `min_tokens` through the engine, against a dense
forward pass: greedy picks the argmax of the dense logits plus the biases (the stop
tokens at -inf while fewer than `min_tokens` are out), the reported logprobs stay the
raw distribution's, sampling never draws a banned token, and requests without biases
batched with biased ones are unchanged; in every execution mode."""

import numpy as np
import pytest
from test_engine import _engine, _run
from test_logprobs_penalties import MODES, _dense_logits

from paxkv import SamplingParams


def _dense_biased_greedy(model, prompt, params, n):
    """Greedy tokens of `prompt` with the params' biases and min_tokens (and stop ids)."""
    out = []
    bias = dict(params.logit_bias or ())
    for _ in range(n):
        logits = _dense_logits(model, [*prompt, *out])
        adjusted = logits.copy()
        for token, value in bias.items():
            adjusted[token] += value
        if len(out) < params.min_tokens:
            adjusted[list(params.stop_token_ids)] = -np.inf
        out.append(int(np.argmax(adjusted)))
        if out[-1] in params.stop_token_ids:
            break
    return out


@pytest.fixture(scope="module")
def bias_case(tiny):
    config, model, _ = tiny
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (7, 21, 13, 30)]
    plain = [_dense_biased_greedy(model, p, SamplingParams(max_tokens=8), 8) for p in prompts]
    params = [
        # A strong pull to one token, and a push away from the plain greedy's first two.
        SamplingParams(temperature=0, max_tokens=8, logit_bias={17: 100.0}, logprobs=0),
        SamplingParams(
            temperature=0,
            max_tokens=8,
            logit_bias={plain[1][0]: -100, plain[1][1]: -100, 3: 2.5},
            logprobs=0,
        ),
        # The plain greedy's first token stops it, unless min_tokens holds it back.
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[plain[2][0]], min_tokens=4),
        SamplingParams(temperature=0, max_tokens=8, logprobs=0),  # none: batched with them
    ]
    expected = [
        _dense_biased_greedy(model, p, sp, 8) for p, sp in zip(prompts, params, strict=True)
    ]
    assert expected[0] == [17] * 8 and expected[1] != plain[1] and len(expected[2]) >= 4
    assert expected[3] == plain[3]
    return model, prompts, params, expected


@pytest.mark.parametrize("mode", MODES)
def test_biased_greedy_matches_dense_reference(bias_case, mode):
    model, prompts, params, expected = bias_case
    got = _run(_engine(model, **MODES[mode]), prompts, params)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert got[2].outputs[0].finish_reason == ("stop" if len(expected[2]) < 8 else "length")
    # Logprobs are the raw distribution's, not the biased one's.
    for out, prompt in ((got[0], prompts[0]), (got[1], prompts[1])):
        c = out.outputs[0]
        for j, token in enumerate(c.token_ids):
            logits = _dense_logits(model, [*prompt, *c.token_ids[:j]])
            raw = logits[token] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
            assert abs(c.logprobs_array[j] - raw) < 1e-4, (j, c.logprobs_array[j], raw)


def test_sampling_never_draws_a_banned_token(tiny):
    config, model, _ = tiny
    allowed = [40, 41, 42]
    banned = {t: -100.0 for t in range(config.vocab_size) if t not in allowed}
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=24, logit_bias=banned)
    prompts = [[1, 2, 3], [9] * 17]
    got = _run(_engine(model), prompts, params)
    tokens = [t for o in got for t in o.outputs[0].token_ids]
    assert set(tokens) <= set(allowed) and len(set(tokens)) > 1  # sampled, not greedy
    again = _run(_engine(model), prompts, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in got]


def test_bad_biases_are_refused_naming_the_field(tiny):
    _, model, _ = tiny
    engine = _engine(model)
    with pytest.raises(ValueError, match=r"logit_bias names token 256, outside the vocabulary"):
        engine.add_request("a", {"prompt_token_ids": [1]}, SamplingParams(logit_bias={256: 1}))
    for kwargs, error, message in [
        ({"logit_bias": {5: 101}}, ValueError, r"logit_bias\[5\]=101.0 must be in \[-100, 100\]"),
        ({"logit_bias": {"x": 1}}, TypeError, "logit_bias keys must be token ids, got 'x'"),
        ({"logit_bias": [5]}, TypeError, "logit_bias must be a mapping"),
        ({"min_tokens": 9, "max_tokens": 8}, ValueError, "min_tokens=9 must be at most"),
        ({"min_tokens": -1}, ValueError, r"min_tokens=-1 must be in \[0"),
    ]:
        with pytest.raises(error, match=message):
            SamplingParams(**kwargs)
    assert not engine.has_unfinished()
