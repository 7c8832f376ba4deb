"""`paxkv-serve --enable_sleep_mode` over HTTP: POST /sleep, POST /wake_up and GET
/is_sleeping, as vLLM's, on a real tiny-py engine served in this process by uvicorn.

The oracle of a completion served after a sleep is the same greedy completion served
before it; a request sent while asleep waits for /wake_up (or is refused, 503), and the
stepping thread waits without using the CPU meanwhile.
"""

import concurrent.futures
import contextlib
import time

import jax
import numpy as np
import pytest
from serve_env import ENGINE, MAX_MODEL_LEN, in_process

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

PROMPT = "def f(x):"
BODY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm():
    from paxkv import LLM

    return LLM("tiny-py", warmup=False, max_model_len=MAX_MODEL_LEN, **ENGINE)


@contextlib.contextmanager
def serving(llm, *, enable_sleep_mode: bool):
    """`llm`'s engine served on 127.0.0.1 in this process; yields the base URL."""
    from paxkv.serve.app import ServerState
    from paxkv.serve.replicas import ReplicaSet
    from paxkv.text import chat

    state = ServerState(
        front=ReplicaSet([llm.engine], max_queued=4),
        model_name="tiny-py",
        tokenizer=llm.engine.tokenizer,
        chat_templates=chat.ChatTemplates({}, {}, "none"),
        max_model_len=MAX_MODEL_LEN,
        enable_sleep_mode=enable_sleep_mode,
    )
    with in_process(state) as url:
        yield url


@pytest.fixture(scope="module")
def base(llm):
    with serving(llm, enable_sleep_mode=True) as url:
        yield url


@pytest.fixture(autouse=True)
def awake(request, llm):
    """Every test starts, and leaves the engine, awake."""
    yield
    if llm.engine.asleep and "base" in request.fixturenames:
        httpx.post(f"{request.getfixturevalue('base')}/wake_up", timeout=60)
    assert not llm.engine.asleep


def complete(base: str, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={**BODY, **body}, timeout=120)


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def is_sleeping(base: str) -> bool:
    response = httpx.get(f"{base}/is_sleeping", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["is_sleeping"]


def error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_without_the_flag_the_endpoints_are_not_served(llm):
    with serving(llm, enable_sleep_mode=False) as url:
        assert httpx.post(f"{url}/sleep", timeout=10).status_code == 404
        assert httpx.post(f"{url}/wake_up", timeout=10).status_code == 404
        assert httpx.get(f"{url}/is_sleeping", timeout=10).status_code == 404
        assert "is_sleeping" not in httpx.get(f"{url}/metrics", timeout=10).text
    assert not llm.engine.asleep


def test_a_request_sent_while_asleep_waits_for_wake_up(base, llm):
    before = text(complete(base))
    assert is_sleeping(base) is False
    response = httpx.post(f"{base}/sleep", params={"level": 2}, timeout=60)
    assert response.status_code == 200, response.text
    slept = response.json()
    assert slept["released_bytes"] > 0
    assert [r["released_bytes"] for r in slept["replicas"]] == [slept["released_bytes"]]
    assert is_sleeping(base) is True
    assert llm.engine.asleep == 2
    # Serving still answers: /health stays 200 (as vLLM's), /metrics says it sleeps.
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    assert "paxkv:is_sleeping 1.0" in httpx.get(f"{base}/metrics", timeout=10).text

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(complete, base)
        time.sleep(0.5)  # queued on the stepping thread by now
        cpu0, t0 = time.process_time(), time.perf_counter()
        time.sleep(1.0)
        cpu = time.process_time() - cpu0
        wall = time.perf_counter() - t0
        assert not waiting.done()
        # A spinning stepping thread would take a whole core.
        assert cpu < 0.4 * wall, f"{cpu=:.2f} s of CPU in {wall=:.2f} s asleep"
        response = httpx.post(f"{base}/wake_up", timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["restored_bytes"] > 0
        assert text(waiting.result(timeout=120)) == before
    assert is_sleeping(base) is False
    assert "paxkv:is_sleeping 0.0" in httpx.get(f"{base}/metrics", timeout=10).text
    assert text(complete(base)) == before


def test_level_1_frees_the_kv_pool_and_keeps_the_output(base):
    before = text(complete(base))
    response = httpx.post(f"{base}/sleep", timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["released_bytes"] > 0
    assert httpx.post(f"{base}/wake_up", timeout=60).status_code == 200
    assert text(complete(base)) == before


def test_refusing_sleep_answers_503(base):
    response = httpx.post(f"{base}/sleep", params={"requests": "refuse"}, timeout=60)
    assert response.status_code == 200, response.text
    e = error(complete(base), 503)
    assert "asleep" in e["message"] and "wake_up" in e["message"]
    assert httpx.post(f"{base}/wake_up", timeout=60).status_code == 200
    text(complete(base))


@pytest.mark.parametrize(
    "params, param",
    [
        ({"level": 3}, "level"),
        ({"level": "two"}, "level"),
        ({"level": 1, "weights": "disk"}, "weights"),
        ({"requests": "drop"}, "requests"),
        ({"levle": 1}, "levle"),
    ],
)
def test_a_bad_parameter_is_400_naming_it(base, llm, params, param):
    e = error(httpx.post(f"{base}/sleep", params=params, timeout=10), 400)
    assert e["param"] == param
    assert param in e["message"] and str(params[param]) in e["message"]
    assert not llm.engine.asleep


def test_sleep_twice_is_400_and_wake_up_while_awake_a_no_op(base):
    response = httpx.post(f"{base}/wake_up", timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["restored_bytes"] == 0
    assert httpx.post(f"{base}/sleep", timeout=60).status_code == 200
    e = error(httpx.post(f"{base}/sleep", params={"level": 2}, timeout=60), 400)
    assert "asleep already" in e["message"]
    assert is_sleeping(base) is True
    assert httpx.post(f"{base}/wake_up", timeout=60).status_code == 200
    assert is_sleeping(base) is False


def test_dropped_weights_are_400_at_wake_up_until_replaced(base, llm):
    before = text(complete(base))
    weights = jax.tree.map(np.asarray, llm.get_weights())  # the trainer's copy
    response = httpx.post(f"{base}/sleep", params={"level": 2, "weights": "drop"}, timeout=60)
    assert response.status_code == 200, response.text
    e = error(httpx.post(f"{base}/wake_up", timeout=60), 400)
    assert "update_weights" in e["message"]
    assert is_sleeping(base) is True
    llm.engine.update_weights(weights)  # as the trainer does while the server sleeps
    assert httpx.post(f"{base}/wake_up", timeout=60).status_code == 200
    assert text(complete(base)) == before
