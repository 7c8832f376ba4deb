"""A replica across processes whose device call never returns (another process died
without breaking the collective, or hangs), served in this process over HTTP: process
0's watchdog (`paxkv.serve.multihost.exit_when_failed`) ends the stream in flight with
a 503 error event and `data: [DONE]` once the call has waited its bound, a request sent
then is answered 503, and the process is told to exit 1 after the grace period. While
nothing is served, the watchdog's pings find a process that died (the collective
raises) or hangs (it waits) the same way, before JAX's heartbeat check would abort the
process. (Two real processes, one killed: tests/multidevice/test_multihost_serving.py,
-m slow.)"""

import contextlib
import json
import queue
import threading
import time

import numpy as np
import pytest
from engine_configs import small_config
from serve_env import in_process

from paxkv.engine import Engine
from paxkv.engine import multihost as mh
from paxkv.engine.fake_runner import FakeRunner

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

CONFIG = small_config(64, log_stats_interval_s=0)
STALL_S = 1.0
GRACE_S = 0.5


PING_S = 0.2


class Collective:
    """Process 0's broadcast to processes that answer until `stuck` is set; then it
    waits, as a collective whose peer is gone may, until `release` (then it raises), or
    with `broken` set raises at once (gloo: connection reset by the dead peer). Counts
    the PING headers it sent."""

    def __init__(self) -> None:
        self.stuck = threading.Event()
        self.broken = threading.Event()
        self.release = threading.Event()
        self.pings = 0

    def __call__(self, x):
        if self.broken.is_set():
            raise RuntimeError("Connection reset by peer")
        if self.stuck.is_set():
            self.release.wait()
            raise RuntimeError("the collective broke")
        if len(x) == mh.HEADER_WORDS and x[0] == mh.MAGIC and x[1] == mh.Command.PING:
            self.pings += 1
        return np.array(x)


@contextlib.contextmanager
def leader_server(collective: Collective):
    """Process 0's server over `collective`, its watchdog on (stall `STALL_S`, pings after
    `PING_S` idle, grace `GRACE_S`): (its base URL, the queue of the watchdog's exits as
    (status, message, time))."""
    from paxkv.serve import multihost
    from paxkv.serve.app import ServerState
    from paxkv.serve.replicas import ReplicaSet
    from paxkv.text import chat

    engine = Engine(
        None, CONFIG, runner=lambda c: mh.LeaderRunner(FakeRunner(256, c), mh.Channel(collective))
    )
    engine.warmup()
    front = ReplicaSet([engine], max_queued=4)
    state = ServerState(
        front=front,
        model_name="fake",
        tokenizer=None,
        chat_templates=chat.ChatTemplates({}, {}, "none"),
        max_model_len=CONFIG.max_model_len,
    )
    exits: queue.Queue = queue.Queue()
    multihost.exit_when_failed(
        front,
        engine,
        stall_s=STALL_S,
        ping_every_s=PING_S,
        grace_s=GRACE_S,
        on_exit=lambda status, message: exits.put((status, message, time.monotonic())),
    )
    with in_process(state) as base:
        try:
            yield base, exits
        finally:
            collective.release.set()  # the stepping thread's call raises; shutdown can join it


def test_a_stuck_device_call_ends_the_stream_with_503_and_exits_1():
    collective = Collective()
    with leader_server(collective) as (base, exits):
        body = {"prompt": [1, 2, 3], "max_tokens": 80, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    collective.stuck.set()
                    t_stuck = time.monotonic()
        t_end = time.monotonic()
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503, error
        assert "stopped answering" in error["message"], error
        assert all("choices" in json.loads(e) for e in events[:-2])  # tokens, then the error
        assert 3 <= len(events) - 2 < 80
        assert STALL_S <= t_end - t_stuck < STALL_S + 2.0
        again = httpx.post(f"{base}/v1/completions", json=body | {"stream": False}, timeout=30)
        assert again.status_code == 503, again.text
        status, message, t_exit = exits.get(timeout=10)
        assert status == 1 and "stopped answering" in message
        assert STALL_S + GRACE_S <= t_exit - t_stuck < STALL_S + GRACE_S + 2.0


@pytest.mark.parametrize("failure", ["broken", "stuck"])
def test_a_process_lost_while_idle_is_found_by_a_ping_and_the_server_exits_1(failure):
    collective = Collective()
    with leader_server(collective) as (base, exits):
        deadline = time.monotonic() + 10
        while collective.pings < 2:  # idle: pings go out, and answered they change nothing
            assert time.monotonic() < deadline, "no ping was sent"
            time.sleep(0.05)
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        assert exits.empty()
        getattr(collective, failure).set()
        t_lost = time.monotonic()
        status, message, t_exit = exits.get(timeout=10)
        assert status == 1 and "stopped answering" in message
        # Found by the next ping (at most PING_S away) at once when it raises, or when it
        # has waited STALL_S; then the grace period.
        bound = PING_S + (0 if failure == "broken" else STALL_S) + GRACE_S
        assert t_exit - t_lost < bound + 1.5, t_exit - t_lost
        assert httpx.get(f"{base}/health", timeout=5).status_code == 503
        body = {"prompt": [1, 2, 3], "max_tokens": 4}
        again = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert again.status_code == 503, again.text
