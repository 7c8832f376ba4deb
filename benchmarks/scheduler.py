"""Benchmark: host time per step at 256 running sequences, and prefix caching's cost.

    python -m benchmarks.scheduler [--num_seqs=256] [--steps=200]

Part 1 (host only, no model): 256 sequences decode; each step times `schedule()`,
the page-table build (`build_host_batch`) and `update()` with a fake model's tokens,
with prefix caching on and off. Reports medians.

Part 2 (--engine): the tiny model through the engine on the CPU, random prompts (a
0% prefix hit rate), prefix caching on against off, alternated over --repeats runs;
reports the median output tok/s of each and their ratio.
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

from paxkv.host.batch import Buckets, build_host_batch
from paxkv.host.page_pool import PagePool
from paxkv.host.request import SamplingParams
from paxkv.host.scheduler import Scheduler
from paxkv.host.sequence import SequenceState as Sequence
from paxkv.pallas_kernels.layout import cdiv

_NUM_SEQS = flags.DEFINE_integer("num_seqs", 256, "Running sequences.")
_STEPS = flags.DEFINE_integer("steps", 200, "Timed decode steps.")
_PROMPT = flags.DEFINE_integer("prompt_len", 500, "Prompt tokens per sequence.")
_ENGINE = flags.DEFINE_bool("engine", True, "Also measure prefix caching's cost end to end.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Alternated engine runs per setting.")

PAGE_SIZE = 16


def host_step_times(
    num_seqs: int, steps: int, prompt_len: int, *, caching: bool
) -> dict[str, float]:
    """Median seconds of schedule / build / update per decode step at `num_seqs` running."""
    max_len = prompt_len + steps + 64
    pages_per_seq = cdiv(max_len, PAGE_SIZE)
    pool = PagePool(num_seqs * pages_per_seq + 1)
    sched = Scheduler(
        pool,
        page_size=PAGE_SIZE,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(num_seqs, 8192),
        max_model_len=max_len,
        enable_prefix_caching=caching,
    )
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 32, ignore_eos=True)
    for i in range(num_seqs):
        prompt = rng.integers(0, 32000, size=prompt_len).tolist()
        sched.add(Sequence(str(i), str(i), 0, prompt, params, seed=i, arrival_time=float(i)))
    buckets = Buckets(
        tokens=(num_seqs, 8192 * 8), seqs=(num_seqs,), pages=(pages_per_seq,), max_seqs=num_seqs
    )
    while len(sched.running) < num_seqs or any(
        s.num_computed_tokens < prompt_len for s in sched.running
    ):
        out = sched.schedule()
        sched.update(out, [(1, 0.0) if c.samples else None for c in out.chunks])
    times = {"schedule": [], "build": [], "update": []}
    for step in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        build_host_batch(out, page_size=PAGE_SIZE, buckets=buckets, rows=sched.batch_rows)
        t2 = time.perf_counter()
        sched.update(out, [(step % 32000, 0.0)] * len(out.chunks))
        t3 = time.perf_counter()
        assert len(out.chunks) == num_seqs
        times["schedule"].append(t1 - t0)
        times["build"].append(t2 - t1)
        times["update"].append(t3 - t2)
    return {k: float(np.median(v)) for k, v in times.items()}


def engine_tok_per_s(caching: bool, prompts: list[list[int]]) -> float:
    """Output tok/s of the tiny model serving `prompts` (32 tokens each), caching on or off."""
    from paxkv.engine import Engine, EngineConfig
    from paxkv.models import load_model

    _, model, _ = load_model("tiny", dtype="float32")
    engine = Engine(
        model,
        EngineConfig(
            num_pages=1024,
            page_size=PAGE_SIZE,
            max_num_seqs=32,
            max_num_batched_tokens=256,
            max_model_len=512,
            enable_prefix_caching=caching,
            log_stats_interval_s=0,
        ),
    )
    engine.warmup()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    final = engine.run_until_done()
    n = sum(len(o.outputs[0].token_ids) for o in final.values())
    return n / (time.perf_counter() - start)


def main(argv: list[str]) -> None:
    """Times the host step with prefix caching on and off, then (--engine) end to end."""
    del argv
    import jax

    print(
        f"machine: {jax.devices()[0].device_kind} host, {_NUM_SEQS.value} running sequences, "
        f"prompt {_PROMPT.value}, medians of {_STEPS.value} decode steps"
    )
    print(
        "| prefix caching | schedule() (us) | page-table build (us) | update() (us) | schedule + build (us) |"
    )
    print("|---|---:|---:|---:|---:|")
    for caching in (True, False):
        t = host_step_times(_NUM_SEQS.value, _STEPS.value, _PROMPT.value, caching=caching)
        print(
            f"| {'on' if caching else 'off'} | {t['schedule'] * 1e6:.0f} | {t['build'] * 1e6:.0f} | "
            f"{t['update'] * 1e6:.0f} | {(t['schedule'] + t['build']) * 1e6:.0f} |"
        )
    if not _ENGINE.value:
        return
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(16, 200, size=64)]
    runs = {True: [], False: []}
    for _ in range(_REPEATS.value):
        for caching in (True, False):
            runs[caching].append(engine_tok_per_s(caching, prompts))
    on, off = np.median(runs[True]), np.median(runs[False])
    print(
        f"\ntiny model, 64 random prompts (0% prefix hits), median of {_REPEATS.value} alternated runs:"
    )
    print(f"output tok/s with prefix caching {on:.1f}, without {off:.1f}: ratio {on / off:.3f}")


def run() -> None:
    """The benchmark as a console script."""
    app.run(main)


if __name__ == "__main__":
    run()
