"""`paxkv-serve --mesh=model:2,data:4` on 8 CPU devices: four replicas behind one
endpoint. Completions equal one device's token for token, a shared-prefix workload
sticks to the replicas that hold its prefixes and spreads evenly over them, and
/metrics gives each replica's figures and their totals."""

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

ENGINE = {"num_pages": 256, "page_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 64}
MAX_MODEL_LEN = 128
MODEL = "tiny-py"
# Eight prefixes of two full pages (32 byte tokens) and more.
PREFIXES = [f"# module {i}\nimport os\nimport sys\nimport json\n\n" for i in range(8)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(base: str) -> dict[str, float]:
    samples = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "paxkv.launch.serve",
        f"--config={MODEL}",
        f"--port={port}",
        "--mesh=model:2,data:4",
        "--dtype=float32",
        f"--max_model_len={MAX_MODEL_LEN}",
        "--expose_prefix_cache_metrics",
        *(f"--{k}={v}" for k, v in ENGINE.items()),
    ]
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed below)
    env = os.environ | {"JAX_PLATFORMS": "cpu"}  # XLA_FLAGS: this process's 8 devices
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 480  # four replicas compile their step shapes
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"paxkv-serve exited {proc.returncode}:\n{log.read()[-5000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "paxkv-serve was not ready in time"
        time.sleep(0.5)
    yield base
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    log.close()


@pytest.fixture(scope="module")
def llm():
    """The oracle: the same model and engine on one device."""
    from paxkv import LLM

    return LLM(MODEL, dtype="float32", warmup=False, max_model_len=MAX_MODEL_LEN, **ENGINE)


def test_four_replicas_answer_as_one_device(server, llm):
    from paxkv import SamplingParams

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    before = _metrics(server)
    prompts = [PREFIXES[i] + f"def f{i}(x):" for i in range(4)] + ["x", "class A:"]
    want = [
        o.outputs[0].text
        for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    ]
    for prompt, text in zip(prompts, want, strict=True):
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert plain.choices[0].text == text
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
            )
        )
        assert streamed == text
    several = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=8, temperature=0, n=2
    )
    assert [c.text for c in several.choices] == [t for t in want for _ in range(2)]
    after = _metrics(server)
    assert after["paxkv:num_compilations_total"] == before["paxkv:num_compilations_total"] > 0
    for i in range(4):  # each replica compiled its own step shapes, and nothing since
        assert after[f'paxkv:replica_num_compilations_total{{replica="{i}"}}'] > 0


def test_shared_prefixes_stick_to_their_replica_and_spread_evenly(server):
    """48 requests over 8 new two-page prefixes: each prefix's first request (one at a
    time, onto an idle server) goes to the least loaded replica in turn, and the other 40
    (8 at a time) follow it there by the prefix rule, so every replica serves two
    prefixes and 12 requests."""
    before = _metrics(server)
    prefixes = [p.replace("module", "package") for p in PREFIXES]

    def one(i: int) -> int:
        body = {"prompt": prefixes[i % 8] + f"y = {i}\n", "max_tokens": 4, "temperature": 0}
        return httpx.post(f"{server}/v1/completions", json=body, timeout=120).status_code

    assert [one(i) for i in range(8)] == [200] * 8
    for batch in range(1, 6):  # all eight prefixes in every batch of 8
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(batch * 8, batch * 8 + 8))) == [200] * 8
    after = _metrics(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    routed = [
        sum(
            delta(f'paxkv:replica_routed_requests_total{{replica="{i}",rule="{rule}"}}')
            for rule in ("prefix", "least_loaded")
        )
        for i in range(4)
    ]
    by_prefix = sum(
        delta(f'paxkv:replica_routed_requests_total{{replica="{i}",rule="prefix"}}')
        for i in range(4)
    )
    assert sum(routed) == 48 and by_prefix == 40, (routed, by_prefix)
    assert routed == [12] * 4, routed
    hits = delta("paxkv:prefix_cache_hits_total")
    queries = delta("paxkv:prefix_cache_queries_total")
    # Every request after its prefix's first reads its two pages from the cache.
    assert hits >= 40 * 32 and hits / queries > 0.6, (hits, queries)
    gen = [delta(f'paxkv:replica_generation_tokens_total{{replica="{i}"}}') for i in range(4)]
    assert sum(gen) == delta("paxkv:generation_tokens_total") == 48 * 4
    assert all(after[f'paxkv:replica_up{{replica="{i}"}}'] == 1 for i in range(4))
