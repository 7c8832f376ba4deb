"""The steady decode: the running sequences that decode, kept as columns across steps
and planned and recorded by array operations. No JAX.

Most running sequences decode one token per step, step after step. The scheduler
keeps the leading run of them (in running order: the first `n` running sequences,
all decoding) as NumPy columns: rows, cache lengths, output counters, last tokens,
output limits, stop tokens. Each step advances the columns with a few array
operations; Python runs only for what changes: a sequence whose next token needs a
new page or fills one (one step in `page_size`), one that ends (dropped from the
columns at the next plan), one that starts decoding right after them (appended).
The rest of the step (the other running sequences' chunks, admissions) is planned
the general way after the columns, exactly as the general path would order it: the
columns are the first sequences of the running list, and all of them decode.

With async scheduling the columns' last tokens are placeholders of the step in
flight (`src`: each one's row in that step's output, where the device reads it);
`advance` records a dispatched plan's placeholders, `resolve` the real tokens when
the step is read, ending those that sampled a stop token.

What the columns cannot absorb (a preemption, an admission ahead of them, a plan not
recorded) drops them; the general path plans and records until the next `update`
makes new ones. Sequences needing more keep to the general path (they end the leading
run): top logprobs, prompt scores, many stop tokens; so do sliding windows,
speculative proposals and multi-step decoding.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from paxkv.host.kv_cache_manager import KVCacheManager, allocate_decodes
from paxkv.host.queues import SequenceQueues
from paxkv.host.request import FinishReason
from paxkv.host.sequence import SeqStatus, SequenceState
from paxkv.host.step_plan import DecodeColumns, Scheduled, SchedulerOutput, rows_among, stop_tokens

# Stop tokens per sequence kept in the columns; a sequence with more keeps the general path.
MAX_STEADY_STOPS = 16
# The packed integer columns of `SteadyDecode` (`i64`, `i32`), in order.
I64 = ("rows", "ends", "caps", "registered", "max_outputs")
I32 = ("counters", "tokens", "src")
_RUNNING = SeqStatus.RUNNING
_NEXT_END = np.array([0, 1, 0, 0, 0], np.int64)  # a step: cache length + 1
_NEXT_OUTPUT = np.array([1, 0, 0], np.int32)  # and output counter + 1


def decodes_steadily(
    seq: SequenceState, eos_token_ids: tuple[int, ...], pending: Mapping[int, int]
) -> bool:
    """Whether `seq`'s next step is a decode the columns can hold; `pending`: `id(seq)`
    to its row in the in-flight step's output, if its last token is a placeholder."""
    return (
        seq.status is _RUNNING
        and seq.num_computed_tokens + 1 == seq.num_tokens
        and bool(seq.output_token_ids)
        and (seq.output_token_ids[-1] >= 0 or id(seq) in pending)
        and not seq.track_top
        and seq.prompt_scores is None
        and seq.params.max_tokens > 0
        and len(seq.stop_set(eos_token_ids)) <= MAX_STEADY_STOPS
    )


