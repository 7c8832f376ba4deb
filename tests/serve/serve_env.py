"""The serve tests' helpers: a real `paxkv-serve` process on 127.0.0.1 (`Server`), an
app served in this process (`in_process`), and the small engine both serve tiny-py with
(two step shapes, so the server's warm-up and the oracle's compilations take seconds).

A module of its own, imported by name (`from serve_env import ...`): `conftest` is a
name every test folder's conftest.py shares, which a run mixing folders may resolve to
another folder's."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

# The engine both sides run: a short max_model_len keeps the step shapes few.
ENGINE = {"num_pages": 256, "page_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 64}
MAX_MODEL_LEN = 128
MAX_QUEUED = 24  # with max_num_seqs=8: 32 requests at once, more answered 429
# A chat template the tests know (it replaces the one tiny-py ships).
CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(port: int, *flags: str, log) -> subprocess.Popen:
    """Starts `paxkv-serve` of the small engine on 127.0.0.1:`port`, its stdout and
    stderr into the file `log`; returns at once."""
    argv = [
        sys.executable,
        "-m",
        "paxkv.launch.serve",
        "--setup=tiny-py",
        f"--port={port}",
        f"--max_model_len={MAX_MODEL_LEN}",
        f"--max_queued_requests={MAX_QUEUED}",
        f"--chat_template={CHAT_TEMPLATE}",
        *(f"--{k}={v}" for k, v in ENGINE.items()),
        *flags,
    ]
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


class Server:
    """A `paxkv-serve` subprocess; `url` is its API root (…/v1)."""

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/v1"
        # A file, not a pipe: nobody reads the log while the server runs.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in stop)
        self.proc = launch(self.port, *flags, log=self.log)
        self._wait_ready(timeout_s=180)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"paxkv-serve exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("paxkv-serve was not ready in time")

    def output(self) -> str:
        """What the server has logged so far."""
        self.log.seek(0)
        return self.log.read()

    def model_compilations(self, timeout: float = 600) -> float:
        """The server's compilations of model programs, once its background warm-up has
        compiled every step shape."""
        deadline = time.monotonic() + timeout
        while self.metrics()["paxkv:compiling"]:
            assert time.monotonic() < deadline, "the background warm-up did not finish"
            time.sleep(0.2)
        return self.metrics()["paxkv:num_model_compilations_total"]

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name with labels: value}."""
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@contextlib.contextmanager
def in_process(state):
    """The app of `state` (a `paxkv.serve.app.ServerState`) served by uvicorn on a free
    port of 127.0.0.1 in a thread of this process; yields its base URL, and stops it."""
    import uvicorn

    from paxkv.serve.app import bind, build_app

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
