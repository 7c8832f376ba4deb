"""Compilations an engine triggers, counted from JAX's own monitoring events.

JAX reports every backend compilation (`jax.monitoring`, the event
`/jax/core/compile/backend_compile_duration` with the jitted function's name), a
program loaded from the persistent compilation cache included (it reports a cache hit
first, in the same thread). One listener, registered once, credits each such event to
the `CompileCounter` that is active in the calling context, when the compiled function
is one it watches. So an engine counts only what its own calls compiled or loaded,
whatever other engines or tests compiled before it in the process.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import threading
from collections.abc import Iterable, Iterator

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_hit = threading.local()  # this thread's next backend "compilation" is a cache load


class CompileCounter:
    """Counts compilations of the jitted functions named `fun_names` inside `counting()`."""

    def __init__(self, fun_names: Iterable[str]) -> None:
        self.fun_names = frozenset(f"jit({name})" for name in fun_names)
        self.count = 0  # programs compiled or loaded from the persistent cache
        self.by_function: collections.Counter[str] = collections.Counter()
        self.loaded = 0  # of them, loaded
        self.seconds = 0.0
        self.lock = threading.Lock()  # programs compile in several threads at once

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Credits the compilations that happen in this context (this thread) to self;
        a thread that compiles for it enters its own."""
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)


_ACTIVE: contextvars.ContextVar[CompileCounter | None] = contextvars.ContextVar(
    "paxkv_compile_counter", default=None
)


def _on_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT_EVENT:
        _hit.pending = True


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event != _BACKEND_COMPILE_EVENT:
        return
    loaded, _hit.pending = getattr(_hit, "pending", False), False
    counter = _ACTIVE.get()
    if counter is not None and kwargs.get("fun_name") in counter.fun_names:
        with counter.lock:
            counter.count += 1
            counter.by_function[kwargs["fun_name"]] += 1
            counter.loaded += loaded
            counter.seconds += duration


jax.monitoring.register_event_listener(_on_event)
jax.monitoring.register_event_duration_secs_listener(_on_duration)
