"""Benchmark: a serving soak, a mixed workload against a warm `paxkv-serve` for a while.

    python -m benchmarks.serve_soak --duration_s=1800 --concurrency=256
    python -m benchmarks.serve_soak --server_url=http://127.0.0.1:8000/v1 --server_pid=PID

Without `--server_url` it starts `paxkv-serve` (tiny-py, `--server_flag`s added) on a
free port of 127.0.0.1, waits for `/health`, and stops it with SIGTERM at the end. Only
127.0.0.1 is ever contacted. `--concurrency` clients each send one request after another
until `--duration_s` has passed, each request of a kind drawn at random (`KINDS`):
normal streams (whose inter-token gaps are measured), streams the client leaves
mid-way, penalties, logprobs, prompts echoed with their logprobs, n > 1, requests
abandoned before their answer, stop strings, and prompts too big for the server
(which must answer 400 or 413).

At the end, once the server is idle, it reports as JSON (`--json_out`, and printed):
the compilations after warm-up (`/metrics`' counter, before and after), the answers by
status (5xx must be zero), the KV pages still in use (a leak unless zero: every
request has ended), the server's RSS before the load, at each tenth of it and at
the end (`/proc/PID/status`, when the server's pid is known), and the p50/p99
inter-token gap of the normal streams on the client's clock. The clients share the
machine with the server: on a small one their CPU time is part of what is measured.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
import numpy as np
from absl import app, flags

_SERVER_URL = flags.DEFINE_string(
    "server_url", None, "API root (…/v1) of a running server on 127.0.0.1; unset: start one."
)
_SERVER_PID = flags.DEFINE_integer(
    "server_pid", None, "With --server_url: the server's pid, for its RSS."
)
_SERVER_FLAG = flags.DEFINE_multi_string(
    "server_flag", [], "A flag for the paxkv-serve this starts, e.g. --server_flag=--num_pages=512."
)
_DURATION_S = flags.DEFINE_float("duration_s", 1800.0, "Seconds of load.", lower_bound=1.0)
_CONCURRENCY = flags.DEFINE_integer("concurrency", 256, "Clients at once.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the workload.", lower_bound=0)
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the report as JSON here.")

# Kinds of request and their weights in the mix.
KINDS = {
    "stream": 30,  # a normal stream, read to its end: its inter-token gaps are measured
    "disconnect": 10,  # a stream the client closes after a few chunks
    "penalties": 10,
    "logprobs": 10,
    "echo": 5,  # the prompt echoed with its logprobs (steps that score prompt rows)
    "n": 10,  # n > 1 completions
    "abort": 10,  # a request the client gives up on before the answer
    "stop": 10,  # stop strings
    "too_long": 8,  # more prompt tokens than max_model_len: 400
    "too_many_chars": 1,  # a text prompt past the server's character limit: 400
    "too_big_body": 1,  # a body past the server's size limit: 413
}
# What each kind must be answered with (anything else is counted as unexpected).
EXPECTED = {"too_long": {400}, "too_many_chars": {400}, "too_big_body": {413}}
BODY_LIMIT_BYTES = 16 << 20  # paxkv.serve.protocol.Limits.max_body_bytes' default
WORDS = ("def", "return", "self", "import", "class", "for", "in", "if", "x", "(", ")", ":")
PREFIXES = tuple(f"# module {i}\nimport os\nimport sys\n\n" for i in range(8))  # shared pages


class Soak:
    """The clients of one soak and what they saw."""

    def __init__(self, url: str, *, max_model_len: int, model: str, seed: int) -> None:
        self.url = url
        self.max_model_len = max_model_len
        self.model = model
        self.rng = random.Random(seed)
        self.sent: collections.Counter[str] = collections.Counter()
        self.statuses: collections.Counter[int] = collections.Counter()
        self.unexpected: collections.Counter[str] = collections.Counter()  # "kind status"
        self.errors: collections.Counter[str] = collections.Counter()  # transport errors
        self.gaps: list[float] = []  # inter-token gaps of normal streams, seconds
        self.tokens = 0
        self._big_body: bytes | None = None

    def _prompt(self) -> str:
        """ASCII text (a byte a token for tiny-py) of at most half of max_model_len."""
        words = self.rng.choices(WORDS, k=self.rng.randint(4, 24))
        return (self.rng.choice(PREFIXES) + " ".join(words))[: self.max_model_len // 2]

    def _body(self, kind: str) -> dict[str, Any]:
        r = self.rng
        prompt = self._prompt()
        room = self.max_model_len - len(prompt.encode()) - 1
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max(1, min(r.randint(8, 64), room)),
            "temperature": r.choice([0.0, 0.7, 1.0]),
        }
        if kind in ("stream", "disconnect"):
            body["stream"] = True
        elif kind == "penalties":
            body |= {
                "frequency_penalty": r.uniform(-1, 1),
                "presence_penalty": r.uniform(-1, 1),
                "repetition_penalty": r.uniform(0.8, 1.3),
            }
        elif kind == "logprobs":
            body["logprobs"] = r.randint(0, 5)
        elif kind == "echo":
            body |= {"echo": True, "logprobs": r.randint(0, 3), "max_tokens": r.choice([0, 4])}
        elif kind == "n":
            body |= {"n": r.randint(2, 4), "temperature": 1.0, "stream": r.random() < 0.5}
        elif kind == "stop":
            body |= {"stop": [" self", "):", "\n\n", "return x"], "stream": r.random() < 0.5}
        elif kind == "too_long":
            body["prompt"] = [r.randrange(256) for _ in range(self.max_model_len + 1)]
        elif kind == "too_many_chars":
            body["prompt"] = "x" * (32 * self.max_model_len + 1)
        return body

    async def client(self, http: httpx.AsyncClient, deadline: float) -> None:
        """One client: requests one after another until `deadline` (monotonic)."""
        kinds, weights = list(KINDS), list(KINDS.values())
        while time.monotonic() < deadline:
            kind = self.rng.choices(kinds, weights)[0]
            self.sent[kind] += 1
            try:
                await self._one(http, kind)
            except (httpx.TransportError, httpx.DecodingError) as e:
                self.errors[type(e).__name__] += 1

    async def _one(self, http: httpx.AsyncClient, kind: str) -> None:
        url = f"{self.url}/completions"
        if kind == "too_big_body":
            if self._big_body is None:
                self._big_body = b'{"prompt": "' + b"x" * BODY_LIMIT_BYTES + b'"}'
            response = await http.post(
                url, content=self._big_body, headers={"Content-Type": "application/json"}
            )
            return self._status(kind, response.status_code)
        body = self._body(kind)
        if kind == "abort":
            try:
                response = await asyncio.wait_for(
                    http.post(url, json=body), timeout=self.rng.uniform(0.01, 0.5)
                )
            except TimeoutError:
                return  # given up: the server aborts it when the connection closes
            return self._status(kind, response.status_code)
        if not body.get("stream"):
            response = await http.post(url, json=body)
            return self._status(kind, response.status_code)
        leave_after = self.rng.randint(1, 8) if kind == "disconnect" else None
        async with http.stream("POST", url, json=body) as response:
            self._status(kind, response.status_code)
            if response.status_code != 200:
                await response.aread()
                return
            last, chunks = None, 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunks += 1
                if kind == "stream":
                    if last is not None:
                        self.gaps.append(now - last)
                    last = now
                    self.tokens += 1
                if leave_after is not None and chunks >= leave_after:
                    return  # leaving mid-stream closes the connection

    def _status(self, kind: str, status: int) -> None:
        self.statuses[status] += 1
        if status not in EXPECTED.get(kind, {200}):
            self.unexpected[f"{kind} {status}"] += 1


def metrics(base: str, prefix: str = "paxkv") -> dict[str, float]:
    """`/metrics` samples named `prefix:...`, by name (labels included)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    samples = {}
    for line in text.splitlines():
        if line.startswith(f"{prefix}:"):
            name, value = line.rsplit(" ", 1)
            samples[name[len(prefix) + 1 :]] = float(value)
    return samples


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of process `pid` in MiB (VmRSS), or None without a pid."""
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def wait_idle(base: str, timeout_s: float = 120.0) -> dict[str, float]:
    """The server's metrics once no request runs or waits (or after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(base)
        idle = m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def run_soak(
    url: str, *, duration_s: float, concurrency: int, seed: int = 0, pid: int | None = None
) -> dict[str, Any]:
    """Runs the mixed workload against the warm server at `url` (…/v1) and returns the
    report (see the module docstring)."""
    base = url.removesuffix("/v1")
    if httpx.URL(base).host not in ("127.0.0.1", "localhost"):
        raise ValueError(f"{url}: the soak only targets 127.0.0.1")
    model = httpx.get(f"{url}/models", timeout=30).json()["data"][0]
    before = metrics(base)
    rss_start = rss_mib(pid)
    soak = Soak(url, max_model_len=model["max_model_len"], model=model["id"], seed=seed)

    rss_samples: list[float | None] = []  # at each tenth of the run

    async def load() -> None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=120) as http:
            deadline = time.monotonic() + duration_s
            clients = asyncio.gather(*(soak.client(http, deadline) for _ in range(concurrency)))
            for _ in range(9):
                await asyncio.sleep(duration_s / 10)
                rss_samples.append(rss_mib(pid))
            await clients

    start = time.monotonic()
    asyncio.run(load())
    elapsed = time.monotonic() - start
    after = wait_idle(base)
    rss_end = rss_mib(pid)
    gaps = np.asarray(soak.gaps) * 1e3
    compiles = "num_compilations_total"
    return {
        "duration_s": round(elapsed, 1),
        "concurrency": concurrency,
        "requests": dict(soak.sent),
        "statuses": {str(k): v for k, v in sorted(soak.statuses.items())},
        "num_5xx": sum(v for k, v in soak.statuses.items() if k >= 500),
        "unexpected": dict(soak.unexpected),
        "transport_errors": dict(soak.errors),
        "compiles_at_start": int(before[compiles]),
        "compiles_after_warmup": int(after[compiles] - before[compiles]),
        "kv_pages_in_use_after": int(after["kv_pages_in_use"]),
        "requests_left_after": int(after["num_requests_running"] + after["num_requests_waiting"]),
        "rss_start_mib": None if rss_start is None else round(rss_start, 1),
        "rss_end_mib": None if rss_end is None else round(rss_end, 1),
        # After the allocator's first growth (and any compilation early in the run).
        "rss_each_tenth_mib": [None if r is None else round(r, 1) for r in rss_samples],
        "rss_growth_since_10pct_pct": None
        if pid is None
        else round(100 * (rss_end - rss_samples[0]) / rss_samples[0], 1),
        "normal_streams_tokens": soak.tokens,
        "itl_p50_ms": round(float(np.percentile(gaps, 50)), 2) if gaps.size else None,
        "itl_p99_ms": round(float(np.percentile(gaps, 99)), 2) if gaps.size else None,
        "itl_max_ms": round(float(gaps.max()), 2) if gaps.size else None,
    }


