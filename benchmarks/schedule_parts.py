"""`host_step`'s schedule part broken down: where a step's planning goes at full batch.

Runs `benchmarks.host_step` (same flags) with the scheduler's inner pieces timed
on the thread's CPU clock, and prints, for the steps planned with `--max_num_seqs`
sequences running, the median of each piece per step: the running decodes' plan
(dropping ended sequences, appending new ones, the page work of the sequences whose
token starts or fills a page) and the admissions.

    python -m benchmarks.schedule_parts --trace=trace.json
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from absl import app

from benchmarks import host_step
from paxkv.host import running_decodes
from paxkv.host.prefix_writers import PrefixWriters
from paxkv.host.running_decodes import RunningColumns, RunningDecodes
from paxkv.host.scheduler import Scheduler

# (owner, attribute, what it is): timed each call, nested pieces inside outer ones.
PIECES: tuple[tuple[Any, str, str], ...] = (
    (RunningDecodes, "plan", "running decodes: plan"),
    (RunningColumns, "keep", "  drop ended sequences"),
    (RunningColumns, "extend", "  append new decodes"),
    (RunningColumns, "plan_next", "  page work"),
    (running_decodes, "allocate_decodes", "    new pages"),
    (PrefixWriters, "register_decodes", "    filled pages' keys"),
    (Scheduler, "_admit", "admissions"),
    (PrefixWriters, "register", "  their pages' keys"),
)


@contextlib.contextmanager
def timed_schedule() -> Iterator[list[tuple[int, dict[str, float]]]]:
    """Times `Scheduler.schedule` and `PIECES` while open; yields the list it fills
    with `(running sequences, {piece: us})` per schedule call."""
    steps: list[tuple[int, dict[str, float]]] = []
    current: dict[str, float] = collections.defaultdict(float)
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in PIECES]

    def timed(f: Callable, label: str) -> Callable:
        def call(*args, **kwargs):
            t = time.thread_time_ns()
            try:
                return f(*args, **kwargs)
            finally:
                current[label] += (time.thread_time_ns() - t) / 1e3

        return call

    schedule = Scheduler.schedule

    def timed_schedule_call(self: Scheduler):
        current.clear()
        t = time.thread_time_ns()
        plan = schedule(self)
        current["schedule"] = (time.thread_time_ns() - t) / 1e3
        steps.append((len(self.running), dict(current)))
        return plan

    try:
        Scheduler.schedule = timed_schedule_call
        for (owner, name, label), (_, _, f) in zip(PIECES, saved, strict=True):
            setattr(owner, name, timed(f, label))
        yield steps
    finally:
        Scheduler.schedule = schedule
        for owner, name, f in saved:
            setattr(owner, name, f)


def medians(steps: list[tuple[int, dict[str, float]]], running: int) -> dict[str, float]:
    """Per piece, its median per schedule call over the calls with `running` sequences
    running (0 for a call where it did not run); `"steps"`: how many calls."""
    chosen = [parts for n, parts in steps if n == running]
    labels = ["schedule", *(label for _, _, label in PIECES)]
    out = {"steps": float(len(chosen))}
    for label in labels:
        out[label] = statistics.median([p.get(label, 0.0) for p in chosen]) if chosen else 0.0
    return out


def main(argv: list[str]) -> None:
    """Runs `host_step` with the pieces timed; prints its tables, then the pieces'."""
    with timed_schedule() as steps:
        host_step.main(argv)
    running = host_step._MAX_NUM_SEQS.value
    m = medians(steps, running)
    print(f"\nschedule calls with {running} running: {int(m.pop('steps'))}; medians, us (CPU)")
    print("| piece | us |\n|---|---:|")
    for label, us in m.items():
        print(f"| {label} | {us:.1f} |")


if __name__ == "__main__":
    app.run(main)
