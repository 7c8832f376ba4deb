"""Benchmark: `Engine.update_weights` against one device-to-device copy of the params.

    python -m benchmarks.update_weights [--models=tiny,llama-3.2-1b] [--repeats=5]

For each model (random weights of its preset, `--dtype`), an engine with a small pool
takes new weights: a tree of device arrays in the engine's shardings (a trainer's
arrays, copied in: `copy=True`), the same adopted without a copy (`copy=False`), and
host NumPy arrays. The baseline is `jax.tree.map(jnp.copy, params)`. Each is the
median of `--repeats` runs after one untimed one, in wall seconds and in the calling
thread's CPU seconds, with the peak growth of the process's resident memory during
the call (sampled every millisecond; on the CPU the device memory is the process's).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

_MODELS = flags.DEFINE_list("models", ["tiny", "llama-3.2-1b"], "Model presets (random weights).")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Parameter dtype.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per case.")

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def measure(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    """Median wall and thread-CPU seconds of `fn()` (blocked until ready), and the
    median peak RSS growth (bytes) during a call, after one untimed call."""
    jax.block_until_ready(fn())
    walls, cpus, peaks = [], [], []
    for _ in range(repeats):
        base = _rss()
        peak = [base]
        done = threading.Event()

        def sample(peak=peak, done=done):
            while not done.is_set():
                peak[0] = max(peak[0], _rss())
                time.sleep(0.001)

        sampler = threading.Thread(target=sample)
        sampler.start()
        w0, c0 = time.perf_counter(), time.thread_time()
        jax.block_until_ready(fn())
        walls.append(time.perf_counter() - w0)
        cpus.append(time.thread_time() - c0)
        done.set()
        sampler.join()
        peaks.append(max(peak[0], _rss()) - base)
    return {
        "wall_s": float(np.median(walls)),
        "cpu_s": float(np.median(cpus)),
        "peak_rss_mb": float(np.median(peaks)) / 2**20,
    }


def run_model(name: str, dtype: str, repeats: int) -> dict[str, dict[str, float]]:
    """The cases above for preset `name`."""
    from flax import nnx

    from paxkv.engine import Engine, EngineConfig
    from paxkv.models import load_model

    _, model, _ = load_model(name, dtype=dtype, seed=0)
    config = EngineConfig(
        num_pages=16, page_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128
    )
    engine = Engine(model, config)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    del model
    on_device = jax.tree.map(lambda x: x * 1.01, params)  # new values, in place already
    jax.block_until_ready(on_device)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    print(f"{name} ({dtype}): {nbytes / 2**20:.1f} MiB of parameters", flush=True)
    results = {
        "copy baseline": measure(lambda: jax.tree.map(jnp.copy, on_device), repeats),
        "update (device, copy)": measure(
            lambda: (engine.update_weights(on_device), engine.runner.params)[1], repeats
        ),
        "update (device, no copy)": measure(
            lambda: (engine.update_weights(on_device, copy=False), engine.runner.params)[1],
            repeats,
        ),
    }
    del params
    on_host = jax.device_get(on_device)
    results["update (host numpy)"] = measure(
        lambda: (engine.update_weights(on_host), engine.runner.params)[1], repeats
    )
    return results


def main(argv: list[str]) -> None:
    """Prints each model's cases, with the ratio to the copy."""
    del argv
    for name in _MODELS.value:
        results = run_model(name, _DTYPE.value, _REPEATS.value)
        base = results["copy baseline"]["wall_s"]
        for case, r in results.items():
            print(
                f"  {case:26s} wall {r['wall_s'] * 1e3:9.2f} ms ({r['wall_s'] / base:5.2f}x copy)"
                f"  thread cpu {r['cpu_s'] * 1e3:9.2f} ms  peak rss +{r['peak_rss_mb']:8.1f} MiB",
                flush=True,
            )


if __name__ == "__main__":
    app.run(main)
