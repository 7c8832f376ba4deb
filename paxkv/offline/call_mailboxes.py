"""An engine's outputs, each routed to the call that waits for its request.

`LLM.generate` and `LLM.generate_stream` calls may be live at once (interleaved streams,
a stream suspended while a `generate` runs): whichever call steps the engine files each
output for the call its request belongs to, so every call yields exactly its own
requests' outputs, and a call that ends early aborts its unfinished requests.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

from paxkv.host.request import RequestOutput


class CallMailboxes:
    """The outputs of each live call's requests not yet taken by it, by request id.

    Args:
      engine: the `paxkv.Engine` whose `step` outputs are routed.
      pause_timeout_s: how long a call waits while the engine is paused before it
        raises TimeoutError (None: until `Engine.resume`).
    """

    def __init__(self, engine: Any, pause_timeout_s: float | None = None) -> None:
        self.engine = engine
        self.pause_timeout_s = pause_timeout_s
        self._lock = threading.Lock()  # one call steps at a time; the others wait
        self._inbox: dict[str, collections.deque[RequestOutput]] = {}  # a queue per call
        self._stepping = False
        self._deferred_aborts: list[str] = []

    def open(self, ids: list[str]) -> collections.deque[RequestOutput]:
        """A box for the outputs of requests `ids`, filed from now on: open it before
        the requests are submitted, so no step on another thread reports one first."""
        box: collections.deque[RequestOutput] = collections.deque()
        for rid in ids:
            self._inbox[rid] = box
        return box

    def close(self, ids: list[str]) -> None:
        """Stops filing the outputs of requests `ids` (a box opened for requests that
        were not all submitted)."""
        for rid in ids:
            self._inbox.pop(rid, None)

    def outputs(
        self,
        ids: list[str],
        bar: Any,
        deltas: set[str],
        box: collections.deque[RequestOutput] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields the outputs of requests `ids`, and of no others, in the order the
        engine reports them, until each has finished; counts them on `bar` (`deltas`: the
        ids whose outputs are deltas). Steps the engine while it has none of them to
        yield: other calls' outputs reported meanwhile are kept for those calls. However
        it ends early (closed, garbage-collected, or an exception, KeyboardInterrupt
        included) it aborts its unfinished requests; once closed it steps once more to
        report them, unless it is closed inside a step. `box`: the one `open` made for
        them (None: opened now)."""
        if box is None:
            box = self.open(ids)
        unfinished = dict.fromkeys(ids)
        closed = False
        try:
            bar.start(len(ids))
            while unfinished:
                if not box:
                    self.step(box)
                    continue
                out = box.popleft()
                bar.advanced(out, delta=out.request_id in deltas)
                if out.finished:
                    del unfinished[out.request_id]
                yield out
        except GeneratorExit:
            closed = True
            raise
        finally:
            bar.close()
            for rid in ids:
                self._inbox.pop(rid, None)
            for rid in unfinished:
                self.abort(rid)
            if closed and unfinished and not self._stepping and not self.engine.paused:
                self.step(report_only=True)  # reports, and so forgets, the aborted requests

    def step(self, waiting: collections.deque | None = None, *, report_only: bool = False) -> None:
        """Runs one engine step and files each output for the call that waits for its
        request; outputs no call waits for (an ended call's) are dropped. While the
        engine is paused it waits for `resume` first, without spinning (TimeoutError
        after `pause_timeout_s`). Calls on several threads step one at a time; one
        whose box (`waiting`) another's step filled meanwhile does not step. With
        `report_only` (aborted requests to report) it steps only if the engine still has
        something to report: another thread's step may have reported them."""
        if self.engine.paused and not self.engine.wait_resumed(self.pause_timeout_s):
            raise TimeoutError(
                f"the engine stayed paused for pause_timeout_s={self.pause_timeout_s}: "
                "resume() it, or abort the requests"
            )
        with self._lock, self.engine.lock:
            if waiting or (report_only and not self.engine.has_unfinished()):
                return
            self._step()

    def _step(self) -> None:
        if not self.engine.has_unfinished():
            raise RuntimeError(
                "requests of this call are unfinished but the engine has none: were their "
                "outputs taken by a direct engine.step()?"
            )
        self._stepping = True  # till every output is filed: a stream closed meanwhile waits
        try:
            for out in self.engine.step():
                box = self._inbox.get(out.request_id)
                if box is not None:
                    box.append(out)
        finally:
            self._stepping = False
            deferred, self._deferred_aborts = self._deferred_aborts, []
            for rid in deferred:
                self.engine.abort(rid)

    def abort(self, request_id: str) -> None:
        """Aborts a request now, or after the step in progress (a stream collected inside
        one)."""
        if self._stepping:
            self._deferred_aborts.append(request_id)
        else:
            self.engine.abort(request_id)
