"""Structured outputs through the engine (`SamplingParams.structured_outputs`).

Greedy constrained decoding equals a dense forward pass whose logits are masked, token
by token, by a matcher of llguidance's own (`LLMatcher.compute_bitmask`, independent of
the engine's mask filling, its bit layout and the device's unpacking), in every
execution mode, with unconstrained requests in the same steps unchanged. Sampled
outputs always match their constraint, and nothing compiles after warm-up."""

import json
import re

import numpy as np
import pytest
from test_engine import _dense_greedy, _engine, _run
from test_logprobs_penalties import MODES, _dense_logits

from paxkv import SamplingParams
from paxkv.engine import Engine

llguidance = pytest.importorskip("llguidance")

MODES = MODES | {
    "async with 4 decode steps": {"async_scheduling": True, "num_decode_steps": 4},
    "n-gram speculation": {
        "speculative_config": {"num_speculative_tokens": 3, "prompt_lookup_min": 1}
    },
}

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{0,6}$"},
        "ok": {"type": "boolean"},
        "n": {"enum": [1, 22, 333]},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "n", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
CHOICES = ["red", "green", "blue", "reddish"]
GRAMMAR = 'start: num | num "+" num | num "+" num "+" num\nnum: /[0-9]{1,3}/'
GRAMMAR_RE = r"[0-9]{1,3}(\+[0-9]{1,3}){0,2}"
SPECS = {
    "json": {"json": SCHEMA, "disable_any_whitespace": True},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
    "grammar": {"grammar": GRAMMAR},
}


class _Bytes:
    """The byte tokenizer for llguidance, its EOS a token past the model's 256."""

    eos_token_id, bos_token_id = 256, None

    def __init__(self):
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        self.special_token_ids = [256]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode())


def _reference_matcher(spec):
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
    kind, value = next((k, v) for k, v in spec.items() if k != "disable_any_whitespace")
    if kind == "json":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            value, defaults={"whitespace_flexible": False}
        )
    else:
        grammar = llguidance.grammar_from("choice" if kind == "choice" else kind, value)
    return llguidance.LLMatcher(tok, grammar)


def _dense_constrained_greedy(model, prompt, spec, max_tokens):
    """Greedy tokens of `prompt` under `spec`: the dense logits with the tokens the
    reference matcher refuses at -inf, until the constraint is complete."""
    m = _reference_matcher(spec)
    out = []
    for _ in range(max_tokens):
        mask = np.frombuffer(m.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(mask, bitorder="little")[:256].astype(bool)
        if not allowed.any():  # only EOS: the constraint is complete
            break
        logits = _dense_logits(model, [*prompt, *out])
        token = int(np.argmax(np.where(allowed, logits, -np.inf)))
        out.append(token)
        assert m.consume_token(token)
        if m.is_stopped():
            break
    return out


@pytest.fixture(scope="module")
def constrained_case(tiny):
    _, model, _ = tiny
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (9, 23, 5, 17, 12)]
    specs = [SPECS["json"], SPECS["regex"], SPECS["choice"], SPECS["grammar"], None]
    max_tokens = 48
    expected = [
        _dense_constrained_greedy(model, p, s, max_tokens)
        if s is not None
        else _dense_greedy(model, p, max_tokens)[0]
        for p, s in zip(prompts, specs, strict=True)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=s, logprobs=0)
        for s in specs
    ]
    return model, prompts, params, expected


