"""paxkv-serve end to end: one server process, OpenAI's client, and `LLM` as the oracle.

Token ids come back through logprobs (`return_tokens_as_token_ids`: "token_id:<id>"),
so the comparison with `LLM.generate` / `LLM.chat` is token for token, not only text.
"""

import asyncio
import concurrent.futures
import json
import socket
import time

import httpx
import openai
import pytest
from serve_env import CHAT_TEMPLATE, MAX_QUEUED

from paxkv import SamplingParams

MODEL = "tiny-py"
PROMPTS = ["def f(x):", "import os\n", "class Stack:", "for i in range(10):"]
IDS = {"return_tokens_as_token_ids": True}


def token_ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)


def expected(llm, prompts, **params):
    """The oracle's outputs: (token ids, text) of each prompt's completion."""
    outs = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


def test_health_and_models(server, client):
    assert httpx.get(f"{server.base}/health").status_code == 200
    (model,) = client.models.list().data
    assert model.id == MODEL


def test_completions_equal_generate(server, client, llm):
    want = expected(llm, PROMPTS, temperature=0, max_tokens=12)
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0, logprobs=0, extra_body=IDS
    )
    got = [(token_ids(c.logprobs.tokens), c.text) for c in resp.choices]
    assert got == want
    assert [c.finish_reason for c in resp.choices] == ["length"] * len(PROMPTS)
    prompt_tokens = sum(len(p.encode()) for p in PROMPTS)  # tiny-py's tokens are bytes
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.completion_tokens == 12 * len(PROMPTS)
    # Token-id prompts, streamed: the chunks add up to the same completion.
    ids = list(PROMPTS[0].encode())
    stream = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=12,
        temperature=0,
        logprobs=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IDS,
    )
    tokens, text, usage = [], "", None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            tokens += token_ids(c.logprobs.tokens)
            text += c.text
    assert (tokens, text) == want[0]
    assert usage.completion_tokens == 12


def test_chat_equals_llm_chat(server, client, llm):
    messages = [{"role": "user", "content": "Write a function."}]
    (out,) = llm.chat(
        messages,
        SamplingParams(temperature=0, max_tokens=10),
        chat_template=CHAT_TEMPLATE,
        use_tqdm=False,
    )
    want = (out.outputs[0].token_ids, out.outputs[0].text)
    kwargs = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True)
    resp = client.chat.completions.create(**kwargs, extra_body=IDS)
    (choice,) = resp.choices
    assert choice.message.role == "assistant"
    assert (token_ids([e.token for e in choice.logprobs.content]), choice.message.content) == want
    assert resp.usage.prompt_tokens == len(out.prompt_token_ids)
    tokens, text = [], ""
    for chunk in client.chat.completions.create(**kwargs, stream=True, extra_body=IDS):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += token_ids([e.token for e in c.logprobs.content])
            text += c.delta.content or ""
    assert (tokens, text) == want


def stream_completion(server, prompt, **params):
    """(token ids, text, finish reason) of one streamed completion, over raw HTTP."""
    body = {"model": MODEL, "prompt": prompt, "stream": True, "logprobs": 0, **IDS, **params}
    tokens, text, reason = [], "", None
    with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                return tokens, text, reason
            (c,) = json.loads(line.removeprefix("data: "))["choices"]
            tokens += token_ids(c["logprobs"]["tokens"])
            text += c["text"]
            reason = c["finish_reason"] or reason
    raise AssertionError("the stream ended without [DONE]")


