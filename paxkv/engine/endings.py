"""How an engine's requests end and are reported.

A request ends finished (its outputs reported by the step that finished it, then
forgotten) or aborted: by `Engine.abort`, because host work tied to it failed
(`Scheduler.fail`), or by a weight update or a lost KV cache. An aborted request's pages
go back to the pool at once, and its final output waits here until the next step
reports it, exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from absl import logging

from paxkv.engine.metrics import EngineMetrics
from paxkv.engine.outputs import StepOutputs
from paxkv.engine.requests import Request, RequestRegistry
from paxkv.host.request import RequestOutput
from paxkv.host.scheduler import Scheduler
from paxkv.host.sequence import PLACEHOLDER_TOKEN, SequenceState
from paxkv.host.step_plan import SchedulerOutput


class Endings:
    """The final outputs an engine owes its next step, and how requests end.

    Args:
      requests: the engine's requests.
      scheduler: frees an ended request's sequences and names the failed ones.
      metrics: told of every request that ends.
      tokenizer: detokenizes a final output (None: token ids only).
    """

    def __init__(
        self,
        requests: RequestRegistry,
        scheduler: Scheduler,
        metrics: EngineMetrics,
        tokenizer: Any,
    ) -> None:
        self.requests = requests
        self.scheduler = scheduler
        self.metrics = metrics
        self.tokenizer = tokenizer
        self._pending: list[RequestOutput] = []  # reported by the next step

    @property
    def pending(self) -> bool:
        """Whether final outputs wait for the next step."""
        return bool(self._pending)

    def is_pending(self, request_id: str) -> bool:
        """Whether `request_id` ended and its final output is not yet reported."""
        return any(o.request_id == request_id for o in self._pending)

    def end(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """Aborts a request (with `error`: because something tied to it failed); the next
        step reports it. None if it is not unfinished."""
        req = self.requests.pop(request_id)
        if req is None:
            return None
        self.scheduler.abort(req.seqs)
        for seq in req.seqs:  # placeholders of a step in flight: its outputs end before
            drop_placeholders(seq)
        try:
            out = req.output(self.tokenizer)
        except Exception:  # what failed may be the output itself: report the bare tokens
            out = req.bare_output()
        out.error = error
        self._pending.append(out)
        self._finished(req)
        return out

    def end_failed(self) -> None:
        """Ends the requests of sequences whose host work failed (`Scheduler.fail`):
        finish reason "abort" and the error in their output; the others go on."""
        for seq, error in self.scheduler.take_failed():
            if self.end(seq.request_id, error) is not None:
                logging.warning(
                    "paxkv: request %r failed and was aborted: %s", seq.request_id, error
                )

    def report(self, request_ids) -> list[RequestOutput]:
        """The outputs of the requests `request_ids` now; finished ones are forgotten.
        Requests whose host work failed are ended first (`end_failed`)."""
        self.end_failed()
        outputs, finished = self.requests.report(request_ids, defer=True)
        for req in finished:
            self._finished(req)
        return outputs

    def report_decode(
        self, plan: SchedulerOutput, extra: Iterable[str] | None = None
    ) -> StepOutputs:
        """`report` of the requests of a plan made with the running decodes' columns: one
        batch of deltas for the columns' requests that go on
        (`RequestRegistry.report_decode`), the others one by one: those of `extra`
        (None: the plan's other chunks that sample)."""
        self.end_failed()
        deltas, others = self.requests.report_decode(plan.decode, self.scheduler.decodes.gone(plan))
        if extra is None:
            extra = [c.seq.request_id for c in plan.extra if c.samples]
        others += extra
        outputs, finished = self.requests.report(others, defer=True)
        for req in finished:
            self._finished(req)
        return StepOutputs(outputs, deltas)

    def after_failed_step(
        self, error: BaseException, *, cache_lost: bool, in_flight_lost: bool
    ) -> None:
        """Keeps the engine usable after a step raised `error`. A sync step's host state
        is as before it, and it runs again, unless the device's KV cache was lost
        (`cache_lost`: donated to the call that raised; the runner made an empty one):
        then every request with KV in it is aborted (the next step reports them with
        why), its pages go back to the pool, and the prefix cache is emptied. With async
        scheduling (`in_flight_lost`) the in-flight step's tokens are lost too: the
        running requests are aborted either way. Waiting requests hold no KV and go on."""
        if not cache_lost and not in_flight_lost:
            return
        what = "the KV cache" if cache_lost else "the step in flight"
        message = f"{what} was lost: a step raised {type(error).__name__}"
        logging.error("paxkv: %s; aborting the running requests", message)
        for rid in dict.fromkeys(seq.request_id for seq in self.scheduler.running):
            self.end(rid, message)
        if cache_lost:
            self.scheduler.kv_cache_manager.pool.uncache_all()

    def defer(self, outputs: list[RequestOutput]) -> None:
        """Reports `outputs` with the next step's (before the other pending ones)."""
        self._pending[:0] = outputs

    def take(self) -> list[RequestOutput]:
        """The pending final outputs, now reported (forgotten here)."""
        taken, self._pending = self._pending, []
        return taken

    def _finished(self, req: Request) -> None:
        for seq in req.seqs:
            self.metrics.on_finish(seq)


def drop_placeholders(seq: SequenceState) -> None:
    """Cuts seq's outputs before the placeholders of a step in flight (async
    scheduling): an ended sequence's outputs end at its last real token."""
    out = seq.output_token_ids
    real = len(out)
    while real and out[real - 1] == PLACEHOLDER_TOKEN:
        real -= 1
    seq.truncate_outputs(real)