@pytest.mark.parametrize("mode", MODES)
def test_constrained_greedy_matches_dense_masked_reference(tiny, constrained_case, mode):
    model, prompts, params, expected = constrained_case
    _, _, tokenizer = tiny
    engine = _engine(model, tokenizer, **MODES[mode])
    got = _run(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in got] == expected
    json.loads(got[0].outputs[0].text)
    assert re.fullmatch(REGEX, got[1].outputs[0].text)
    assert got[2].outputs[0].text in CHOICES
    assert re.fullmatch(GRAMMAR_RE, got[3].outputs[0].text)
    for o in got[:4]:  # complete: ended by the constraint, text whole
        assert o.outputs[0].finish_reason == "stop"
        assert o.outputs[0].text == bytes(o.outputs[0].token_ids).decode()
    # The logprobs stay the raw distribution's, not the masked one's.
    c = got[1].outputs[0]
    for j, token in enumerate(c.token_ids[:5]):
        logits = _dense_logits(model, [*prompts[1], *c.token_ids[:j]])
        raw = logits[token] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        assert abs(c.logprobs_array[j] - raw) < 1e-4, (j, c.logprobs_array[j], raw)
    assert engine.pool.num_free == engine.config.num_pages - 1  # no page leaked
    if "speculative_config" in MODES[mode]:  # the unconstrained one still speculated
        assert engine.stats()["spec_decode_num_drafts"] > 0


def _check(kind, text):
    if kind == "json":
        value = json.loads(text)
        assert set(value) == set(SCHEMA["properties"]), value
        assert isinstance(value["name"], str) and len(value["name"]) <= 6
        assert isinstance(value["ok"], bool) and value["n"] in (1, 22, 333)
        assert len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "bc"}
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(GRAMMAR_RE, text), text


SAMPLED_MODES = {"sync": {}, "async": {"async_scheduling": True}} | {
    "n-gram speculation": MODES["n-gram speculation"]
}


@pytest.mark.parametrize(
    ("mode", "num_requests"), [("sync", 200), ("async", 60), ("n-gram speculation", 60)]
)
def test_sampled_outputs_always_match_and_nothing_compiles_after_warmup(tiny, mode, num_requests):
    _, model, tokenizer = tiny
    engine = _engine(model, tokenizer, num_pages=256, **SAMPLED_MODES[mode])
    engine.warmup()
    warmed = len(engine.runner.programs_compiled)
    rng = np.random.default_rng(3)
    kinds = [*SPECS, None]
    work = []
    for i in range(num_requests):
        kind = kinds[i % len(kinds)]
        params = SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=64,
            n=1 + i % 2,
            structured_outputs=SPECS[kind] if kind else None,
        )
        work.append((kind, rng.integers(0, 256, size=int(rng.integers(3, 30))).tolist(), params))
    for i, (_, prompt, params) in enumerate(work):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    done = engine.run_until_done()
    checked = 0
    for i, (kind, _, _) in enumerate(work):
        for c in done[str(i)].outputs:
            if kind is None:
                continue
            assert c.finish_reason == "stop", (kind, c.text)
            _check(kind, c.text)
            checked += 1
    assert checked == sum(1 + i % 2 for i in range(num_requests) if kinds[i % len(kinds)])
    later = engine.runner.programs_compiled[warmed:]
    if "speculative_config" in SAMPLED_MODES[mode]:  # proposals under masks: compiled at first use
        later = [(n, k) for n, k in later if not (n == "resample" and k[4] and k[7])]
    assert not later, later
    assert engine.pool.num_free == engine.config.num_pages - 1


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ({"regex": "[a-z"}, "structured_outputs.regex", "unclosed character class"),
        ({"json": {"type": "frob"}}, "structured_outputs.json", "frob"),
        ({"grammar": "start: x\nx: 'a' | y"}, "structured_outputs.grammar", ""),
        ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
        ({"choice": []}, "structured_outputs.choice", "empty"),
        ({"regex": "a", "choice": ["a"]}, "exactly one", ""),
        ({"regex": "a", "disable_any_whitespace": True}, "disable_any_whitespace", ""),
        ({"jsonn": {}}, "unknown keys", "jsonn"),
    ],
)
def test_a_bad_constraint_is_rejected_naming_the_field_and_nothing_is_kept(
    tiny, spec, field, message
):
    _, model, tokenizer = tiny
    engine = _engine(model, tokenizer)
    with pytest.raises((ValueError, TypeError)) as e:
        engine.add_request(
            "bad", {"prompt_token_ids": [1, 2]}, SamplingParams(structured_outputs=spec)
        )
    assert field in str(e.value) and message in str(e.value), e.value
    assert not engine.has_unfinished()
    engine.add_request("bad", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))
    assert len(engine.run_until_done()["bad"].outputs[0].token_ids) == 2


