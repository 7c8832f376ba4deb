"""The engine: turns each scheduler decision into one jitted step of the model.

The host schedules (`paxkv.host.scheduler`), lays out the step batch (tokens,
positions, page table, sampling parameters) as int32/float32 arrays padded to a small
declared set of bucket shapes (`paxkv.host.batch`), and calls one jitted function with
the KV cache donated (`paxkv.engine.device.step`). A long run therefore compiles each bucket
once; `Engine.num_compilations` counts what this engine compiled, and a test asserts
that it stays flat after warm-up.

Threads: an engine may be called from several threads. Every call that changes it
(`add_request`, `add_score_request`, `abort`, `step`, `update_weights`'s install, and
`stats`, which reads it whole) holds `Engine.lock`, a re-entrant lock, so one caller
changes it at a time; hold the lock to make several calls one. `update_weights`
prepares the new parameters before taking it, and then handles the requests in flight
as its policy says on the calling thread, stepping the engine itself for "wait": the
outputs of those steps are reported by the next `step`, whoever calls it. `pause` and
`resume` take no lock: a loop that steps a paused engine waits in `wait_resumed`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from absl import logging
from flax import nnx

from paxkv.engine import compile_cache, sleep
from paxkv.engine.batch_builder import BatchBuilder
from paxkv.engine.config import EngineConfig
from paxkv.engine.endings import Endings
from paxkv.engine.host_tier import HostCopyError, HostTierCopies, host_slots, warm_copies
from paxkv.engine.lora import LoRAAdapters
from paxkv.engine.metrics import EngineMetrics, engine_stats
from paxkv.engine.outputs import StepOutputs
from paxkv.engine.requests import Request, RequestRegistry
from paxkv.engine.routed_experts import RoutedExperts
from paxkv.engine.runner import ModelRunner, StepRunner
from paxkv.engine.stepper import Stepper
from paxkv.engine.weights_update import WeightUpdater
from paxkv.host.batch import mask_words
from paxkv.host.constrained import ConstrainedSequences
from paxkv.host.host_tier import HostKVTier
from paxkv.host.lora_slots import LoRARequest
from paxkv.host.page_pool import PagePool
from paxkv.host.request import RequestOutput, SamplingParams
from paxkv.host.reservation import PagedReservation
from paxkv.host.scheduler import Scheduler
from paxkv.host.speculative import SpeculativeConfig, Speculator
from paxkv.sharding import shardings
from paxkv.text.grammar import GrammarCompiler


def _locked(method: Callable) -> Callable:
    """`method` run holding the engine's lock (one caller changes it at a time)."""

    @functools.wraps(method)
    def locked(self: Engine, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return locked


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
        e.g. `runner=lambda config: FakeRunner(32000, config)` (`paxkv.engine.fake_runner`) runs the whole host path
        without a model or a device.
      draft_model: the draft model when `config.speculative_config` has method
        "draft_model": an NNX causal LM like `model`, with its vocabulary
        (`paxkv.engine.device.draft`).
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
        draft_model: nnx.Module | None = None,
    ) -> None:
        compile_cache.enable()  # the default unless the process chose (`LLM(cache_dir=)`)
        platform = jax.default_backend()
        self.config = config = (config or EngineConfig()).for_backend(platform)
        spec = config.speculative_config
        if runner is None:
            _check_draft(spec, draft_model)
        if runner is not None:
            self.runner = runner(config)
        else:
            mesh = mesh if mesh is not None else shardings.default_mesh()
            self.runner = ModelRunner(model, config, mesh, draft_model)
        mc = self.model_config = self.runner.model_config
        config.check_serves(mc, platform)
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(getattr(mc, "eos_token_ids", ()) or ())
        self.pool = PagePool(config.num_pages)
        host_tier = _host_tier(config, self.runner)
        self._buckets = config.buckets()
        self.speculator = (
            Speculator(spec, self._buckets.tokens, optimistic=config.async_scheduling)
            if spec is not None
            else None
        )
        self.scheduler = _scheduler(
            config, self.pool, reservation, self.runner, self.speculator, host_tier
        )
        # The LoRA adapters served (None: enable_lora is off), written to their device
        # slots before each step.
        self.loras = (
            LoRAAdapters(self.runner, self.scheduler.lora_slots, self._lora_keys_in_use)
            if config.enable_lora
            else None
        )
        if self.loras is not None:
            self.scheduler.admission.lora_current = self.loras.current_key
        # The copies of the host KV tier, made before each step (None: no tier).
        self.host_copies = (
            HostTierCopies(self.scheduler.kv_cache_manager, self.runner) if host_tier else None
        )
        self.requests = RequestRegistry(
            self.scheduler,
            vocab_size=mc.vocab_size,
            max_model_len=config.max_model_len,
            tokenizer=tokenizer,
            seed=config.seed,
            max_logprobs=config.max_logprobs,
            max_n=config.max_n,
        )
        self.batch_builder = BatchBuilder(
            self.scheduler,
            page_size=config.page_size,
            buckets=self._buckets,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            eos_token_ids=self.eos_token_ids,
            mask_words=mask_words(mc.vocab_size),
        )
        self.metrics = EngineMetrics()
        self.routed_experts = RoutedExperts(self.runner, speculative=spec is not None)
        self.endings = Endings(self.requests, self.scheduler, self.metrics, tokenizer)
        self._stepper = Stepper(
            *(self.runner, self.scheduler, self.batch_builder),
            endings=self.endings,
            metrics=self.metrics,
            eos_token_ids=self.eos_token_ids,
            depth=1 if config.async_scheduling else 0,
            num_decode_steps=config.num_decode_steps,
            routed_experts=self.routed_experts,
            constrained=ConstrainedSequences(),
            fill_masks=lambda matchers, out, drafts=None: self.grammars.fill(matchers, out, drafts),
            consume=lambda pairs: self.grammars.consume(pairs),
            before_launch=_before_launch(self.host_copies, self.loras),
        )
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        if spec is not None and spec.method == "ngram" and not config.async_scheduling:
            # Constrained sequences keep the n-gram proposals their constraint allows
            # (their matchers are up to date when a synchronous step is planned).
            self.scheduler.allowed_prefix = self._stepper.constrained.allowed_prefix
        self._paused = False  # `pause`: `step` then does nothing
        self._asleep: sleep.Asleep | None = None  # `sleep`: the same, its memory freed
        self._resumed = threading.Condition()  # `wait_resumed` waits on it
        # Held by every call that changes the engine (module docstring, "Threads").
        self.lock = threading.RLock()
        self._weights = WeightUpdater(
            self.runner,
            self.scheduler,
            self.requests,
            self._stepper,
            end_request=self.endings.end,
            step=self.step,
            has_unfinished=self.has_unfinished,
            defer=self.endings.defer,
        )

    @property
    def num_compilations(self) -> int:
        """Compilations of the step programs that this engine's calls triggered (those
        loaded from the persistent compilation cache included: `num_cache_loads`)."""
        return self.runner.num_compilations

    @property
    def num_cache_loads(self) -> int:
        """Step programs this engine loaded from the persistent compilation cache."""
        return self.runner.num_cache_loads

    # The model runner's state, for introspection (None with another runner).
    kv_cache = property(lambda self: getattr(self.runner, "kv_cache", None))
    mesh = property(lambda self: getattr(self.runner, "mesh", None))

    # Weights.

    @property
    def weight_version(self) -> int:
        """How many times `update_weights` has installed new weights (0: the model's)."""
        return self._weights.version

    @property
    def paused(self) -> bool:
        """Whether `step` runs nothing: paused (`pause`) or asleep (`sleep`)."""
        return self._paused or self._asleep is not None

    @property
    def asleep(self) -> int:
        """The level of the `sleep` the engine is in; 0 when awake."""
        return 0 if self._asleep is None else self._asleep.level

    def pause(self) -> None:
        """Stops scheduling between steps: `step` returns [] and runs nothing until
        `resume`. Requests can still be added and aborted, and weights updated. A loop
        that steps the engine waits in `wait_resumed`, not spinning."""
        with self._resumed:
            self._paused = True

    def resume(self) -> None:
        """Restarts the scheduling `pause` stopped, waking those in `wait_resumed`."""
        with self._resumed:
            self._paused = False
            self._resumed.notify_all()

    @_locked
    def sleep(
        self, level: int = 1, *, weights: str = "host", requests: str = "wait"
    ) -> dict[str, float]:
        """Frees the engine's device memory until `wake_up` (`paxkv.engine.sleep`):
        level 1 the KV pool (the prefix cache forgotten), level 2 the parameters too,
        copied to host memory (`weights="host"`) or dropped (`"drop"`: `update_weights`
        before waking). Running sequences are preempted (they recompute after waking);
        requests submitted while asleep wait for the wake-up, or with
        `requests="refuse"` are refused. Returns {"released_bytes", "seconds"}.
        ValueError, changing nothing, for a bad argument or an engine already asleep."""
        sleep.check(level, weights, requests)
        if self._asleep is not None:
            raise ValueError(f"the engine is asleep already (level {self.asleep}): wake_up() first")
        timer = sleep.Timer()
        self.endings.defer(self._stepper.drain())  # the step in flight, reported next step
        self.scheduler.preempt_all()
        kv = self.scheduler.kv_cache_manager
        if self.host_copies is not None:  # the cached pages go to the host tier first
            kv.save_cached()
        kv.prefix_cache.forget_all()
        if self.host_copies is not None:  # saved (and the pages evicted before) as the cache goes
            try:
                self.host_copies.flush()
                self.host_copies.land()
            except HostCopyError as e:  # the prefix cache is forgotten anyway
                logging.warning("paxkv: %s; the host KV tier drops those pages", e)
                self.host_copies.take_failed()
                self.host_copies.drop()
        freed, host = self.runner.release(weights if level == 2 else None)
        self._asleep = sleep.Asleep(
            level, weights if level == 2 else None, requests, host, released_bytes=freed
        )
        logging.info("paxkv: asleep (level %d): %.1f MiB released", level, freed / 2**20)
        return {"released_bytes": freed, "seconds": timer.seconds()}

    @_locked
    def wake_up(self) -> dict[str, float]:
        """Places back what `sleep` freed, in the same shardings (nothing recompiles),
        and resumes stepping; returns {"restored_bytes", "seconds"}. ValueError, the
        engine staying asleep, when `sleep(level=2, weights="drop")` dropped weights no
        `update_weights` replaced; a no-op when awake."""
        if self._asleep is None:
            return {"restored_bytes": 0, "seconds": 0.0}
        timer = sleep.Timer()
        placed = self.runner.restore(self._asleep.host_params)
        with self._resumed:
            self._asleep = None
            self._resumed.notify_all()
        logging.info("paxkv: awake: %.1f MiB placed", placed / 2**20)
        return {"restored_bytes": placed, "seconds": timer.seconds()}

    def wait_resumed(self, timeout: float | None = None) -> bool:
        """Blocks, without using the CPU, while the engine is paused, until `resume` or
        `timeout` seconds (None: no limit); returns whether it is running."""
        with self._resumed:
            return self._resumed.wait_for(lambda: not self.paused, timeout)

    def update_weights(self, weights: Any, *, policy: str = "wait", copy: bool = True) -> int:
        """Replaces the model's parameters in place, without a recompilation; returns the
        new `weight_version`.

        `weights` is the model's parameter tree (`nnx.state(model, nnx.Param)`, or the
        same nesting of jax or NumPy arrays) in the caller's model's layout; every leaf
        keeps its shape, dtype and sharding. A missing, extra or mismatched leaf, or NaN
        or inf, raises ValueError naming it, and the engine keeps its weights. `policy`
        ("wait", "abort", "recompute") decides the requests in flight, and the prefix
        cache forgets older weights' pages: see `paxkv.engine.weights_update`.
        """
        new = self._weights.prepare(weights, policy=policy, copy=copy)  # no lock: the slow part
        with self.lock:
            return self._weights.install(new, policy, paused=self.paused)

    # Requests.

    @_locked
    def add_request(
        self,
        request_id: str | None,
        prompt: str | dict,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | str | None = None,
    ) -> str:
        """Validates and queues a request; returns its id. Raises ValueError to reject it.

        Lower `priority` values run first and are preempted last. Requests with
        different `cache_salt` never share prefix-cache pages. `lora_request`: the LoRA
        adapter it runs under (a `LoRARequest`, loaded at first use, or the name of one
        loaded; `enable_lora`). An id may be used again once its request's final output
        was reported (an aborted one's: by `step`).
        """
        self.check_accepting()
        lora_key = None
        if lora_request is not None:
            if self.loras is None:
                raise ValueError(
                    f"lora_request={lora_request!r}: this engine serves no LoRA adapters "
                    "(enable_lora=False)"
                )
            lora_key = self.loras.key_for(lora_request)
            lora_request = self.loras.request_of(lora_key[0])
        if self.endings.is_pending(request_id):
            raise ValueError(
                f"request_id={request_id!r} was aborted and its final output is not yet "
                "reported: reuse the id after the next step"
            )
        params = params or SamplingParams()
        spec = getattr(params, "structured_outputs", None)  # a bad `params` is named below
        grammar = None if spec is None else self.grammars.compile(spec)
        # One matcher per completion, made before the request is: nothing to undo.
        matchers = (
            [] if grammar is None else [self.grammars.matcher(grammar) for _ in range(params.n)]
        )
        req = self.requests.create(
            request_id,
            prompt,
            params,
            priority=priority,
            arrival_time=arrival_time,
            cache_salt=self.routed_experts.cache_salt(request_id, params, cache_salt),
            lora_key=lora_key,
            lora_request=lora_request,
        )
        for seq, matcher in zip(req.seqs, matchers, strict=False):
            self._stepper.constrained.add(seq, matcher)
        return self._queue(self.routed_experts.add(req))

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured outputs against the engine's tokenizer (made at first use)."""
        with self._grammars_lock:  # the server builds it on a thread of its own too
            if self._grammars is None or self._grammars.tokenizer is not self.tokenizer:
                self._grammars = GrammarCompiler(
                    self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
                )
            return self._grammars

    def check_accepting(self) -> None:
        """Raises `EngineAsleep` while the engine sleeps refusing requests
        (`sleep(requests="refuse")`); nothing otherwise."""
        if self._asleep is not None and self._asleep.requests == "refuse":
            raise sleep.EngineAsleep(
                f"the engine is asleep (sleep(level={self.asleep}, requests='refuse')): "
                "requests are refused until wake_up()"
            )

    def _queue(self, req: Request) -> str:
        self.metrics.on_arrival(req.arrival_time)
        self.metrics.prompt_tokens += len(req.prompt_token_ids)
        for seq in req.seqs:
            self.scheduler.add(seq)
        return req.request_id

    @_locked
    def add_score_request(
        self,
        request_id: str | None,
        prompt_token_ids: Sequence[int],
        completion_token_ids: Sequence[int],
        *,
        top_logprobs: int = 0,
        priority: int = 0,
    ) -> str:
        """Queues the teacher-forced scoring of a completion after a prompt; returns its
        id. Its output (nothing generated, finish reason "length") has `scores`, each
        completion token's logprob (f32[len(completion)]); the prompt part may come from
        the prefix cache. ValueError rejects it (`RequestRegistry.create_score`)."""
        self.check_accepting()
        ids = (prompt_token_ids, completion_token_ids)
        req = self.requests.create_score(
            request_id, *ids, top_logprobs=top_logprobs, priority=priority
        )
        return self._queue(req)

    @_locked
    def abort(self, request_id: str) -> None:
        """Ends a request now (finish reason "abort") and frees every page it holds; the
        next `step` reports it. An unknown or already finished id is a no-op, as in vLLM."""
        if self.endings.end(str(request_id)) is None:
            logging.debug("paxkv: abort(%r): no unfinished request of that id", request_id)

    def has_unfinished(self) -> bool:
        """Whether a request is queued, running, or ended but not yet reported by `step`."""
        return self.scheduler.has_unfinished() or self.endings.pending or self._stepper.busy

    def run_until_done(self) -> dict[str, RequestOutput]:
        """Steps until every request has ended; returns each one's last output by id:
        the whole completion for CUMULATIVE and FINAL_ONLY requests, the last delta for
        DELTA ones (see `SamplingParams.output_kind`).

        The dict is in the order the requests ended (aborted ones included).
        """
        if self.paused and self.has_unfinished():
            raise RuntimeError(
                f"the engine is {'asleep' if self.asleep else 'paused'}: "
                f"{'wake_up' if self.asleep else 'resume'}() it before running it"
            )
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return final

    # Stepping.

    @_locked
    def step(self) -> StepOutputs:
        """Runs one step; returns the outputs of the requests it advanced or finished, as
        each request's `output_kind` asks (the whole completion so far, the new part
        only, or nothing until it finishes): `RequestOutput`s built when first read
        (`paxkv.engine.outputs.StepOutputs`).

        Requests aborted since the last step are reported here too, finished with reason
        "abort". While paused (`pause`), returns [] and does nothing.
        """
        if self.paused:
            return StepOutputs([])
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        self.endings.end_failed()
        plan = self.scheduler.prune(plan)
        t_sched = time.perf_counter()
        if not plan.num_chunks and not self._stepper.busy:
            if self.scheduler.has_unfinished() and not self.endings.pending:
                raise RuntimeError("the scheduler made no progress with requests pending")
            return self.routed_experts.attach(StepOutputs(self.endings.take()))
        try:
            outputs, t1, t2 = self._stepper.step(plan)
        except BaseException as e:  # KeyboardInterrupt too: the engine must stay usable
            in_flight_lost = self._stepper.depth > 0
            self._stepper.lose_in_flight()
            # A failed host-tier copy leaves pages half written: as lost as a donated cache.
            copies = self.host_copies
            cache_lost = self.runner.restore_cache()
            cache_lost = (copies is not None and copies.take_failed()) or cache_lost
            if cache_lost and copies is not None:
                self.host_copies.drop()  # the pages they would read or write are gone
            self.endings.after_failed_step(e, cache_lost=cache_lost, in_flight_lost=in_flight_lost)
            raise
        self.endings.end_failed()
        self.metrics.account_step(t0, t_sched, t1, t2)
        self.metrics.maybe_log(self.stats, self.config.log_stats_interval_s)
        return self.routed_experts.attach(StepOutputs.of(self.endings.take(), outputs))

    # Introspection.

    @_locked
    def stats(self) -> dict[str, Any]:
        """The run's metrics so far (see `paxkv.engine.metrics.engine_stats`)."""
        stats = engine_stats(
            self.metrics,
            self.scheduler,
            num_compilations=self.num_compilations,
            compile_time_s=self.runner.compile_seconds,
            num_model_compilations=self.runner.num_model_compilations,
            compiling=self.compiling,
        )
        if self.speculator is not None:
            stats.update(self.speculator.stats())
        if self.host_copies is not None:
            stats.update(self.host_copies.stats())
        return stats

    def warmup(
        self, progress: Callable[[int, int], None] | None = None, *, background: bool = False
    ) -> None:
        """Compiles the step's programs now, so no request waits for them later.

        One program per step shape runs the model (`paxkv.engine.device.step.forward_step`);
        beside them, the small samplers of penalties, and with
        `EngineConfig.warmup_scoring` of scored prompt rows (`prompt_logprobs`, `echo`
        with logprobs, `add_score_request`), and of speculative proposals
        (`ModelRunner.warmup`). `progress(done, total)` is called as each program is
        compiled, or taken from the ones this process compiled or the persistent
        compilation cache holds. With `background`, only the largest and smallest shapes' programs
        compile before this returns: the engine serves at once, each step on the
        smallest compiled shape that holds it, while the others compile in a thread
        (`compiling`, `wait_compiled`).
        """
        shapes = self._buckets.shapes()
        b = self._buckets
        logging.info(
            "paxkv: step shapes: tokens %s x pages %s, sequences %s",
            b.tokens,
            b.pages,
            b.seqs or "tied to tokens",
        )
        self.runner.warmup(
            shapes, progress, scoring=self.config.warmup_scoring, background=background
        )
        if self.host_copies is not None:
            warm_copies(self.runner)
        if self.loras is not None:  # the slot writer: slot 0 holds zeros, and keeps them
            self.runner.write_lora_slot(0, None)

    # LoRA adapters (`paxkv.engine.lora`).

    def _lora_adapters(self) -> LoRAAdapters:
        if self.loras is None:
            raise ValueError("this engine serves no LoRA adapters (enable_lora=False)")
        return self.loras

    @_locked
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Reads and checks an adapter so requests can name it (ValueError naming the
        file and field); False when it is loaded already."""
        return self._lora_adapters().add(lora_request)

    @_locked
    def remove_lora(self, name: str) -> bool:
        """Forgets adapter `name`: requests that started under it finish under it
        (preempted ones too), those not started end now, aborted with the reason.
        Whether it was loaded."""
        removed = self._lora_adapters().remove(name)
        for req in list(self.requests.unfinished()):
            seqs = req.seqs
            if any(s.lora_key and s.lora_key[0] == name for s in seqs) and all(
                s.first_scheduled_time is None for s in seqs
            ):
                self.endings.end(req.request_id, f"LoRA adapter {name!r} was removed before it ran")
        return removed

    def _lora_keys_in_use(self) -> set:
        """The adapter keys unfinished sequences run under."""
        return {s.lora_key for r in self.requests.unfinished() for s in r.seqs if s.lora_key}

    @_locked
    def update_lora(
        self, name: str, state_dict: Mapping[str, Any], adapter_config: Mapping[str, Any]
    ) -> None:
        """New weights for adapter `name` (PEFT's tensor names; `adapter_config`'s r,
        lora_alpha, ...), added if unknown: requests admitted from now on run under them
        (RL with LoRA); running ones keep the old. Nothing recompiles."""
        self._lora_adapters().update(name, state_dict, adapter_config)

    def check_lora(self, name: str) -> None:
        """ValueError unless adapter `name` is loaded (TypeError for a name not a str)."""
        if not isinstance(name, str):
            raise TypeError(f"lora_request must be a LoRARequest or a str, got {name!r}")
        self._lora_adapters().key_for(name)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded, in the order they were added."""
        return [] if self.loras is None else self.loras.requests()

    @property
    def compiling(self) -> bool:
        """Whether a background warm-up is still compiling."""
        return bool(getattr(self.runner, "compiling", False))

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Waits until a background warm-up has compiled every program; whether it has."""
        wait = getattr(self.runner, "wait_compiled", None)
        return True if wait is None else wait(timeout)


def _check_draft(spec: SpeculativeConfig | None, draft_model: nnx.Module | None) -> None:
    """ValueError unless a draft model comes exactly with method "draft_model"."""
    wants_draft = spec is not None and spec.method == "draft_model"
    if wants_draft != (draft_model is not None):
        raise ValueError(
            "speculative_config method 'draft_model' needs draft_model= (the draft "
            "model object; LLM loads it by name)"
            if wants_draft
            else "draft_model= needs speculative_config={'method': 'draft_model', ...}"
        )


def _before_launch(*parts: Any) -> Callable[[], None] | None:
    """What runs before each step dispatch: the flushes of the parts that are there
    (the host KV tier's copies, the LoRA slots' writes)."""
    flushes = [p.flush for p in parts if p is not None]
    if not flushes:
        return None

    def flush() -> None:
        for f in flushes:
            f()

    return flush


def _scheduler(
    config: EngineConfig,
    pool: PagePool,
    reservation: PagedReservation | None,
    runner: StepRunner,
    speculator: Speculator | None,
    host_tier: HostKVTier | None = None,
) -> Scheduler:
    """The host scheduler of an engine with `config`, over `pool` and the runner's KV
    groups (one group unless the model mixes windows)."""
    return Scheduler(
        pool,
        page_size=config.page_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        watermark=config.watermark,
        enable_prefix_caching=config.enable_prefix_caching,
        reservation=reservation,
        kv_groups=getattr(runner, "kv_groups", None),
        speculator=speculator,
        host_tier=host_tier,
        max_loras=config.max_loras if config.enable_lora else 0,
    )


def _host_tier(config: EngineConfig, runner: StepRunner) -> HostKVTier | None:
    """The host KV tier of `config.kv_host_cache_gib` over `runner`'s pages (None: off);
    ValueError naming the field where the runner cannot copy pages."""
    gib = config.kv_host_cache_gib
    if not gib:
        return None
    if not hasattr(runner, "read_pages"):
        raise ValueError(
            f"kv_host_cache_gib={gib}: this engine's runner ({type(runner).__name__}) cannot "
            "copy KV pages to host memory"
        )
    page_bytes = runner.page_bytes()
    return HostKVTier(host_slots(gib, page_bytes), page_bytes)
