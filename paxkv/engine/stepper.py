"""The stepping loop: each plan laid out, launched on the device and read back.

One loop serves every mode. `depth` is how many launched steps may wait unread while
the next is planned: 0 reads each step right after launching it; 1 (async scheduling)
launches step k+1 before reading step k, so the host plans while the device runs.

A step launched ahead records placeholders (`PLACEHOLDER_TOKEN`) for the tokens it
samples: lengths advance at once (so max_tokens finishes are known), and the step
after it reads the real tokens on the device (`paxkv.engine.device.step.Carried`). Reading
the step puts them in place, ending the sequences that sampled a stop token (their
work in the step after is discarded). A page freed meanwhile is only reused by steps
launched later, which the device runs in order.

How a plan runs is a strategy chosen per plan:
- one step (`OneStep`), the default;
- N decode iterations in one call (`DecodeLoop`, `EngineConfig.num_decode_steps`): a
  decode-only plan without proposals whose pages for N tokens can be reserved; its
  placeholders, read ahead, are N per sequence.
Constrained sequences (structured outputs, `paxkv.host.constrained`) run one step at
a time: a step with them dispatches its forward first, the host fills their token
masks while it runs (with async scheduling, after reading the step before, whose
tokens the masks depend on), then the sampler runs with the masks (`Deferred`).
Speculative proposals are part of a plan (`paxkv.host.speculative`). A step launched
ahead records each sequence's proposals as if all were accepted; the step after it
moves the sequence back, on the device, by those the verdict rejected, and reading
the verdict does the same on the host (`Scheduler.resolve_verified`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from paxkv.engine.batch_builder import BatchBuilder
from paxkv.engine.device.sampling import Sampled, sample_result
from paxkv.engine.device.step import MAX_STOP_IDS
from paxkv.engine.endings import Endings
from paxkv.engine.metrics import EngineMetrics
from paxkv.engine.recording import record_samples, record_scores, verified_results
from paxkv.engine.routed_experts import RoutedExperts
from paxkv.engine.runner import Deferred, StepRunner
from paxkv.host.constrained import ConstrainedSequences
from paxkv.host.request import RequestOutput
from paxkv.host.scheduler import Scheduler, SchedulerOutput
from paxkv.host.sequence import PLACEHOLDER_TOKEN, SequenceState
from paxkv.host.step_plan import reserve_ahead


class OneStep:
    """Runs a plan as one step (`StepRunner.dispatch`)."""

    num_steps = 1

    @staticmethod
    def launch(runner: StepRunner, hb: Any, plan: SchedulerOutput) -> Any:
        """Dispatches the step of host batch `hb`; returns the runner's handle."""
        return runner.dispatch(hb)

    @staticmethod
    def read(runner: StepRunner, handle: Any) -> list[tuple[Sampled, Sequence[bool] | None]]:
        """Each iteration's samples and which sequences produced a token (None: all)."""
        return [(runner.fetch(handle), None)]


@dataclasses.dataclass(frozen=True)
class DecodeLoop:
    """Runs a decode-only plan as `num_steps` decode iterations in one call, each
    sequence i producing at most `limits[i]` tokens (`StepRunner.decode_loop`)."""

    num_steps: int
    limits: list[int]
    stops: list[tuple[int, ...]]

    def launch(self, runner: StepRunner, hb: Any, plan: SchedulerOutput) -> Any:
        """Dispatches the loop of host batch `hb`; returns the runner's handle."""
        return runner.decode_loop(hb, self.stops, self.limits)

    def read(self, runner: StepRunner, handle: Any) -> list[tuple[Sampled, Sequence[bool]]]:
        """Each iteration's samples and which sequences produced a token."""
        sampled, valid = runner.fetch_loop(handle)
        return [(jax.tree.map(lambda a, i=i: a[i], sampled), valid[i]) for i in range(len(valid))]

    def kept(self, planned: SchedulerOutput, plan: SchedulerOutput) -> DecodeLoop:
        """The loop of `plan`, `planned` without chunks whose layout failed."""
        if plan is planned:
            return self
        kept = {id(c.seq) for c in plan.chunks}
        pairs = [
            (n, s)
            for c, n, s in zip(planned.chunks, self.limits, self.stops, strict=True)
            if id(c.seq) in kept
        ]
        return DecodeLoop(self.num_steps, [n for n, _ in pairs], [s for _, s in pairs])


