"""`paxkv-serve --mesh=model:2,data:4` on 8 CPU devices: four replicas behind one
endpoint. Completions equal one device's token for token, a shared-prefix workload
sticks to the replicas that hold its prefixes and spreads evenly over them, and
/metrics gives each replica's figures and their totals."""

import concurrent.futures

import pytest
from serve_processes import (
    MODEL,
    ServeProcesses,
    cpu_env,
    free_port,
    metrics,
    serve_argv,
    warm_metrics,
)

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

# Eight prefixes of two full pages (32 byte tokens) and more.
PREFIXES = [f"# module {i}\nimport os\nimport sys\nimport json\n\n" for i in range(8)]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    argv = serve_argv(port, "--mesh=model:2,data:4", "--expose_prefix_cache_metrics")
    # XLA_FLAGS: this process's 8 devices (conftest).
    proc = ServeProcesses([argv], base=f"http://127.0.0.1:{port}", env=cpu_env())
    try:
        yield proc.base
        assert proc.terminate() == [0]
    finally:
        proc.kill()


def test_four_replicas_answer_as_one_device(server, serve_oracle):
    from paxkv import SamplingParams

    llm = serve_oracle
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    before = warm_metrics(server)
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
    after = metrics(server)
    # Only the small sampler of a penalties-with-scores mix may compile after warm-up.
    model = "paxkv:num_model_compilations_total"
    assert after[model] == before[model] > 0
    for i in range(4):  # each replica compiled its own step shapes, and no model's since
        assert after[f'paxkv:replica_num_compilations_total{{replica="{i}"}}'] > 0


def test_shared_prefixes_stick_to_their_replica_and_spread_evenly(server):
    """48 requests over 8 new two-page prefixes: each prefix's first request (one at a
    time, onto an idle server) goes to the least loaded replica in turn, and the other 40
    (8 at a time) follow it there by the prefix rule, so every replica serves two
    prefixes and 12 requests."""
    before = warm_metrics(server)
    prefixes = [p.replace("module", "package") for p in PREFIXES]

    def one(i: int) -> int:
        body = {"prompt": prefixes[i % 8] + f"y = {i}\n", "max_tokens": 4, "temperature": 0}
        return httpx.post(f"{server}/v1/completions", json=body, timeout=120).status_code

    assert [one(i) for i in range(8)] == [200] * 8
    for batch in range(1, 6):  # all eight prefixes in every batch of 8
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(batch * 8, batch * 8 + 8))) == [200] * 8
    after = metrics(server)

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
