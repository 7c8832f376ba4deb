"""The engine: turns each scheduler decision into one jitted step of the model.

The host schedules (`paxkv.host.scheduler`), lays out the step batch (tokens,
positions, page table, sampling parameters) as int32/float32 arrays padded to a small
declared set of bucket shapes (`paxkv.host.batch`), and calls one jitted function with
the KV cache donated (`paxkv.engine.step`). A long run therefore compiles each bucket
once; `Engine.num_compilations` counts what this engine compiled, and a test asserts
that it stays flat after warm-up.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
from absl import logging
from flax import nnx

from paxkv.engine.config import EngineConfig
from paxkv.engine.pipeline import AsyncPipeline
from paxkv.engine.requests import Request, RequestRegistry
from paxkv.engine.runner import ModelRunner, StepRunner
from paxkv.engine.sampling import Sampled, sample_result
from paxkv.engine.step import MAX_STOP_IDS
from paxkv.host.batch import HostBatch, build_host_batch
from paxkv.host.page_pool import PagePool
from paxkv.host.reservation import PagedReservation
from paxkv.host.scheduler import Scheduler, SchedulerOutput
from paxkv.host.sequence import SeqStatus
from paxkv.metrics import EngineMetrics, engine_stats
from paxkv.request import FinishReason, RequestOutput, SamplingParams
from paxkv.sharding import shardings


class Engine:
    """A serving engine for JAX pipelines that drive their own loop.

    `add_request` submits (and validates) a request, `step` runs one scheduled step and
    returns the requests it advanced, `abort` ends a request at any time, and
    `has_unfinished` tells when to stop (`run_until_done` does all of it). Every
    submitted request ends finished or aborted; one that can never be served is
    rejected by `add_request` (ValueError or TypeError naming the problem), and nothing
    else is affected.

    Args:
      model: an NNX causal LM with a `config` (num_layers, num_kv_heads, head_dim,
        vocab_size, dtype, eos_token_ids), `__call__(tokens, positions, kv_cache, table,
        attention_backend=)` (and `decode_only=True` in multi-step decode, a promise of
        one row per sequence) and `logits(hidden)`, like `paxkv.models.LlamaForCausalLM`.
      config: serving limits (`EngineConfig`; None: its defaults).
      tokenizer: optional, with `encode(str) -> list[int]` and `decode(list[int]) -> str`.
      mesh: a `jax.sharding.Mesh` of one replica (see `paxkv.sharding.shardings`) to
        serve on; None: `shardings.default_mesh()`, which is None (one device) unless set.
      reservation: how many token slots a sequence holds; None: the pages it needs
        (`paxkv.host.reservation`). The load benchmark's contiguous baselines pass theirs.
      runner: makes the step runner from the engine's config (`paxkv.engine.runner`);
        None: a `ModelRunner` of `model` (on `mesh`). With a runner, `model` may be None,
        e.g. `runner=lambda config: FakeRunner(32000, config)` runs the whole host path
        without a model or a device.
    """

    def __init__(
        self,
        model: nnx.Module | None,
        config: EngineConfig | None = None,
        *,
        tokenizer: Any = None,
        mesh: Any = None,
        reservation: PagedReservation | None = None,
        runner: Callable[[EngineConfig], StepRunner] | None = None,
    ) -> None:
        platform = jax.default_backend()
        self.config = config = (config or EngineConfig()).for_backend(platform)
        if runner is not None:
            self.runner = runner(config)
        else:
            mesh = mesh if mesh is not None else shardings.default_mesh()
            self.runner = ModelRunner(model, config, mesh)
        mc = self.model_config = self.runner.model_config
        config.check_serves(mc, platform)
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(getattr(mc, "eos_token_ids", ()) or ())
        self.pool = PagePool(config.num_pages)
        self.scheduler = Scheduler(
            self.pool,
            page_size=config.page_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            watermark=config.watermark,
            enable_prefix_caching=config.enable_prefix_caching,
            reservation=reservation,
            layout=getattr(self.runner, "kv_groups", None),
        )
        self.requests = RequestRegistry(
            self.scheduler,
            vocab_size=mc.vocab_size,
            max_model_len=config.max_model_len,
            tokenizer=tokenizer,
            seed=config.seed,
            max_logprobs=config.max_logprobs,
        )
        self._buckets = config.buckets()
        self._aborted: list[RequestOutput] = []  # reported by the next step
        self._pipeline = AsyncPipeline(self) if config.async_scheduling else None
        self.metrics = EngineMetrics()

    @property
    def num_compilations(self) -> int:
        """Compilations of the step functions that this engine's calls triggered."""
        return self.runner.num_compilations

    # The model runner's state, for introspection (None with another runner).
    kv_cache = property(lambda self: getattr(self.runner, "kv_cache", None))
    mesh = property(lambda self: getattr(self.runner, "mesh", None))

    # Requests.

    def add_request(
        self,
        request_id: str | None,
        prompt: str | dict,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validates and queues a request; returns its id. Raises ValueError to reject it.

        Lower `priority` values run first and are preempted last. Requests with
        different `cache_salt` never share prefix-cache pages. An id may be used again
        once its request's final output was reported (an aborted one's: by `step`).
        """
        if any(o.request_id == request_id for o in self._aborted):
            raise ValueError(
                f"request_id={request_id!r} was aborted and its final output is not yet "
                "reported: reuse the id after the next step"
            )
        req = self.requests.create(
            request_id,
            prompt,
            params or SamplingParams(),
            priority=priority,
            arrival_time=arrival_time,
            cache_salt=cache_salt,
        )
        self.metrics.on_arrival(req.arrival_time)
        self.metrics.prompt_tokens += len(req.prompt_token_ids)
        for seq in req.seqs:
            self.scheduler.add(seq)
        return req.request_id

    def abort(self, request_id: str) -> None:
        """Ends a request now (finish reason "abort") and frees every page it holds; the
        next `step` reports it. An unknown or already finished id is a no-op, as in vLLM."""
        if self._end_request(str(request_id)) is None:
            logging.debug("paxkv: abort(%r): no unfinished request of that id", request_id)

    def _end_request(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """Aborts a request (with `error`: because something tied to it failed); the next
        `step` reports it. None if it is not unfinished."""
        req = self.requests.pop(request_id)
        if req is None:
            return None
        self.scheduler.abort(req.seqs)
        if self._pipeline is not None:
            self._pipeline.forget(req.seqs)
        try:
            out = req.output(self.tokenizer)
        except Exception:  # what failed may be the output itself: report the bare tokens
            out = req.bare_output()
        out.error = error
        self._aborted.append(out)
        self._on_finished(req)
        return out

    def _after_failed_step(self, error: BaseException) -> None:
        """Makes the engine usable after a step raised `error`. A sync step's host state
        is as before it, and it runs again, unless the device's KV cache was lost
        (donated to the call that raised; the runner makes an empty one): then every
        request with KV in it is aborted (the next `step` reports them with why), its
        pages go back to the pool, and the prefix cache is emptied. With async
        scheduling the in-flight step's tokens are lost too: the running requests are
        aborted either way. Waiting requests hold no KV and go on."""
        lost = self.runner.restore_cache()
        if not lost and self._pipeline is None:
            return
        what = "the KV cache" if lost else "the step in flight"
        message = f"{what} was lost: a step raised {type(error).__name__}"
        logging.error("paxkv: %s; aborting the running requests", message)
        for rid in dict.fromkeys(seq.request_id for seq in self.scheduler.running):
            self._end_request(rid, message)
        if self._pipeline is not None:
            self._pipeline.inflight = None  # its sequences are all aborted
        if lost:
            self.pool.clear_cache_keys()

    def end_failed(self) -> None:
        """Ends the requests of sequences whose host work failed (`Scheduler.fail`):
        finish reason "abort" and the error in their output; the others go on."""
        for seq, error in self.scheduler.take_failed():
            out = self._end_request(seq.request_id, error)
            if out is not None:
                logging.warning(
                    "paxkv: request %r failed and was aborted: %s", seq.request_id, error
                )

    def has_unfinished(self) -> bool:
        """Whether a request is queued, running, or ended but not yet reported by `step`."""
        return (
            self.scheduler.has_unfinished()
            or bool(self._aborted)
            or (self._pipeline is not None and self._pipeline.busy)
        )

    def run_until_done(self) -> dict[str, RequestOutput]:
        """Steps until every request has ended; returns each one's last output by id:
        the whole completion for CUMULATIVE and FINAL_ONLY requests, the last delta for
        DELTA ones (see `SamplingParams.output_kind`).

        The dict is in the order the requests ended (aborted ones included).
        """
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return final

    # Stepping.

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs of the requests it advanced or finished, as
        each request's `output_kind` asks (the whole completion so far, the new part
        only, or nothing until it finishes).

        Requests aborted since the last step are reported here too, finished with reason
        "abort".
        """
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        self.end_failed()
        plan = self.scheduler.prune(plan)
        t_sched = time.perf_counter()
        if not plan.chunks and (self._pipeline is None or not self._pipeline.busy):
            if self.scheduler.has_unfinished() and not self._aborted:
                raise RuntimeError("the scheduler made no progress with requests pending")
            aborted, self._aborted = self._aborted, []
            return aborted
        try:
            if self._pipeline is not None:
                outputs, t1, t2 = self._pipeline.step(plan)
            else:
                outputs, t1, t2 = self._step_sync(plan)
        except BaseException as e:  # KeyboardInterrupt too: the engine must stay usable
            self._after_failed_step(e)
            raise
        self.end_failed()
        self.metrics.account_step(t0, t_sched, t1, t2)
        self.metrics.maybe_log(self.stats, self.config.log_stats_interval_s)
        aborted, self._aborted = self._aborted, []
        return aborted + outputs

    def _step_sync(self, plan: SchedulerOutput) -> tuple[list[RequestOutput], float, float]:
        """Runs `plan` (N decode steps in one call when it can) and records its tokens."""
        limits = None
        reserved = self._reserve_ahead(plan)
        if reserved is not None:
            plan, limits = reserved
        planned = plan
        plan, hb = self.layout(plan)
        if not plan.chunks:  # every chunk's request failed
            t1 = time.perf_counter()
            return [], t1, t1
        if limits is not None and plan is not planned:
            kept = {id(c.seq) for c in plan.chunks}
            limits = [n for c, n in zip(planned.chunks, limits, strict=True) if id(c.seq) in kept]
        t1 = time.perf_counter()  # laid out; the device's time starts with the dispatch
        if limits is None:
            results = [(self.runner.fetch(self.runner.dispatch(hb)), None)]
        else:
            stops = [c.seq.stop_token_ids(self.eos_token_ids) for c in plan.chunks]
            sampled, valid = self.runner.decode_loop(hb, stops, limits)
            self.metrics.num_decode_loops += 1
            results = [
                (jax.tree.map(lambda a, i=i: a[i], sampled), valid[i]) for i in range(len(valid))
            ]
        t2 = time.perf_counter()
        for i, (sampled, valid) in enumerate(results):
            self._record(plan if i == 0 else _advanced(plan, i), sampled, valid)
        return self.report([c.seq.request_id for c in plan.chunks if c.samples]), t1, t2

    def report(self, request_ids) -> list[RequestOutput]:
        """The outputs of the requests `request_ids` now; finished ones are forgotten.
        Requests whose host work failed are ended first (`end_failed`)."""
        self.end_failed()
        outputs, finished = self.requests.report(request_ids)
        for req in finished:
            self._on_finished(req)
        return outputs

    def _record(self, plan: SchedulerOutput, samples: Sampled, valid) -> None:
        """Hands one iteration's samples (on the host) to the scheduler; `valid` masks a
        loop's."""
        tokens, logprobs = samples.tokens.tolist(), samples.logprobs.tolist()
        running = SeqStatus.RUNNING
        sampled, previous = [], []
        for i, c in enumerate(plan.chunks):
            seq = c.seq
            previous.append(seq.last_token_time)
            result = None
            if c.samples and (valid is None or valid[i]) and seq.status is running:
                if seq.track_top:  # the top-k too
                    try:
                        result = sample_result(samples, i, seq)
                    except Exception as e:  # isolated: only this sequence fails
                        self.scheduler.fail(seq, e)
                else:
                    result = (tokens[i], logprobs[i])
            sampled.append(result)
        was_running = [c.seq.status is running for c in plan.chunks] if valid is not None else None
        self.scheduler.update(plan, sampled, eos_token_ids=self.eos_token_ids)
        if was_running is not None:  # the loop and the host must agree on who ran
            for c, ran, got in zip(plan.chunks, was_running, sampled, strict=True):
                aborted = c.seq.finish_reason is FinishReason.ABORT  # failed or aborted
                if not aborted and ran != (got is not None):
                    raise RuntimeError(
                        f"multi-step decode disagrees with the host about {c.seq.seq_id}: "
                        f"running={ran}, token produced={got is not None}"
                    )
        self.metrics.on_tokens(
            [
                None if before is None else c.seq.last_token_time - before
                for c, before, got in zip(plan.chunks, previous, sampled, strict=True)
                if got is not None
            ]
        )

    def _reserve_ahead(self, plan: SchedulerOutput) -> tuple[SchedulerOutput, list[int]] | None:
        """A decode-only plan with pages for N steps reserved, and its token limits; None
        when the plan is not decode-only or the pages cannot be reserved."""
        n = self.config.num_decode_steps
        if n <= 1 or any(c.num_tokens != 1 or not c.samples for c in plan.chunks):
            return None
        eos = self.eos_token_ids
        if any(len(c.seq.stop_token_ids(eos)) > MAX_STOP_IDS for c in plan.chunks):
            return None
        return self.scheduler.reserve_ahead(plan, n)

    def layout(
        self, plan: SchedulerOutput, pending: dict[int, int] | None = None
    ) -> tuple[SchedulerOutput, HostBatch | None]:
        """The host batch of `plan`: `pending` maps `id(seq)` to the row of the in-flight
        step's output that holds the token seq samples there (async scheduling).

        A chunk whose layout fails fails its sequence (`Scheduler.fail`) and leaves the
        step: returns the plan without it, and None for the batch if no chunk is left.
        A fault may show only on a later call (state a failed attempt left behind), so the
        chunks left are laid out again until the batch builds, each round failing at least
        one more chunk or raising (a fault no chunk shows alone is the step's).
        """
        build = functools.partial(
            build_host_batch,
            page_size=self.config.page_size,
            buckets=self._buckets,
            rows=self.scheduler.kv_cache.rows,
            pending=pending,
            history_slack=self.config.num_decode_steps,
        )
        while True:
            try:
                return plan, build(plan)
            except Exception:
                # The chunks that fail on their own; if none does, the fault is the step's.
                bad = []
                for c in plan.chunks:
                    try:
                        build(SchedulerOutput((c,), ()))
                    except Exception as e:
                        bad.append(c)
                        self.scheduler.fail(c.seq, e)
                if not bad:
                    raise
                plan = self.scheduler.prune(plan)
                if not plan.chunks:
                    return plan, None

    def _on_finished(self, req: Request) -> None:
        for seq in req.seqs:
            self.metrics.on_finish(seq)

    # Introspection.

    def stats(self) -> dict[str, Any]:
        """The run's metrics so far (see `paxkv.metrics.engine_stats`)."""
        return engine_stats(
            self.metrics,
            self.scheduler,
            num_compilations=self.num_compilations,
            compile_time_s=self.runner.compile_seconds,
        )

    def warmup(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Compiles every bucket now, so no request waits for a compilation later.

        `progress(done, total)` is called after each shape (for a progress bar).
        Steps with penalties compile their history bucket when they first run.
        """
        shapes = self._buckets.shapes()
        logging.info("paxkv: compiling %d step shapes", len(shapes))
        self.runner.warmup(shapes, progress)


def _advanced(plan: SchedulerOutput, i: int) -> SchedulerOutput:
    """Iteration i of a decode-only plan run N steps at once: each chunk one token later."""
    chunks = tuple(c._replace(start=c.start + i, num_tokens=1, samples=True) for c in plan.chunks)
    return SchedulerOutput(chunks, ())
