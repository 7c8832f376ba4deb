"""Benchmark: `Engine.warmup` with and without the scoring variants (`warmup_scoring`).

    python -m benchmarks.warmup                       # tiny-py at paxkv-serve's set-up
    python -m benchmarks.warmup --setup=tiny --repeats=5

For the serving set-up `--setup` (`paxkv.launch.setups`: the engine limits paxkv-serve uses),
an engine warms up with `warmup_scoring` off and on, alternately, `--repeats` times
each; JAX's in-memory compilation caches are cleared before every warm-up (the steps
are jitted at module level, so a second engine would otherwise reuse the first one's
compilations). Reports the median wall seconds of each, the compilations, and the
difference; the machine's load average before and after.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np
from absl import app, flags

from paxkv.engine import Engine
from paxkv.launch.setups import get_setup
from paxkv.models import load_model

_SETUP = flags.DEFINE_string("setup", "tiny-py", "Serving set-up (paxkv.launch.setups).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Warm-ups per setting.", lower_bound=1)


def warmup_seconds(model, config, tokenizer, *, scoring: bool) -> tuple[float, int]:
    """Wall seconds of one engine's warm-up from cold caches, and its compilations."""
    jax.clear_caches()
    engine = Engine(model, dataclasses.replace(config, warmup_scoring=scoring), tokenizer=tokenizer)
    t0 = time.perf_counter()
    engine.warmup()
    return time.perf_counter() - t0, engine.num_compilations


def main(argv: list[str]) -> None:
    """The absl main: alternates the two settings and prints a markdown table."""
    del argv
    setup = get_setup(_SETUP.value)
    source = setup.checkpoint or setup.name
    _, model, tokenizer = load_model(source, scan_layers=setup.model.scan_layers)
    load_before = os.getloadavg()[0]
    runs: dict[bool, list[tuple[float, int]]] = {False: [], True: []}
    for _ in range(_REPEATS.value):
        for scoring in (False, True):  # side by side, so load changes hit both alike
            runs[scoring].append(warmup_seconds(model, setup.engine, tokenizer, scoring=scoring))
    shapes = len(setup.engine.buckets().shapes())
    print(
        f"{_SETUP.value}, {shapes} step shapes, {jax.default_backend()}, load average "
        f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after, median of {_REPEATS.value}"
    )
    print("| warmup_scoring | compilations | warm-up (s) |")
    print("|---|---:|---:|")
    med = {}
    for scoring, rs in runs.items():
        med[scoring] = float(np.median([s for s, _ in rs]))
        print(f"| {scoring} | {rs[0][1]} | {med[scoring]:.1f} |")
    print(f"scoring variants add {med[True] - med[False]:.1f} s ({med[True] / med[False]:.2f}x)")


if __name__ == "__main__":
    app.run(main)