Strategy = OneStep | DecodeLoop


@dataclasses.dataclass(frozen=True)
class Launched:
    """A step on the device: the plan it runs, how, and the runner's handle."""

    plan: SchedulerOutput
    strategy: Strategy
    handle: Any


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A launched step whose tokens the host has not read, and its placeholders: per
    entry `(seq, iteration, row, index, count)`, seq's outputs `index ..
    index + count - 1` are placeholders for what row `row` of iteration `iteration`
    emits (count > 1: a proposal run recorded as accepted). With `columns`, the running
    decode recorded the plan's `decode` (rows 0 to n - 1), which it resolves. `ended`:
    sequences that recording the launch ended with no placeholder (a scoring request's
    last chunk), which reading the step reports."""

    launched: Launched
    placeholders: tuple[tuple[SequenceState, int, int, int, int], ...]
    columns: bool = False
    # Sequences recording the launch ended with no placeholder (a score request's last
    # prefill chunk, max_tokens=0): reported when the step is read, with their scores.
    ended: tuple[SequenceState, ...] = ()


class _InFlightRows(Mapping[int, int]):
    """`id(seq)` to the row of the in-flight step's output that holds seq's last token
    (`Carried.tokens`), made when first read (`build_host_batch` reads it only for
    chunks whose last known token is a placeholder)."""

    def __init__(self, inflight: InFlight) -> None:
        self._inflight = inflight
        self._rows: dict[int, int] | None = None

    def _map(self) -> dict[int, int]:
        if self._rows is None:
            f = self._inflight
            rows = {id(seq): row for seq, _, row, _, _ in f.placeholders}
            if f.columns:
                rows.update((id(seq), i) for i, seq in enumerate(f.launched.plan.decode.seqs))
            self._rows = rows
        return self._rows

    def __getitem__(self, key: int) -> int:
        return self._map()[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._map())

    def __len__(self) -> int:
        return len(self._map())


class Stepper:
    """Steps an engine's plans: lays each out, launches it and reads it back, `depth`
    steps behind (module docstring).

    Args:
      runner: launches steps and decode loops and reads their samples.
      scheduler: reserves pages ahead and records the samples (placeholders first, when
        read later).
      batch_builder: lays out each plan.
      endings: reports the requests a step advanced (`Endings.report`).
      metrics: counts decode loops and the gaps between tokens.
      eos_token_ids: the model's end-of-sequence tokens.
      depth: launched steps left unread while the next is planned: 0 or 1.
      num_decode_steps: decode iterations per call when a plan allows it (`DecodeLoop`).
      routed_experts: records the routing of steps whose requests ask for it (their
        plans run one step per call).
      constrained: the constrained sequences and their matchers (None: none ever).
      fill_masks: `fill(matchers, out)` fills `out[i]` (i32[n, W]) with matcher i's
        token mask (`paxkv.text.grammar.GrammarCompiler.fill`).
      consume: feeds `(matcher, token)` pairs at once (`GrammarCompiler.consume`).
      before_launch: called before each step is dispatched, after it is laid out (the
        host KV tier's copies, `paxkv.engine.host_tier.HostTierCopies.flush`).
    """

    def __init__(
        self,
        runner: StepRunner,
        scheduler: Scheduler,
        batch_builder: BatchBuilder,
        *,
        endings: Endings,
        metrics: EngineMetrics,
        eos_token_ids: tuple[int, ...],
        depth: int = 0,
        num_decode_steps: int = 1,
        routed_experts: RoutedExperts | None = None,
        constrained: ConstrainedSequences | None = None,
        fill_masks: Any = None,
        consume: Any = None,
        before_launch: Callable[[], None] | None = None,
    ) -> None:
        if depth not in (0, 1):
            raise ValueError(f"depth={depth} must be 0 (synchronous) or 1 (async scheduling)")
        self.runner = runner
        self.scheduler = scheduler
        self.batch_builder = batch_builder
        self.endings = endings
        self.metrics = metrics
        self.eos_token_ids = eos_token_ids
        self.depth = depth
        self.num_decode_steps = num_decode_steps
        self.routed_experts = routed_experts
        self.constrained = constrained if constrained is not None else ConstrainedSequences()
        self.fill_masks = fill_masks
        self.consume = consume
        self.before_launch = before_launch
        self.inflight: InFlight | None = None

    @property
    def busy(self) -> bool:
        """Whether a launched step waits to be read."""
        return self.inflight is not None

    def lose_in_flight(self) -> None:
        """Forgets the step in flight (its sequences were all aborted)."""
        self.inflight = None

    def drain(self) -> Sequence[RequestOutput]:
        """Reads the step in flight, if any, launching nothing; its outputs."""
        if self.inflight is None:
            return []
        outputs, _, _ = self.step(SchedulerOutput((), ()))
        return outputs

    def step(self, plan: SchedulerOutput) -> tuple[Sequence[RequestOutput], float, float]:
        """Launches `plan` (if it has work) and reads the step `depth` behind it.

        Returns the outputs of the requests that step advanced, the time the launch
        ended and the time the device's results were read (`time.perf_counter`).
        """
        launched = self._launch(plan) if plan.num_chunks else None
        t1 = time.perf_counter()
        if self.depth == 0:
            outputs = self._read(self._finish(launched)) if launched is not None else []
            return outputs, t1, time.perf_counter()
        outputs, rejected = self._resolve(self.inflight) if self.inflight else ([], {})
        t2 = time.perf_counter()
        self.inflight = None
        if launched is not None:
            try:
                launched = self._finish(launched)
            except BaseException:  # the step just read is reported with the next one
                self.endings.defer(list(outputs))
                raise
        if launched is None:
            self.scheduler.decodes.drop()  # its rows would name a step no longer in flight
            self.scheduler.release_rejected(seq for seq, _ in rejected.values())
        else:
            self.inflight = self._record_placeholders(launched, rejected)
        return outputs, t1, t2

    # Launching.

    def _strategy(self, plan: SchedulerOutput) -> tuple[SchedulerOutput, Strategy]:
        """How `plan` runs: N decode iterations when it is decode-only without
        proposals and the pages for N tokens of each sequence can be reserved (then
        the plan with them, reserved), else one step."""
        n = self.num_decode_steps
        if n <= 1 or any(c.num_tokens != 1 or not c.samples for c in plan.chunks):
            return plan, OneStep()
        if any(c.seq.num_unverified for c in plan.chunks):
            return plan, OneStep()  # its token limits depend on a verdict not read yet
        if any(c.seq.biased or c.seq.constrained for c in plan.chunks):
            return plan, OneStep()  # the decode loop applies no logit biases nor masks
        if self.routed_experts is not None and self.routed_experts.wants(plan):
            return plan, OneStep()  # the decode loop returns no routing
        eos = self.eos_token_ids
        stops = [c.seq.stop_token_ids(eos) for c in plan.chunks]
        if any(len(s) > MAX_STOP_IDS for s in stops):
            return plan, OneStep()
        s = self.scheduler
        reserved = reserve_ahead(s.kv_cache_manager, plan, n, s.max_model_len)
        if reserved is None:
            return plan, OneStep()
        return reserved[0], DecodeLoop(n, reserved[1], stops)

    def _launch(self, plan: SchedulerOutput) -> Launched | None:
        """Lays `plan` out and launches it; None when no chunk of it is left to run."""
        plan, strategy = self._strategy(plan)
        pending = _InFlightRows(self.inflight) if self.inflight else None
        planned = plan
        plan, hb = self.batch_builder.build_batch(plan, pending)
        if hb is None or not plan.num_chunks:  # every chunk's request failed
            return None
        if isinstance(strategy, DecodeLoop):
            strategy = strategy.kept(planned, plan)
            self.metrics.num_decode_loops += 1
        if self.before_launch is not None:
            self.before_launch()
        return Launched(plan, strategy, strategy.launch(self.runner, hb, plan))

    def _finish(self, launched: Launched) -> Launched:
        """`launched` with its sampler dispatched: a `Deferred` step's after the host
        fills the token masks of its constrained sequences (their matchers up to date).
        A sequence whose constraint leaves none of the model's tokens (only an EOS the
        model has not got) samples freely and ends before that token. A fill that
        raises fails the step's constrained sequences, not the step."""
        handle = launched.handle
        if not isinstance(handle, Deferred):
            return launched
        rows = self.constrained.sampling(launched.plan)
        if rows:
            # Each sequence's rows: its mask now, then after each of its proposals.
            counts = [1 + len(d) for _, _, _, d in rows]
            starts = np.cumsum([0, *counts[:-1]])
            masks = np.empty((sum(counts), handle.allowed.shape[1]), np.int32)
            drafts = [d for _, _, _, d in rows] if len(masks) > len(rows) else None
            try:
                self.fill_masks([m for _, m, _, _ in rows], masks, drafts)
            except Exception as e:  # isolated: only the constrained sequences fail
                for _, _, seq, _ in rows:
                    self.scheduler.fail(seq, e)
                masks[:] = -1
            empty = ~masks.any(axis=1)
            first_empty = empty[starts]
            for i, (_, m, seq, _) in enumerate(rows):
                if m.is_error():  # llguidance gave up (a limit): the sequence fails
                    self.scheduler.fail(seq, ValueError(f"structured_outputs: {m.get_error()}"))
                    empty[starts[i] : starts[i] + counts[i]] = True
                elif first_empty[i]:
                    if m.is_accepting():  # complete: only an EOS the model has not got
                        self.constrained.end_after((seq,))
                    else:
                        self.scheduler.fail(
                            seq, ValueError("structured_outputs: the constraint allows no token")
                        )
            # Past a complete constraint (only an EOS the model has not got): any token,
            # which the sequence's end (at the next sync) cuts off.
            masks[empty] = -1
            k1 = handle.positions
            for (row, _, _, _), start, n in zip(rows, starts.tolist(), counts, strict=True):
                handle.allowed[row * k1 : row * k1 + n] = masks[start : start + n]
        return dataclasses.replace(launched, handle=self.runner.finish(handle))

    def _sync_constrained(self) -> None:
        """Brings the matchers up to the tokens just recorded, ending the sequences
        whose constraint is complete."""
        if self.constrained:
            self.constrained.sync(self.scheduler, self.consume)

    # Reading now (depth 0).

    def _read(self, launched: Launched) -> Sequence[RequestOutput]:
        """Reads a step just launched and records its tokens."""
        plan, strategy = launched.plan, launched.strategy
        results = strategy.read(self.runner, launched.handle)
        if self.routed_experts is not None and isinstance(strategy, OneStep):
            self.routed_experts.record(plan, launched.handle)
        for i, (sampled, valid) in enumerate(results):
            step = plan if i == 0 else _advanced(plan, i)
            gaps = record_samples(self.scheduler, step, sampled, valid, self.eos_token_ids)
            self.metrics.on_tokens(gaps)
        self._sync_constrained()
        if plan.decode is not None:
            return self.endings.report_decode(plan)
        return self.endings.report(plan.sampled_request_ids())

    # Reading later (depth 1).

    def _record_placeholders(
        self, launched: Launched, rejected: dict[int, tuple[SequenceState, int]]
    ) -> InFlight:
        """Records launched `plan` with placeholders for the tokens it samples (each
        chunk moved back by the proposals the step before it rejected, `rejected`:
        `id(seq)` to seq and their number). The running decodes record its columns' decodes;
        `Scheduler.update` the rest (all of it when the plan was not made with the
        columns)."""
        s = self.scheduler
        plan, strategy = launched.plan, launched.strategy
        n = plan.num_decode
        columns = n > 0 and not rejected and s.decodes.advance(plan, PLACEHOLDER_TOKEN)
        general = SchedulerOutput(plan.extra, ()) if columns else plan
        offset = n if columns else 0
        chunks = general.chunks
        if rejected:
            chunks = tuple(
                c._replace(start=c.start - rejected[id(c.seq)][1]) if id(c.seq) in rejected else c
                for c in chunks
            )
        placeholders, ended = [], []
        for i in range(strategy.num_steps):
            step = chunks if i == 0 else _advanced_chunks(chunks, i)
            limits = strategy.limits if isinstance(strategy, DecodeLoop) else None
            sampled = [
                None
                if not c.samples or (limits is not None and i >= limits[j])
                else [(PLACEHOLDER_TOKEN, 0.0)] * (1 + c.num_draft)
                if c.num_draft
                else (PLACEHOLDER_TOKEN, 0.0)
                for j, c in enumerate(step)
            ]
            counts = [len(c.seq.output_token_ids) for c in step]
            finished = s.update(
                SchedulerOutput(step, ()), sampled, eos_token_ids=self.eos_token_ids
            )
            placeholders += [
                (c.seq, i, offset + j, counts[j], added)
                for j, c in enumerate(step)
                if (added := len(c.seq.output_token_ids) - counts[j]) > 0
            ]
            if finished:  # those with no placeholder: reading the step touches them not
                before = {id(c.seq): counts[j] for j, c in enumerate(step)}
                ended += [seq for seq in finished if len(seq.output_token_ids) == before[id(seq)]]
        if not columns:  # the next plan reads this one's tokens on the device
            s.decodes.after_update(self.eos_token_ids, SchedulerOutput(step, ()))
        if rejected:
            s.release_rejected(seq for seq, _ in rejected.values())
        return InFlight(launched, tuple(placeholders), columns, tuple(ended))

    def _resolve(
        self, inflight: InFlight
    ) -> tuple[Sequence[RequestOutput], dict[int, tuple[SequenceState, int]]]:
        """Waits for an in-flight step and puts its tokens in place of the placeholders.
        Returns the outputs, and for each sequence whose proposals the step partly
        rejected, `id(seq)` to seq and how many."""
        launched = inflight.launched
        plan, strategy = launched.plan, launched.strategy
        results = strategy.read(self.runner, launched.handle)
        if self.routed_experts is not None and isinstance(strategy, OneStep):
            self.routed_experts.record(plan, launched.handle)
        now = time.monotonic()
        gaps: list[float | None] = []
        # Scored sequences that ended with this step (max_tokens=0) are reported now,
        # with their prompt logprobs in place (only general chunks score).
        general = SchedulerOutput(plan.extra, ()) if inflight.columns else plan
        touched = [s for s in record_scores(general, results[0][0]) if s.finish_reason]
        touched += inflight.ended
        decode = plan.decode if inflight.columns else None
        if decode is not None:
            n = len(decode.seqs)
            sampled = results[0][0]
            gaps += self.scheduler.decodes.resolve(
                decode,
                sampled.tokens[:n].tolist(),
                lambda i: sample_result(sampled, i, decode.seqs[i])[1:],
            )
        rejected: dict[int, tuple[SequenceState, int]] = {}
        for seq, i, row, index, count in inflight.placeholders:
            if index >= len(seq.output_token_ids):
                continue  # dropped: the sequence stopped at an earlier token
            sampled, valid = results[i]
            if valid is not None and not valid[row]:
                continue
            # Placeholders keep the token times: this is the previous token's, as read.
            before = seq.last_token_time if index else None
            try:
                if count > 1:  # a proposal run, recorded as accepted
                    emitted = verified_results(sampled, row, seq)
                    r = self.scheduler.resolve_verified(
                        seq, index, count - 1, emitted, self.eos_token_ids, now
                    )
                    if r:
                        rejected[id(seq)] = (seq, r)
                    gaps += [None] * (len(emitted) - 1)
                else:
                    token, logprob, *top = sample_result(sampled, row, seq)
                    self.scheduler.resolve(
                        seq, index, token, logprob, self.eos_token_ids, now, top[0] if top else None
                    )
            except Exception as e:  # isolated: only this sequence fails
                self.scheduler.fail(seq, e)
                continue
            gaps.append(None if before is None else now - before)
            touched.append(seq)
        self.metrics.on_tokens(gaps)
        self._sync_constrained()
        if decode is not None:
            ids = [seq.request_id for seq in dict.fromkeys(touched)]
            return self.endings.report_decode(plan, ids), rejected
        return self.endings.report(seq.request_id for seq in dict.fromkeys(touched)), rejected


def _advanced_chunks(chunks: tuple, i: int) -> tuple:
    """Iteration i of decode-only chunks run N steps at once: each one token later."""
    return tuple(c._replace(start=c.start + i, num_tokens=1, samples=True) for c in chunks)


def _advanced(plan: SchedulerOutput, i: int) -> SchedulerOutput:
    """Iteration i of a decode-only plan run N steps at once: each chunk one token later."""
    return SchedulerOutput(_advanced_chunks(plan.chunks, i), ())
