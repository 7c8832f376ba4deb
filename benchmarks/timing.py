"""The benchmarks' timer: the median wall time of a jitted call, compile excluded."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def median_seconds(
    fn: Callable[[], Any],
    *,
    iters: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median seconds of `fn()` over `iters` calls after `max(1, warmup)` untimed ones.

    The untimed calls compile and warm up; every call ends with `jax.block_until_ready`
    on its result, so the time is the device's, not the dispatch's. A call that donates
    its input carries its state in `fn` itself (a closure that reassigns it). `clock`:
    the wall clock, or `time.process_time` for the CPU time of every thread of the
    process (on the CPU backend, the work itself, less sensitive to a loaded machine).
    """
    for _ in range(max(1, warmup)):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = clock()
        jax.block_until_ready(fn())
        times.append(clock() - start)
    return float(np.median(times))
