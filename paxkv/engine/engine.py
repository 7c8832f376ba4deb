"""The engine: turns each scheduler decision into one jitted step of the model.

The host schedules (`paxkv.host.scheduler`), builds the step batch (tokens, positions,
page table, sampling parameters) as int32/float32 arrays padded to a small declared
set of bucket shapes, and calls one jitted function with the KV cache donated:

    step(graphdef, params, kv_cache, batch) -> (tokens i32[S], logprobs f32[S], kv_cache)

A long run therefore compiles each bucket once; `Engine.num_compilations` counts the
compilations, and a test asserts that it stays flat after warm-up.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx, struct

from paxkv.engine import decode_loop
from paxkv.engine.decode_loop import MAX_STOP_IDS, DecodeLimits
from paxkv.engine.sampling import SamplingBatch, sample
from paxkv.engine.state import PagedKVCache, PageTable
from paxkv.host.batch import Buckets, build_host_batch
from paxkv.host.page_pool import PagePool
from paxkv.host.scheduler import ScheduledChunk, Scheduler, SchedulerOutput, SeqStatus, Sequence
from paxkv.metrics import EngineMetrics, format_log_line
from paxkv.request import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    normalize_prompt,
)
from paxkv.sharding import shardings


@struct.dataclass
class StepBatch:
    """Everything one compiled step consumes, padded to its bucket shapes."""

    tokens: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    table: PageTable
    logits_indices: jax.Array  # i32[S]; the packed row of each sequence's last token
    sampling: SamplingBatch


def _geometric(lo: int, hi: int, growth: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= growth
    return (*out, hi)


PLACEHOLDER_TOKEN = -1  # async scheduling: a sampled token the host has not read yet
_TRACES = [0]  # traces of `_step` in this process: one per compiled bucket signature


def _step(
    graphdef,
    params,
    kv_cache: PagedKVCache,
    batch: StepBatch,
    token_src: jax.Array,  # i32[T]; >= 0: take the token from prev_tokens
    prev_tokens: jax.Array,  # i32[max_num_seqs]; the previous step's sampled tokens
    *,
    attention_backend: str,
):
    """One model step: write the batch's K/V, attend, sample a token per sequence.

    Returns tokens and logprobs padded to `max_num_seqs` rows (row i: the batch's
    sequence i), so the next step can read its input tokens from them on the device.
    """
    _TRACES[0] += 1  # runs at trace time only
    model = nnx.merge(graphdef, params)
    fed = prev_tokens[jnp.maximum(token_src, 0)]
    tokens_in = jnp.where(token_src >= 0, fed, batch.tokens)
    hidden, kv_cache = model(
        tokens_in, batch.positions, kv_cache, batch.table, attention_backend=attention_backend
    )
    logits = model.logits(hidden[batch.logits_indices])
    tokens, logprobs = sample(logits, batch.sampling)
    pad = prev_tokens.shape[0] - tokens.shape[0]
    tokens, logprobs = jnp.pad(tokens, (0, pad)), jnp.pad(logprobs, (0, pad))
    mesh = getattr(model, "mesh", None)
    if mesh is not None:  # replicated, like the next step's prev_tokens input
        tokens = jax.lax.with_sharding_constraint(tokens, shardings.replicated(mesh))
    return tokens, logprobs, kv_cache


# Module level, so engines serving the same model at the same shapes share compilations.
_STEP = jax.jit(_step, static_argnames=("attention_backend",), donate_argnames=("kv_cache",))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Serving limits and step shapes (see `buckets`)."""

    num_pages: int = 1024
    page_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    reservation: str = "paged"  # "max" / "guess": contiguous-style baselines (benchmarks)
    guess_tokens: int = 256
    log_stats_interval_s: float = 10.0  # a periodic absl log line; 0 turns it off
    # Decode steps per compiled call when every scheduled sequence is decoding
    # (`paxkv.engine.decode_loop`); 1 runs one step per call. None: 8 on an accelerator, where
    # it hides the host's time, and 1 on the CPU, where host and "device" share cores.
    num_decode_steps: int | None = None
    # Schedule and dispatch step k+1 before reading step k's tokens (`_step_async`).
    async_scheduling: bool = False
    token_buckets: tuple[int, ...] | None = None
    seq_buckets: tuple[int, ...] | None = None
    page_buckets: tuple[int, ...] | None = None
    bucket_growth: int = 4

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs}, so every running sequence can decode each step"
            )
        if self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be at least 2 (page 0 is reserved)")

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    def buckets(self) -> Buckets:
        """The step shapes: each list grows by `bucket_growth` and ends at its limit.

        `seq_buckets=None` ties the sequence count to the token bucket.
        """
        g = self.bucket_growth
        tokens = self.token_buckets or _geometric(
            min(16, self.max_num_batched_tokens), self.max_num_batched_tokens, g
        )
        pages = self.page_buckets or _geometric(min(8, self.pages_per_seq), self.pages_per_seq, g)
        return Buckets(
            tuple(tokens), tuple(self.seq_buckets or ()), tuple(pages), self.max_num_seqs
        )


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float


