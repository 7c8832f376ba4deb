"""Signals end paxkv-serve cleanly whenever they come: status 0, no crash.

Before the server listens (importing JAX, loading, compiling) SIGTERM or SIGINT ends it
at once; while it drains after one, a second one ends the wait.
"""

import signal
import socket
import tempfile
import time

import httpx
import pytest
from serve_env import Server, free_port, launch

CRASHES = ("Segmentation fault", "Fatal Python error", "Traceback")
# The server's log lines as it starts, in order: JAX is up, the model loads, warm-up
# compiles. A point in the start is named by its line, not by a time: a warm
# compilation cache has the server listening within 3 s.
PLATFORM = "paxkv-serve: platform"
LOADING = "loading the model"
WARMUP = "paxkv: compiling"
# As soon as the process catches the signal (its handler is the first thing paxkv-serve
# installs, before it imports JAX): a fixed delay after the start would race the
# interpreter's own start on a loaded machine, when no program can catch a signal yet.
CAUGHT = "caught"


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (Linux: /proc/PID/status SigCgt)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


def read(log) -> str:
    log.seek(0)
    return log.read()


def listening(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize(
    ("sig", "when"),
    [
        (signal.SIGTERM, CAUGHT),
        (signal.SIGINT, PLATFORM),
        (signal.SIGTERM, LOADING),
        (signal.SIGTERM, WARMUP),
        (signal.SIGINT, WARMUP),
    ],
    ids=lambda v: v.name if isinstance(v, signal.Signals) else str(v).replace(" ", "-"),
)
def test_a_signal_before_the_server_listens_exits_0(sig, when):
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        proc = launch(port, log=log)
        try:
            deadline = time.monotonic() + 120
            if when == CAUGHT:
                while not catches(proc.pid, sig) and time.monotonic() < deadline:
                    assert proc.poll() is None, read(log)
                    time.sleep(0.005)
                assert catches(proc.pid, sig), read(log)
            else:  # as soon as the log says so
                while when not in read(log) and time.monotonic() < deadline:
                    assert proc.poll() is None, read(log)
                    time.sleep(0.05)
                assert when in read(log), read(log)
            assert proc.poll() is None and not listening(port), read(log)
            proc.send_signal(sig)
            status = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out = read(log)
    assert status == 0, out
    assert not [c for c in CRASHES if c in out], out
    assert f"paxkv-serve: {sig.name}: exiting" in out  # our handler ended it


def test_a_second_signal_during_the_drain_exits_0_at_once():
    server = Server("--shutdown_grace_s=120")
    # A request whose body never finishes: the drain would wait for it for the whole
    # grace period.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as client:
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
        try:
            time.sleep(0.5)  # the server is reading its body
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            assert server.proc.poll() is None, "the drain ended before the second signal"
            sent = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            status = server.proc.wait(timeout=30)
            took = time.monotonic() - sent
            out = server.output()
        finally:
            server.stop()
    assert status == 0, out
    assert took < 10, took
    assert not [c for c in CRASHES if c in out], out
