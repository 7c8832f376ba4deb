"""Benchmark: does the HTTP front end of many streaming clients take time from the step loop?

    python -m benchmarks.serve_frontend --clients=64,256 --step_ms=5

One engine over the fake runner (`paxkv.engine.fake_runner.FakeRunner`, whose calls sleep
`--step_ms`: a stand-in for device time that, like a device call, releases the GIL)
with the byte tokenizer, behind the server's front end (`paxkv.serve.replicas.ReplicaSet`,
one stepping thread). For each count of `--clients`, the same load is run three ways,
one after another, `--repeats` times:

- `engine, ids`: driven in-process through `ReplicaSet.submit`, the engine without a
  tokenizer (no detokenization: token ids only);
- `engine`: the same, with the tokenizer (the step loop detokenizes, as when serving);
- `http`: the server's app (`paxkv.serve.app`) under uvicorn in this process, the
  clients streaming `/v1/completions` over HTTP from another process (a bare asyncio
  client: its CPU time is the client's, not the server's).

Each client sends `--requests_per_client` streamed requests one after another: a text
prompt of `--prompt_len` bytes and `ignore_eos` outputs of between half of and
`--max_tokens` tokens (the same lengths in every run). Measured on the stepping thread,
over the run: the gap between consecutive device calls (the end of one to the start of
the next: everything the host does per step, plus any wait for the GIL or a core), on
the wall clock and on the thread's CPU clock (p50 / p99), the step loop's CPU time as a
share of the process's (`time.process_time`, every thread: the event loop, uvicorn, the
worker threads), the step loop's and the process's CPU time over the wall time (near
100% the process's threads would queue for the GIL), the device's busy share (the calls' wall time over
the run's), and output tokens per second. `uptime` is printed first: the machine may
be shared.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

import numpy as np
from absl import app, flags

from paxkv.engine import Engine, EngineConfig
from paxkv.engine.fake_runner import FakeRunner
from paxkv.host.request import SamplingParams
from paxkv.serve.frontend import Submission
from paxkv.serve.replicas import ReplicaSet

_CLIENTS = flags.DEFINE_list("clients", ["64", "256"], "Concurrent streaming clients, per run.")
_STEP_MS = flags.DEFINE_float("step_ms", 5.0, "Each device call's sleep (device time).")
_REQUESTS = flags.DEFINE_integer(
    "requests_per_client", 4, "Streamed requests each client sends in turn.", lower_bound=1
)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt bytes (tokens).", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "Longest output.", lower_bound=2)
_REPEATS = flags.DEFINE_integer("repeats", 2, "Runs of each mode, interleaved.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the prompts and lengths.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write every run's results as JSON here.")
# Client mode: this module run as the HTTP clients' process (by the `http` runs).
_CLIENT_OF = flags.DEFINE_string("client_of", None, "Internal: be the clients of this port.")

MODES = ("engine, ids", "engine", "http")
VOCAB = 256  # the byte tokenizer's


class TimedRunner(FakeRunner):
    """The fake runner, each call sleeping `step_s` and timed from the calling (stepping)
    thread: its start and end on the wall clock, and on that thread's and the process's
    CPU clocks."""

    def __init__(self, vocab: int, config: EngineConfig, *, step_s: float) -> None:
        super().__init__(vocab, config)
        self.step_s = step_s
        self.calls: list[tuple[int, int, int, int, int]] = []  # wall in/out, thread in/out, proc

    def dispatch(self, hb: Any) -> Any:
        """FakeRunner's call after `step_s` of "device" time, timed."""
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        time.sleep(self.step_s)
        out = super().dispatch(hb)
        self.calls.append(
            (w0, time.perf_counter_ns(), c0, time.thread_time_ns(), time.process_time_ns())
        )
        return out