class Engine:
    """A serving engine for JAX pipelines that drive their own loop.

    `add_request` submits (and validates) a request, `step` runs one scheduled step and
    returns the requests it advanced, `abort` ends a request at any time, and
    `has_unfinished` tells when to stop. Every submitted request ends finished or
    aborted; one that can never be served is rejected by `add_request` with a
    ValueError, and nothing else is affected.

    Args:
      model: an NNX causal LM with a `config` (num_layers, num_kv_heads, head_dim,
        vocab_size, dtype, eos_token_ids), `__call__(tokens, positions, kv_cache, table,
        attention_backend=)` and `logits(hidden)`, like `paxkv.models.LlamaForCausalLM`.
      config: serving limits (`EngineConfig`).
      tokenizer: optional, with `encode(str) -> list[int]` and `decode(list[int]) -> str`.
      mesh: a `jax.sharding.Mesh` of one replica (see `paxkv.sharding`) to serve on;
        None: `paxkv.sharding.shardings.default_mesh()`, which is None (one device) unless set.
    """

    def __init__(
        self,
        model: nnx.Module,
        config: EngineConfig = EngineConfig(),
        *,
        tokenizer: Any = None,
        mesh: Any = None,
    ) -> None:
        self.config = config
        self.model_config = model.config
        self.tokenizer = tokenizer
        mc = model.config
        self.eos_token_ids = tuple(getattr(mc, "eos_token_ids", ()) or ())
        self._graphdef, self._params = nnx.split(model)
        dtype = jnp.dtype(mc.dtype)
        self.kv_cache = PagedKVCache.create(
            num_layers=mc.num_layers,
            num_pages=config.num_pages,
            num_kv_heads=mc.num_kv_heads,
            page_size=config.page_size,
            head_dim=mc.head_dim,
            dtype=jnp.float32 if dtype == jnp.float32 else dtype,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        self.mesh = mesh if mesh is not None else shardings.default_mesh()
        if self.mesh is not None:  # weights and pages spread over the mesh's devices
            self._graphdef, self._params, self.kv_cache = shardings.shard_engine_state(
                self._graphdef, self._params, self.kv_cache, self.mesh
            )
        self.pool = PagePool(config.num_pages)
        self.scheduler = Scheduler(
            self.pool,
            page_size=config.page_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            watermark=config.watermark,
            enable_prefix_caching=config.enable_prefix_caching,
            reservation=config.reservation,
            guess_tokens=config.guess_tokens,
        )
        self._buckets = config.buckets()
        if config.num_decode_steps is None:
            steps = 1 if jax.default_backend() == "cpu" else 8
            self.config = config = dataclasses.replace(config, num_decode_steps=steps)
        elif config.num_decode_steps < 1:
            raise ValueError(f"num_decode_steps={config.num_decode_steps} must be at least 1")
        if config.async_scheduling and config.num_decode_steps > 1:
            raise ValueError(
                f"async_scheduling runs one decode step per call: set num_decode_steps=1, "
                f"not {config.num_decode_steps}"
            )
        self._requests: dict[str, _Request] = {}
        self._aborted: list[RequestOutput] = []  # reported by the next step
        self._inflight = None  # async scheduling: (tokens, logprobs, [(seq, row, index)])
        self._last_token_seen: dict[int, float] = {}
        self._prev_tokens = jnp.zeros(config.max_num_seqs, jnp.int32)
        if self.mesh is not None:  # as the step returns it, so warm-up compiles the real signature
            self._prev_tokens = jax.device_put(self._prev_tokens, shardings.replicated(self.mesh))
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self.num_compilations = 0  # compilations this engine's steps triggered
        self.metrics = EngineMetrics()
        self._last_log = time.monotonic()

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
        different `cache_salt` never share prefix-cache pages.
        """
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        text, ids = self.validate(request_id, prompt, params or SamplingParams())
        params = params or SamplingParams()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        base_seed = params.seed if params.seed is not None else self._rng.randrange(2**31)
        seqs = [
            Sequence(
                seq_id=request_id if params.n == 1 else f"{request_id}/{i}",
                request_id=request_id,
                index=i,
                prompt_token_ids=list(ids),
                params=params,
                seed=(base_seed + i) % 2**31,
                arrival_time=arrival,
                priority=priority,
                cache_salt=cache_salt,
            )
            for i in range(params.n)
        ]
        self._requests[request_id] = _Request(request_id, text, ids, seqs, arrival)
        self.metrics.on_arrival(arrival)
        self.metrics.prompt_tokens += len(ids)
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def validate(
        self, request_id: str, prompt, params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """Returns `(text, token_ids)` of a servable request, or raises ValueError saying why not."""
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        text, ids = normalize_prompt(prompt)
        if ids is None:
            if self.tokenizer is None:
                raise ValueError(
                    "a string prompt needs a tokenizer, and this model has none: pass "
                    "{'prompt_token_ids': [...]} instead"
                )
            ids = list(self.tokenizer.encode(text))
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab]
        if bad:
            i, t = bad[0]
            raise ValueError(
                f"request {request_id!r}: token id {t} at position {i} is outside the vocabulary [0, {vocab})"
            )
        if len(ids) > self.config.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(ids)} tokens is longer than max_model_len={self.config.max_model_len}"
            )
        try:
            self.scheduler.check_fits(len(ids), params)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        return text, ids

    def abort(self, request_id: str) -> None:
        """Ends a request now (finish reason "abort") and frees every page it holds."""
        req = self._requests.pop(str(request_id), None)
        if req is None:
            raise KeyError(f"no unfinished request with request_id={request_id!r}")
        self.scheduler.abort(req.seqs)
        self._aborted.append(self._output(req))
        self._on_finished(req)

    def has_unfinished(self) -> bool:
        """Whether a request is queued, running, or ended but not yet reported by `step`."""
        return self.scheduler.has_unfinished() or bool(self._aborted) or self._inflight is not None

    def run_until_done(self) -> dict[str, RequestOutput]:
        """Steps until every request has ended; returns each one's final output by id.

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
        """Runs one step; returns the outputs of the requests it advanced or finished.

        Requests aborted since the last step are reported here too, finished with reason
        "abort".
        """
        if self.config.async_scheduling:
            return self._step_async()
        t0 = time.perf_counter()
        aborted, self._aborted = self._aborted, []
        plan = self.scheduler.schedule()
        t_sched = time.perf_counter()
        if not plan.chunks:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler made no progress with requests pending")
            return aborted
        limits = self._multi_step_limits(plan)
        batch, token_src = self._build_batch(plan, all_pages=limits is not None)
        t1 = time.perf_counter()
        if limits is None:
            tokens, logprobs = self._run_step(batch, token_src)
            results = [(np.asarray(tokens), np.asarray(logprobs), None)]
        else:
            tokens, logprobs, valid = self._run_decode_loop(batch, plan, limits)
            results = [(tokens[i], logprobs[i], valid[i]) for i in range(len(tokens))]
        t2 = time.perf_counter()
        for i, (tokens, logprobs, valid) in enumerate(results):
            chunks = (
                plan.chunks
                if i == 0
                else tuple(ScheduledChunk(c.seq, c.start + i, 1, True) for c in plan.chunks)
            )
            self._record(SchedulerOutput(chunks, ()), tokens, logprobs, valid)
        touched = dict.fromkeys(c.seq.request_id for c in plan.chunks if c.samples)
        outputs = [self._output(self._requests[r]) for r in touched if r in self._requests]
        for out in outputs:
            if out.finished:
                self._on_finished(self._requests.pop(out.request_id))
        m = self.metrics
        m.num_steps += 1
        m.schedule_time_s += t_sched - t0
        m.host_time_s += (t1 - t0) + (time.perf_counter() - t2)
        m.device_time_s += t2 - t1
        self._maybe_log()
        return aborted + outputs

    def _step_async(self) -> list[RequestOutput]:
        """One step with the host one step ahead of the device.

        Step k+1 is scheduled and dispatched before step k's tokens are read: each
        sequence step k samples for holds a placeholder token, and step k+1 reads the
        real token from step k's output on the device. Then the host waits for step k,
        puts its tokens in place of the placeholders (finishing sequences that sampled a
        stop token, whose step k+1 work is discarded), and records step k+1's plan. A
        page freed meanwhile is only reused by steps dispatched later, which the device
        runs in order.
        """
        t0 = time.perf_counter()
        aborted, self._aborted = self._aborted, []
        plan = self.scheduler.schedule()
        t_sched = time.perf_counter()
        launched = None
        if plan.chunks:
            pending = (
                {id(seq): row for seq, row, _ in self._inflight[2]} if self._inflight else None
            )
            batch, token_src = self._build_batch(plan, pending=pending)
            tokens, logprobs = self._run_step(batch, token_src)
            launched = (tokens, logprobs)
        elif self._inflight is None:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler made no progress with requests pending")
            return aborted
        t1 = time.perf_counter()
        outputs = self._resolve(self._inflight) if self._inflight else []
        t2 = time.perf_counter()
        self._inflight = None
        if launched is not None:
            # Placeholders for the tokens step k+1 samples: lengths advance now (so
            # max_tokens finishes are known), values arrive with the next call.
            sampled = [(PLACEHOLDER_TOKEN, 0.0) if c.samples else None for c in plan.chunks]
            counts = [len(c.seq.output_token_ids) for c in plan.chunks]
            self.scheduler.update(plan, sampled, eos_token_ids=())
            entries = [
                (c.seq, i, counts[i])
                for i, c in enumerate(plan.chunks)
                if c.samples and len(c.seq.output_token_ids) > counts[i]
            ]
            self._inflight = (*launched, entries)
        m = self.metrics
        m.num_steps += 1
        m.schedule_time_s += t_sched - t0
        m.host_time_s += (t1 - t0) + (time.perf_counter() - t2)
        m.device_time_s += t2 - t1  # waiting for step k while step k+1 is queued
        self._maybe_log()
        return aborted + outputs

    def _resolve(self, inflight) -> list[RequestOutput]:
        """Waits for an in-flight step and puts its sampled tokens in place."""
        tokens, logprobs, entries = inflight
        tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
        now = time.monotonic()
        touched = {}
        for seq, row, index in entries:
            if index >= len(seq.output_token_ids):
                continue  # dropped: the sequence stopped at an earlier token
            before = self._last_token_seen.get(id(seq))
            self.scheduler.resolve(
                seq, index, int(tokens[row]), float(logprobs[row]), self.eos_token_ids, now
            )
            self.metrics.on_token(None if before is None else now - before)
            self._last_token_seen[id(seq)] = now
            touched[seq.request_id] = None
        outputs = [self._output(self._requests[r]) for r in touched if r in self._requests]
        for out in outputs:
            if out.finished:
                req = self._requests.pop(out.request_id)
                for seq in req.seqs:
                    self._last_token_seen.pop(id(seq), None)
                self._on_finished(req)
        return outputs

    def _record(self, plan: SchedulerOutput, tokens, logprobs, valid) -> None:
        """Hands one iteration's sampled tokens to the scheduler; `valid` masks a loop's."""
        sampled = [
            (tokens[i], logprobs[i]) if c.samples and (valid is None or valid[i]) else None
            for i, c in enumerate(plan.chunks)
        ]
        previous = [c.seq.last_token_time for c in plan.chunks]
        running = [c.seq.status is SeqStatus.RUNNING for c in plan.chunks]
        self.scheduler.update(plan, sampled, eos_token_ids=self.eos_token_ids)
        for chunk, before, was_running, got in zip(
            plan.chunks, previous, running, sampled, strict=True
        ):
            if valid is not None and was_running != (got is not None):
                raise RuntimeError(
                    f"multi-step decode disagrees with the host about {chunk.seq.seq_id}: "
                    f"running={was_running}, token produced={got is not None}"
                )
            if got is not None:
                self.metrics.on_token(
                    None if before is None else chunk.seq.last_token_time - before
                )

    def _multi_step_limits(self, plan: SchedulerOutput) -> list[int] | None:
        """Token limits of a decode-only plan whose pages for N steps could be reserved."""
        n = self.config.num_decode_steps
        if n <= 1 or any(c.num_tokens != 1 or not c.samples for c in plan.chunks):
            return None
        if any(len(self._stop_ids(c.seq)) > MAX_STOP_IDS for c in plan.chunks):
            return None
        return self.scheduler.reserve_ahead(plan, n)

    def _stop_ids(self, seq: Sequence) -> tuple[int, ...]:
        eos = () if seq.params.ignore_eos else self.eos_token_ids
        return tuple(dict.fromkeys((*seq.params.stop_token_ids, *eos)))

    def _run_decode_loop(self, batch: StepBatch, plan: SchedulerOutput, limits: list[int]):
        size = batch.logits_indices.shape[0]
        stops = DecodeLimits.from_host([self._stop_ids(c.seq) for c in plan.chunks], limits, size)
        traces = decode_loop.TRACES[0]
        tokens, logprobs, valid, self.kv_cache = decode_loop.DECODE_LOOP(
            self._graphdef,
            self._params,
            self.kv_cache,
            batch,
            stops,
            attention_backend=self.config.attention_backend,
            num_steps=self.config.num_decode_steps,
        )
        self.num_compilations += decode_loop.TRACES[0] - traces
        self.metrics.num_decode_loops += bool(plan.chunks)
        return np.asarray(tokens), np.asarray(logprobs), np.asarray(valid)

    def _on_finished(self, req: _Request) -> None:
        for seq in req.seqs:
            self.metrics.on_finish(
                seq.finish_reason.value,
                queue=None
                if seq.first_scheduled_time is None
                else seq.first_scheduled_time - seq.arrival_time,
                ttft=None
                if seq.first_token_time is None
                else seq.first_token_time - seq.arrival_time,
                e2e=seq.finished_time - seq.arrival_time,
                first_token=seq.first_token_time,
                last_token=seq.last_token_time,
                num_tokens=len(seq.output_token_ids),
            )

    def _maybe_log(self) -> None:
        interval = self.config.log_stats_interval_s
        now = time.monotonic()
        if interval > 0 and now - self._last_log >= interval:
            self._last_log = now
            logging.info(format_log_line(self.stats()))

    def _run_step(self, batch: StepBatch, token_src: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Dispatches one step (without waiting for it); remembers its sampled tokens."""
        traces = _TRACES[0]
        tokens, logprobs, self.kv_cache = _STEP(
            self._graphdef,
            self._params,
            self.kv_cache,
            batch,
            token_src,
            self._prev_tokens,
            attention_backend=self.config.attention_backend,
        )
        self.num_compilations += _TRACES[0] - traces
        self._prev_tokens = tokens
        return tokens, logprobs

    def _build_batch(
        self, plan: SchedulerOutput, *, all_pages: bool = False, pending: dict | None = None
    ) -> tuple[StepBatch, jax.Array]:
        """The device batch of `plan` and its token feed (`pending`: see `_step_async`)."""
        hb = build_host_batch(
            plan, page_size=self.config.page_size, buckets=self._buckets, all_pages=all_pages
        )
        if pending:
            row = 0
            for c in plan.chunks:
                last = c.seq.num_tokens - 1  # the token the in-flight step is sampling
                if id(c.seq) in pending and c.start <= last < c.start + c.num_tokens:
                    hb.token_src[row + last - c.start] = pending[id(c.seq)]
                row += c.num_tokens
        names = [f.name for f in dataclasses.fields(hb)]
        a = dict(
            zip(names, jax.device_put([getattr(hb, n) for n in names]), strict=True)
        )  # one transfer
        table = PageTable(
            block_tables=a["block_tables"],
            kv_lens=a["kv_lens"],
            cu_q_lens=a["cu_q_lens"],
            num_seqs=a["num_seqs"],
            page_size=self.config.page_size,
        )
        sampling = SamplingBatch(floats=a["sampling_floats"], ints=a["sampling_ints"])
        batch = StepBatch(a["tokens"], a["positions"], table, a["logits_indices"], sampling)
        return batch, a["token_src"]

    def _output(self, req: _Request) -> RequestOutput:
        completions = []
        for seq in req.seqs:
            text = None
            if self.tokenizer is not None:
                text = self.tokenizer.decode(seq.output_token_ids)
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    token_ids=list(seq.output_token_ids),
                    text=text,
                    logprobs=list(seq.logprobs) if seq.params.logprobs else None,
                    finish_reason=None if seq.finish_reason is None else seq.finish_reason.value,
                )
            )
        first = req.seqs[0]
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
            last_token_time=first.last_token_time,
            finished_time=first.finished_time,
            num_preemptions=sum(s.num_preemptions for s in req.seqs),
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=completions,
            finished=all(s.finish_reason is not None for s in req.seqs),
            num_cached_tokens=req.seqs[0].num_cached_tokens,
            metrics=metrics,
        )

    # Introspection.

    def stats(self) -> dict[str, Any]:
        """The run's metrics so far, with vLLM-compatible names where one exists.

        Counters (tokens, preemptions, prefix-cache queries and hits in tokens,
        compilations), gauges (running and waiting requests, KV usage in pages and in
        token slots), latency summaries (p50/p90/p99/mean of queue time, TTFT, TPOT,
        inter-token latency, end-to-end latency), throughput, and the host's scheduling
        and batch-building time against the device step time.
        """
        m, sch = self.metrics, self.scheduler
        kv = sch.kv_usage()
        running = len(sch.running)
        host, device = m.host_time_s, m.device_time_s
        return {
            "num_requests_running": running,
            "num_requests_waiting": len(sch.waiting),
            "peak_num_requests_running": sch.peak_running,
            "kv_cache_usage_perc": kv["page_usage"],
            "kv_pages_in_use": kv["pages_in_use"],
            "kv_pages_total": kv["pages_total"],
            "kv_token_slots_used": kv["token_slots_used"],
            "kv_token_slots_reserved": kv["token_slots_reserved"],
            "kv_token_utilization": kv["kv_utilization"],
            "kv_wasted_slots_per_seq": kv["wasted_slots"] / running if running else 0.0,
            "prefix_cache_queries": sch.prefix_queries,
            "prefix_cache_hits": sch.prefix_hits,
            "prefix_cache_hit_rate": sch.prefix_hits / sch.prefix_queries
            if sch.prefix_queries
            else 0.0,
            "prefix_cache_short_prefix_misses": sch.short_prefix_misses,
            "num_preemptions": sch.num_preemptions,
            "num_recomputed_tokens": sch.num_recomputed_tokens,
            "prompt_tokens": m.prompt_tokens,
            "generation_tokens": m.generation_tokens,
            "requests_finished": dict(m.finished),
            **{name: summary.summary() for name, summary in m.latency.items()},
            **m.throughput(),
            "num_steps": m.num_steps,
            "num_decode_loops": m.num_decode_loops,
            "num_compilations": self.num_compilations,
            "schedule_time_per_step_s": m.schedule_time_s / m.num_steps if m.num_steps else 0.0,
            "host_time_s": host,
            "device_time_s": device,
            "host_overhead_fraction": host / (host + device) if host + device else 0.0,
        }

    def warmup(self) -> None:
        """Compiles every bucket now, so no request waits for a compilation later."""
        shapes = self._buckets.shapes()
        logging.info("paxkv: compiling %d step shapes", len(shapes))
        for t, s, p in shapes:
            table = PageTable(
                block_tables=jnp.zeros((s, p), jnp.int32),
                kv_lens=jnp.zeros(s, jnp.int32),
                cu_q_lens=jnp.zeros(s + 1, jnp.int32),
                num_seqs=jnp.zeros(1, jnp.int32),
                page_size=self.config.page_size,
            )
            batch = StepBatch(
                tokens=jnp.zeros(t, jnp.int32),
                positions=jnp.zeros(t, jnp.int32),
                table=table,
                logits_indices=jnp.zeros(s, jnp.int32),
                sampling=SamplingBatch.from_host([], s),
            )
            self._run_step(batch, jnp.full(t, -1, jnp.int32))
            if self.config.num_decode_steps > 1:
                plan = SchedulerOutput((), ())
                self._run_decode_loop(batch, plan, [])
