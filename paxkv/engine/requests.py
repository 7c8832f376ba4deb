"""The engine's requests: validation at submission, the registry, and their outputs."""

from __future__ import annotations

import dataclasses
import itertools
import operator
import random
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from paxkv.engine.outputs import (
    DELTA,
    FINAL_ONLY,
    DecodeDeltas,
    DeferredOutput,
    Progress,
    StopFn,
    completion,
    decode_one,
    new_lock,
    new_progress,
    snapshot,
    take,
)
from paxkv.engine.validation import check_params, prompt_ids
from paxkv.host.prompt_scores import PromptScores
from paxkv.host.request import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    check_float,
    check_int,
    check_token_ids,
)
from paxkv.host.scheduler import Scheduler
from paxkv.host.sequence import SequenceState
from paxkv.host.step_plan import DecodeColumns
from paxkv.text.detokenizer import StopStrings


@dataclasses.dataclass(eq=False)
class Request:
    """One submitted request: its prompt and its n sequences (completions).

    Its outputs take one of two paths (`paxkv.engine.outputs`): built on the step's
    thread (`output`), or, when nothing of them is needed there (`deferred`: no stop
    strings, logprobs or prompt logprobs), snapshotted by the step and built by
    whoever reads them (`snapshot`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[SequenceState]
    arrival_time: float
    # `(weight version, outputs sampled before it)` for each version since it arrived.
    version_starts: list[tuple[int, int]] = dataclasses.field(default_factory=lambda: [(0, 0)])
    tokenizer: Any = dataclasses.field(default=None, repr=False)  # decodes its text
    lora_request: Any = None  # the `LoRARequest` it runs under (None: the base model)
    progress: list[Progress] | None = dataclasses.field(default=None, repr=False)
    # `(prompt_logprobs, scores)` once built, and whether a delta output carried them.
    _prompt_out: tuple[list, np.ndarray] | None = dataclasses.field(default=None, repr=False)
    _prompt_sent: bool = dataclasses.field(default=False, repr=False)

    def __post_init__(self) -> None:
        p = self.seqs[0].params
        self.deferred = (
            not (p.stop or p.logprobs is not None or p.prompt_logprobs is not None)
            and not p.return_routed_experts
        )
        self.output_kind = p.output_kind  # what its outputs hold
        self.build_lock = new_lock()

    @property
    def finished(self) -> bool:
        """Whether every completion has ended."""
        return all(s.finish_reason is not None for s in self.seqs)

    def _num_outputs(self) -> int:
        return sum(len(s.output_token_ids) for s in self.seqs)

    def start_version(self, version: int) -> None:
        """Its tokens from now on are sampled under weight version `version`."""
        self.version_starts.append((version, self._num_outputs()))

    def weight_versions(self) -> tuple[int, ...]:
        """The weight versions its output tokens were sampled under, oldest first."""
        starts = self.version_starts
        if len(starts) == 1:  # no update since it arrived
            return (starts[0][0],) if any(s.output_token_ids for s in self.seqs) else ()
        ends = [start for _, start in starts[1:]] + [self._num_outputs()]
        return tuple(v for (v, start), end in zip(starts, ends, strict=True) if end > start)

    def _init_progress(self, tokenizer: Any) -> list[Progress]:
        if self.progress is None:
            # One index of the stop strings for all its completions.
            strings = StopStrings(self.seqs[0].params.stop)
            self.progress = [new_progress(seq, tokenizer, strings) for seq in self.seqs]
            self.tokenizer = tokenizer
        return self.progress

    def report(
        self, tokenizer: Any = None, stop: StopFn | None = None
    ) -> RequestOutput | DeferredOutput | None:
        """Its output now, as `output` says: built (`output`), or deferred (`snapshot`)
        when it is `deferred`."""
        if self.deferred:
            self._init_progress(tokenizer)
            return snapshot(self)
        return self.output(tokenizer, stop)

    def output(self, tokenizer: Any = None, stop: StopFn | None = None) -> RequestOutput | None:
        """The request's output now, as its `SamplingParams.output_kind` says: all of it
        so far (CUMULATIVE); what is new since the previous call (DELTA; None when
        nothing is); or None until it has ended, then all of it (FINAL_ONLY).

        First takes each completion's new final tokens (not a step's placeholders):
        decodes only them with `tokenizer` (fixed by the first call) and matches the
        stop strings on their text. When a token completes a stop string, `stop(seq, n)`
        ends its sequence after its n outputs (`Scheduler.stop`), and the completion's
        outputs end there whatever its sequence holds (e.g. aborted: no `stop` needed).
        A `deferred` request's output is snapshotted and built at once.
        """
        progresses = self._init_progress(tokenizer)
        if self.deferred:
            out = snapshot(self)
            return None if out is None else out.build()
        finished = True
        for seq, progress in zip(self.seqs, progresses, strict=True):
            take(seq, progress, tokenizer, stop)
            finished = finished and seq.finish_reason is not None
        kind = self.output_kind
        if kind is FINAL_ONLY and not finished:
            return None
        delta = kind is DELTA
        completions = []
        for seq, progress in zip(self.seqs, progresses, strict=True):
            if (
                not delta
                or progress.num_taken > progress.num_sent
                or (seq.finish_reason is not None and not progress.sent_finished)
            ):
                completions.append(completion(seq, progress, delta))
        prompt_logprobs, scores = self._prompt_logprobs(tokenizer, delta)
        if not completions and prompt_logprobs is None:
            return None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=self.seqs[0].num_cached_tokens,
            # A delta carries the request's metrics once, when it finishes: per step they
            # would cost more than the delta itself.
            metrics=self.metrics() if finished or not delta else None,
            weight_versions=self.weight_versions(),
            prompt_logprobs=prompt_logprobs,
            scores=scores,
            lora_request=self.lora_request,
        )

    def _prompt_logprobs(self, tokenizer: Any, delta: bool) -> tuple[list | None, Any]:
        """`(prompt_logprobs, scores)` for an output now: None until the prefill has run
        (and in a delta output, after the first that carried them); built once."""
        ps = self.seqs[0].prompt_scores
        if ps is None or not ps.complete or (delta and self._prompt_sent):
            return None, None
        if self._prompt_out is None:
            ids = self.prompt_token_ids
            entries: list[dict[int, Logprob] | None] = [None] * ps.first
            for i, pos in enumerate(range(ps.first, len(ids))):
                d = {
                    t: Logprob(lp, r, decode_one(tokenizer, t))
                    for r, (t, lp) in enumerate(
                        zip(ps.top_ids[i].tolist(), ps.top_logprobs[i].tolist(), strict=True), 1
                    )
                }
                token = ids[pos]
                d.setdefault(
                    token,
                    Logprob(float(ps.logprobs[i]), int(ps.ranks[i]), decode_one(tokenizer, token)),
                )
                entries.append(d)
            self._prompt_out = (entries, ps.logprobs.copy())
        self._prompt_sent = True
        return self._prompt_out

    def bare_output(self) -> RequestOutput:
        """The request's tokens and finish reasons only (no text, logprobs or metrics):
        what is reported when building the full output is what failed. Delta outputs
        hold the tokens after those already sent."""
        delta = self.output_kind is DELTA and self.progress is not None
        completions = [
            CompletionOutput(
                index=seq.index,
                token_ids=[
                    t for t in seq.output_token_ids[self._sent(i) if delta else 0 :] if t >= 0
                ],
                finish_reason=None if seq.finish_reason is None else seq.finish_reason.value,
            )
            for i, seq in enumerate(self.seqs)
        ]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            completions,
            self.finished,
            weight_versions=self.weight_versions(),
            lora_request=self.lora_request,
        )

    def _sent(self, i: int) -> int:
        """Outputs of completion i already in its delta outputs."""
        p = self.progress[i]
        return p.num_taken if self.deferred else p.num_sent

    def metrics(self) -> RequestMetrics:
        """Its metrics now (from its first completion's times)."""
        first = self.seqs[0]
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
            last_token_time=first.last_token_time,
            finished_time=first.finished_time,
            num_preemptions=sum(s.num_preemptions for s in self.seqs),
        )


