"""Synchronous stepping: each plan dispatched, waited for and recorded in turn.

The counterpart of `paxkv.engine.pipeline.AsyncPipeline`. A decode-only plan whose
pages for N steps can be reserved runs N decode iterations in one compiled call
(`EngineConfig.num_decode_steps`); every other plan runs one step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import jax

from paxkv.engine.batch_builder import BatchBuilder
from paxkv.engine.metrics import EngineMetrics
from paxkv.engine.outputs import StepOutputs
from paxkv.engine.recording import record_samples
from paxkv.engine.routed_experts import RoutedExperts
from paxkv.engine.runner import StepRunner
from paxkv.engine.step import MAX_STOP_IDS
from paxkv.host.request import RequestOutput
from paxkv.host.scheduler import Scheduler, SchedulerOutput
from paxkv.host.step_plan import reserve_ahead


class SyncStepper:
    """Runs an engine's plans one after the other (no `async_scheduling`).

    Args:
      runner: dispatches steps (or N-step decode loops) and fetches their samples.
      scheduler: reserves pages ahead and records the samples.
      batch_builder: lays out each plan.
      report: the outputs of the given request ids now (`Endings.report`).
      metrics: counts decode loops and the gaps between tokens.
      eos_token_ids: the model's end-of-sequence tokens.
      num_decode_steps: decode iterations per compiled call when a plan allows it.
      report_decode: the outputs of a steady decode plan (`Endings.report_decode`);
        None: `report` them.
      routed_experts: records the routing of steps whose requests ask for it (their
        plans run one step per call).
    """

    def __init__(
        self,
        runner: StepRunner,
        scheduler: Scheduler,
        batch_builder: BatchBuilder,
        *,
        report: Callable[[Iterable[str]], list[RequestOutput]],
        metrics: EngineMetrics,
        eos_token_ids: tuple[int, ...],
        num_decode_steps: int,
        report_decode: Callable[[SchedulerOutput], StepOutputs] | None = None,
        routed_experts: RoutedExperts | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.batch_builder = batch_builder
        self.report = report
        self.metrics = metrics
        self.eos_token_ids = eos_token_ids
        self.num_decode_steps = num_decode_steps
        self.report_decode = report_decode
        self.routed_experts = routed_experts

    def step(self, plan: SchedulerOutput) -> tuple[list[RequestOutput], float, float]:
        """Runs `plan` (N decode steps in one call when it can) and records its tokens;
        returns the outputs, the time the batch was laid out and the time the device's
        results were read (`time.perf_counter`)."""
        limits = None
        reserved = self._reserve_ahead(plan)
        if reserved is not None:
            plan, limits = reserved
        planned = plan
        plan, hb = self.batch_builder.build_batch(plan)
        if not plan.num_chunks:  # every chunk's request failed
            t1 = time.perf_counter()
            return [], t1, t1
        if limits is not None and plan is not planned:
            kept = {id(c.seq) for c in plan.chunks}
            limits = [n for c, n in zip(planned.chunks, limits, strict=True) if id(c.seq) in kept]
        t1 = time.perf_counter()  # laid out; the device's time starts with the dispatch
        if limits is None:
            handle = self.runner.dispatch(hb)
            results = [(self.runner.fetch(handle), None)]
            if self.routed_experts is not None:
                self.routed_experts.record(plan, handle)
        else:
            stops = [c.seq.stop_token_ids(self.eos_token_ids) for c in plan.chunks]
            sampled, valid = self.runner.decode_loop(hb, stops, limits)
            self.metrics.num_decode_loops += 1
            results = [
                (jax.tree.map(lambda a, i=i: a[i], sampled), valid[i]) for i in range(len(valid))
            ]
        t2 = time.perf_counter()
        for i, (sampled, valid) in enumerate(results):
            step = plan if i == 0 else _advanced(plan, i)
            gaps = record_samples(self.scheduler, step, sampled, valid, self.eos_token_ids)
            self.metrics.on_tokens(gaps)
        if plan.decode is not None and self.report_decode is not None:
            return self.report_decode(plan), t1, t2
        return self.report(plan.sampled_request_ids()), t1, t2

    def _reserve_ahead(self, plan: SchedulerOutput) -> tuple[SchedulerOutput, list[int]] | None:
        """A decode-only plan with pages for N steps reserved, and its token limits; None
        when the plan is not decode-only or the pages cannot be reserved."""
        n = self.num_decode_steps
        if n <= 1 or any(c.num_tokens != 1 or not c.samples for c in plan.chunks):
            return None
        if self.routed_experts is not None and self.routed_experts.wants(plan):
            return None  # the decode loop returns no routing
        eos = self.eos_token_ids
        if any(len(c.seq.stop_token_ids(eos)) > MAX_STOP_IDS for c in plan.chunks):
            return None
        return reserve_ahead(self.scheduler.kv_cache_manager, plan, n, self.scheduler.max_model_len)


def _advanced(plan: SchedulerOutput, i: int) -> SchedulerOutput:
    """Iteration i of a decode-only plan run N steps at once: each chunk one token later."""
    chunks = tuple(c._replace(start=c.start + i, num_tokens=1, samples=True) for c in plan.chunks)
    return SchedulerOutput(chunks, ())