def workload(clients: int, seed: int) -> list[list[tuple[str, int]]]:
    """Each client's requests: (prompt text of `--prompt_len` ASCII bytes, max_tokens)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz (),:=\n"
    return [
        [
            (
                "".join(rng.choice(letters) for _ in range(_PROMPT_LEN.value)),
                rng.randint(_MAX_TOKENS.value // 2, _MAX_TOKENS.value),
            )
            for _ in range(_REQUESTS.value)
        ]
        for _ in range(clients)
    ]


def make_engine(clients: int, *, detokenize: bool) -> tuple[Engine, TimedRunner]:
    """An engine that holds every client's sequence at once, over a `TimedRunner`."""
    from paxkv.models import ByteTokenizer

    longest = _PROMPT_LEN.value + _MAX_TOKENS.value
    config = EngineConfig(
        num_pages=clients * (-(-longest // 16) + 1) + 16,
        page_size=16,
        max_num_seqs=clients,
        max_num_batched_tokens=max(2048, _PROMPT_LEN.value * 8),
        max_model_len=longest,
        num_decode_steps=1,
        log_stats_interval_s=0.0,
    )
    runners: list[TimedRunner] = []

    def runner(c: EngineConfig) -> TimedRunner:
        runners.append(TimedRunner(VOCAB, c, step_s=_STEP_MS.value / 1e3))
        return runners[0]

    engine = Engine(None, config, tokenizer=ByteTokenizer() if detokenize else None, runner=runner)
    return engine, runners[0]


async def drive_in_process(front: ReplicaSet, load: list[list[tuple[str, int]]]) -> int:
    """The clients as tasks submitting to `front`; the output tokens they received."""
    received = 0

    async def client(i: int) -> None:
        nonlocal received
        for j, (prompt, max_tokens) in enumerate(load[i]):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            ids = list(prompt.encode())
            group = await front.submit(
                [Submission(f"c{i}-{j}", {"prompt_token_ids": ids}, params)], stream=True
            )
            async for out in group:
                received += sum(len(c.token_ids) for c in out.outputs)

    await asyncio.gather(*(client(i) for i in range(len(load))))
    return received


async def serve_http(front: ReplicaSet, clients: int, tokenizer: Any) -> dict[str, Any]:
    """Serves `front` over HTTP on 127.0.0.1 while the clients' process runs; its report."""
    import uvicorn

    from paxkv.serve.app import ServerState, bind, build_app
    from paxkv.text import chat

    state = ServerState(
        front=front,
        model_name="fake",
        tokenizer=tokenizer,
        chat_templates=chat.ChatTemplates({}, {}, "the fake model"),
        max_model_len=_PROMPT_LEN.value + _MAX_TOKENS.value,
    )
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    config = uvicorn.Config(build_app(state), log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    argv = [
        sys.executable,
        "-m",
        "benchmarks.serve_frontend",
        f"--client_of={port}",
        f"--clients={clients}",
        *(f"--{f.name}={f.value}" for f in (_REQUESTS, _PROMPT_LEN, _MAX_TOKENS, _SEED)),
    ]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    server.should_exit = True
    await serving
    if proc.returncode != 0:
        raise RuntimeError(f"the clients' process exited {proc.returncode}")
    return json.loads(out.decode().strip().splitlines()[-1])


def run(mode: str, clients: int) -> dict[str, Any]:
    """One run of the load in `mode` (`MODES`) with `clients` clients; its figures."""
    engine, runner = make_engine(clients, detokenize=mode != "engine, ids")
    load = workload(clients, _SEED.value)
    front = ReplicaSet([engine], max_queued=clients)

    async def main() -> dict[str, Any]:
        if mode == "http":  # the app's lifespan starts and closes the front end
            return await serve_http(front, clients, engine.tokenizer)
        front.start()
        try:
            return {"tokens": await drive_in_process(front, load)}
        finally:
            await front.close()

    t0 = time.perf_counter()
    report = asyncio.run(main())
    calls = np.array(runner.calls, np.int64)  # [steps, 5]
    want = sum(n for requests in load for _, n in requests)
    if report["tokens"] != want:
        raise RuntimeError(f"{mode}: the clients received {report['tokens']} tokens, not {want}")
    gap_wall = (calls[1:, 0] - calls[:-1, 1]) / 1e6
    gap_cpu = (calls[1:, 2] - calls[:-1, 3]) / 1e6
    span = (calls[-1, 1] - calls[0, 0]) / 1e9
    loop_cpu = (calls[-1, 3] - calls[0, 2]) / 1e9
    process_cpu = (calls[-1, 4] - calls[0, 4]) / 1e9
    return {
        "mode": mode,
        "clients": clients,
        "steps": len(calls),
        "gap_ms_p50": float(np.median(gap_wall)),
        "gap_ms_p99": float(np.percentile(gap_wall, 99)),
        "gap_ms_mean": float(gap_wall.mean()),
        "gap_cpu_ms_p50": float(np.median(gap_cpu)),
        "gap_cpu_ms_p99": float(np.percentile(gap_cpu, 99)),
        "loop_cpu_share_of_process": loop_cpu / process_cpu,
        "loop_cpu_share_of_wall": loop_cpu / span,
        "process_cpu_share_of_wall": process_cpu / span,
        "device_busy": float((calls[:, 1] - calls[:, 0]).sum() / 1e9 / span),
        "tok_per_s": want / span,
        "wall_s": time.perf_counter() - t0,
        "client_cpu_s": report.get("cpu_s"),
    }


# The clients' process.


async def _stream(port: int, body: bytes) -> int:
    """One streamed completion over a fresh connection; its output tokens (the usage
    event's count)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"the server answered {status!r}")
    while (await reader.readline()) not in (b"\r\n", b""):
        pass  # headers; the body comes chunked
    data = bytearray()
    while size := int((await reader.readline()).strip() or b"0", 16):
        data += (await reader.readexactly(size + 2))[:-2]
    writer.close()
    events = bytes(data).split(b"\n\n")
    if b"data: [DONE]" not in events or any(b'"error"' in e for e in events):
        raise RuntimeError(f"a stream ended without [DONE] or with an error: {events[-3:]}")
    return json.loads(events[-3].removeprefix(b"data: "))["usage"]["completion_tokens"]


async def _clients(port: int, clients: int) -> int:
    load = workload(clients, _SEED.value)

    async def client(i: int) -> int:
        tokens = 0
        for prompt, max_tokens in load[i]:
            body = {
                "model": "fake",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            tokens += await _stream(port, json.dumps(body).encode())
        return tokens

    return sum(await asyncio.gather(*(client(i) for i in range(clients))))


def main(argv: list[str]) -> None:
    """The runs and their table (or, with --client_of, the clients' process)."""
    del argv
    if _CLIENT_OF.value is not None:
        c0 = time.process_time()
        tokens = asyncio.run(_clients(int(_CLIENT_OF.value), int(_CLIENTS.value[0])))
        print(json.dumps({"tokens": tokens, "cpu_s": time.process_time() - c0}))
        return
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(f"{os.cpu_count()} CPUs; step {_STEP_MS.value} ms; {_REQUESTS.value} requests per client")
    rows = []
    for clients in (int(c) for c in _CLIENTS.value):
        for _ in range(_REPEATS.value):
            rows.extend(run(mode, clients) for mode in MODES)
    print(
        "| clients | mode | steps | gap p50 / p99 / mean (ms) | gap CPU p50 / p99 (ms) | loop CPU / "
        "process CPU | loop / process CPU over wall | device busy | output tok/s | client CPU (s) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        client = "" if r["client_cpu_s"] is None else f"{r['client_cpu_s']:.1f}"
        print(
            f"| {r['clients']} | {r['mode']} | {r['steps']} | {r['gap_ms_p50']:.2f} / "
            f"{r['gap_ms_p99']:.2f} / {r['gap_ms_mean']:.2f} | {r['gap_cpu_ms_p50']:.2f} / {r['gap_cpu_ms_p99']:.2f} | "
            f"{r['loop_cpu_share_of_process']:.0%} | {r['loop_cpu_share_of_wall']:.0%} / "
            f"{r['process_cpu_share_of_wall']:.0%} | "
            f"{r['device_busy']:.0%} | {r['tok_per_s']:.0f} | {client} |"
        )
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    app.run(main)
