"""A replica across processes whose device call never returns (another process died
without breaking the collective, or hangs), served in this process over HTTP: process
0's watchdog (`paxkv.serve.multihost.exit_when_failed`) ends the stream in flight with
a 503 error event and `data: [DONE]` once the call has waited its bound, a request sent
then is answered 503, and the process is told to exit 1 after the grace period.
(Two real processes, one killed: tests/multidevice/test_multihost_serving.py, -m slow.)"""

import json
import queue
import threading
import time

import numpy as np
import pytest
from engine_configs import small_config

from paxkv.engine import Engine
from paxkv.engine import multihost as mh
from paxkv.engine.runner import FakeRunner

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

CONFIG = small_config(64, log_stats_interval_s=0)
STALL_S = 1.0
GRACE_S = 0.5


class Collective:
    """Process 0's broadcast to processes that answer until `stuck` is set; then it
    waits, as a collective whose peer is gone may, until `release` (then it raises)."""

    def __init__(self) -> None:
        self.stuck = threading.Event()
        self.release = threading.Event()

    def __call__(self, x):
        if self.stuck.is_set():
            self.release.wait()
            raise RuntimeError("the collective broke")
        return np.array(x)


def test_a_stuck_device_call_ends_the_stream_with_503_and_exits_1():
    from paxkv.serve import multihost
    from paxkv.serve.app import ServerState, bind, build_app
    from paxkv.serve.replicas import ReplicaSet
    from paxkv.text import chat

    collective = Collective()
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
        grace_s=GRACE_S,
        on_exit=lambda status, message: exits.put((status, message, time.monotonic())),
    )
    sock = bind("127.0.0.1", 0)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
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
    finally:
        collective.release.set()  # the stepping thread's call raises; shutdown can join it
        server.should_exit = True
        thread.join(timeout=30)
