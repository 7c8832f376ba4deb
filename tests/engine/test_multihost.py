"""The multi-process step protocol (`paxkv.engine.multihost`) in one process: a leader
engine and a follower joined by an in-process broadcast. The follower runs exactly the
calls the leader runs, on equal inputs, in every execution mode; a damaged or reordered
message stops it with `InputMismatch`. (Two real processes: tests/multidevice.)"""

import dataclasses
import importlib.util
import queue
import threading

import numpy as np
import pytest

from paxkv import SamplingParams
from paxkv.engine import Engine, EngineConfig
from paxkv.engine import multihost as mh
from paxkv.engine.fake_runner import FakeRunner
from paxkv.engine.runner import Deferred
from paxkv.host.batch import HostBatch
from paxkv.models.tokenizer import ByteTokenizer

LLGUIDANCE = importlib.util.find_spec("llguidance") is not None
CONFIG = EngineConfig(
    num_pages=64,
    page_size=8,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    max_model_len=96,
    log_stats_interval_s=0,
)


class Pipe:
    """A broadcast from the leader's thread to the follower's: the leader's arrays come
    out at the follower, which must ask for the same shapes."""

    def __init__(self, damage=None):
        self.q: queue.Queue = queue.Queue()
        self.damage = damage  # called on each array the follower receives
        self.received = 0

    def leader(self, x):
        x = np.array(x)
        self.q.put(x)
        return x

    def follower(self, x):
        got = self.q.get(timeout=30)
        assert got.shape == x.shape and got.dtype == x.dtype, (got.shape, x.shape)
        self.received += 1
        return got if self.damage is None else self.damage(self.received, got)


class Recording(FakeRunner):
    """A fake runner that records the calls it makes."""

    def __init__(self, config):
        super().__init__(256, config)
        self.calls = []

    def dispatch(self, hb):
        # Copies: a step's masks are filled in its arrays after it is dispatched.
        self.calls.append(("step", [np.array(a) for a in mh.host_batch_arrays(hb)]))
        return super().dispatch(hb)

    def finish(self, handle):
        if isinstance(handle, Deferred):  # a step with structured outputs: its masks
            self.calls.append(("masks", [np.array(handle.allowed)]))
        return super().finish(handle)

    def decode_loop(self, hb, stop_ids, limits):
        self.calls.append(("loop", [*mh.host_batch_arrays(hb), list(stop_ids), list(limits)]))
        return super().decode_loop(hb, stop_ids, limits)

    def warmup(self, shapes, progress, *, scoring=True):
        self.calls.append(("warmup", [list(shapes), scoring]))


def run_pair(config, work, damage=None):
    """Leader and follower over `work`; (leader's calls, follower's calls, follower's
    exception or None, the leader's outputs)."""
    pipe = Pipe(damage)
    config = config.for_backend("cpu")
    follower_runner = Recording(config)
    result = {}

    def follow():
        try:
            result["handled"] = mh.follow(follower_runner, mh.Channel(pipe.follower))
        except Exception as e:  # what the follower stops with
            result["error"] = e

    thread = threading.Thread(target=follow)
    thread.start()
    leader_runner = None

    def make(c):
        nonlocal leader_runner
        leader_runner = mh.LeaderRunner(Recording(c), mh.Channel(pipe.leader))
        return leader_runner

    engine = Engine(None, config, runner=make, tokenizer=ByteTokenizer())
    engine.warmup()
    for i, (prompt, params) in enumerate(work):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    outputs = engine.run_until_done()
    if "error" not in result:
        leader_runner.ping()  # what an idle server sends: the follower runs nothing
        leader_runner.stop()
    thread.join(timeout=30)
    return leader_runner.runner.calls, follower_runner.calls, result.get("error"), outputs


