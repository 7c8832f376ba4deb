"""Two `jax.distributed` processes of 4 CPU devices each serve one `model:8` replica
behind process 0's endpoint (`paxkv.engine.multihost`): completions equal one
device's, a client that leaves frees its pages, /metrics is the whole replica's;
SIGTERM to process 0 stops both with status 0; killing process 1 mid-stream ends the
stream with a 503 error event and `[DONE]`, and process 0 with status 1, within half
the heartbeat timeout and a few seconds."""

import json
import time

import pytest
from serve_processes import MODEL, ServeProcesses, cpu_env, free_port, metrics, serve_argv

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

HEARTBEAT_S = 10
# Process 0 fails a device call that waits this long (half the heartbeat timeout), its
# requests answered 503, then exits 1 after 2 s of grace (`paxkv.serve.multihost`).
STALL_S = HEARTBEAT_S / 2


def start_job(heartbeat_s: int | None = HEARTBEAT_S) -> ServeProcesses:
    """paxkv-serve as two processes of 4 devices each serving one `model:8` replica
    (`heartbeat_s` None: the default heartbeat timeout)."""
    coordinator, port = free_port(), free_port()
    argvs = [
        serve_argv(
            port,
            "--jax_distributed",
            f"--coordinator_address=localhost:{coordinator}",
            "--num_processes=2",
            f"--process_id={i}",
            "--mesh=model:8",
            *([f"--heartbeat_timeout_s={heartbeat_s}"] if heartbeat_s else []),
        )
        for i in range(2)
    ]
    return ServeProcesses(argvs, base=f"http://127.0.0.1:{port}", env=cpu_env(devices=4))


def test_one_replica_over_two_processes_serves_as_one_device(serve_oracle):
    from paxkv import SamplingParams

    llm = serve_oracle
    job = start_job()
    try:
        client = openai.OpenAI(base_url=f"{job.base}/v1", api_key="none")
        before = metrics(job.base)
        prompts = ["def f(x):", "import os\n", "class Stack:", "for i in range(10):"]
        greedy = SamplingParams(temperature=0, max_tokens=8)
        want = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]
        seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=8, n=3)
        want_n = [
            [c.text for c in o.outputs] for o in llm.generate(prompts, seeded, use_tqdm=False)
        ]
        for i, prompt in enumerate(prompts):
            plain = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0
            )
            assert plain.choices[0].text == want[i]
            streamed = "".join(
                c.choices[0].text
                for c in client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
                )
            )
            assert streamed == want[i]
            several = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0.9, seed=7, n=3
            )
            assert [c.text for c in several.choices] == want_n[i]
        # A client that leaves mid-stream: its request is aborted on every process.
        body = {"model": MODEL, "prompt": "x", "max_tokens": 100, "stream": True}
        with httpx.stream("POST", f"{job.base}/v1/completions", json=body, timeout=60) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 4:
                    break
        after = client.completions.create(
            model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0
        )
        assert after.choices[0].text == want[0]  # both processes still in step
        deadline = time.monotonic() + 30
        while (m := metrics(job.base))["paxkv:num_requests_running"] > 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert m["paxkv:kv_pages_in_use"] == 0
        assert m["paxkv:num_compilations_total"] == before["paxkv:num_compilations_total"] > 0
        generated = m["paxkv:generation_tokens_total"] - before["paxkv:generation_tokens_total"]
        assert 4 * (8 + 8 + 3 * 8) + 8 + 4 <= generated <= 4 * (8 + 8 + 3 * 8) + 8 + 100
        # SIGTERM to process 0 drains and stops both.
        codes = job.terminate()
        assert codes == [0, 0], (job.output(0)[-3000:], job.output(1)[-3000:])
        assert "process 0 stopped the job" in job.output(1)
    finally:
        job.kill()


@pytest.mark.slow  # two processes started and one killed: minutes (CI's 25-minute budget)
def test_killing_process_1_mid_stream_ends_the_stream_with_503_and_process_0():
    job = start_job()
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 110, "stream": True}
        events, t_kill = [], None
        with httpx.stream("POST", f"{job.base}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():  # a cut connection raises here: the test fails
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                if len(events) == 3 and t_kill is None:
                    job.procs[1].kill()
                    t_kill = time.monotonic()
        t_end = time.monotonic()
        assert t_kill is not None
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503, error
        assert 3 <= len(events) - 2 < 110
        assert t_end - t_kill < STALL_S + 3, t_end - t_kill
        code = job.procs[0].wait(timeout=HEARTBEAT_S + 30)
        elapsed = time.monotonic() - t_kill
        out = job.output(0)
        assert code == 1, (code, out[-3000:])
        assert elapsed < STALL_S + 5, elapsed  # the stall bound, 2 s of grace, the poll
        assert "stopped answering" in out, out[-3000:]
    finally:
        job.kill()


@pytest.mark.slow  # two processes started and one killed: a minute
def test_killing_process_1_while_idle_ends_process_0_at_the_default_flags():
    # Nothing in flight to break: process 0's pings (every 5 s idle at the default
    # heartbeat timeout of 100 s) find the loss, long before JAX's heartbeat check would
    # abort it (SIGABRT after about 90 s, /health answering 200 until then).
    job = start_job(heartbeat_s=None)
    try:
        time.sleep(2)
        job.procs[1].kill()
        t_kill = time.monotonic()
        code = job.procs[0].wait(timeout=120)
        elapsed = time.monotonic() - t_kill
        out = job.output(0)
        assert code == 1, (code, out[-3000:])
        assert elapsed < 5 + 2 + 3, elapsed  # a ping's interval, the grace, slack
        assert "stopped answering" in out, out[-3000:]
    finally:
        job.kill()
