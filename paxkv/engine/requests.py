"""The engine's requests: validation at submission, the registry, and their outputs."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from typing import Any

from paxkv.host.scheduler import Scheduler
from paxkv.host.sequence import SequenceState
from paxkv.request import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    check_float,
    check_int,
    normalize_prompt,
)


@dataclasses.dataclass
class Request:
    """One submitted request: its prompt and its n sequences (completions)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[SequenceState]
    arrival_time: float
    _built: dict[int, list[dict[int, Logprob]]] = dataclasses.field(default_factory=dict)

    @property
    def finished(self) -> bool:
        """Whether every completion has ended."""
        return all(s.finish_reason is not None for s in self.seqs)

    def output(self, tokenizer: Any = None) -> RequestOutput:
        """The request's state now, as the API returns it (texts decoded by `tokenizer`)."""
        completions = []
        for seq in self.seqs:
            asked = seq.params.logprobs is not None
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    token_ids=list(seq.output_token_ids),
                    text=None if tokenizer is None else tokenizer.decode(seq.output_token_ids),
                    logprobs=self._logprob_dicts(seq, tokenizer) if asked else None,
                    finish_reason=None if seq.finish_reason is None else seq.finish_reason.value,
                    cumulative_logprob=float(sum(seq.logprobs)) if asked else None,
                )
            )
        first = self.seqs[0]
        metrics = RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
            last_token_time=first.last_token_time,
            finished_time=first.finished_time,
            num_preemptions=sum(s.num_preemptions for s in self.seqs),
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=completions,
            finished=self.finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=metrics,
        )

    def bare_output(self) -> RequestOutput:
        """The request's tokens and finish reasons only (no text, logprobs or metrics):
        what is reported when building the full output is what failed."""
        completions = [
            CompletionOutput(
                index=seq.index,
                token_ids=[t for t in seq.output_token_ids if t >= 0],
                finish_reason=None if seq.finish_reason is None else seq.finish_reason.value,
            )
            for seq in self.seqs
        ]
        return RequestOutput(
            self.request_id, self.prompt, list(self.prompt_token_ids), completions, self.finished
        )

    def _logprob_dicts(self, seq: SequenceState, tokenizer: Any) -> list[dict[int, Logprob]]:
        """Per output token: its top-k and itself, as `{token id: Logprob}`.

        Built once per token and kept (tokens whose top-k the host has not read yet,
        under async scheduling, are built when it has)."""
        built = self._built.setdefault(seq.index, [])
        del built[len(seq.output_token_ids) :]  # outputs dropped after a stop token
        for j in range(len(built), len(seq.output_token_ids)):
            top = seq.top_logprobs[j]
            if top is None:
                break
            ids, lps, rank = top
            entries = {
                t: Logprob(lp, r, _decode(tokenizer, t))
                for r, (t, lp) in enumerate(zip(ids, lps, strict=True), 1)
            }
            token = seq.output_token_ids[j]
            entries.setdefault(token, Logprob(seq.logprobs[j], rank, _decode(tokenizer, token)))
            built.append(entries)
        return list(built)


def _decode(tokenizer: Any, token: int) -> str | None:
    return None if tokenizer is None else tokenizer.decode([token])


class RequestRegistry:
    """The unfinished requests of an engine, by id; validates what is submitted.

    Args:
      scheduler: checks that a request can ever be served (`Scheduler.check_fits`).
      vocab_size: token ids must lie in `[0, vocab_size)`.
      max_model_len: the longest prompt + output.
      tokenizer: optional, with `encode(str) -> list[int]`; string prompts need it.
      seed: draws the sampling seeds of requests that give none.
      max_logprobs: the most `SamplingParams.logprobs` a request may ask for.
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
    ) -> None:
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs
        self._requests: dict[str, Request] = {}
        self._rng = random.Random(seed)
        self._ids = itertools.count()

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
    ) -> Request:
        """Validates a request and registers it with its sequences; ValueError or
        TypeError (naming the argument and showing its value) rejects it."""
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
            )
            for i in range(params.n)
        ]
        request = Request(request_id, text, ids, seqs, arrival)
        self._requests[request_id] = request
        return request

    def report(self, request_ids) -> tuple[list[RequestOutput], list[Request]]:
        """The outputs of the requests `request_ids` now (unknown ids skipped), and the
        requests that finished, which are forgotten. A request whose output cannot be
        built fails (`Scheduler.fail`) instead of being reported."""
        outputs, finished = [], []
        for rid in dict.fromkeys(request_ids):
            req = self._requests.get(rid)
            if req is None:
                continue
            try:
                out = req.output(self.tokenizer)
            except Exception as e:  # isolated: only this request fails
                self.scheduler.fail(req.seqs[0], e)
                continue
            outputs.append(out)
            if out.finished:
                finished.append(self._requests.pop(rid))
        return outputs, finished

    def _new_id(self) -> str:
        """An id no caller-chosen id takes: the next counter value not in use."""
        while (rid := str(next(self._ids))) in self._requests:
            pass
        return rid

    def validate(
        self, request_id: str, prompt: str | dict, params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """Returns `(text, token_ids)` of a servable request, or raises ValueError saying why not."""
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(
                f"request {request_id!r}: logprobs={params.logprobs} exceeds the engine's "
                f"max_logprobs={self.max_logprobs}"
            )
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
        vocab = self.vocab_size
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab]
        if bad:
            i, t = bad[0]
            raise ValueError(
                f"request {request_id!r}: token id {t} at position {i} is outside the vocabulary [0, {vocab})"
            )
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(ids)} tokens is longer than max_model_len={self.max_model_len}"
            )
        try:
            self.scheduler.check_fits(len(ids), params)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        return text, ids