def wait_idle(server, timeout_s=120):
    """The server's metrics once no request runs or waits, no page is in use and the
    background warm-up is done (its compilations count as they finish)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        idle = (
            m["paxkv:kv_pages_in_use"] == 0
            and m["paxkv:num_requests_running"] == 0
            and m["paxkv:num_requests_waiting"] == 0
            and m.get("paxkv:compiling", 0) == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_concurrent_streams_equal_running_alone(server, llm):
    # Seeded sampling: the outputs differ between prompts and still reproduce exactly.
    prompts = [f"{p} # {i}" for i in range(8) for p in PROMPTS]  # 32
    seeds = range(len(prompts))
    outs = llm.generate(
        prompts,
        [SamplingParams(temperature=0.8, seed=s, max_tokens=16) for s in seeds],
        use_tqdm=False,
    )
    want = [(o.outputs[0].token_ids, o.outputs[0].text, "length") for o in outs]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(
            pool.map(
                lambda ps: stream_completion(
                    server, ps[0], temperature=0.8, seed=ps[1], max_tokens=16
                ),
                zip(prompts, seeds, strict=True),
            )
        )
    assert got == want
    assert wait_idle(server)["paxkv:kv_pages_in_use"] == 0


def aborted(server) -> float:
    return server.metrics().get('paxkv:request_success_total{finished_reason="abort"}', 0.0)


def test_a_client_that_leaves_aborts_its_request(server):
    before = aborted(server)
    body = {
        "model": MODEL,
        "prompt": "def f(x):",
        "max_tokens": 110,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the request runs; then the client leaves
    m = wait_idle(server)
    assert m["paxkv:kv_pages_in_use"] == 0
    assert aborted(server) == before + 1
    # A client that leaves before a non-streamed response too (as soon as it has sent
    # the request: its 110 tokens take ~100 steps).
    body["stream"] = False
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
    assert wait_idle(server)["paxkv:kv_pages_in_use"] == 0
    assert aborted(server) == before + 2


BAD_REQUESTS = [
    # (path, body or raw text, status, param, words of the message)
    ("completions", "{not json", 400, None, "not valid JSON"),
    ("completions", "[1, 2]", 400, None, "JSON object"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "gpt-4"),
    # A lone surrogate (valid JSON, not encodable as UTF-8) echoed in the message.
    ("completions", '{"prompt": "x", "model": "a\\ud800"}', 404, "model", "a\ud800"),
    ("completions", {"max_tokens": 4}, 400, "prompt", "prompt is required"),
    ("completions", {"prompt": 3}, 400, "prompt", "prompt must be"),
    ("completions", {"prompt": []}, 400, "prompt", "prompt must be"),
    ("completions", {"prompt": [1, 99999]}, 400, "prompt", "outside the vocabulary"),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature", ">= 0"),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),
    (
        "completions",
        {"prompt": "x", "max_tokens": 0},
        400,
        "max_tokens",
        "max_tokens=0 must be at least 1 (0 only with echo",
    ),
    (
        "completions",
        {"prompt": "x", "max_tokens": -1},
        400,
        "max_tokens",
        "max_tokens=-1 must be at least 1",
    ),
    (
        "completions",
        {"prompt": "x", "echo": True, "max_tokens": -1},
        400,
        "max_tokens",
        "must be at least 1",
    ),
    ("completions", {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", "integer"),
    ("completions", {"prompt": "x", "n": 0}, 400, "n", "n=0"),
    ("completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", "max_logprobs"),
    ("completions", {"prompt": "x", "stop": [""]}, 400, "stop", "empty string"),
    ("completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "[-2, 2]"),
    ("completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    ("completions", {"prompt": "x" * 120, "max_tokens": 16}, 400, "max_tokens", "max_model_len"),
    ("completions", {"prompt": "x" * 200}, 400, "prompt", "longer than max_model_len"),
    ("chat/completions", {"messages": []}, 400, "messages", "non-empty"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "max_completion_tokens=0 must be at least 1",
    ),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages", "content"),
    ("chat/completions", {"messages": [{"role": "user", "content": 1}]}, 400, "messages", "str"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs",
        "logprobs=true",
    ),
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template": "{{ raise_exception('no') }}",
        },
        400,
        "chat_template",
        "no",
    ),
]


def test_bad_requests_are_answered_and_harm_no_one(server, llm):
    want = expected(llm, [PROMPTS[1]], temperature=0, max_tokens=100)[0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(stream_completion, server, PROMPTS[1], temperature=0, max_tokens=100)
        for path, body, status, param, words in BAD_REQUESTS:
            kwargs = {"content": body} if isinstance(body, str) else {"json": body}
            r = httpx.post(f"{server.url}/{path}", timeout=30, **kwargs)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param, (body, error)
            assert words in error["message"], (body, error)
            assert error["type"] in ("invalid_request_error", "not_found_error")
        assert good.result()[:2] == want
    assert wait_idle(server)["paxkv:kv_pages_in_use"] == 0


def test_past_the_queue_bound_requests_get_429(server):
    # 16 more than the server holds (max_num_seqs + MAX_QUEUED = 32), all at once: the
    # ones past the bound are refused while the others run (each long enough that
    # none finishes before all have arrived).
    body = {"model": MODEL, "prompt": "x", "max_tokens": 120, "ignore_eos": True}
    n = 8 + MAX_QUEUED + 16
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        responses = list(
            pool.map(
                lambda _: httpx.post(f"{server.url}/completions", json=body, timeout=120), range(n)
            )
        )
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429}, codes
    assert codes.count(429) >= 1
    refused = next(r for r in responses if r.status_code == 429).json()["error"]
    assert refused["type"] == "rate_limit_error"
    assert "retry later" in refused["message"]
    ok = [r.json() for r in responses if r.status_code == 200]
    assert all(o["usage"]["completion_tokens"] == 120 for o in ok)
    assert wait_idle(server)["paxkv:kv_pages_in_use"] == 0


def test_bench_client_measures_a_poisson_trace(server):
    import asyncio

    from paxkv.measure.load_bench import make_workload
    from paxkv.serve import bench_client

    trace = make_workload(
        "fixed",
        num_requests=6,
        vocab_size=256,
        max_model_len=64,
        request_rate=50.0,
        fixed_prompt_len=(4, 16),
        fixed_output_len=(4, 12),
    )
    results, duration = asyncio.run(bench_client.run_trace(server.url, trace, model=MODEL))
    assert [r.output_tokens for r in results] == trace.output_lens
    summary = bench_client.summarize(results, duration)
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == sum(trace.output_lens)
    assert 0 < summary["ttft"]["p50_ms"] <= summary["e2e_latency"]["p99_ms"]
    assert "TTFT" in bench_client.format_summary(summary)


# Client chat templates that would take the server's time or memory, were they not bounded.
HOSTILE_TEMPLATES = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'x' * 10**9 }}",
]


def refused_quickly_while_health_answers(server, body, *, within_s):
    """The chat request's response (asserted 400 within `within_s`), /health polled
    meanwhile: every poll answered within a second."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        pending = pool.submit(httpx.post, f"{server.url}/chat/completions", json=body, timeout=60)
        polls = []
        while not pending.done():
            t0 = time.monotonic()
            assert httpx.get(f"{server.base}/health", timeout=5).status_code == 200
            polls.append(time.monotonic() - t0)
            time.sleep(0.05)
        r = pending.result()
    took = time.monotonic() - start
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template"
    assert took < within_s, took
    assert max(polls, default=0) < 1.0, polls
    return r.json()["error"]["message"]


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES)
def test_trusted_client_templates_are_bounded_in_time_and_size(server, template):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": template}
    message = refused_quickly_while_health_answers(server, body, within_s=10)
    assert "limit" in message
    # The server serves on.
    r = httpx.post(
        f"{server.url}/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def prefix_hits(server) -> float:
    return server.metrics()["paxkv:prefix_cache_hits_total"]


def test_cache_salt_separates_tenants(server):
    # 40 byte tokens: two full pages of 16 to share, when the salts let them.
    prompt = "tenant secret: the launch code is 123456"
    assert len(prompt.encode()) == 40

    def complete(salt):
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        r = httpx.post(f"{server.url}/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text

    complete("tenant-a")
    wait_idle(server)
    before = prefix_hits(server)
    complete("tenant-b")
    complete(None)
    wait_idle(server)
    assert prefix_hits(server) == before  # another salt, or none: nothing shared
    complete("tenant-a")
    wait_idle(server)
    assert prefix_hits(server) == before + 32  # the same salt: both full pages
    r = httpx.post(f"{server.url}/completions", json={"prompt": "x", "cache_salt": 3}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_no_request_compiles_after_warmup(server, client):
    """Once the server's warm-up has compiled every step shape (in the background while
    it serves), requests with every sampling feature, penalties and echoed prompt
    logprobs included, on short and long prompts, alone and batched together, compile
    no program of the model (at most the small sampler of a mix of penalties and scored
    rows, when first met)."""
    before = server.model_compilations()
    assert before > 0
    sampling = dict(
        max_tokens=8,
        temperature=0.9,
        top_p=0.9,
        seed=1,
        stop=["\n\n"],
        extra_body={"repetition_penalty": 1.2, "top_k": 5, "min_p": 0.05, "stop_token_ids": [3]},
    )
    for prompt in ("def f(x):", "x = 1\n" * 15):  # other token and page buckets
        client.completions.create(
            model=MODEL, prompt=prompt, frequency_penalty=0.5, logprobs=5, n=2, **sampling
        )
        # Echo with logprobs scores the prompt's rows; max_tokens=0 only scores them.
        echoed = client.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=2, n=2, **sampling
        )
        assert echoed.choices[0].text.startswith(prompt)
        assert echoed.choices[0].logprobs.token_logprobs[0] is None  # the first token
        client.completions.create(
            model=MODEL, prompt=[prompt, "y"], echo=True, logprobs=0, max_tokens=0
        )
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            presence_penalty=0.4,
            logprobs=True,
            top_logprobs=3,
            **sampling,
        )

    async def together():  # scoring, penalised and plain requests in the same steps
        aclient = openai.AsyncOpenAI(base_url=server.url, api_key="none")
        kinds = [
            dict(echo=True, logprobs=1, presence_penalty=0.3),
            dict(echo=True, logprobs=0, max_tokens=0),
            dict(frequency_penalty=0.2, n=3),
            dict(logprobs=3),
            {},
        ]
        calls = [
            aclient.completions.create(model=MODEL, prompt=f"{i} " + "z = 2\n" * i, **k)
            for i in range(4)  # 28 sequences: within the server's bound of 32
            for k in kinds
        ]
        await asyncio.gather(*calls)

    asyncio.run(together())
    assert server.metrics()["paxkv:num_model_compilations_total"] == before
