"""`paxkv-serve` processes for the multi-device serving tests: the small engine they
serve (and the in-process oracle runs: `conftest.serve_oracle`), a free port, starting
them and waiting for /health, and reading /metrics."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from multidevice_env import xla_flags

ENGINE = {"num_pages": 256, "page_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 64}
MAX_MODEL_LEN = 128
MODEL = "tiny-py"


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(base: str) -> dict[str, float]:
    """/metrics of the server at `base` as {sample name with labels: value}."""
    samples = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def warm_metrics(base: str, timeout: float = 600) -> dict[str, float]:
    """`metrics` once the server's background warm-up has compiled every step shape."""
    deadline = time.monotonic() + timeout
    while (samples := metrics(base)).get("paxkv:compiling"):
        assert time.monotonic() < deadline, "the background warm-up did not finish"
        time.sleep(0.2)
    return samples


def serve_argv(port: int, *flags: str) -> list[str]:
    """`paxkv-serve` of `MODEL` and `ENGINE` in float32 on 127.0.0.1:`port`, and `flags`."""
    return [
        sys.executable,
        "-m",
        "paxkv.launch.serve",
        f"--setup={MODEL}",
        f"--port={port}",
        "--dtype=float32",
        f"--max_model_len={MAX_MODEL_LEN}",
        *(f"--{k}={v}" for k, v in ENGINE.items()),
        *flags,
    ]


class ServeProcesses:
    """`paxkv-serve` processes (one server, or the processes of one `--jax_distributed`
    job), each logging to a temporary file; ready once the first, whose address is
    `base`, answers /health with 200 (the test fails if any exits before, or after
    `timeout_s`: every replica compiles its step shapes first)."""

    def __init__(
        self, argvs: list[list[str]], *, base: str, env: dict[str, str], timeout_s: float = 480
    ) -> None:
        self.base = base
        self.logs = [tempfile.TemporaryFile("w+") for _ in argvs]  # noqa: SIM115
        self.procs = [
            subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            for argv, log in zip(argvs, self.logs, strict=True)
        ]
        deadline = time.monotonic() + timeout_s
        while True:
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    self.kill()
                    pytest.fail(f"process {i} exited {p.returncode}:\n{self.output(i)[-5000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail("paxkv-serve was not ready in time")
            time.sleep(0.5)

    def output(self, i: int = 0) -> str:
        """What process `i` has logged so far."""
        self.logs[i].seek(0)
        return self.logs[i].read()

    def terminate(self, timeout_s: float = 60) -> list[int]:
        """SIGTERM to the first process; every process's exit status."""
        self.procs[0].send_signal(signal.SIGTERM)
        return [p.wait(timeout=timeout_s) for p in self.procs]

    def kill(self) -> None:
        """Kills what still runs."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def cpu_env(devices: int | None = None) -> dict[str, str]:
    """This environment on the CPU; with `devices`, that many forced host devices per
    process and gloo collectives (a `--jax_distributed` job's)."""
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    if devices is not None:
        env |= {
            "XLA_FLAGS": xla_flags(devices),
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        }
    return env
