"""The step's programs, compiled ahead of time: lowered from shapes, compiled in parallel.

A program is one jitted function of `paxkv.engine.device.step` lowered for one shape. It is
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

import atexit
import concurrent.futures
import contextlib
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


def clear_compiled() -> None:
    """Forgets the process's compiled programs (as `jax.clear_caches` forgets JAX's):
    engines keep the ones they hold; a new engine compiles (or loads) its own."""
    with _LOCK:
        _COMPILED.clear()


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


def _at_thread_shutdown(callback: Callable[[], None]) -> None:
    """Runs `callback` when the interpreter starts to exit, before it joins threads
    (where `concurrent.futures` stops its workers); at `atexit` where that hook is gone."""
    register = getattr(threading, "_register_atexit", None)
    try:
        register(callback)
    except (TypeError, RuntimeError):  # no hook, or the interpreter is exiting already
        atexit.register(callback)


def _lower_priority() -> None:
    """Makes the calling thread yield the CPU to the engine's steps (Linux: a thread's
    nice value is its own); a no-op where that is refused."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10))


def default_compile_threads() -> int:
    """How many programs compile at once: one per core, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


class Programs:
    """A runner's compiled programs by `(name, key)`, compiled on first need, ahead of
    time (`compile`) or in the background (`compile_in_background`), each counted by
    `counter` when the backend compiles (or loads) it. A program is compiled once: a
    caller that needs one being compiled waits for it."""

    def __init__(self, counter: CompileCounter) -> None:
        self.counter = counter
        self._ready: dict[tuple[str, tuple], Any] = {}
        self._pending: dict[tuple[str, tuple], concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self.loaded = 0  # programs this runner took from the process's compiled ones
        self.compiled: list[tuple[str, tuple]] = []  # and those it compiled, in order
        self.background: threading.Thread | None = None

    def __contains__(self, name_key: tuple[str, tuple]) -> bool:
        """Whether the program is compiled (ready to run)."""
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
        thread_name: str = "paxkv-compile",
        initializer: Callable[[], None] | None = None,
    ) -> None:
        """Compiles `programs`, `threads` at once (those compiled or being compiled
        elsewhere are waited for); calls `progress(done, total)` as each is ready."""
        total, done = len(programs), 0
        mine, theirs = [], []
        for p in programs:
            future, claimed = self._claim(p)
            if claimed:
                mine.append((p, future))
            elif future is not None:
                theirs.append(future)
            else:
                done += 1
                if progress is not None:
                    progress(done, total)
        workers = max(1, min(len(mine), threads or default_compile_threads()))
        try:
            with concurrent.futures.ThreadPoolExecutor(
                workers, thread_name, initializer=initializer
            ) as pool:
                jobs = {}
                for p, future in mine:  # lowering traces Python: one at a time
                    lowered = p.fn.lower(*p.args, **p.kwargs)
                    jobs[pool.submit(self._compile_one, lowered)] = (p, future)
                for job in concurrent.futures.as_completed(jobs):
                    p, future = jobs[job]
                    self._finish(p, future, job.result())
                    done += 1
                    if progress is not None:
                        progress(done, total)
        except BaseException as e:  # what this call claimed and did not compile
            for p, future in mine:
                if not future.done():
                    self._fail(p, future, e)
            raise
        for future in theirs:
            future.result()
            done += 1
            if progress is not None:
                progress(done, total)

    def compile_in_background(self, programs: Sequence[Program], *, threads: int = 1) -> None:
        """Compiles `programs` in a daemon thread while the engine serves; one that a
        step needs first is compiled then (or waited for), not twice."""

        stop = threading.Event()

        def run() -> None:
            _lower_priority()
            for p in programs:
                if stop.is_set():  # the interpreter is exiting: no new compilation
                    return
                if (p.name, p.key) in self._ready:
                    continue
                try:
                    self.compile(
                        [p],
                        threads=threads,
                        thread_name="paxkv-background",
                        initializer=_lower_priority,
                    )
                except Exception:  # a step that needs it compiles it and raises then
                    continue

        # Not a daemon: XLA must not be torn down under a compilation. At exit the
        # thread finishes the program it is compiling and starts no other.
        self.background = threading.Thread(target=run, name="paxkv-background-compile")
        _at_thread_shutdown(stop.set)
        self.background.start()

    def _claim(self, p: Program) -> tuple[concurrent.futures.Future | None, bool]:
        """`(future, True)` when this caller must compile `p` (the process had not);
        `(future, False)` when another caller is compiling it; `(None, False)` when it is
        ready."""
        name_key = (p.name, p.key)
        with self._lock:
            if name_key in self._ready:
                return None, False
            if name_key in self._pending:
                return self._pending[name_key], False
            with _LOCK:
                compiled = _COMPILED.get(p.cache_key())
            if compiled is not None:
                self._ready[name_key] = compiled
                self.loaded += 1
                return None, False
            future = concurrent.futures.Future()
            self._pending[name_key] = future
            return future, True

    def _finish(self, p: Program, future: concurrent.futures.Future, compiled: Any) -> None:
        with _LOCK:
            compiled = _COMPILED.setdefault(p.cache_key(), compiled)
        with self._lock:
            self._ready[(p.name, p.key)] = compiled
            self.compiled.append((p.name, p.key))
            del self._pending[(p.name, p.key)]
        future.set_result(compiled)

    def _fail(self, p: Program, future: concurrent.futures.Future, error: BaseException) -> None:
        with self._lock:
            self._pending.pop((p.name, p.key), None)
        future.set_exception(error)

    def _compile_one(self, lowered: Any) -> Any:
        with self.counter.counting():
            return lowered.compile()
