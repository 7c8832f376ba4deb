"""The serve tests' fixtures: a real `paxkv-serve` process and the in-process `LLM` it
must agree with (the helpers are `serve_env`'s)."""

import pytest
from serve_env import ENGINE, MAX_MODEL_LEN, Server


@pytest.fixture(scope="module")
def server():
    # Trusting clients' chat templates, showing the prefix-cache counters and compact
    # JSON outputs: the tests of each run here (tests/serve/test_limits.py runs a server
    # without them).
    s = Server(
        "--trust_request_chat_template",
        "--expose_prefix_cache_metrics",
        "--disable_any_whitespace",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm():
    """The oracle: the same model and engine limits, in process."""
    from paxkv import LLM

    return LLM("tiny-py", warmup=False, max_model_len=MAX_MODEL_LEN, **ENGINE)