_NOT_DELTA = object()  # `DecodeColumns.attached` of a request that needs `report`
_FINISH_REASON = operator.attrgetter("finish_reason")


class RequestRegistry:
    """The unfinished requests of an engine, by id; validates what is submitted.

    Args:
      scheduler: checks that a request can ever be served (`Scheduler.check_fits`).
      vocab_size: token ids must lie in `[0, vocab_size)`.
      max_model_len: the longest prompt + output.
      tokenizer: optional, with `encode(str) -> list[int]`; string prompts need it.
      seed: draws the sampling seeds of requests that give none.
      max_logprobs: the most `SamplingParams.logprobs` a request may ask for.
      max_n: the most completions (`SamplingParams.n`) a request may ask for.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        vocab_size: int,
        max_model_len: int,
        tokenizer: Any = None,
        seed: int = 0,
        max_logprobs: int = 20,
        max_n: int = 128,
    ) -> None:
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs
        self.max_n = max_n
        self._requests: dict[str, Request] = {}
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self.weight_version = 0  # the weights new requests sample under
        # The weight version under which `report_decode` attached requests to the columns,
        # and the last columns' list it found whole (every request a delta one).
        self._attached_version = 0
        self._attached_whole: list | None = None
        self._apart: np.ndarray | None = None  # `report_decode`'s, of `_attached_whole`

    def unfinished(self) -> list[Request]:
        """The unfinished requests, in the order they were submitted."""
        return list(self._requests.values())

    def set_weight_version(self, version: int) -> None:
        """Every unfinished request and every later one samples under `version` from now."""
        self.weight_version = version
        for req in self._requests.values():
            req.start_version(version)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def get(self, request_id: str) -> Request | None:
        """The unfinished request `request_id`, or None."""
        return self._requests.get(request_id)

    def pop(self, request_id: str) -> Request | None:
        """Forgets request `request_id` and returns it (None if unknown)."""
        return self._requests.pop(request_id, None)

    def create(
        self,
        request_id: str | None,
        prompt: str | dict,
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        score_from: int = 1,
        lora_key: tuple | None = None,
        lora_request: Any = None,
    ) -> Request:
        """Validates a request and registers it with its sequences; ValueError or
        TypeError (naming the argument and showing its value) rejects it. With
        `params.prompt_logprobs`, the prompt positions from `score_from` on are scored
        (by its first sequence; the others may share its prompt's cached pages)."""
        if request_id is None:
            request_id = self._new_id()
        elif not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str or None, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        priority = check_int("priority", priority)
        if arrival_time is not None:
            arrival_time = check_float("arrival_time", arrival_time)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {cache_salt!r}")
        text, ids = self.validate(request_id, prompt, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        base_seed = params.seed if params.seed is not None else self._rng.randrange(2**31)
        seqs = [
            SequenceState(
                seq_id=request_id if params.n == 1 else f"{request_id}/{i}",
                request_id=request_id,
                index=i,
                prompt_token_ids=list(ids),
                params=params,
                seed=(base_seed + i) % 2**31,
                arrival_time=arrival,
                priority=priority,
                cache_salt=cache_salt,
                lora_key=lora_key,
            )
            for i in range(params.n)
        ]
        if params.prompt_logprobs is not None:
            seqs[0].prompt_scores = PromptScores(ids, score_from, params.prompt_logprobs)
        request = Request(request_id, text, ids, seqs, arrival, [(self.weight_version, 0)])
        request.lora_request = lora_request
        self._requests[request_id] = request
        return request

    def create_score(
        self,
        request_id: str | None,
        prompt_token_ids: Any,
        completion_token_ids: Any,
        *,
        top_logprobs: int = 0,
        priority: int = 0,
    ) -> Request:
        """Validates and registers a score request (`Engine.add_score_request`): prompt +
        completion, nothing generated, the completion's positions scored. ValueError
        names the field: an id outside the vocabulary, or a completion past max_model_len."""
        prompt = check_token_ids("prompt_token_ids", prompt_token_ids, lo=None)
        completion = check_token_ids("completion_token_ids", completion_token_ids, lo=None)
        check_int("top_logprobs", top_logprobs, lo=0)
        if not prompt:
            raise ValueError("prompt_token_ids is empty: the first token has no logprob")
        vocab = self.vocab_size
        for name, ids in (("prompt_token_ids", prompt), ("completion_token_ids", completion)):
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"{name}[{bad}]={ids[bad]} is outside the vocabulary [0, {vocab})")
        if len(prompt) + len(completion) > self.max_model_len:
            raise ValueError(
                f"completion_token_ids: {len(completion)} tokens after a prompt of "
                f"{len(prompt)} exceed max_model_len={self.max_model_len}"
            )
        return self.create(
            request_id,
            {"prompt_token_ids": prompt + completion},
            SamplingParams(max_tokens=0, prompt_logprobs=top_logprobs),
            priority=priority,
            score_from=len(prompt),
        )

    def report(
        self, request_ids: Iterable[str], *, defer: bool = False
    ) -> tuple[list[RequestOutput | DeferredOutput], list[Request]]:
        """The outputs of the requests `request_ids` now, as each one's output kind says
        (`Request.output`: none for one with nothing to say), and the requests that
        finished, which are forgotten. With `defer`, a `deferred` request's output is a
        `DeferredOutput` that its reader builds (`Request.report`). Unknown ids are skipped. A completion whose text
        completes a stop string ends here (`Scheduler.stop`). A request whose output
        cannot be built fails (`Scheduler.fail`) instead of being reported.

        Call it only when the requests' tokens before any placeholder are final: tokens
        taken into an output are never taken back."""
        outputs, finished = [], []
        for rid in dict.fromkeys(request_ids):
            req = self._requests.get(rid)
            if req is None:
                continue
            try:
                if defer and req.deferred and req.progress is not None:
                    out = snapshot(req)  # the common case, without a call more
                elif defer:
                    out = req.report(self.tokenizer, self.scheduler.stop)
                else:
                    out = req.output(self.tokenizer, self.scheduler.stop)
            except Exception as e:  # isolated: only this request fails
                self.scheduler.fail(req.seqs[0], e)
                continue
            if out is not None:
                outputs.append(out)
                if out.finished:
                    finished.append(self._requests.pop(rid))
            elif req.finished:
                finished.append(self._requests.pop(rid))
        return outputs, finished

    def report_decode(
        self, decode: DecodeColumns, gone: np.ndarray | None = None
    ) -> tuple[DecodeDeltas | None, list[str]]:
        """The outputs of a step's decodes (`DecodeColumns`): one `DecodeDeltas` for the
        requests that took their token and go on and whose output is such a delta
        (`Request.deferred`, one completion, DELTA, no weight update since it arrived),
        and the ids of the others (ended in the step, or needing more), to `report`.
        `gone` (bool[n], `RunningDecodes.gone`) tells which sequences ended; None: each
        one's finish reason does."""
        attached = decode.attached  # (request, its progress) of each, kept by the columns
        if self._attached_version != self.weight_version:  # looked up anew under new weights
            attached[:] = [None] * len(attached)
            self._attached_version = self.weight_version
            self._attached_whole = None
        if attached is not self._attached_whole:  # the columns changed: fill in who joined
            missing = attached.count(None)
            i = len(attached)
            while missing:  # from the end, where the columns append those that join
                i -= 1
                if attached[i] is None:
                    missing -= 1
                    r = self._delta_request(decode.request_ids[i])
                    attached[i] = _NOT_DELTA if r is None else (r, r.progress[0])
            self._attached_whole = attached
            # bool[n]: those reported one by one (None: none).
            self._apart = (
                np.fromiter(map(operator.is_, attached, itertools.repeat(_NOT_DELTA)), bool)
                if attached.count(_NOT_DELTA)
                else None
            )
        if gone is None:
            reasons = list(map(_FINISH_REASON, decode.seqs))
            if reasons.count(None) != len(reasons):
                gone = np.fromiter(
                    map(operator.is_not, reasons, itertools.repeat(None)), bool, len(reasons)
                )
        others, apart = gone, self._apart
        if apart is not None:
            others = apart if gone is None else apart | gone
        counters = decode.counters
        ended: list[int] = []
        if others is not None and others.any():  # only the others take deltas
            going = ~others
            ended = np.flatnonzero(others).tolist()
            attached = list(itertools.compress(attached, going.tolist()))
            counters = counters[going]
        deltas = DecodeDeltas.take(attached, counters, self.weight_version) if attached else None
        return deltas, [decode.request_ids[i] for i in ended]

    def _delta_request(self, request_id: str) -> Request | None:
        """The request `request_id` if its output each step is a delta of one token that
        its reader builds (`Request.deferred`, one completion, DELTA, one weight version,
        reported once already), else None."""
        r = self._requests.get(request_id)
        ok = (
            r is not None
            and r.deferred
            and r.progress is not None
            and len(r.seqs) == 1
            and r.output_kind is DELTA
            and len(r.version_starts) == 1
        )
        return r if ok else None

    def _new_id(self) -> str:
        """An id no caller-chosen id takes: the next counter value not in use."""
        while (rid := str(next(self._ids))) in self._requests:
            pass
        return rid

    def validate(
        self, request_id: str, prompt: str | dict, params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """Returns `(text, token_ids)` of a servable request, or raises ValueError saying
        why not (`paxkv.engine.validation`)."""
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        check_params(request_id, params, self.tokenizer, self.max_logprobs, self.max_n)
        for token, _ in params.logit_bias or ():
            if token >= self.vocab_size:
                raise ValueError(
                    f"request {request_id!r}: logit_bias names token {token}, outside the "
                    f"vocabulary [0, {self.vocab_size})"
                )
        text, ids = prompt_ids(
            request_id, prompt, self.tokenizer, self.vocab_size, self.max_model_len
        )
        try:
            self.scheduler.check_fits(len(ids), params)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        return text, ids
