"""Benchmark: decode steps per compiled call against host overhead and throughput.

    python -m benchmarks.multi_step [--num_seqs=64] [--steps=1,4,8,16]

The tiny model on the CPU with `--num_seqs` sequences decoding together (short
prompts, `--max_tokens` each). For each N it reports the host-overhead fraction
(host time, during which the device waits, over host + device time per step) and the
output tok/s of the decode phase, each the median of `--repeats` alternated runs, and
the same for N=1 and the largest N with async scheduling (the host one step ahead of the device; with
overlap, "host overhead" is the host time the device is not already queued for).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from absl import app, flags

_NUM_SEQS = flags.DEFINE_integer("num_seqs", 64, "Sequences decoding together.")
_STEPS = flags.DEFINE_list("steps", ["1", "4", "8", "16"], "Decode steps per call (N).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Tokens generated per sequence.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Alternated runs per N.")


def measure(
    model: Any, num_steps: int, prompts: list[list[int]], max_tokens: int, *, overlap: bool = False
) -> dict[str, float]:
    """Host-overhead fraction and output tok/s of the decode phase at `num_steps` per call.

    `model` (the tiny model) decodes `prompts` together, `max_tokens` each, after an
    untimed prefill of them all.
    """
    from paxkv.engine import Engine, EngineConfig
    from paxkv.host.request import SamplingParams

    n = len(prompts)
    engine = Engine(
        model,
        EngineConfig(
            num_pages=n * 8 + 1,
            page_size=16,
            max_num_seqs=n,
            max_num_batched_tokens=max(n, 256),
            max_model_len=128,
            num_decode_steps=num_steps,
            async_scheduling=overlap,
            log_stats_interval_s=0,
        ),
    )
    engine.warmup()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    while (
        any(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()  # prefill, not timed
    m = engine.metrics
    host0, dev0, tok0 = m.host_time_s, m.device_time_s, m.generation_tokens
    start = time.perf_counter()
    engine.run_until_done()
    wall = time.perf_counter() - start
    host, dev = m.host_time_s - host0, m.device_time_s - dev0
    return {"host_overhead": host / (host + dev), "tok_per_s": (m.generation_tokens - tok0) / wall}


def main(argv: list[str]) -> None:
    """Measures every --steps setting, alternated over --repeats runs; prints the table."""
    del argv
    import jax

    from paxkv.models import load_model

    _, model, _ = load_model("tiny", dtype="float32")
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(0, 256, size=int(k)).tolist() for k in rng.integers(4, 32, _NUM_SEQS.value)
    ]
    # (N, overlap): each N synchronous, then 1 and the largest N with async scheduling.
    largest = max(int(s) for s in _STEPS.value)
    settings = [(int(s), False) for s in _STEPS.value] + [(1, True), (largest, True)]
    runs = {k: [] for k in settings}
    for _ in range(_REPEATS.value):
        for n, overlap in settings:
            runs[(n, overlap)].append(
                measure(model, n, prompts, _MAX_TOKENS.value, overlap=overlap)
            )
    print(
        f"machine: {jax.devices()[0].device_kind}; tiny model, {_NUM_SEQS.value} sequences decoding "
        f"{_MAX_TOKENS.value} tokens; medians of {_REPEATS.value} alternated runs"
    )
    print("| decode steps per call (N) | overlap | host overhead | output tok/s | vs N=1 |")
    print("|---:|---|---:|---:|---:|")
    base = np.median([r["tok_per_s"] for r in runs[settings[0]]])
    for n, overlap in settings:
        h = np.median([r["host_overhead"] for r in runs[(n, overlap)]])
        t = np.median([r["tok_per_s"] for r in runs[(n, overlap)]])
        print(f"| {n} | {'on' if overlap else 'off'} | {h:.1%} | {t:.1f} | {t / base:.2f}x |")


def run() -> None:
    """The benchmark as a console script."""
    app.run(main)


if __name__ == "__main__":
    run()
