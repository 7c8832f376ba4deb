"""paxkv-serve with `--speculative_config`: OpenAI completions (plain and streamed, n > 1)
equal the oracle without speculation token for token, /metrics counts the drafts
with vLLM's names, and nothing compiles after warm-up."""

import json

import openai
import pytest
from serve_env import Server

from paxkv import SamplingParams

MODEL = "tiny-py"
PROMPTS = ["for i in range(10):\n    print(i)\nfor j in range(10):\n", "import os\nimport sys\n"]
IDS = {"return_tokens_as_token_ids": True}
SPEC = {"num_speculative_tokens": 4, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def spec_server():
    s = Server(f"--speculative_config={json.dumps(SPEC)}")
    yield s
    s.stop()


def _ids(tokens):
    return [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.mark.slow  # a second server warm-up (the 25-minute CI budget); LLM is tested in tests/engine
def test_speculative_server_equals_plain_decoding(spec_server, llm):
    client = openai.OpenAI(base_url=spec_server.url, api_key="none", max_retries=0, timeout=60)
    compiled = spec_server.model_compilations()
    want = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    want = [(o.outputs[0].token_ids, o.outputs[0].text) for o in want]
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=24, temperature=0, logprobs=1, extra_body=IDS
    )
    assert [(_ids(c.logprobs.tokens), c.text) for c in resp.choices] == want
    # Streamed, with n = 2: every choice adds up to the same greedy completion.
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=24,
        temperature=0,
        n=2,
        logprobs=0,
        stream=True,
        extra_body=IDS,
    )
    got = {0: ([], ""), 1: ([], "")}
    for chunk in stream:
        for c in chunk.choices:
            ids, text = got[c.index]
            got[c.index] = (ids + _ids(c.logprobs.tokens), text + c.text)
    assert got[0] == got[1] == want[0]
    m = spec_server.metrics()
    assert m["paxkv:spec_decode_num_drafts_total"] > 0
    assert m["paxkv:spec_decode_num_accepted_tokens_total"] > 0
    assert (
        m["paxkv:spec_decode_num_accepted_tokens_total"]
        <= (m["paxkv:spec_decode_num_draft_tokens_total"])
    )
    assert 'paxkv:spec_decode_acceptance_per_position{position="0"}' in m
    assert m["paxkv:num_model_compilations_total"] == compiled