def work():
    rng = np.random.default_rng(0)
    out = []
    for i in range(10):
        prompt = rng.integers(0, 256, int(rng.integers(1, 40))).tolist()
        kw = dict(max_tokens=int(rng.integers(1, 12)), ignore_eos=True)
        if i % 3 == 0:
            kw |= dict(frequency_penalty=0.5, stop_token_ids=[5, 6])
        if i % 4 == 1:
            kw |= dict(prompt_logprobs=1)
        if i % 5 == 2 and LLGUIDANCE:  # structured outputs: the masks follow each step
            kw |= dict(structured_outputs={"regex": "[a-z]{1,11}"})
        out.append((prompt, SamplingParams(**kw)))
    return out


def same(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            np.array_equal(np.asarray(a), np.asarray(b))
            and np.asarray(a).dtype == np.asarray(b).dtype
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize(
    "mode", [{}, {"num_decode_steps": 4}, {"async_scheduling": True}], ids=["sync", "loop", "async"]
)
def test_the_follower_runs_the_leaders_calls_on_equal_inputs(mode):
    led, followed, error, outputs = run_pair(dataclasses.replace(CONFIG, **mode), work())
    assert error is None
    assert len(outputs) == 10
    assert [k for k, _ in led] == [k for k, _ in followed]
    assert led[0][0] == "warmup" and len(led) > 10
    if "num_decode_steps" in mode:
        assert any(k == "loop" for k, _ in led)
    if LLGUIDANCE:
        assert any(k == "masks" for k, _ in led)
    for (_, a), (_, b) in zip(led, followed, strict=True):
        assert same(a, b)


def test_a_damaged_payload_stops_the_follower():
    payloads = []

    def flip(n, x):  # the second payload with data (the first: warm-up's), one bit
        if x.size > mh.HEADER_WORDS and x.any():
            payloads.append(n)
            if len(payloads) == 2:
                x = x.copy()
                x[0] ^= 1
        return x

    pipe_work = work()[:2]
    _, followed, error, _ = run_pair(CONFIG, pipe_work, damage=flip)
    assert isinstance(error, mh.InputMismatch), error
    assert "CRC-32" in str(error) and "differ between processes" in str(error)
    assert [k for k, _ in followed] == ["warmup"]  # it ran no step on the damaged inputs


def test_pack_round_trips_any_host_batch_fields_and_checks_order():
    arrays = [
        np.arange(7, dtype=np.int32),
        np.ones((2, 3), np.float32) / 3,
        np.array([True, False, True]),
        np.zeros((0,), np.int32),
        np.arange(24, dtype=np.int32).reshape(2, 3, 4),
    ]
    header, payload = mh.pack(mh.Command.STEP, 3, arrays)
    assert payload.size == mh.MIN_PAYLOAD_WORDS  # padded to a power of two
    command, seq, back = mh.unpack(header, payload)
    assert command is mh.Command.STEP and seq == 3
    assert all(same(a, b) for a, b in zip(arrays, back, strict=True))
    channel = mh.Channel(lambda x: header if x.size == mh.HEADER_WORDS else payload)
    with pytest.raises(mh.InputMismatch, match="received message 3, expected 0"):
        channel.receive()
    with pytest.raises(ValueError, match="cannot be sent"):
        mh.pack(mh.Command.STEP, 0, [np.zeros(2, np.float64)])
    fields = [f.name for f in dataclasses.fields(HostBatch)]
    assert len(fields) <= mh.MAX_ARRAYS - 2  # room for the decode loop's extras


def test_update_weights_is_refused_naming_why_and_the_engine_serves_on():
    """A replica across processes cannot take new weights from process 0 alone: refused
    before anything changes or is sent to the other processes."""
    channel = mh.Channel(np.array)
    engine = Engine(None, CONFIG, runner=lambda c: mh.LeaderRunner(FakeRunner(256, c), channel))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, params)
    sent = channel.seq
    with pytest.raises(ValueError, match=r"spans processes.*own shards"):
        engine.update_weights({}, policy="abort")
    assert channel.seq == sent and engine.weight_version == 0
    (out,) = engine.run_until_done().values()
    assert out.error is None and len(out.outputs[0].token_ids) == 4
