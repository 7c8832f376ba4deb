"""Two `jax.distributed` processes of 4 CPU devices each serve one `model:8` replica
behind process 0's endpoint (`paxkv.engine.multihost`): completions equal one
device's, a client that leaves frees its pages, /metrics is the whole replica's;
SIGTERM to process 0 stops both with status 0; killing process 1 mid-stream ends
process 0, non-zero, within the heartbeat timeout, and the stream with an error."""

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
HEARTBEAT_S = 10


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


class Job:
    """paxkv-serve as two processes of one replica; `base` is process 0's address."""

    def __init__(self) -> None:
        coordinator, port = _free_port(), _free_port()
        self.base = f"http://127.0.0.1:{port}"
        env = os.environ | {
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            "JAX_PLATFORMS": "cpu",
        }
        self.logs = [tempfile.TemporaryFile("w+") for _ in range(2)]  # noqa: SIM115
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "paxkv.launch.serve",
                    f"--config={MODEL}",
                    f"--port={port}",
                    "--jax_distributed",
                    f"--coordinator_address=localhost:{coordinator}",
                    "--num_processes=2",
                    f"--process_id={i}",
                    "--mesh=model:8",
                    "--dtype=float32",
                    f"--max_model_len={MAX_MODEL_LEN}",
                    f"--heartbeat_timeout_s={HEARTBEAT_S}",
                    *(f"--{k}={v}" for k, v in ENGINE.items()),
                ],
                env=env,
                stdout=self.logs[i],
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in range(2)
        ]
        deadline = time.monotonic() + 480
        while True:
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    self.kill()
                    pytest.fail(f"process {i} exited {p.returncode}:\n{self.output(i)[-5000:]}")
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail("the job was not ready in time")
            time.sleep(0.5)

    def output(self, i: int) -> str:
        self.logs[i].seek(0)
        return self.logs[i].read()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def llm():
    """The oracle: the same model and engine on one device."""
    from paxkv import LLM

    return LLM(MODEL, dtype="float32", warmup=False, max_model_len=MAX_MODEL_LEN, **ENGINE)


def test_one_replica_over_two_processes_serves_as_one_device(llm):
    from paxkv import SamplingParams

    job = Job()
    try:
        client = openai.OpenAI(base_url=f"{job.base}/v1", api_key="none")
        before = _metrics(job.base)
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
        while (m := _metrics(job.base))["paxkv:num_requests_running"] > 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert m["paxkv:kv_pages_in_use"] == 0
        assert m["paxkv:num_compilations_total"] == before["paxkv:num_compilations_total"] > 0
        generated = m["paxkv:generation_tokens_total"] - before["paxkv:generation_tokens_total"]
        assert 4 * (8 + 8 + 3 * 8) + 8 + 4 <= generated <= 4 * (8 + 8 + 3 * 8) + 8 + 100
        # SIGTERM to process 0 drains and stops both.
        job.procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in job.procs]
        assert codes == [0, 0], (job.output(0)[-3000:], job.output(1)[-3000:])
        assert "process 0 stopped the job" in job.output(1)
    finally:
        job.kill()


@pytest.mark.slow  # two processes started and one killed: minutes (CI's 25-minute budget)
def test_killing_process_1_ends_process_0_and_its_streams():
    job = Job()
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 110, "stream": True}
        events, error = [], None
        t_kill = None
        try:
            with httpx.stream("POST", f"{job.base}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                    if len(events) == 3 and t_kill is None:
                        job.procs[1].kill()
                        t_kill = time.monotonic()
        except httpx.HTTPError as e:  # the connection cut: an error, not a hang
            error = e
        assert t_kill is not None
        ended_with_error = error is not None or any('"error"' in e for e in events[3:])
        assert ended_with_error and len(events) < 110, (error, events[-2:])
        code = job.procs[0].wait(timeout=HEARTBEAT_S + 30)
        assert code != 0
        assert time.monotonic() - t_kill < HEARTBEAT_S + 30
        out = job.output(0)
        assert "another task died" in out or "stopped answering" in out, out[-3000:]
    finally:
        job.kill()
