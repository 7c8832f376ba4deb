"""SIGTERM during streams: paxkv-serve stops, and exits 0 within its grace period."""

import concurrent.futures
import signal
import threading
import time

import httpx
from serve_env import Server

GRACE_S = 1.0


def test_sigterm_during_streams_exits_0_within_the_grace_period():
    server = Server(f"--shutdown_grace_s={GRACE_S}")
    started = threading.Event()
    accepted = threading.Semaphore(0)  # one release per stream the server answered

    def stream(i):
        # 32 streams of 120 tokens, 8 at a time: longer than the grace period.
        body = {"prompt": f"x{i}", "max_tokens": 120, "ignore_eos": True, "stream": True}
        lines = []
        try:
            with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=60) as r:
                accepted.release()
                for line in r.iter_lines():
                    started.set()
                    lines.append(line)
        except httpx.TransportError:  # cut when the grace period ended
            pass
        return lines

    try:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            streams = [pool.submit(stream, i) for i in range(32)]
            assert started.wait(60)
            # Every stream in flight before the signal: one the server never read would be
            # refused, not cut, and could end before the grace period for that reason.
            assert all(accepted.acquire(timeout=60) for _ in range(32))
            sent = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            status = server.proc.wait(timeout=GRACE_S + 20)
            took = time.monotonic() - sent
            results = [s.result() for s in streams]
        assert status == 0, server.output()
        assert took < GRACE_S + 10, took
        # No stream hung: each ended with [DONE], or was cut once the grace period was over.
        done = sum("data: [DONE]" in lines for lines in results)
        if done < len(results):
            assert took >= GRACE_S, (done, took)
    finally:
        server.stop()