class ServerProcess:
    """`paxkv-serve` (tiny-py and `flags`) on a free port of 127.0.0.1, its log in a
    temporary file; `url` once `/health` answers 200 (the warm-up done)."""

    def __init__(self, flags_: list[str], *, concurrency: int, timeout_s: float = 600) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        self.url = f"{self.base}/v1"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        argv = [
            sys.executable,
            "-m",
            "paxkv.launch.serve",
            "--setup=tiny-py",
            "--host=127.0.0.1",
            f"--port={port}",
            # Every client's sequences may wait (n <= 4 each): no 429 in the soak.
            f"--max_queued_requests={4 * concurrency}",
            *flags_,
        ]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"paxkv-serve exited {self.proc.returncode}; log {self.log.name}"
                )
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"paxkv-serve was not ready in {timeout_s} s; log {self.log.name}")

    def stop(self) -> int:
        """SIGTERM, and its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def main(argv: list[str]) -> None:
    """Starts a server unless given one, soaks it, stops it, and reports."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    server = None
    url, pid = _SERVER_URL.value, _SERVER_PID.value
    if url is None:
        server = ServerProcess(_SERVER_FLAG.value, concurrency=_CONCURRENCY.value)
        url, pid = server.url, server.proc.pid
    try:
        report = run_soak(
            url,
            duration_s=_DURATION_S.value,
            concurrency=_CONCURRENCY.value,
            seed=_SEED.value,
            pid=pid,
        )
    finally:
        if server is not None:
            status = server.stop()
    if server is not None:
        report["server_exit_status"] = status
        report["server_log"] = server.log.name
    report["machine"] = {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    text = json.dumps(report, indent=2)
    print(text)
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    app.run(main)
