"""Structured outputs over HTTP with the `openai` client: OpenAI's `response_format`
(JSON mode and JSON schema) and vLLM's `structured_outputs` and `guided_*` fields, on
both endpoints, streamed or not, with n > 1; greedy outputs equal the in-process `LLM`
with the same constraint; bad ones are answered 400 naming the field. The server runs
with `--disable_any_whitespace` (tests/serve/conftest.py): the trained tiny model
would otherwise indent a JSON object until max_tokens."""

import json
import re

import openai
import pytest

from paxkv import SamplingParams

pytest.importorskip("llguidance")

MODEL = "tiny-py"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}


def _client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


def test_json_schema_completions_equal_the_engine_and_validate(server, llm):
    client = _client(server)
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    out = client.completions.create(
        model=MODEL,
        prompt="def f(x):",
        max_tokens=48,
        temperature=0,
        extra_body={"response_format": fmt},
    )
    want = llm.generate(
        "def f(x):",
        SamplingParams(
            temperature=0,
            max_tokens=48,
            structured_outputs={"json": SCHEMA, "disable_any_whitespace": True},
        ),
        use_tqdm=False,
    )[0].outputs[0]
    text = out.choices[0].text
    assert text == want.text and out.choices[0].finish_reason == "stop"
    value = json.loads(text)
    assert set(value) == {"name", "n"} and re.fullmatch("[a-z]{1,8}", value["name"])
    assert 0 <= value["n"] <= 99


def test_chat_json_mode_streamed_with_n_2(server):
    client = _client(server)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "an object, please"}],
        max_tokens=64,
        temperature=1.0,
        seed=4,
        n=2,
        stream=True,
        response_format={"type": "json_object"},
        extra_body={"structured_outputs": None},
    )
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    for text, reason in zip(texts, reasons, strict=True):
        # An object has no bound: a completion cut at max_tokens is checked as a prefix.
        if reason == "stop":
            assert isinstance(json.loads(text), dict), text
        assert text.startswith("{"), text  # compact JSON: no leading whitespace


def test_chat_json_schema_streamed_with_n_2_always_completes(server):
    """A bounded schema: both sampled completions end with "stop" and validate."""
    client = _client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a person"}],
        max_tokens=64,
        temperature=1.0,
        seed=9,
        n=2,
        stream=True,
        response_format=fmt,
    )
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert reasons == ["stop", "stop"], texts
    for text in texts:
        value = json.loads(text)
        assert set(value) == {"name", "n"} and 0 <= value["n"] <= 99, text


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, r"[0-9]{3}-[a-z]{2}"),
        ({"guided_regex": "(ab|cd){2}"}, r"(ab|cd){2}"),
        ({"guided_choice": ["alpha", "beta"]}, r"alpha|beta"),
        ({"structured_outputs": {"choice": ["x1", "y22"]}}, r"x1|y22"),
        (
            {"guided_grammar": 'start: "[" NUM ("," NUM)~0..2 "]"\nNUM: /[0-9]/'},
            r"\[[0-9](,[0-9]){0,2}\]",
        ),
        ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}, None),
    ],
)
def test_vllm_fields_on_both_endpoints(server, extra, check):
    client = _client(server)
    comp = client.completions.create(
        model=MODEL, prompt="x = ", max_tokens=40, temperature=1.0, seed=7, extra_body=extra
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "go"}],
        max_tokens=40,
        temperature=1.0,
        seed=7,
        extra_body=extra,
    )
    for text, reason in (
        (comp.choices[0].text, comp.choices[0].finish_reason),
        (chat.choices[0].message.content, chat.choices[0].finish_reason),
    ):
        assert reason == "stop", text
        if check is None:
            value = json.loads(text)
            assert isinstance(value, list) and len(value) <= 2
            assert all(isinstance(v, bool) for v in value)
        else:
            assert re.fullmatch(check, text), text


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frob"}},
                }
            },
            "response_format",
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "json_object or json_schema"),
        ({"response_format": "json"}, "response_format", "type"),
        ({"guided_regex": "[a-"}, "guided_regex", "guided_regex does not compile"),
        ({"structured_outputs": {"grammar": "start: x"}}, "structured_outputs", "does not compile"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "not several"),
        (
            {"guided_json": {"type": "object"}, "guided_whitespace_pattern": 5},
            "guided_whitespace_pattern",
            "guided_whitespace_pattern must be a str",
        ),
    ],
)
def test_bad_constraints_name_the_field(server, extra, param, words):
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body
