"""The async front end of one `Engine`: a stepping thread that owns it, for asyncio callers.

Everything that touches the engine (adding, aborting, stepping, reading its stats) runs
on one thread, the stepping thread, in the order asyncio code asked for it: callers send
it commands through a queue, and it sends each request's delta outputs back to the
event loop, into the queue of the HTTP request that submitted it. While requests are
unfinished the thread steps without waiting; when none are, or the engine is paused or
asleep (`Engine.sleep`: `AsyncEngine.sleep`, `wake_up`), it waits on the command queue.

The engine isolates what one request can break (its host work failing ends it with
finish reason "abort" and `RequestOutput.error`). A step that raises anyway is a bug in
the engine: the front end then fails every request in flight, answers no more, and
reports itself dead (`AsyncEngine.dead`), as vLLM's engine client does; `fail_stuck`
does the same from outside when the stepping thread is stuck in a call that will not
return (a replica across processes that lost one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any

from absl import logging

from paxkv.engine import Engine
from paxkv.engine.outputs import built, handles
from paxkv.host.request import RequestOutput, RequestOutputKind, SamplingParams


class QueueFull(Exception):
    """The front end holds as many unfinished requests as it may: retry later (HTTP 429)."""


class EngineDead(Exception):
    """The engine failed or is shutting down, and takes no more requests (HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class Submission:
    """One engine request of a group: its id, prompt, params and cache salt
    (`Engine.add_request`'s)."""

    request_id: str
    prompt: str | dict
    params: SamplingParams
    cache_salt: str | None = None
    lora: str | None = None  # the name of a LoRA adapter the engines have loaded


class RequestGroup:
    """The requests of one HTTP request (one per prompt), whose delta outputs come in
    one queue as the engine produces them.

    Iterate it (`async for out in group`) for the outputs, in engine order, until every
    request has finished; each output is a `RequestOutputKind.DELTA` output, the last
    one of a request `finished`. `abort()` ends the unfinished ones (their final outputs
    still come, with finish reason "abort").
    """

    def __init__(self, front: AsyncEngine, submissions: Sequence[Submission]) -> None:
        self._front = front
        self.request_ids = tuple(s.request_id for s in submissions)
        self.num_seqs = {s.request_id: s.params.n for s in submissions}
        self.unfinished = set(self.request_ids)
        self.outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self.unfinished:
            out = await self.outputs.get()
            if isinstance(out, BaseException):
                raise out
            if out.finished:
                self.unfinished.discard(out.request_id)
            yield out

    def abort(self) -> None:
        """Aborts the group's unfinished requests (a no-op once all have finished)."""
        for rid in self.unfinished:
            self._front.abort(rid)


class AsyncEngine:
    """Serves one `Engine` to asyncio code; start it with `start()` inside the event loop.

    Args:
      engine: the engine, warmed up; from now on only the stepping thread touches it.
      max_unfinished: the most sequences (prompts times `n`) submitted and not finished
        at once; a group that would exceed it is refused with `QueueFull`, one that
        alone exceeds it with ValueError.
    """

    def __init__(self, engine: Engine, *, max_unfinished: int) -> None:
        if max_unfinished < 1:
            raise ValueError(f"max_unfinished={max_unfinished} must be >= 1")
        self.engine = engine
        self.max_unfinished = max_unfinished
        self.num_unfinished = 0  # sequences; read and written on the event loop only
        self.dead = False
        self.asleep = 0  # the level of the engine's sleep (`sleep`); the event loop's
        # What the stepping thread runs next, in order: a function, and the future of its
        # result (None: nobody waits for it).
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future | None]] = (
            queue.SimpleQueue()
        )
        self._groups: dict[str, RequestGroup] = {}  # the stepping thread's, by request id
        # The event loop's: every group submitted and not yet collected.
        self._live: weakref.WeakSet[RequestGroup] = weakref.WeakSet()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts the stepping thread; call it from the event loop that will submit."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="paxkv-engine", daemon=True)
        self._thread.start()

    async def submit(self, submissions: Sequence[Submission]) -> RequestGroup:
        """Validates and queues the requests of one HTTP request, all or none.

        Raises QueueFull if their sequences would take the unfinished ones past
        `max_unfinished`, EngineDead when the engine takes no more, and the engine's
        ValueError or TypeError (naming the field) for a request it rejects; then
        nothing is queued. Requests are validated in a worker thread first, so that the
        stepping thread only queues them.
        """
        if self.dead or self._stopping:
            raise EngineDead("the engine is shutting down or has failed")
        num_seqs = sum(s.params.n for s in submissions)
        if num_seqs > self.max_unfinished:
            raise ValueError(
                f"the request has {num_seqs} sequences (prompts x n), and the server holds "
                f"at most {self.max_unfinished} at once"
            )
        if self.num_unfinished + num_seqs > self.max_unfinished:
            raise QueueFull(
                f"the server holds {self.num_unfinished} unfinished sequences, and takes at "
                f"most {self.max_unfinished}: retry later"
            )
        # Held from the check on: requests that arrive while this one is validated or
        # queued see its sequences (checked and counted with no await in between).
        self.num_unfinished += num_seqs
        try:
            await asyncio.to_thread(self._validate, submissions)
            group = RequestGroup(self, submissions)
            await self._call(lambda: self._add(group, submissions))
        except BaseException:
            self.num_unfinished -= num_seqs
            raise
        self._live.add(group)
        return group

    def end_in_flight(self, reason: str) -> None:
        """Ends every request in flight now: their groups raise EngineDead(`reason`)
        (HTTP 503), and the engine aborts them; no more are taken. On the event loop."""
        logging.info("paxkv-serve: ending the requests in flight: %s", reason)
        self._stopping = True
        self._commands.put((lambda: self._fail_all(EngineDead(reason), abort=True), None))

    def fail_stuck(self, reason: str) -> None:
        """Fails every request in flight with EngineDead(`reason`) (HTTP 503) without the
        stepping thread, which is stuck in a call that will not return (a process of a
        replica across processes died or hangs); the front end is dead from now on.
        Safe from any thread."""

        def fail() -> None:
            logging.error("paxkv-serve: failing the requests in flight: %s", reason)
            self.dead = True
            error = EngineDead(reason)
            for group in list(self._live):
                group.outputs.put_nowait(error)
            while True:  # commands queued behind the stuck call never run
                try:
                    _, future = self._commands.get_nowait()
                except queue.Empty:
                    break
                if future is not None and future.set_running_or_notify_cancel():
                    future.set_exception(error)

        self._loop.call_soon_threadsafe(fail)

    def abort(self, request_id: str) -> None:
        """Ends request `request_id` (its last output comes with finish reason "abort");
        an unknown or finished id is a no-op. Safe from any thread."""
        self._commands.put((lambda: self.engine.abort(request_id), None))

    async def stats(self) -> dict[str, Any]:
        """The engine's stats (`Engine.stats`), read on the stepping thread."""
        return await self._call(self.engine.stats)

    async def sleep(
        self, level: int = 1, *, weights: str = "host", requests: str = "wait"
    ) -> dict[str, float]:
        """`Engine.sleep` on the stepping thread: {"released_bytes", "seconds"}. Until
        `wake_up`, requests submitted are queued (`requests="wait"`) or refused with
        `EngineAsleep` (`"refuse"`), and the stepping thread waits without stepping."""
        result = await self._call(
            lambda: self.engine.sleep(level, weights=weights, requests=requests)
        )
        self.asleep = level
        return result

    async def add_lora(self, request: Any) -> bool:
        """`Engine.add_lora` on the stepping thread."""
        return await self._call(lambda: self.engine.add_lora(request))

    async def remove_lora(self, name: str) -> bool:
        """`Engine.remove_lora` on the stepping thread."""
        return await self._call(lambda: self.engine.remove_lora(name))

    async def wake_up(self) -> dict[str, float]:
        """`Engine.wake_up` on the stepping thread: {"restored_bytes", "seconds"}; the
        queued requests then run. A no-op when awake."""
        result = await self._call(self.engine.wake_up)
        self.asleep = 0
        return result

    async def close(self, timeout_s: float = 10.0) -> None:
        """Aborts what is unfinished, reports it, and stops the stepping thread."""
        if self._thread is None or not self._thread.is_alive():
            return
        self._stopping = True
        self._commands.put((self._stop, None))
        await asyncio.to_thread(self._thread.join, timeout_s)

    # The stepping thread.

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Runs `fn` on the stepping thread; its result or exception."""
        if self.dead:
            raise EngineDead("the engine has failed")
        future: Future = Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    def _validate(self, submissions: Sequence[Submission]) -> None:
        """Checks the requests against the engine's limits; read-only, so any thread."""
        for s in submissions:
            self.engine.requests.validate(s.request_id, s.prompt, s.params)

    def _add(self, group: RequestGroup, submissions: Sequence[Submission]) -> None:
        self._validate(submissions)  # again, now on the stepping thread: all or none
        for s in submissions:
            params = dataclasses.replace(s.params, output_kind=RequestOutputKind.DELTA)
            self.engine.add_request(
                s.request_id, s.prompt, params, cache_salt=s.cache_salt, lora_request=s.lora
            )
            self._groups[s.request_id] = group

    def _stop(self) -> None:
        for rid in list(self._groups):
            self.engine.abort(rid)
        raise _Stop

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                unfinished = engine.has_unfinished()
                try:
                    if unfinished and not engine.paused:
                        command = self._commands.get_nowait()
                    else:
                        # Nothing to step, or a paused or sleeping engine that steps
                        # nothing: wait for a command. With requests waiting, look again
                        # now and then: `Engine.resume` may come from another thread.
                        command = self._commands.get(timeout=_PAUSED_POLL_S if unfinished else None)
                    while True:
                        _run_command(*command)
                        command = self._commands.get_nowait()
                except queue.Empty:
                    pass
                except _Stop:
                    self._step_until_done()
                    return
                if engine.has_unfinished() and not engine.paused:
                    self._deliver(engine.step())
        except Exception as e:
            logging.exception("paxkv-serve: the engine failed; failing every request in flight")
            self._fail_all(EngineDead(f"the engine failed: {e}"))
            while True:  # callers still waiting on a command learn that it never ran
                fn, future = self._commands.get()
                if fn == self._stop:
                    return
                if future is not None and future.set_running_or_notify_cancel():
                    future.set_exception(EngineDead(f"the engine failed: {e}"))

    def _step_until_done(self) -> None:
        while self.engine.has_unfinished():
            if self.engine.paused:  # paused or asleep: what is left never runs
                self._fail_all(
                    EngineDead("the server stopped while the engine was paused or asleep")
                )
                return
            self._deliver(self.engine.step())

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        """Hands a step's outputs to their groups on the event loop, which builds them
        (`paxkv.engine.outputs.handles`): the stepping thread builds no output objects."""
        if not outputs:
            return
        routed = []
        for rid, finished, out in handles(outputs):
            group = self._groups.get(rid)
            if group is None:
                continue
            if finished:
                del self._groups[rid]
            routed.append((group, rid, finished, out))
        self._loop.call_soon_threadsafe(self._hand_over, routed)

    def _hand_over(self, routed: list[tuple[RequestGroup, str, bool, Any]]) -> None:
        """On the event loop: builds each output and puts it in its group's queue."""
        for group, rid, finished, out in routed:
            if finished:
                self.num_unfinished -= group.num_seqs[rid]
            group.outputs.put_nowait(built(out))

    def _fail_all(self, error: EngineDead, *, abort: bool = False) -> None:
        """Fails every group in flight with `error` (and with `abort`, aborts their
        requests in the engine); the front end is dead from now on."""
        self.dead = True
        groups = dict.fromkeys(self._groups.values())
        failed = sum(g.num_seqs[rid] for rid, g in self._groups.items())
        if abort:
            for rid in self._groups:
                self.engine.abort(rid)
        self._groups.clear()

        def fail() -> None:
            self.num_unfinished -= failed
            for group in groups:
                group.outputs.put_nowait(error)

        self._loop.call_soon_threadsafe(fail)


# How often a stepping thread with requests waiting looks whether its paused engine was
# resumed from another thread; a wake-up sent as a command is seen at once.
_PAUSED_POLL_S = 0.1


def _run_command(fn: Callable[[], Any], future: Future | None) -> None:
    """Runs a command: into its future, if it has one (else its exceptions propagate)."""
    if future is None:
        fn()
        return
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except Exception as e:
        future.set_exception(e)


class _Stop(Exception):
    """Raised by the stop command to end the stepping loop."""
