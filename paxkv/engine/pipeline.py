"""Async scheduling: the host one step ahead of the device.

Step k+1 is scheduled and dispatched before step k's tokens are read: each sequence
that step k samples for holds a placeholder token (`PLACEHOLDER_TOKEN`), and step k+1
reads the real token from step k's output on the device. Then the host waits for step
k, puts its tokens in place of the placeholders (finishing sequences that sampled a
stop token, whose step k+1 work is discarded), and records step k+1's plan. A page
freed meanwhile is only reused by steps dispatched later, which the device runs in
order.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

from paxkv.engine.batch_builder import BatchBuilder
from paxkv.engine.recording import record_scores
from paxkv.engine.routed_experts import RoutedExperts
from paxkv.engine.runner import StepRunner
from paxkv.engine.sampling import Sampled, sample_result
from paxkv.engine.step import PLACEHOLDER_TOKEN
from paxkv.host.scheduler import Scheduler, SchedulerOutput
from paxkv.host.sequence import SequenceState
from paxkv.request import RequestOutput


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A dispatched step whose tokens the host has not read: its outputs on the device,
    and for each placeholder it left, `(seq, row of the output, index in seq's outputs)`."""

    sampled: Sampled  # padded to max_num_seqs rows
    placeholders: tuple[tuple[SequenceState, int, int], ...]
    plan: SchedulerOutput  # what it ran: its scored rows are read from it


class AsyncPipeline:
    """The in-flight step of an engine with `async_scheduling`, and how to resolve it.

    Args:
      runner: dispatches steps and fetches their samples.
      scheduler: records the placeholders and their resolved tokens.
      batch_builder: lays out each plan.
      report: the outputs of the given request ids now (`Endings.report`).
      on_token: called with the time since a sequence's previous token (None for its
        first) for each token resolved.
      eos_token_ids: the model's end-of-sequence tokens.
      routed_experts: records the routing of steps whose requests ask for it.
    """

    def __init__(
        self,
        runner: StepRunner,
        scheduler: Scheduler,
        batch_builder: BatchBuilder,
        *,
        report: Callable[[Iterable[str]], list[RequestOutput]],
        on_token: Callable[[float | None], None],
        eos_token_ids: tuple[int, ...],
        routed_experts: RoutedExperts | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.batch_builder = batch_builder
        self.report = report
        self.on_token = on_token
        self.eos_token_ids = eos_token_ids
        self.routed_experts = routed_experts
        self.inflight: InFlight | None = None
        self._last_token_seen: dict[int, float] = {}

    @property
    def busy(self) -> bool:
        """Whether a step is in flight."""
        return self.inflight is not None

    def forget(self, seqs: list[SequenceState]) -> None:
        """Drops the placeholders of sequences that were aborted while a step was in
        flight: their outputs end at the last real token."""
        for seq in seqs:
            real = len(seq.output_token_ids)
            while real and seq.output_token_ids[real - 1] == PLACEHOLDER_TOKEN:
                real -= 1
            seq.truncate_outputs(real)
            self._last_token_seen.pop(id(seq), None)

    def step(self, plan: SchedulerOutput) -> tuple[list[RequestOutput], float, float]:
        """Dispatches `plan` (if it has work), then resolves the step before it.

        Returns the resolved requests' outputs and the times the dispatch ended and the
        wait for the previous step ended.
        """
        launched = None
        if plan.chunks:
            pending = (
                {id(seq): row for seq, row, _ in self.inflight.placeholders}
                if self.inflight
                else None
            )
            plan, hb = self.batch_builder.build_batch(plan, pending)
            if plan.chunks:
                launched = self.runner.dispatch(hb)
        t1 = time.perf_counter()
        outputs = self._resolve(self.inflight) if self.inflight else []
        t2 = time.perf_counter()
        self.inflight = None
        if launched is not None:
            # Placeholders for the tokens this step samples: lengths advance now (so
            # max_tokens finishes are known), values arrive with the next call.
            sampled = [(PLACEHOLDER_TOKEN, 0.0) if c.samples else None for c in plan.chunks]
            counts = [len(c.seq.output_token_ids) for c in plan.chunks]
            self.scheduler.update(plan, sampled, eos_token_ids=())
            placeholders = tuple(
                (c.seq, i, counts[i])
                for i, c in enumerate(plan.chunks)
                if c.samples and len(c.seq.output_token_ids) > counts[i]
            )
            self.inflight = InFlight(launched, placeholders, plan)
        return outputs, t1, t2

    def _resolve(self, inflight: InFlight) -> list[RequestOutput]:
        """Waits for an in-flight step and puts its sampled tokens in place."""
        sampled = self.runner.fetch(inflight.sampled)
        if self.routed_experts is not None:
            self.routed_experts.record(inflight.plan, inflight.sampled)
        now = time.monotonic()
        # Scored sequences that ended with this step (max_tokens=0) are reported now,
        # with their prompt logprobs in place.
        touched = [s for s in record_scores(inflight.plan, sampled) if s.finish_reason]
        for seq, row, index in inflight.placeholders:
            if index >= len(seq.output_token_ids):
                continue  # dropped: the sequence stopped at an earlier token
            before = self._last_token_seen.get(id(seq))
            try:
                token, logprob, *top = sample_result(sampled, row, seq)
                self.scheduler.resolve(
                    seq, index, token, logprob, self.eos_token_ids, now, top[0] if top else None
                )
            except Exception as e:  # isolated: only this sequence fails
                self.scheduler.fail(seq, e)
                continue
            self.on_token(None if before is None else now - before)
            self._last_token_seen[id(seq)] = now
            touched.append(seq)
        outputs = self.report(seq.request_id for seq in touched)
        for seq in touched:
            if seq.finish_reason is not None:
                self._last_token_seen.pop(id(seq), None)
        return outputs
