"""paxkv-serve as a public endpoint: limits at the door, untrusted chat templates
refused, and /metrics that does not tell one client what another sent.

The server here runs with the default flags (no --trust_request_chat_template, no
--expose_prefix_cache_metrics).
"""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from serve_env import MAX_MODEL_LEN, Server
from test_server import HOSTILE_TEMPLATES, refused_quickly_while_health_answers, wait_idle

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES)
def test_client_templates_are_refused_by_default(server, template):
    body = {"messages": HI, "chat_template": template}
    message = refused_quickly_while_health_answers(server, body, within_s=5)
    assert "--trust_request_chat_template" in message


LIMITS = [
    # (body, param, words of the message): each past a limit of protocol.Limits.
    ({"prompt": "x", "n": 129}, "n", "limit of 128"),
    ({"prompt": "x", "n": 2**64}, "n", "limit of 128"),
    ({"prompt": "x", "top_k": 2**31}, "top_k", "2147483647"),
    ({"prompt": "x", "seed": 2**31}, "seed", "2147483647"),
    ({"prompt": "x", "max_tokens": 2**63}, "max_tokens", None),
    ({"prompt": "x", "stop_token_ids": [2**40]}, "stop_token_ids", "2147483647"),
    ({"prompt": "x", "stop": ["s"] * 65}, "stop", "limit of 64"),
    ({"prompt": "x", "stop": "s" * 1025}, "stop", "limit of 1024"),
    ({"prompt": "x", "logprobs": 2**40}, "logprobs", None),
    ({"prompt": "x" * (32 * MAX_MODEL_LEN + 1)}, "prompt", "before tokenizing"),
    ({"prompt": [1] * (MAX_MODEL_LEN + 1)}, "prompt", "longer than max_model_len"),
    ({"prompt": [[1]] * 257}, "prompt", "limit of 256"),
    ({"prompt": "a\ud800b"}, "prompt", "Unicode"),
    ({"messages": HI * 4097}, "messages", "limit of 4096"),
    ({"messages": [{"role": "user", "content": "x" * 400}]}, "messages", "max_model_len"),
]


def test_limits_are_400s_that_name_the_limit(server):
    for body in LIMITS:
        body, param, words = body
        path = "chat/completions" if "messages" in body else "completions"
        # ensure_ascii keeps the lone surrogate as the escape a client would send
        r = httpx.post(
            f"{server.url}/{path}",
            content=json.dumps(body),
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400, (str(body)[:80], r.text)
        error = r.json()["error"]
        assert error["param"] == param, (str(body)[:80], error)
        if words is not None:
            assert words in error["message"], (str(body)[:80], error)
    # One request of more sequences than the server holds at once: 400, not a 429 forever.
    r = httpx.post(f"{server.url}/completions", json={"prompt": ["a"] * 5, "n": 7}, timeout=30)
    assert r.status_code == 400 and "sequences" in r.json()["error"]["message"], r.text
    assert wait_idle(server)["paxkv:kv_pages_in_use"] == 0


def test_malformed_http_is_answered_as_json(server):
    r = httpx.post(f"{server.url}/completions", content="[" * 100_000, timeout=30)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/completions", content=b" " * (16 << 20 | 1), timeout=30)
    assert r.status_code == 413 and "16777216 bytes" in r.json()["error"]["message"]
    r = httpx.get(f"{server.base}/v1/nowhere", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{server.url}/completions", timeout=30)
    assert r.status_code == 405 and "error" in r.json()


def test_metrics_do_not_tell_a_right_guess_from_a_wrong_one(server):
    # A tenant's 100-token prompt (tiny-py's tokens are bytes), cached once it ran; then
    # two guesses of its first pages, one right and one wrong, of the same length.
    secret = "the secret of tenant A is 7f3a9c; " * 3
    secret = secret[:100]
    right = secret[:96] + "0000"
    wrong = "x" * 96 + "0000"

    def complete(prompt):
        r = httpx.post(
            f"{server.url}/completions",
            json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text

    def counters():
        m = wait_idle(server)
        return {k: v for k, v in m.items() if "_total" in k or "kv_" in k}

    complete(secret)
    deltas = []
    for guess in (right, wrong):
        before = counters()
        complete(guess)
        after = counters()
        deltas.append({k: after[k] - before.get(k, 0.0) for k in after})
    assert deltas[0] == deltas[1]
    assert not any("prefix_cache" in k or "num_steps" in k for k in deltas[0])


def test_chat_template_flag_naming_a_missing_file_is_refused_at_start(tmp_path):
    missing = str(tmp_path / "template.jinja")
    argv = [sys.executable, "-m", "paxkv.launch.serve", f"--chat_template={missing}"]
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "looks like a file's path" in done.stderr + done.stdout


def test_grace_expiry_answers_in_flight_requests_with_openai_errors():
    import concurrent.futures
    import threading

    # Requests long enough that no host or step speed finishes them within the grace
    # period: the stream 4000 tokens, each plain request 1000 (their pages fit at once).
    # One step shape (--deterministic): warm-up compiles one, not the dozens a 4096-token
    # model length's buckets make (6 s to ready, not 30).
    s = Server(
        "--shutdown_grace_s=0.1", "--max_model_len=4096", "--num_pages=1024", "--deterministic"
    )
    body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True}
    running = threading.Event()

    def stream():
        lines = []
        with httpx.stream(
            "POST",
            f"{s.url}/completions",
            json={**body, "max_tokens": 4000, "stream": True},
            timeout=60,
        ) as r:
            for line in r.iter_lines():
                running.set()
                if line:
                    lines.append(line)
        return lines

    try:
        with concurrent.futures.ThreadPoolExecutor(21) as pool:
            # A stream, then 20 plain requests, 8 at a time: more than the grace period's work.
            streamed = pool.submit(stream)
            assert running.wait(60)
            plain = [
                pool.submit(httpx.post, f"{s.url}/completions", json=body, timeout=60)
                for _ in range(20)
            ]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until the engine holds them all
                m = s.metrics()
                if m["paxkv:num_requests_running"] + m["paxkv:num_requests_waiting"] >= 21:
                    break
            s.proc.send_signal(signal.SIGTERM)
            lines = streamed.result()
            # A connection the server had not read a request from when it stopped
            # listening is closed: the client sees a transport error, never a 500.
            responses = [p.result() for p in plain if p.exception() is None]
            assert all(
                isinstance(p.exception(), httpx.TransportError) for p in plain if p.exception()
            )
            assert s.proc.wait(timeout=30) == 0
    finally:
        s.stop()
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and 503 in codes, codes
    for r in responses:
        if r.status_code == 503:
            assert "shutting down" in r.json()["error"]["message"]
    assert lines[-1] == "data: [DONE]"
    assert "shutting down" in json.loads(lines[-2].removeprefix("data: "))["error"]["message"]
