"""Two `paxkv-serve` instances behind SGLang's router (`sglang-router`, the Rust
sgl-model-gateway; not a paxkv dependency: the test is skipped without it) with its
cache-aware policy: plain and streamed completions through the router equal an
instance's own, and a shared-prefix workload stays with the instance that holds each
prefix (every request after a prefix's first reads its pages from the cache), where
round robin splits each prefix over both.

    pip install sglang-router   # or PAXKV_ROUTER_PYTHON=/path/to/a/python/with/it
    python -m pytest -m slow tests/serve/test_external_router.py
"""

import os
import subprocess
import sys
import tempfile
import time

import pytest
from serve_env import ENGINE, Server, free_port

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

ROUTER_PYTHON = os.environ.get("PAXKV_ROUTER_PYTHON", sys.executable)
PAGE_SIZE = ENGINE["page_size"]


def head(i: int, run: str) -> str:
    """Head `i` of five pages or so (byte tokens) that prompts share, new in each `run`
    (another run's cached pages do not count); heads differ from their first page on."""
    return f"# package {i} ({run})\n" + "import os, sys, json, re, math\n" * 2


def _has_router() -> bool:
    probe = [ROUTER_PYTHON, "-c", "import sglang_router"]
    return subprocess.run(probe, capture_output=True).returncode == 0


pytestmark = [
    pytest.mark.slow,  # two servers and a router: a minute or more (CI's 25-minute budget)
    pytest.mark.skipif(not _has_router(), reason="sglang-router is not installed"),
]


class Router:
    """`sglang_router.launch_router` on a free port in front of `workers` (base URLs)."""

    def __init__(self, workers: list[str], policy: str) -> None:
        self.base = f"http://127.0.0.1:{free_port()}"
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in stop)
        argv = [
            ROUTER_PYTHON,
            "-m",
            "sglang_router.launch_router",
            "--host=127.0.0.1",
            f"--port={self.base.rsplit(':', 1)[1]}",
            f"--policy={policy}",
            "--worker-urls",
            *workers,
        ]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.3)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def workers():
    servers = [Server("--expose_prefix_cache_metrics") for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def _hits(servers) -> float:
    return sum(s.metrics()["paxkv:prefix_cache_hits_total"] for s in servers)


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_paxkv_serve_instances_behind_sglang_router(workers, policy):
    router = Router([w.base for w in workers], policy)
    try:
        via = openai.OpenAI(base_url=f"{router.base}/v1", api_key="none")
        direct = openai.OpenAI(base_url=workers[0].url, api_key="none")
        kw = dict(model="tiny-py", prompt="def f(x):", max_tokens=8, temperature=0)
        want = direct.completions.create(**kw).choices[0].text
        assert via.completions.create(**kw).choices[0].text == want
        streamed = via.completions.create(**kw, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == want
        # Each head's four requests one after another: round robin sends every head to
        # both instances, the cache-aware policy each to one.
        before = _hits(workers)
        shared = len(head(0, policy).encode()) // PAGE_SIZE * PAGE_SIZE  # full pages
        for n in range(16):
            body = {"model": "tiny-py", "prompt": head(n // 4, policy) + f"x{n} = "}
            r = httpx.post(f"{router.base}/v1/completions", json=body | {"max_tokens": 2})
            assert r.status_code == 200, r.text
        hits = _hits(workers) - before
        # cache_aware: 12 of the 16 find their head cached; round robin: 8.
        assert hits == (12 if policy == "cache_aware" else 8) * shared, (hits, shared)
    finally:
        router.stop()