def test_an_engine_without_a_tokenizer_refuses_constraints(tiny):
    _, model, _ = tiny
    engine = Engine(model, _engine(model).config)
    with pytest.raises(ValueError, match="structured_outputs needs a tokenizer"):
        engine.add_request(
            "r", {"prompt_token_ids": [1]}, SamplingParams(structured_outputs={"regex": "a"})
        )


def test_a_mask_fill_that_raises_fails_only_the_constrained_requests(tiny):
    _, model, tokenizer = tiny
    engine = _engine(model, tokenizer)

    def broken(*args):
        raise RuntimeError("llguidance broke")

    engine._stepper.fill_masks = broken
    engine.add_request("free", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=5))
    engine.add_request(
        "json",
        {"prompt_token_ids": [4, 5]},
        SamplingParams(max_tokens=5, structured_outputs={"json_object": True}),
    )
    done = engine.run_until_done()
    assert len(done["free"].outputs[0].token_ids) == 5
    assert done["json"].outputs[0].finish_reason == "abort"
    assert "llguidance broke" in done["json"].error
    assert engine.pool.num_free == engine.config.num_pages - 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_draft_model_speculation_leaves_constrained_requests_exact(
    tiny, constrained_case, async_scheduling
):
    """A draft model proposes for the free request only: the constrained ones decode one
    token a step, still the masked dense greedy."""
    from engine_configs import small_config
    from test_draft_model import DRAFT, _perturbed

    model, prompts, params, expected = constrained_case
    _, _, tokenizer = tiny
    config = small_config(64, speculative_config=DRAFT, async_scheduling=async_scheduling)
    engine = Engine(model, config, draft_model=_perturbed(model), tokenizer=tokenizer)
    got = _run(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert engine.stats()["spec_decode_num_drafts"] > 0


def test_constrained_sequences_take_the_ngram_proposals_their_constraint_allows(tiny):
    """Prompt lookup proposes the rest of a forced output from the prompt: the proposals
    the constraint allows are verified under each position's mask and accepted."""
    _, model, tokenizer = tiny
    text = "hello world, hello world"
    engine = _engine(model, tokenizer, **MODES["n-gram speculation"])
    prompt = list(f"say {text}\n".encode())
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"choice": [text]})
    (out,) = _run(engine, [prompt], params)
    assert out.outputs[0].text == text and out.outputs[0].finish_reason == "stop"
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_acceptance_rate"] > 0.5


def test_a_matcher_in_error_fails_its_request_with_the_error(tiny):
    """A matcher llguidance gave up on (here: fed a token its grammar refuses) allows
    only EOS: its request fails, naming the error, rather than ending as "stop"."""
    _, model, tokenizer = tiny
    engine = _engine(model, tokenizer)
    make = engine.grammars.matcher

    def broken(grammar):
        m = make(grammar)
        m.consume_token(ord("x"))  # the regex below allows digits only
        assert m.is_error()
        return m

    engine.grammars.matcher = broken
    engine.add_request(
        "r", {"prompt_token_ids": [1, 2]}, SamplingParams(structured_outputs={"regex": "[0-9]+"})
    )
    engine.add_request("free", {"prompt_token_ids": [3]}, SamplingParams(max_tokens=3))
    done = engine.run_until_done()
    assert done["r"].outputs[0].finish_reason == "abort" and "structured_outputs" in done["r"].error
    assert len(done["free"].outputs[0].token_ids) == 3
