"""`echo=true` with `logprobs` on /v1/completions, as lm-evaluation-harness's
`local-completions` model sends it for loglikelihood requests, against `LLM.score`.

lm-eval (`lm_eval/models/openai_completions.py`, `LocalCompletionsAPI`) posts
`{"prompt": [context + continuation token ids, ...], "max_tokens": 1, "logprobs": 1,
"echo": true, "temperature": 0}` and parses each choice (sorted by index) as
`sum(token_logprobs[ctxlen:-1])` and `is_greedy = all(tok == max(top.values()))` over
`top_logprobs[ctxlen:-1]`: the last entry is the generated token's. `parse_logprobs`
below restates that; tests/serve/test_lm_eval.py runs lm-eval itself.
"""

import json
from operator import itemgetter

import httpx
import numpy as np

from paxkv import SamplingParams

MODEL = "tiny-py"


def parse_logprobs(response: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval `LocalCompletionsAPI.parse_logprobs` (v0.4), for one response."""
    res = []
    for choice, ctxlen in zip(
        sorted(response["choices"], key=itemgetter("index")), ctxlens, strict=True
    ):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(
            t == max(top.values()) for t, top in zip(token_logprobs, top_logprobs, strict=True)
        )
        res.append((sum(token_logprobs), greedy))
    return res


def _post(server, body):
    r = httpx.post(f"{server.url}/completions", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_lm_eval_loglikelihood_request(server, llm):
    tok = llm.get_tokenizer()
    pairs = [("def f(x):", " return x"), ("import os\n", "import sys"), ("a", "b")]
    ctx = [tok.encode(c) for c, _ in pairs]
    cont = [tok.encode(c) for _, c in pairs]
    body = {
        "prompt": [c + d for c, d in zip(ctx, cont, strict=True)],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    response = _post(server, body)
    parsed = parse_logprobs(response, [len(c) for c in ctx])
    scores = llm.score(ctx, cont)
    outs = llm.generate(
        [{"prompt_token_ids": c + d} for c, d in zip(ctx, cont, strict=True)],
        SamplingParams(max_tokens=0, prompt_logprobs=1),
        use_tqdm=False,
    )
    for (total, greedy), s, c, out in zip(parsed, scores, ctx, outs, strict=True):
        np.testing.assert_allclose(total, float(np.sum(s, dtype=np.float64)), atol=1e-4)
        ids = out.prompt_token_ids
        want = all(d[ids[p]].rank == 1 for p, d in enumerate(out.prompt_logprobs) if p >= len(c))
        assert greedy == want
    for choice, p in zip(response["choices"], body["prompt"], strict=True):
        lp = choice["logprobs"]
        n = len(p) + 1  # the prompt, echoed, and the one generated token
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
        assert choice["text"].startswith(tok.decode(p))
        offsets = lp["text_offset"]
        assert offsets[0] == 0 and all(
            b - a == len(t)
            for a, b, t in zip(offsets[:-1], offsets[1:], lp["tokens"], strict=False)
        )


def test_echo_without_generation(server, llm):
    prompt = "class Stack:\n    def push(self, x):"
    response = _post(server, {"prompt": prompt, "max_tokens": 0, "logprobs": 2, "echo": True})
    (choice,) = response["choices"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert response["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    ids = llm.get_tokenizer().encode(prompt)
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == prompt
    (out,) = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(max_tokens=0, prompt_logprobs=2),
        use_tqdm=False,
    )
    want = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=1e-5)
    for top in lp["top_logprobs"][1:]:
        assert 2 <= len(top) <= 3  # the top 2, and the actual token when it is not one


def test_echo_without_logprobs_echoes_text(server):
    response = _post(server, {"prompt": "x = 1", "max_tokens": 3, "temperature": 0, "echo": True})
    (choice,) = response["choices"]
    assert choice["text"].startswith("x = 1") and choice["logprobs"] is None
    assert len(choice["text"]) > len("x = 1") or choice["finish_reason"] == "stop"


def test_echo_of_characters_split_over_tokens(server, llm):
    """A character of several UTF-8 bytes, one token each: the tokens' texts make the
    echoed text (the completing token carries the character, the others ""), and the
    offsets stay inside it."""
    prompt = "x = 'é' + '日本'"
    ids = llm.get_tokenizer().encode(prompt)
    assert len(ids) > len(llm.get_tokenizer().encode("x = 'e' + 'ab'"))  # bytes split
    response = _post(server, {"prompt": prompt, "max_tokens": 0, "logprobs": 1, "echo": True})
    (choice,) = response["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == prompt
    assert "".join(lp["tokens"]) == prompt and "\ufffd" not in "".join(lp["tokens"])
    offsets = lp["text_offset"]
    assert offsets == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert max(offsets) <= len(prompt)


def test_streamed_echo_equals_the_whole_response(server):
    """`echo` with `stream`: each choice's first chunk carries the prompt (and its
    logprobs); joined, the chunks are the non-streamed response."""
    body = {"prompt": ["x = 'é'", "def f():"], "max_tokens": 5, "temperature": 0}
    body |= {"logprobs": 1, "echo": True, "n": 2}
    whole = _post(server, body)
    text, tokens, offsets = {}, {}, {}
    with httpx.stream(
        "POST", f"{server.url}/completions", json={"model": MODEL, **body, "stream": True}
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line.removeprefix("data: "))["choices"]:
                i = c["index"]
                text[i] = text.get(i, "") + c["text"]
                if c["logprobs"] is not None:
                    tokens.setdefault(i, []).extend(c["logprobs"]["tokens"])
                    offsets.setdefault(i, []).extend(c["logprobs"]["text_offset"])
    assert sorted(text) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        i = choice["index"]
        assert text[i] == choice["text"] and text[i].startswith(body["prompt"][i // 2])
        assert tokens[i] == choice["logprobs"]["tokens"]
        assert offsets[i] == choice["logprobs"]["text_offset"]
