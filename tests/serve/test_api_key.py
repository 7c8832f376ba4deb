"""`paxkv-serve --api_key`: the `openai` client with the key is served, without it or
with another gets OpenAI's 401 (`AuthenticationError`); /health and /metrics stay open;
the key may come from $PAXKV_API_KEY."""

import os

import httpx
import openai
import pytest
from serve_env import Server

KEY = "sk-paxkv-test-key"


@pytest.fixture(scope="module")
def server():
    s = Server(f"--api_key={KEY}")
    yield s
    s.stop()


def test_the_key_is_needed_and_enough(server):
    good = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    out = good.completions.create(model="tiny-py", prompt="def f(x):", max_tokens=4)
    assert len(out.choices[0].text) > 0
    for key in ("sk-wrong", KEY[:-1], KEY + "x"):
        bad = openai.OpenAI(base_url=server.url, api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model="tiny-py", prompt="x", max_tokens=1)
        assert e.value.status_code == 401 and "API key" in e.value.message
    for path in ("/v1/models", "/tokenizer_info"):
        r = httpx.get(f"{server.base}{path}", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.get(f"{server.base}{path}", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
    assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.base}/metrics", timeout=10).status_code == 200


def test_the_key_from_the_environment(monkeypatch):
    monkeypatch.setitem(os.environ, "PAXKV_API_KEY", KEY)
    s = Server()
    try:
        assert httpx.get(f"{s.base}/v1/models", timeout=10).status_code == 401
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{s.base}/v1/models", headers=headers, timeout=10).status_code == 200
    finally:
        s.stop()