class SteadyDecode:
    """The columns of the leading decoding sequences of a running batch.

    Args:
      seqs: the sequences, in running order (each `decodes_steadily`).
      kv: their pages.
      max_model_len: the longest sequence.
      eos_token_ids: the model's EOS ids the stop columns were made with.
      version: the scheduler's `SequenceQueues.version` they hold for.
      pending: `id(seq)` to its row in the in-flight step's output, for each sequence
        whose last token is a placeholder (see `decodes_steadily`).
    """

    def __init__(
        self,
        seqs: Sequence[SequenceState],
        kv: KVCacheManager,
        *,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        version: int,
        pending: Mapping[int, int],
    ) -> None:
        self.seqs = tuple(seqs)
        self.request_ids = [s.request_id for s in seqs]
        self.attached: list = [None] * len(self.seqs)  # `DecodeColumns.attached`
        self.version = version
        self.eos_token_ids = eos_token_ids
        self.page_size = ps = kv.page_size
        self.caching = kv.prefix_cache.enabled
        # The integer columns, packed by dtype so that dropping and appending sequences
        # is one operation each (`I64`, `I32`: their names, read through the properties).
        n = len(self.seqs)
        self.i64 = np.array(
            [
                (
                    kv.row(s),
                    s.num_computed_tokens + 1,  # the next step's cache length
                    kv.num_pages(s) * ps,
                    kv.num_keys(s),
                    min(s.params.max_tokens, max_model_len - s.num_prompt),
                )
                for s in seqs
            ],
            np.int64,
        ).reshape(n, len(I64))
        self.i32 = np.array(
            [
                # Outputs so far, the last token (the next input) and, when it is a
                # placeholder, its row of the in-flight step's output (-1: known).
                (len(out), out[-1], pending[id(s)] if out[-1] < 0 else -1)
                for s in seqs
                for out in (s.output_token_ids,)
            ],
            np.int32,
        ).reshape(n, len(I32))
        stops = [s.stop_token_ids(eos_token_ids) for s in seqs]
        # i64[n, most stops of one]; -1: none (no columns at all when none has a stop).
        self.stop_table = np.full((len(seqs), max(map(len, stops), default=0)), -1, np.int64)
        for i, ids in enumerate(stops):
            self.stop_table[i, : len(ids)] = ids
        penalised = [s.penalised for s in seqs]
        self.penalised = np.array(penalised, bool)
        self.num_penalised = sum(penalised)  # 0: `record` counts no tokens
        self.last_times = np.array([s.last_token_time for s in seqs], np.float64)
        self.plan: SchedulerOutput | None = None  # planned, not yet recorded
        self.gone: np.ndarray | None = None  # bool[n]: `record`'s, of the step it recorded

    _ARRAYS = ("i64", "i32", "stop_table", "penalised", "last_times")

    # The columns by name (views: the arrays are replaced, never written, once a plan
    # holds them; only caps and registered are written in place).
    rows = property(lambda self: self.i64[:, 0])  # i64[n]: rows of the persistent batch
    ends = property(lambda self: self.i64[:, 1])  # i64[n]: the next step's cache lengths
    caps = property(lambda self: self.i64[:, 2])  # i64[n]: tokens their pages hold
    registered = property(lambda self: self.i64[:, 3])  # i64[n]: pages keyed
    max_outputs = property(lambda self: self.i64[:, 4])  # i64[n]: output limits
    counters = property(lambda self: self.i32[:, 0])  # i32[n]: outputs so far
    tokens = property(lambda self: self.i32[:, 1])  # i32[n]: last tokens (< 0: unknown)
    src = property(lambda self: self.i32[:, 2])  # i32[n]: see `DecodeColumns.src`

    def keep(self, mask: np.ndarray) -> None:
        """Keeps the sequences where `mask` (bool[n]) is True."""
        keep = mask.tolist()
        self.seqs = tuple(itertools.compress(self.seqs, keep))
        self.request_ids = list(itertools.compress(self.request_ids, keep))
        self.attached = list(itertools.compress(self.attached, keep))
        for name in self._ARRAYS:
            setattr(self, name, getattr(self, name)[mask])
        if self.num_penalised:
            self.num_penalised = int(self.penalised.sum())

    def extend(self, more: SteadyDecode) -> None:
        """Appends the columns of `more` (the sequences right after these)."""
        # New objects: a plan in flight (async scheduling) holds the old ones.
        self.seqs += more.seqs
        self.request_ids = self.request_ids + more.request_ids
        self.attached = self.attached + more.attached
        width = max(self.stop_table.shape[1], more.stop_table.shape[1])
        for columns in (self, more):
            if columns.stop_table.shape[1] < width:
                columns.stop_table = np.pad(
                    columns.stop_table,
                    ((0, 0), (0, width - columns.stop_table.shape[1])),
                    constant_values=-1,
                )
        for name in self._ARRAYS:
            setattr(self, name, np.concatenate([getattr(self, name), getattr(more, name)]))
        self.num_penalised += more.num_penalised

    def plan_next(
        self, kv: KVCacheManager, register: Callable[[list[SequenceState], list[int]], None]
    ) -> DecodeColumns | None:
        """The next step's decodes. Allocates the pages of the sequences whose token
        starts a new one and registers (`register(seqs, ends)`) the pages that fill;
        None when a page cannot be had (the general path then preempts) or the work of
        a sequence raised (the general path then fails that sequence alone), keeping
        what it allocated."""
        ends = self.ends
        seqs = self.seqs
        try:
            grow = np.flatnonzero(ends > self.caps)
            if grow.size:
                growing = [seqs[i] for i in grow.tolist()]
                granted = allocate_decodes(kv, growing, ends[grow].tolist())
                self.i64[grow[:granted], 2] = [
                    kv.num_pages(seq) * self.page_size for seq in growing[:granted]
                ]
                if granted < len(growing):
                    return None
            if self.caching:
                filled = np.flatnonzero(ends // self.page_size > self.registered)
                if filled.size:
                    filling = [seqs[i] for i in filled.tolist()]
                    register(filling, ends[filled].tolist())
                    self.i64[filled, 3] = [kv.num_keys(seq) for seq in filling]
        except Exception:  # the general path plans the step and isolates the fault
            return None
        num_pages = -(-ends // self.page_size)
        return DecodeColumns(
            seqs,
            self.request_ids,
            self.rows,
            ends,
            num_pages,
            self.counters,
            self.tokens,
            self.src,
            self.stop_table,
            self.attached,
        )

    def record(
        self, toks: np.ndarray, now: float, dead: np.ndarray | None
    ) -> tuple[list[tuple[SequenceState, FinishReason]], np.ndarray]:
        """Appends the planned step's tokens (`toks`, i32[n]) to their sequences (cache
        length, penalty counts, token time; no logprobs, `decodes_steadily`) and advances
        the columns; one that ended while the step ran (True in `dead`, bool[n], or
        None) takes nothing. Returns those that end, with why (stop token, else length:
        the caller finishes them), and each token's gap since its previous (f64[taken])."""
        seqs = self.seqs
        ends = self.ends
        tokens = toks.tolist()
        every = dead is None or not dead.any()
        alive = [True] * len(seqs) if every else (~dead).tolist()
        columns = zip(seqs, tokens, ends.tolist(), strict=True)
        live = columns if every else itertools.compress(columns, alive)
        for seq, token, end in live:  # no test per sequence when none died
            seq.output_token_ids.append(token)
            seq.num_computed_tokens = end
            seq.last_token_time = now
        if self.num_penalised:
            for i in np.flatnonzero(self.penalised).tolist():
                if alive[i]:
                    seqs[i].count_output(tokens[i])
        i32 = self.i32 + _NEXT_OUTPUT  # the columns one step on: counters + 1
        counters = i32[:, 0]
        over = counters >= self.max_outputs
        stop = stop_tokens(self.stop_table, toks) if self.stop_table.shape[1] else None
        if stop is not None:
            over |= stop
        if not every:
            over &= np.array(alive)
        self.gone = over if every else over | dead  # bool[n]: ended in the step, or before
        ended = [
            (seqs[i], FinishReason.STOP if stop is not None and stop[i] else FinishReason.LENGTH)
            for i in np.flatnonzero(over).tolist()
        ]
        gaps = now - self.last_times
        if not every:
            gaps = gaps[np.array(alive)]
        self.last_times = np.full(len(seqs), now)
        # The next step's columns: new arrays, since the recorded plan holds these.
        self._advanced(i32, toks, -1)
        return ended, gaps

    def advance(self, placeholder: int, dead: np.ndarray | None) -> list[SequenceState]:
        """Records the planned step as dispatched with its tokens unknown (async
        scheduling): appends `placeholder` to each running sequence (its cache length
        too) and advances the columns, each last token now at its row of
        this step's output (`dead`: as `record`'s). Returns the sequences that reach
        their output limit (the caller finishes them, reason "length"; a stop token
        shows at `resolve`)."""
        seqs = self.seqs
        ends = self.ends
        every = dead is None or not dead.any()
        alive = [True] * len(seqs) if every else (~dead).tolist()
        for seq, end, live in zip(seqs, ends.tolist(), alive, strict=True):
            if live:
                seq.output_token_ids.append(placeholder)
                seq.num_computed_tokens = end
        i32 = self.i32 + _NEXT_OUTPUT
        over = i32[:, 0] >= self.max_outputs
        if not every:
            over &= np.array(alive)
        self._advanced(i32, placeholder, np.arange(len(seqs)))
        return [seqs[i] for i in np.flatnonzero(over).tolist()]

    def _advanced(self, i32: np.ndarray, tokens, src) -> None:
        """The columns one step on, as new arrays (the recorded plan holds the old ones):
        cache lengths + 1, and `i32` (new, counters + 1) takes these tokens and rows."""
        i32[:, 1] = tokens
        i32[:, 2] = src
        self.i64, self.i32 = self.i64 + _NEXT_END, i32
        self.plan = None


class SteadyDecoder:
    """A scheduler's steady decode: makes the columns after an `update` of the general
    path (`after_update`), plans from them (`plan`) and records into them (`record`).

    Args:
      queues: the running sequences (and how they end).
      register: caches the pages the given decodes fill, shared within the step
        (`PrefixWriters.register_decodes`).
      max_model_len: the longest sequence.
      max_num_batched_tokens: the step's token budget (more decodes: no columns).
      enabled: whether it plans and records at all (`enabled` may change later).
    """

    def __init__(
        self,
        queues: SequenceQueues,
        register: Callable[[list[SequenceState], list[int]], None],
        *,
        max_model_len: int,
        max_num_batched_tokens: int,
        enabled: bool = True,
    ) -> None:
        self.queues = queues
        self.register = register
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enabled = enabled
        self.columns: SteadyDecode | None = None
        # Async scheduling: `id(seq)` to its row in the in-flight step's output, for the
        # sequences outside the columns that sampled there (`decodes_steadily`).
        self.pending: dict[int, int] = {}
        # The scheduler's departures when the last plan started (`unchanged`).
        self._departures = -1
        self._recorded: tuple | None = None  # `record`'s plan, departures, version, gone

    def drop(self) -> None:
        """Forgets the columns (the general path plans and records)."""
        self.columns = None
        self.pending = {}

    def _leading(self, start: int, eos_token_ids: tuple[int, ...]) -> list[SequenceState]:
        """The running sequences from `start` on that decode steadily, up to the first
        one that does not."""
        out = []
        pending = self.pending
        for seq in self.queues.running[start:]:
            if not decodes_steadily(seq, eos_token_ids, pending):
                break
            out.append(seq)
        return out

    def after_update(
        self, eos_token_ids: tuple[int, ...], in_flight: SchedulerOutput | None = None
    ) -> None:
        """Makes the columns of the leading decoding sequences (after the general path
        recorded a step; `in_flight`: a step dispatched with its tokens unknown, whose
        placeholders it recorded)."""
        s = self.queues
        kv = s.kv_cache_manager
        if not self.enabled or kv.sliding:
            return
        if in_flight is not None:
            self.pending = {id(c.seq): i for i, c in enumerate(in_flight.chunks) if c.samples}
        s.take_departed_rows()  # the new columns hold only running sequences
        seqs = self._leading(0, eos_token_ids)
        if seqs:
            self.columns = self._columns(seqs, eos_token_ids)

    def _columns(self, seqs: list[SequenceState], eos_token_ids: tuple[int, ...]) -> SteadyDecode:
        """New columns of `seqs` (each `decodes_steadily`)."""
        s = self.queues
        return SteadyDecode(
            seqs,
            s.kv_cache_manager,
            max_model_len=self.max_model_len,
            eos_token_ids=eos_token_ids,
            version=s.version,
            pending=self.pending,
        )

    def plan(self) -> tuple[DecodeColumns | None, Scheduled]:
        """The decodes of the next plan from the columns, after dropping the sequences
        that ended and appending those that started decoding right after them; and the
        set of scheduled sequences to go on with. None for the decodes (and no columns
        from now on) when the general path must plan the whole step: no columns, a
        change they cannot absorb, more of them than the token budget, or a page that
        could not be had."""
        steady, s = self.columns, self.queues
        # The rows of the sequences that ended since the last plan, taken.
        gone = s.take_departed_rows()
        self._departures = s.num_departures
        if steady is None:
            return None, Scheduled(())
        running = s.running
        if (
            not self.enabled
            or steady.version != s.version
            or steady.plan is not None  # its last plan was never recorded
        ):
            self.columns = None
            return None, Scheduled(())
        if gone:
            dead = rows_among(steady.rows, gone)
            if dead.any():
                steady.keep(~dead)
        n = len(steady.seqs)
        more = self._leading(n, steady.eos_token_ids) if len(running) > n else []
        if more:
            steady.extend(self._columns(more, steady.eos_token_ids))
            n = len(steady.seqs)
        if (
            not n
            or n > self.max_num_batched_tokens
            or running[:n] != list(steady.seqs)  # still the leading sequences
        ):
            self.columns = None
            return None, Scheduled(())
        decode = steady.plan_next(s.kv_cache_manager, self.register)
        if decode is None:
            self.columns = None
            return None, Scheduled(())
        return decode, Scheduled(decode.seqs)

    def planned(self, plan: SchedulerOutput) -> None:
        """The plan made with the columns' decodes (which `record` will record)."""
        self.columns.plan = plan

    def unchanged(self, plan: SchedulerOutput) -> bool:
        """Whether `plan` is the columns' current plan and no sequence was preempted or
        stopped running since it started: then `plan.running()` is `plan`."""
        steady, s = self.columns, self.queues
        return (
            steady is not None
            and steady.plan is plan
            and steady.version == s.version
            and s.num_departures == self._departures
        )

    def _dead(self, steady: SteadyDecode) -> np.ndarray | None:
        """bool[n]: the columns' sequences that stopped running since the plan started
        (their rows among the departed ones); None when none did."""
        gone = self.queues.departed_rows()
        return rows_among(steady.rows, gone) if gone else None

    def record(
        self,
        plan: SchedulerOutput,
        tokens: np.ndarray,
        eos_token_ids: tuple[int, ...],
    ) -> tuple[list[SequenceState], np.ndarray] | None:
        """Records the decodes of a plan made with the columns: the `tokens` (i32[n])
        each of them sampled; finishes the sequences that end. Returns those and each
        token's gap since its sequence's previous one; None (recording nothing) when
        `plan` is not the columns' current plan: the caller records it all with
        `Scheduler.update`."""
        steady, s = self.columns, self.queues
        if (
            steady is None
            or steady.plan is not plan
            or steady.version != s.version
            or steady.eos_token_ids != eos_token_ids
        ):
            return None
        now = time.monotonic()
        ended, gaps = steady.record(tokens, now, self._dead(steady))
        for seq, reason in ended:
            s.finish(seq, reason, now)
        self._recorded = (plan, s.num_departures, s.version, steady.gone)
        return [seq for seq, _ in ended], gaps

    def gone(self, plan: SchedulerOutput) -> np.ndarray | None:
        """bool[n]: which of `plan`'s columns stopped running in its step or while it
        ran, if `record` recorded it and none left or was preempted since; else None."""
        r, s = self._recorded, self.queues
        if r is None or r[0] is not plan or r[1] != s.num_departures or r[2] != s.version:
            return None
        return r[3]

    def advance(self, plan: SchedulerOutput, placeholder: int) -> bool:
        """Records the decodes of a dispatched plan made with the columns with their
        tokens unknown (async scheduling; `SteadyDecode.advance`), finishing those that
        reach their output limit, and notes the rows of its `extra` chunks that sample.
        False (recording nothing) when `plan` is not the columns' current plan: the
        caller records it all with `Scheduler.update`."""
        steady, s = self.columns, self.queues
        if steady is None or steady.plan is not plan or steady.version != s.version:
            return False
        now = time.monotonic()
        for seq in steady.advance(placeholder, self._dead(steady)):
            s.finish(seq, FinishReason.LENGTH, now)
        n = plan.num_decode
        self.pending = {id(c.seq): n + j for j, c in enumerate(plan.extra) if c.samples}
        return True

    def resolve(self, decode: DecodeColumns, tokens: list[int]) -> list[float]:
        """Puts the tokens a step made with the columns sampled (`tokens`: one per
        decode) in place of their placeholders, and ends the sequences whose
        token is a stop token there (reason "stop", as `SequenceQueues.resolve`). A
        sequence aborted, or ended at an earlier token, takes none. Returns, for each
        token taken, the time since its sequence's previous one."""
        now = time.monotonic()
        took, gaps = [], []
        for seq, index, token in zip(decode.seqs, decode.counters.tolist(), tokens, strict=True):
            out = seq.output_token_ids
            if index >= len(out) or seq.finish_reason is FinishReason.ABORT:
                took.append(False)
                continue
            out[index] = token
            gaps.append(now - seq.last_token_time)  # its previous token's, as resolved
            seq.last_token_time = now
            if seq.penalised:
                seq.count_output(token)
            took.append(True)
        stop = stop_tokens(decode.stops, np.array(tokens, np.int64))
        stop &= np.array(took)
        for i in np.flatnonzero(stop).tolist():
            seq = decode.seqs[i]
            seq.truncate_outputs(int(decode.counters[i]) + 1)
            self.queues.end_stopped(seq, now)
        return gaps
