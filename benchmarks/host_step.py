"""Benchmark: the engine's whole host path per step, over the fake step runner.

    python -m benchmarks.host_step [--trace=FILE] [--repeat=1] [--json_out=FILE]
    python -m benchmarks.host_step --make_trace=FILE [--num_requests=2000 --seed=0]

Runs `Engine.step()` with `FakeRunner` (no model, no device: deterministic tokens on
the host), so what is timed is everything the host does around a compiled step:
scheduling, the batch layout, recording the samples and assembling the outputs
(delta outputs, as a server streams them).

The trace is JSON, `{"requests": [{"id", "arrival_step", "prompt": [ids],
"max_tokens"}, ...]}`: each request is submitted before step `arrival_step`, its
output is forced to `max_tokens` tokens (`ignore_eos`), and the vocabulary is 32000.
Without `--trace`, one is generated: log-normal prompt and output lengths (means 300
and 150, sigma 1, clipped to 2048 and 1024), Poisson arrivals of `--arrival_rate`
requests per step, and optionally a shared prompt prefix.

With `--num_requests=256 --arrival_rate=1e9 --prompt_len=32 --output_len=L` every
request arrives at once and the decode-only steps at 256 running show the host's cost
per step against the sequences' length L.

Each step is timed on the thread's CPU clock (`time.thread_time_ns`: this machine is
shared) and on the wall clock: schedule, layout (the batch build), record (the
samples into the scheduler), outputs (the requests' outputs) and the host total,
which is the whole `step()` less the fake runner's own time; and apart from the
host total, read: the reader building the step's outputs (`StepOutputs`: a server's
front end does it on its event loop, off the stepping thread). Reported in microseconds
(p50 / mean / p99) over all steps, over the steps with `max_num_seqs` running, and
over those of them in which every sequence decodes; with `--repeat=N`, over the steps
of N replays of the trace, each on a new engine (a window of ~100 steps at 256 running
is a tenth of a second: pooling replays steadies its median on a noisy machine).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from absl import app, flags

from benchmarks.step_summary import summary, table
from paxkv.engine import Engine, EngineConfig
from paxkv.engine.fake_runner import FakeRunner
from paxkv.host.request import RequestOutputKind, SamplingParams
from paxkv.planner.workloads import LengthDistribution

VOCAB = 32000

_TRACE = flags.DEFINE_string("trace", None, "Trace JSON to replay; unset: generate one.")
_REPEAT = flags.DEFINE_integer(
    "repeat", 1, "Replays of the trace, each on a new engine; their steps pooled.", lower_bound=1
)
_MAKE_TRACE = flags.DEFINE_string("make_trace", None, "Write a generated trace here and exit.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 2000, "Requests of a generated trace.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of a generated trace.")
_RATE = flags.DEFINE_float("arrival_rate", 2.0, "Generated trace: mean arrivals per step.")
_OUTPUT_LEN = flags.DEFINE_integer(
    "output_len", None, "Generated trace: every output this long (unset: log-normal)."
)
_PROMPT_LEN = flags.DEFINE_integer(
    "prompt_len", None, "Generated trace: every prompt this long (unset: log-normal)."
)
_SHARED_PREFIX = flags.DEFINE_integer(
    "shared_prefix", 0, "Generated trace: prompt tokens every request shares."
)
_NUM_PAGES = flags.DEFINE_integer("num_pages", 16384, "KV pages.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 256, "Sequences running at once.")
_MAX_TOKENS = flags.DEFINE_integer("max_num_batched_tokens", 8192, "Tokens per step.")
_CACHING = flags.DEFINE_bool("enable_prefix_caching", True, "Prefix caching.")
_ASYNC = flags.DEFINE_bool("async_scheduling", False, "The async pipeline's host path.")
_VOCAB = flags.DEFINE_integer(
    "vocab", VOCAB, "The fake model's (and a generated trace's) vocabulary."
)
_SPEC_K = flags.DEFINE_integer(
    "spec_k", 0, "Speculative decoding with n-gram proposals of up to this many tokens; 0: off."
)
_SPEC_ACCEPTANCE = flags.DEFINE_float(
    "spec_acceptance",
    None,
    "With --spec_k: the fraction of each draft the fake runner accepts; unset: its greedy rule.",
)
_WINDOWS = flags.DEFINE_list(
    "layer_windows",
    ["global"],
    "The fake model's layers by attention window ('global' or a token count), e.g. "
    "128,128,128,128,128,global for Gemma 3's pattern: the KV-cache groups to keep.",
)

_DEVICE_MS = flags.DEFINE_float(
    "device_ms",
    0.0,
    "Simulate a device: each call's results are ready this long after the device "
    "starts it (it starts when dispatched and the previous call is done), and fetch "
    "waits for them; reports the device's idle gap before each call.",
)

PARTS = ("schedule", "layout", "record", "outputs")


class SimulatedDevice(FakeRunner):
    """The fake runner in front of a simulated device: a call starts when it is
    dispatched and the previous one is done, is ready `device_s` later, and `fetch`
    waits until then. `gaps` holds, per call after the first, how long the device sat
    idle before it (0 when the host dispatched it in time)."""

    def __init__(self, *args: Any, device_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device_s = device_s
        self.ready = None  # when the last call's results are ready
        self.gaps: list[float] = []

    def dispatch(self, hb: Any) -> Any:
        """Queues the call on the simulated device; the handle says when it is ready."""
        now = time.perf_counter()
        if self.ready is not None:
            self.gaps.append(max(0.0, now - self.ready))
        start = now if self.ready is None else max(now, self.ready)
        self.ready = start + self.device_s
        return (super().dispatch(hb), self.ready)

    def fetch(self, handle: Any) -> Any:
        """Waits until the call is ready; its samples."""
        sampled, ready = handle
        wait = ready - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return super().fetch(sampled)


def _lognormal_mean(mean: float, hi: int) -> LengthDistribution:
    return LengthDistribution(mean / math.exp(0.5), 1.0, lo=1, hi=hi)


def make_trace(
    num_requests: int,
    seed: int,
    *,
    arrival_rate: float = 2.0,
    output_len: int | None = None,
    prompt_len: int | None = None,
    shared_prefix: int = 0,
    vocab: int = VOCAB,
) -> dict[str, Any]:
    """A trace as the module docstring describes it (`output_len` / `prompt_len`: fixed
    lengths instead of log-normal ones; tokens drawn from `vocab`)."""
    rng = np.random.default_rng(seed)
    prompt_lens = _lognormal_mean(300, 2048).sample(rng, num_requests)
    if prompt_len is not None:
        prompt_lens = np.full(num_requests, prompt_len)
    if output_len is None:
        output_lens = _lognormal_mean(150, 1024).sample(rng, num_requests)
    else:
        output_lens = np.full(num_requests, output_len)
    arrivals = np.cumsum(rng.exponential(1 / arrival_rate, num_requests)).astype(np.int64)
    prefix = rng.integers(0, vocab, shared_prefix).tolist()
    return {
        "requests": [
            {
                "id": f"req-{i}",
                "arrival_step": int(arrivals[i]),
                "prompt": prefix + rng.integers(0, vocab, int(prompt_lens[i])).tolist(),
                "max_tokens": int(output_lens[i]),
            }
            for i in range(num_requests)
        ]
    }


class _Clock:
    """Accumulates the CPU and wall nanoseconds spent in wrapped calls during a step."""

    def __init__(self) -> None:
        self.cpu = dict.fromkeys((*PARTS, "runner"), 0)
        self.wall = dict.fromkeys((*PARTS, "runner"), 0)

    def wrap(self, part: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            c, w = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[part] += time.thread_time_ns() - c
                self.wall[part] += time.perf_counter_ns() - w

        return timed

    def reset(self) -> None:
        for d in (self.cpu, self.wall):
            for k in d:
                d[k] = 0


def run(
    trace: dict[str, Any],
    config: EngineConfig,
    layer_windows: tuple[int | None, ...] = (None,),
    *,
    vocab: int = VOCAB,
    accept_fraction: float | None = None,
    device_s: float = 0.0,
    repeat: int = 1,
) -> dict[str, Any]:
    """Replays `trace` `repeat` times, each through a new engine over the fake runner,
    whose layers have `layer_windows` (None: global) and which accepts
    `accept_fraction` of each speculative draft (`FakeRunner`), in front of a
    simulated device of `device_s` per call if > 0 (`SimulatedDevice`); returns the
    results, every replay's steps pooled (the counts and stats: the last replay's)."""
    rows: list[dict[str, float]] = []
    finished = True
    for _ in range(repeat):
        engine, produced = _replay(
            trace, config, layer_windows, rows, vocab, accept_fraction, device_s
        )
        finished = finished and produced == {r["id"]: r["max_tokens"] for r in trace["requests"]}
    stats = engine.stats()
    return {
        "steps": len(rows) // repeat,
        "repeat": repeat,
        "preemptions": stats["num_preemptions"],
        "peak_running": engine.scheduler.peak_running,
        "prefix_hit_rate": stats.get("prefix_cache_hit_rate", 0.0),
        "all_finished": finished,
        "pages_in_use_at_end": engine.pool.num_in_use,
        "generation_tokens": stats["generation_tokens"],
        "device_idle_gap_us": _gaps(engine.runner),
        "per_step_us": {
            clock_name: {
                "all": _summary(rows, clock_name, lambda r: True),
                "at_max_num_seqs": _summary(
                    rows, clock_name, lambda r: r["running"] == config.max_num_seqs
                ),
                "decode_only_at_max_num_seqs": _summary(
                    rows,
                    clock_name,
                    lambda r: r["running"] == config.max_num_seqs and r["decode_only"],
                ),
            }
            for clock_name in ("cpu", "wall")
        },
        "speculation": engine.speculator.stats() if engine.speculator is not None else None,
    }


def _replay(
    trace: dict[str, Any],
    config: EngineConfig,
    layer_windows: tuple[int | None, ...],
    rows: list[dict[str, float]],
    vocab: int,
    accept_fraction: float | None,
    device_s: float,
) -> tuple[Engine, dict[str, int]]:
    """One replay of `trace` through a new instrumented engine (`run`'s), appending a
    row per step to `rows`; returns the engine and each request's token count."""

    def runner(c: EngineConfig) -> FakeRunner:
        kw = dict(layer_windows=layer_windows, accept_fraction=accept_fraction)
        if device_s > 0:
            return SimulatedDevice(vocab, c, device_s=device_s, **kw)
        return FakeRunner(vocab, c, **kw)

    engine = Engine(None, config, runner=runner)
    clock = _Clock()
    # Instrument the parts of a step on this engine's objects only.
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    decode_only = []  # per step: every chunk decodes one token

    def layout(plan, *args, **kwargs):
        decode_only.append(
            all(c.num_tokens - c.num_draft == 1 for c in plan.extra)  # decode: all decodes
        )
        return engine_layout(plan, *args, **kwargs)

    builder = engine.batch_builder
    engine_layout = builder.build_batch
    builder.build_batch = clock.wrap("layout", layout)
    engine.scheduler.update = clock.wrap("record", engine.scheduler.update)
    decodes = engine.scheduler.decodes
    for name in ("record", "advance", "resolve"):  # the latter two: async scheduling
        setattr(decodes, name, clock.wrap("record", getattr(decodes, name)))
    engine.requests.report = clock.wrap("outputs", engine.requests.report)
    engine.requests.report_decode = clock.wrap("outputs", engine.requests.report_decode)
    for name in ("dispatch", "fetch", "decode_loop", "fetch_loop"):
        setattr(engine.runner, name, clock.wrap("runner", getattr(engine.runner, name)))

    requests = sorted(trace["requests"], key=lambda r: r["arrival_step"])
    produced: dict[str, int] = {}
    step, nxt = 0, 0
    while nxt < len(requests) or engine.has_unfinished():
        while nxt < len(requests) and requests[nxt]["arrival_step"] <= step:
            r = requests[nxt]
            params = SamplingParams(
                temperature=0.0,
                max_tokens=r["max_tokens"],
                ignore_eos=True,
                output_kind=RequestOutputKind.DELTA,  # what a server streams
            )
            engine.add_request(r["id"], {"prompt_token_ids": r["prompt"]}, params)
            nxt += 1
        step += 1
        if not engine.has_unfinished():
            continue
        clock.reset()
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        outputs = engine.step()
        cpu, wall = time.thread_time_ns() - c0, time.perf_counter_ns() - w0
        # The reader builds the outputs the step deferred (`StepOutputs`): a server's
        # front end does it on its event loop, not on the stepping thread.
        c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
        for out in outputs:
            produced[out.request_id] = produced.get(out.request_id, 0) + sum(
                len(c.token_ids) for c in out.outputs
            )
        read_cpu, read_wall = time.thread_time_ns() - c1, time.perf_counter_ns() - w1
        row = {
            "running": len(engine.scheduler.running),
            "decode_only": bool(decode_only) and decode_only[-1],
        }
        decode_only.clear()
        for name, total, parts in (("cpu", cpu, clock.cpu), ("wall", wall, clock.wall)):
            row[f"{name}_total"] = (total - parts["runner"]) / 1e3
            for part in PARTS:
                row[f"{name}_{part}"] = parts[part] / 1e3
        row["cpu_read"], row["wall_read"] = read_cpu / 1e3, read_wall / 1e3
        rows.append(row)
    return engine, produced


def _gaps(runner: FakeRunner) -> dict[str, float] | None:
    """p50 / p99 / mean of a simulated device's idle gaps before its calls, and the
    fraction of calls it waited for (None without a simulated device)."""
    gaps = getattr(runner, "gaps", None)
    if not gaps:
        return None
    x = np.array(gaps) * 1e6
    return {
        "p50": float(np.median(x)),
        "p99": float(np.percentile(x, 99)),
        "mean": float(x.mean()),
        "waited": float((x > 0).mean()),
    }


def _summary(rows, clock: str, keep) -> dict[str, Any]:
    return summary(rows, clock, keep, (*PARTS, "read"))


def _table(result: dict[str, Any]) -> str:
    return table(result, "host total", (*PARTS, "read"))


def main(argv: list[str]) -> None:
    """Generates or replays a trace and prints (and optionally writes) the results."""
    del argv
    if _TRACE.value is not None:
        with open(_TRACE.value) as f:
            trace = json.load(f)
    else:
        trace = make_trace(
            _NUM_REQUESTS.value,
            _SEED.value,
            arrival_rate=_RATE.value,
            output_len=_OUTPUT_LEN.value,
            prompt_len=_PROMPT_LEN.value,
            shared_prefix=_SHARED_PREFIX.value,
            vocab=_VOCAB.value,
        )
    if _MAKE_TRACE.value is not None:
        with open(_MAKE_TRACE.value, "w") as f:
            json.dump(trace, f)
        return
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in trace["requests"])
    config = EngineConfig(
        num_pages=_NUM_PAGES.value,
        page_size=_PAGE_SIZE.value,
        max_num_seqs=_MAX_NUM_SEQS.value,
        max_num_batched_tokens=_MAX_TOKENS.value,
        max_model_len=max(longest, _PAGE_SIZE.value),
        enable_prefix_caching=_CACHING.value,
        async_scheduling=_ASYNC.value,
        num_decode_steps=1,
        log_stats_interval_s=0.0,
        speculative_config=(
            {
                "num_speculative_tokens": _SPEC_K.value,
                "prompt_lookup_min": 1,
                "grow_token_bucket": True,
            }
            if _SPEC_K.value
            else None
        ),
    )
    windows = tuple(None if w == "global" else int(w) for w in _WINDOWS.value)
    result = run(
        trace,
        config,
        windows,
        vocab=_VOCAB.value,
        accept_fraction=_SPEC_ACCEPTANCE.value,
        device_s=_DEVICE_MS.value / 1e3,
        repeat=_REPEAT.value,
    )
    print(
        f"steps {result['steps']}, preemptions {result['preemptions']}, peak running "
        f"{result['peak_running']}, prefix hit rate {result['prefix_hit_rate']:.1%}, "
        f"all finished {result['all_finished']}, pages in use at end "
        f"{result['pages_in_use_at_end']}"
    )
    spec = result["speculation"]
    if spec is not None:
        print(
            f"speculation: {spec['spec_decode_num_drafts']} drafts, mean accepted length "
            f"{spec['spec_decode_mean_accepted_length']:.2f}, "
            f"{result['generation_tokens'] / result['steps']:.1f} tokens per step"
        )
    gaps = result["device_idle_gap_us"]
    if gaps is not None:
        print(
            f"simulated device of {_DEVICE_MS.value} ms per call: idle gap before a call "
            f"p50 {gaps['p50']:.0f} us, p99 {gaps['p99']:.0f} us, mean {gaps['mean']:.0f} "
            f"us; it waited for the host before {gaps['waited']:.1%} of calls"
        )
    print(_table(result))
    if _JSON_OUT.value is not None:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    app.run(main)
