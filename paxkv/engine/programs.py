"""The step's programs, compiled ahead of time: lowered from shapes, compiled in parallel.

A program is one jitted function of `paxkv.engine.step` lowered for one shape. It is
lowered from `jax.ShapeDtypeStruct`s for the step batch (no buffer is allocated for
it, so warm-up cannot run out of memory at a large batch) and the engine's own weights,
cache and previous tokens, then compiled; several compile at once in threads (XLA
releases the GIL while it compiles, tracing and lowering gain little from threads and
run one at a time). A compiled program is called directly, with no tracing left on the
step's path.

Compiled programs are shared by the process: engines of the same model and limits (in
one process, or a test suite) compile each program once. With the persistent
compilation cache (`paxkv.engine.compile_cache`) a later process loads it instead.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from paxkv.engine.compilations import CompileCounter

# Every program compiled in this process, by what it was lowered from: the jitted
# function, its static arguments and every input's shape, dtype and sharding.
_COMPILED: dict[Hashable, Any] = {}
_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Program:
    """One program to compile: `fn` (jitted) lowered for `args` (arrays or
    `jax.ShapeDtypeStruct`s) with its static `kwargs`; `name` and `key` say which."""

    name: str
    key: tuple
    fn: Any
    args: tuple
    kwargs: dict

    def cache_key(self) -> Hashable:
        """What the compiled program depends on: its function, static arguments, and
        every input's tree, shape, dtype and sharding (not its values)."""
        leaves, tree = jax.tree.flatten(self.args)
        avals = tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None)) for x in leaves)
        return (self.fn, tree, avals, tuple(sorted(self.kwargs.items())))


def default_compile_threads() -> int:
    """How many programs compile at once: one per core, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


class Programs:
    """A runner's compiled programs by `(name, key)`, compiled on first need or ahead of
    time (`compile`), each counted by `counter` when the backend compiles it."""

    def __init__(self, counter: CompileCounter) -> None:
        self.counter = counter
        self._ready: dict[tuple[str, tuple], Any] = {}
        self.loaded = 0  # programs this runner took from the process's compiled ones
        self.compiled: list[tuple[str, tuple]] = []  # and those it compiled, in order

    def __contains__(self, name_key: tuple[str, tuple]) -> bool:
        return name_key in self._ready

    def get(self, name: str, key: tuple, make: Callable[[], Program]) -> Any:
        """The compiled program `(name, key)`, compiling `make()` now if it is not."""
        program = self._ready.get((name, key))
        if program is None:
            self.compile([make()])
            program = self._ready[(name, key)]
        return program

    def compile(
        self,
        programs: Sequence[Program],
        progress: Callable[[int, int], None] | None = None,
        *,
        threads: int | None = None,
    ) -> None:
        """Compiles `programs` (those not compiled yet), `threads` at once; calls
        `progress(done, total)` as each is ready."""
        total, done = len(programs), 0
        todo: list[tuple[Program, Hashable]] = []
        for p in programs:
            key = p.cache_key()
            with _LOCK:
                compiled = _COMPILED.get(key)
            if compiled is not None or (p.name, p.key) in self._ready:
                if compiled is not None:
                    self._ready[(p.name, p.key)] = compiled
                    self.loaded += 1
                done += 1
                if progress is not None:
                    progress(done, total)
            else:
                todo.append((p, key))
        if not todo:
            return
        workers = min(len(todo), threads or default_compile_threads())
        with concurrent.futures.ThreadPoolExecutor(workers, "paxkv-compile") as pool:
            futures = {}
            # Lowering traces Python: one at a time, each handed to a compiling thread.
            for p, key in todo:
                lowered = p.fn.lower(*p.args, **p.kwargs)
                futures[pool.submit(self._compile_one, lowered)] = (p, key)
            for future in concurrent.futures.as_completed(futures):
                p, key = futures[future]
                compiled = future.result()
                with _LOCK:
                    compiled = _COMPILED.setdefault(key, compiled)
                self._ready[(p.name, p.key)] = compiled
                self.compiled.append((p.name, p.key))
                done += 1
                if progress is not None:
                    progress(done, total)

    def _compile_one(self, lowered: Any) -> Any:
        with self.counter.counting():
            return lowered.compile()
