"""A request's outputs: what each completion has taken of its sequence's tokens, and
the `RequestOutput`s built from it.

Two paths build them. A request that needs its text while it runs (stop strings are
matched on the text) or whose outputs carry logprobs builds each output on the step's
thread (`Request.output`, with `take` and `completion` here). Every other request (no
stop strings, no logprobs, no prompt logprobs: what most serving traffic is) leaves
the step's thread with a `DeferredOutput`: which tokens of which completion are new,
a few numbers copied at the step, and nothing else. Its `RequestOutput`, text
included, is built when someone reads it (`StepOutputs`), on the reader's thread:
the step loop does no per-request object building and no detokenization for them.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from paxkv.host.request import (
    CompletionOutput,
    FinishReason,
    Logprob,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
)
from paxkv.host.sequence import SequenceState
from paxkv.text.detokenizer import IncrementalDetokenizer, StopStrings, decode_stream

if TYPE_CHECKING:
    from paxkv.engine.requests import Request

# Ends a sequence after its first n outputs: `Scheduler.stop`.
StopFn = Callable[[SequenceState, int], None]
DELTA, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
_STOP = FinishReason.STOP


@dataclasses.dataclass(eq=False, slots=True)
class Progress:
    """What one completion has taken of its sequence's tokens, and reported of them.

    Tokens are taken once they are final (the real ones before a step's placeholders)
    into the text, the logprob dicts and the logprob sum; each is taken once, so the
    work per output is proportional to the new tokens. On the deferred path the step
    only takes (`num_taken`, `taken_finished`), and the reader's build feeds the
    detokenizer (`num_decoded`)."""

    detokenizer: IncrementalDetokenizer | None  # None without a tokenizer
    num_taken: int = 0  # output tokens taken
    num_sent: int = 0  # output tokens in outputs so far
    cumulative_logprob: float = 0.0  # of the tokens taken
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)  # per token taken
    stop_reason: int | str | None = None
    sent_finished: bool = False  # an output said it finished
    taken_finished: bool = False  # deferred path: a snapshot said it finished
    num_decoded: int = 0  # deferred path: output tokens fed to the detokenizer


def new_progress(seq: SequenceState, tokenizer: Any, stop: StopStrings) -> Progress:
    """A completion's progress, with a detokenizer when there is a tokenizer."""
    if tokenizer is None:
        return Progress(None)
    p = seq.params
    delta = p.output_kind is DELTA
    detokenizer = IncrementalDetokenizer(
        decode_stream(tokenizer),
        stop=stop,
        include_stop_str_in_output=p.include_stop_str_in_output,
        keep_text=not delta,
        deltas=delta,
    )
    return Progress(detokenizer)


def take(seq: SequenceState, progress: Progress, tokenizer: Any, stop: StopFn | None) -> None:
    """Takes seq's new final tokens into `progress` (see `Request.output`)."""
    detokenizer = progress.detokenizer
    if isinstance(progress.stop_reason, str):
        return  # a stop string ended it
    out = seq.output_token_ids
    if len(out) < progress.num_taken:
        raise RuntimeError(
            f"{seq.seq_id}: its outputs were cut to {len(out)} tokens after "
            f"{progress.num_taken} were taken as final"
        )
    params = seq.params
    # A stop token ends the outputs of a sequence with finish reason "stop" (a stop
    # string's `stop` has set progress.stop_reason); as in vLLM its text is left out.
    ended_by_token = seq.finish_reason is _STOP and not seq.constraint_done
    skip_text_at = len(out) - 1 if ended_by_token and not params.include_stop_str_in_output else -1
    asked = params.logprobs is not None
    i = progress.num_taken
    while i < len(out) and out[i] >= 0:  # placeholders (< 0) end the final tokens
        token = out[i]
        if asked:
            progress.logprobs.append(logprob_dict(seq, i, tokenizer))
            progress.cumulative_logprob += seq.logprobs[i]
        i += 1
        if detokenizer is not None and i - 1 != skip_text_at and detokenizer.add(token):
            progress.stop_reason = detokenizer.stop_reason
            progress.num_taken = i
            if stop is not None:
                stop(seq, i)
            detokenizer.finish()
            return
    progress.num_taken = i
    if seq.finish_reason is not None:
        if ended_by_token and out and out[-1] in params.stop_token_ids:
            progress.stop_reason = out[-1]
        if detokenizer is not None:
            detokenizer.finish()


def completion(seq: SequenceState, progress: Progress, delta: bool) -> CompletionOutput:
    """seq's completion as taken so far: all of it, or (delta) what is new since the last."""
    start, end = (progress.num_sent, progress.num_taken) if delta else (0, progress.num_taken)
    detokenizer = progress.detokenizer
    if detokenizer is None:
        text = None
    else:
        text = detokenizer.take_delta() if delta else detokenizer.text()
    asked = seq.params.logprobs is not None
    reason = seq.finish_reason
    progress.num_sent = end
    progress.sent_finished = reason is not None
    return CompletionOutput(
        index=seq.index,
        token_ids=seq.output_token_ids[start:end],
        text=text,
        logprobs=progress.logprobs[start:end] if asked else None,
        finish_reason=None if reason is None else reason.value,
        cumulative_logprob=progress.cumulative_logprob if asked else None,
        stop_reason=progress.stop_reason if reason is _STOP else None,
    )


def logprob_dict(seq: SequenceState, i: int, tokenizer: Any) -> dict[int, Logprob]:
    """Output i's top-k and itself, as `{token id: Logprob}`."""
    token = seq.output_token_ids[i]
    top = seq.top_logprobs[i]
    entries = {}
    rank = None
    if top is not None:
        ids, lps, rank = top
        entries = {
            t: Logprob(lp, r, decode_one(tokenizer, t))
            for r, (t, lp) in enumerate(zip(ids, lps, strict=True), 1)
        }
    entries.setdefault(token, Logprob(seq.logprobs[i], rank, decode_one(tokenizer, token)))
    return entries


def decode_one(tokenizer: Any, token: int) -> str | None:
    """One token's text (None without a tokenizer)."""
    return None if tokenizer is None else tokenizer.decode([token])


def final_end(seq: SequenceState, num_taken: int) -> int:
    """How many of seq's outputs are final: those before its first placeholder (< 0),
    scanning from `num_taken` (taken tokens are final). RuntimeError if its outputs
    were cut below `num_taken`."""
    out = seq.output_token_ids
    n = len(out)
    if n < num_taken:
        raise RuntimeError(
            f"{seq.seq_id}: its outputs were cut to {n} tokens after {num_taken} were "
            "taken as final"
        )
    if not n or out[-1] >= 0:
        return n
    i = num_taken
    while i < n and out[i] >= 0:
        i += 1
    return i


class DeferredOutput:
    """A request's output at one step, built into its `RequestOutput` when first read.

    The step copies what changes later (which outputs of each completion are new, the
    finish reasons, the weight versions, the metrics of a finished request); the
    tokens are read from the sequences at build time (outputs before a placeholder
    never change), and their text is decoded then. A reader reads a request's outputs
    in step order; one it skips keeps its tokens, and its text goes to the next one
    read (the detokenizer takes every token once, in order).
    """

    __slots__ = ("_built", "_metrics", "_num_cached", "_parts", "_versions", "finished", "request")

    def __init__(
        self,
        request: Request,
        parts: tuple[tuple[int, int, int, FinishReason | None], ...],
        finished: bool,
        versions: tuple[int, ...],
        metrics: RequestMetrics | None,
    ) -> None:
        self.request = request
        self.finished = finished  # whether the request had ended at this step
        self._parts = parts  # per completion reported: (index, start, end, finish reason)
        self._versions = versions
        self._metrics = metrics
        self._num_cached = request.seqs[0].num_cached_tokens
        self._built: RequestOutput | None = None

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id

    def build(self) -> RequestOutput:
        """The `RequestOutput` (built once)."""
        if self._built is None:
            with self.request.build_lock:
                if self._built is None:
                    self._built = _build(
                        self.request, self._parts, self.finished, self._versions, self._metrics
                    )
        return self._built


def _build(
    req: Request,
    parts: Sequence[tuple[int, int, int, FinishReason | None]],
    finished: bool,
    versions: tuple[int, ...],
    metrics: RequestMetrics | None,
    num_cached: int | None = None,
) -> RequestOutput:
    """The `RequestOutput` of `parts` (`(completion, start, end, finish reason)` each)."""
    delta = req.output_kind is DELTA
    completions = []
    error = None
    for i, start, end, reason in parts:
        seq = req.seqs[i]
        out = seq.output_token_ids
        stop_reason = None
        if reason is _STOP and end and out[end - 1] in seq.params.stop_token_ids:
            stop_reason = out[end - 1]
        try:
            text = _text(seq, req.progress[i], end, reason, delta)
        except Exception as e:  # isolated: this output has no text, and says why
            text, error = None, f"detokenizing completion {seq.index} failed: {e!r}"
        completions.append(
            CompletionOutput(
                seq.index,
                out[start:end],
                text,
                None,
                None if reason is None else reason.value,
                None,
                stop_reason,
            )
        )
    return RequestOutput(
        req.request_id,
        req.prompt,
        req.prompt_token_ids,
        completions,
        finished,
        req.seqs[0].num_cached_tokens if num_cached is None else num_cached,
        metrics,
        error,
        versions,
        lora_request=req.lora_request,
    )


def _text(
    seq: SequenceState, progress: Progress, end: int, reason: FinishReason | None, delta: bool
) -> str | None:
    """A deferred completion's text up to output `end`: the detokenizer takes the
    outputs it has not seen before `end` (a stop token's text left out, as vLLM does,
    unless `include_stop_str_in_output`); None without a tokenizer."""
    det = progress.detokenizer
    if det is None:
        return None
    out = seq.output_token_ids
    by_token = reason is _STOP and not seq.constraint_done
    last = end - 1 if by_token and not seq.params.include_stop_str_in_output else end
    for t in out[progress.num_decoded : max(last, progress.num_decoded)]:
        det.add(t)
    progress.num_decoded = max(end, progress.num_decoded)
    if reason is not None:
        det.finish()
    return det.take_delta() if delta else det.text()


def snapshot(req: Request) -> DeferredOutput | None:
    """The deferred output of a request on the deferred path now (`Request.snapshot`):
    takes each completion's new final tokens; None when there is nothing to report
    (nothing new in a delta, or a FINAL_ONLY request still running)."""
    kind = req.output_kind
    delta = kind is DELTA
    if delta and len(req.seqs) == 1:
        return _snapshot_one(req)
    parts = []
    finished = True
    for i, seq in enumerate(req.seqs):
        progress = req.progress[i]
        start = progress.num_taken
        end = final_end(seq, start)
        reason = seq.finish_reason
        if reason is None:
            finished = False
        if delta:
            if end > start or (reason is not None and not progress.taken_finished):
                parts.append((i, start, end, reason))
        else:
            parts.append((i, 0, end, reason))
        progress.num_taken = end
        progress.taken_finished = reason is not None
    if not parts or (kind is FINAL_ONLY and not finished):
        return None
    metrics = req.metrics() if finished or not delta else None
    return DeferredOutput(req, tuple(parts), finished, req.weight_versions(), metrics)


def _snapshot_one(req: Request) -> DeferredOutput | None:
    """`snapshot` of a DELTA request of one completion: the per-step common case."""
    seq = req.seqs[0]
    progress = req.progress[0]
    start = progress.num_taken
    out = seq.output_token_ids
    n = len(out)
    end = n if n and out[-1] >= 0 and n >= start else final_end(seq, start)
    reason = seq.finish_reason
    if end == start and (reason is None or progress.taken_finished):
        return None
    progress.num_taken = end
    finished = progress.taken_finished = reason is not None
    starts = req.version_starts
    # With no weight update since it arrived: one version, once it has an output.
    one = (starts[0][0],) if n else ()
    versions = one if len(starts) == 1 else req.weight_versions()
    metrics = req.metrics() if finished else None
    return DeferredOutput(req, ((0, start, end, reason),), finished, versions, metrics)


class DecodeDeltas:
    """The delta outputs of a decode step, for requests of one completion that
    each got one token and none of which ended: the requests (with their progress),
    and their outputs before the step (`counters`); one object for the whole batch,
    each request's `RequestOutput` built when read (`StepOutputs`).

    Made by `take`, which marks the tokens taken (the step's only work per request)."""

    __slots__ = ("counters", "requests", "versions")

    def __init__(
        self, requests: Sequence[tuple[Request, Progress]], counters: list[int], version: int
    ) -> None:
        self.requests = requests  # (request, its progress[0]) of each
        self.counters = counters  # outputs of each before the step
        self.versions = (version,)

    @staticmethod
    def take(
        requests: Sequence[tuple[Request, Progress]], counters: np.ndarray, version: int
    ) -> DecodeDeltas:
        """The deltas of `requests` (each with its `progress[0]`), each taking its token
        at output `counters[i]` (i32[n])."""
        before = counters.tolist()
        for (_, progress), n in zip(requests, (counters + 1).tolist(), strict=True):
            progress.num_taken = n
        return DecodeDeltas(requests, before, version)

    def build(self, i: int) -> RequestOutput:
        """Request i's output."""
        req = self.requests[i][0]
        c = self.counters[i]
        with req.build_lock:
            return _build(req, ((0, c, c + 1, None),), False, self.versions, None)


class _Entry:
    """Entry i of a `DecodeDeltas`, as a handle (`StepOutputs.handles`)."""

    __slots__ = ("deltas", "i")
    finished = False

    def __init__(self, deltas: DecodeDeltas, i: int) -> None:
        self.deltas, self.i = deltas, i

    def build(self) -> RequestOutput:
        return self.deltas.build(self.i)


class StepOutputs(Sequence[RequestOutput]):
    """The outputs of one `Engine.step`, a sequence of `RequestOutput`s built as they
    are read (`DeferredOutput`, `DecodeDeltas`): indexing or iterating builds them
    (once each). Read a request's outputs in step order. Within a step, the order of
    requests carries no meaning (after a decode step, those that ended come
    first, then the batch of deltas).

    A front end that routes outputs to readers on other threads uses `handles`, which
    builds nothing: each `(request_id, finished, output)` hands over an output that is
    built already or has a `build()` the reader calls (`built`).
    """

    __slots__ = ("_built", "_deltas", "_items")

    def __init__(
        self,
        items: list[RequestOutput | DeferredOutput],
        deltas: DecodeDeltas | None = None,
    ) -> None:
        self._items = items
        self._deltas = deltas
        self._built: dict[int, RequestOutput] = {}

    def __len__(self) -> int:
        return len(self._items) + (len(self._deltas.requests) if self._deltas else 0)

    @overload
    def __getitem__(self, i: int) -> RequestOutput: ...
    @overload
    def __getitem__(self, i: slice) -> list[RequestOutput]: ...
    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"output index {i} out of range for {n} outputs")
        i %= n
        items = self._items
        if i < len(items):
            item = items[i]
            if isinstance(item, DeferredOutput):
                item = items[i] = item.build()
            return item
        out = self._built.get(i)
        if out is None:
            out = self._built[i] = self._deltas.build(i - len(items))
        return out

    def __iter__(self) -> Iterator[RequestOutput]:
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, StepOutputs)):
            return list(self) == list(other)
        return NotImplemented

    def __add__(self, other: Sequence[RequestOutput]) -> list[RequestOutput]:
        return [*self, *other]

    def __radd__(self, other: Sequence[RequestOutput]) -> list[RequestOutput]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"StepOutputs({list(self)!r})"

    @staticmethod
    def of(
        items: list[RequestOutput | DeferredOutput],
        outputs: StepOutputs | list[RequestOutput | DeferredOutput],
    ) -> StepOutputs:
        """`outputs` (a step's, or a list) after `items` (e.g. aborted requests')."""
        if isinstance(outputs, StepOutputs):
            return StepOutputs(items + outputs._items, outputs._deltas)
        return StepOutputs(items + outputs)

    def built_items(self) -> list[RequestOutput]:
        """The outputs built already (those of requests not `Request.deferred`, and
        those read), building none."""
        return [o for o in self._items if isinstance(o, RequestOutput)]

    def handles(self) -> list[tuple[str, bool, Any]]:
        """`(request_id, finished, output)` per output, building none of them."""
        out = [(o.request_id, o.finished, o) for o in self._items]
        d = self._deltas
        if d is not None:
            out += [(req.request_id, False, _Entry(d, i)) for i, (req, _) in enumerate(d.requests)]
        return out


def built(output: Any) -> RequestOutput:
    """A handle's output (`StepOutputs.handles`) as a `RequestOutput`, built if need be."""
    return output if isinstance(output, RequestOutput) else output.build()


def handles(outputs: Sequence[RequestOutput]) -> list[tuple[str, bool, Any]]:
    """`(request_id, finished, output)` per output of a step (`StepOutputs.handles`;
    a plain list of built outputs too), building none."""
    if isinstance(outputs, StepOutputs):
        return outputs.handles()
    return [(o.request_id, o.finished, o) for o in outputs]


def new_lock() -> threading.Lock:
    """A request's lock over building its deferred outputs."""
    return threading.Lock()
