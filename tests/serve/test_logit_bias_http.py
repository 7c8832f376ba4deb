"""`logit_bias` and `min_tokens` over HTTP with the `openai` client, against the
in-process `LLM` with the same params; bad values answered 400 naming the field."""

import openai
import pytest

from paxkv import SamplingParams

MODEL = "tiny-py"


def test_logit_bias_and_min_tokens_as_the_engine_applies_them(server, llm):
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    prompt = "def f(x):\n    return"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    first = plain.choices[0].text[0]
    # JSON keys are strings: the ids of tiny-py's byte tokens.
    bias = {str(ord(first)): -100, str(ord("Q")): 7}
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logit_bias=bias
    )
    want = (
        llm.generate(
            prompt,
            SamplingParams(temperature=0, max_tokens=6, logit_bias={ord(first): -100, ord("Q"): 7}),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
    )
    assert out.choices[0].text == want != plain.choices[0].text
    held = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        extra_body={"stop_token_ids": [ord(first)], "min_tokens": 3},
    )
    assert len(held.choices[0].text) >= 3 and first not in held.choices[0].text[:3]


@pytest.mark.parametrize(
    "body",
    [
        {"logit_bias": {"5": 101}},
        {"logit_bias": {"x": 1}},
        {"logit_bias": {"300": 1}},
        {"logit_bias": [1, 2]},
        {"min_tokens": 20, "max_tokens": 4},
    ],
)
def test_bad_values_name_the_field(server, body):
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    extra = {k: v for k, v in body.items() if k != "max_tokens"}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=body.get("max_tokens", 4), extra_body=extra
        )
    assert e.value.body["param"] == next(iter(extra)), e.value.body


def test_completion_logprob_tokens_make_the_text_across_split_characters(server):
    """Tokens that are parts of one character (UTF-8 bytes, one token each) are named by
    the text each adds, as echo names the prompt's: joined they are the text, and the
    offsets stay in it; streamed or not."""
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    # Only the two bytes of "é" (0xC3 0xA9) may be drawn: some pairs make the character.
    only = {str(t): -100 for t in range(256) if t not in (0xC3, 0xA9)}
    body = dict(model=MODEL, prompt="x = '", max_tokens=24, temperature=1.0, seed=2)
    body |= dict(logprobs=0, logit_bias=only)
    out = client.completions.create(**body).choices[0]
    assert "é" in out.text
    lp = out.logprobs
    assert "".join(lp.tokens) == out.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = [c.choices[0] for c in client.completions.create(**body, stream=True)]
    tokens = [t for c in streamed if c.logprobs for t in c.logprobs.tokens]
    assert tokens == lp.tokens
    offsets = [o for c in streamed if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == lp.text_offset
