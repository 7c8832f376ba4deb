"""Async scheduling: the host one step ahead of the device.

Step k+1 is scheduled and dispatched before step k's tokens are read: each sequence
that step k samples for holds a placeholder token (`PLACEHOLDER_TOKEN`), and step k+1
reads the real token from step k's output on the device. Then the host waits for step
k, puts its tokens in place of the placeholders (finishing sequences that sampled a
stop token, whose step k+1 work is discarded), and records step k+1's plan. The
steady decode's columns (`paxkv.host.steady_decode`) hold their placeholders as
arrays (each sequence's row of the in-flight output), advanced and resolved for the
whole batch at once. A page freed meanwhile is only reused by steps dispatched later,
which the device runs in order.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from paxkv.engine.batch_builder import BatchBuilder
from paxkv.engine.outputs import StepOutputs
from paxkv.engine.recording import record_scores
from paxkv.engine.routed_experts import RoutedExperts
from paxkv.engine.runner import StepRunner
from paxkv.engine.sampling import Sampled, sample_result
from paxkv.engine.step import PLACEHOLDER_TOKEN
from paxkv.host.request import RequestOutput
from paxkv.host.scheduler import Scheduler, SchedulerOutput
from paxkv.host.sequence import SequenceState


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A dispatched step whose tokens the host has not read: its outputs on the device,
    and for each placeholder of its general chunks, `(seq, row of the output, index in
    seq's outputs)`; with `columns`, the steady decode recorded its decodes (the plan's
    `decode`, rows 0 to n - 1), which it resolves."""

    sampled: Sampled  # padded to max_num_seqs rows
    placeholders: tuple[tuple[SequenceState, int, int], ...]
    plan: SchedulerOutput  # what it ran: its scored rows are read from it
    columns: bool = False


class _InFlightRows(Mapping[int, int]):
    """`id(seq)` to the row of the in-flight step's output holding seq's last token,
    made when first read (`build_host_batch` reads it only for chunks whose last token
    is a placeholder)."""

    def __init__(self, inflight: InFlight) -> None:
        self._inflight = inflight
        self._rows: dict[int, int] | None = None

    def _map(self) -> dict[int, int]:
        if self._rows is None:
            f = self._inflight
            rows = {id(seq): row for seq, row, _ in f.placeholders}
            if f.columns:
                rows.update((id(seq), i) for i, seq in enumerate(f.plan.decode.seqs))
            self._rows = rows
        return self._rows

    def __getitem__(self, key: int) -> int:
        return self._map()[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._map())

    def __len__(self) -> int:
        return len(self._map())


class AsyncPipeline:
    """The in-flight step of an engine with `async_scheduling`, and how to resolve it.

    Args:
      runner: dispatches steps and fetches their samples.
      scheduler: records the placeholders and their resolved tokens.
      batch_builder: lays out each plan.
      report: the outputs of the given request ids now (`Endings.report`).
      report_decode: the outputs of a plan made with the steady decode's columns, and
        of the given other request ids (`Endings.report_decode`).
      on_tokens: called with, for each token resolved, the time since its sequence's
        previous token (None for its first).
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
        report_decode: Callable[[SchedulerOutput, Iterable[str]], StepOutputs],
        on_tokens: Callable[[list[float | None]], None],
        eos_token_ids: tuple[int, ...],
        routed_experts: RoutedExperts | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.batch_builder = batch_builder
        self.report = report
        self.report_decode = report_decode
        self.on_tokens = on_tokens
        self.eos_token_ids = eos_token_ids
        self.routed_experts = routed_experts
        self.inflight: InFlight | None = None

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

    def step(self, plan: SchedulerOutput) -> tuple[Sequence[RequestOutput], float, float]:
        """Dispatches `plan` (if it has work), then resolves the step before it.

        Returns the resolved requests' outputs and the times the dispatch ended and the
        wait for the previous step ended.
        """
        launched = None
        if plan.num_chunks:
            pending = _InFlightRows(self.inflight) if self.inflight else None
            plan, hb = self.batch_builder.build_batch(plan, pending)
            if plan.num_chunks:
                launched = self.runner.dispatch(hb)
        t1 = time.perf_counter()
        outputs = self._resolve(self.inflight) if self.inflight else []
        t2 = time.perf_counter()
        self.inflight = None
        if launched is None:
            self.scheduler.steady.drop()  # its rows would name a step no longer in flight
        else:
            self.inflight = self._record_placeholders(plan, launched)
        return outputs, t1, t2

    def _record_placeholders(self, plan: SchedulerOutput, launched: Sampled) -> InFlight:
        """Records dispatched `plan` with placeholders for the tokens it samples: lengths
        advance now (so max_tokens finishes are known), values arrive with the next
        call. The steady decode records its columns' decodes; `Scheduler.update` the
        rest (all of it when the plan was not made with the columns)."""
        s = self.scheduler
        n = plan.num_decode
        columns = n > 0 and s.steady.advance(plan, PLACEHOLDER_TOKEN)
        general = SchedulerOutput(plan.extra, ()) if columns else plan
        offset = n if columns else 0
        chunks = general.chunks
        sampled = [(PLACEHOLDER_TOKEN, 0.0) if c.samples else None for c in chunks]
        counts = [len(c.seq.output_token_ids) for c in chunks]
        s.update(general, sampled, eos_token_ids=self.eos_token_ids, steady=columns, in_flight=True)
        placeholders = tuple(
            (c.seq, offset + i, counts[i])
            for i, c in enumerate(chunks)
            if c.samples and len(c.seq.output_token_ids) > counts[i]
        )
        return InFlight(launched, placeholders, plan, columns)

    def _resolve(self, inflight: InFlight) -> Sequence[RequestOutput]:
        """Waits for an in-flight step and puts its sampled tokens in place."""
        sampled = self.runner.fetch(inflight.sampled)
        plan = inflight.plan
        if self.routed_experts is not None:
            self.routed_experts.record(plan, inflight.sampled)
        now = time.monotonic()
        gaps: list[float | None] = []
        # Scored sequences that ended with this step (max_tokens=0) are reported now,
        # with their prompt logprobs in place (only general chunks score).
        general = SchedulerOutput(plan.extra, ()) if inflight.columns else plan
        touched = [s for s in record_scores(general, sampled) if s.finish_reason]
        decode = plan.decode if inflight.columns else None
        if decode is not None:
            n = len(decode.seqs)
            gaps += self.scheduler.steady.resolve(decode, sampled.tokens[:n].tolist())
        for seq, row, index in inflight.placeholders:
            if index >= len(seq.output_token_ids):
                continue  # dropped: the sequence stopped at an earlier token
            # Placeholders keep the token times: this is the previous token's, as read.
            before = seq.last_token_time if index else None
            try:
                token, logprob, *top = sample_result(sampled, row, seq)
                self.scheduler.resolve(
                    seq, index, token, logprob, self.eos_token_ids, now, top[0] if top else None
                )
            except Exception as e:  # isolated: only this sequence fails
                self.scheduler.fail(seq, e)
                continue
            gaps.append(None if before is None else now - before)
            touched.append(seq)
        self.on_tokens(gaps)
        if decode is not None:
            return self.report_decode(plan, [seq.request_id for seq in touched])
        return self.report(seq.request_id for seq in touched)
