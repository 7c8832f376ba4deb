"""The running decodes: every running sequence whose next step is a decode, kept as
columns across steps, planned and recorded by array operations. No JAX.

Most running sequences decode one token per step, step after step. The scheduler
plans every decode of a step from these NumPy columns (rows of the persistent batch,
cache lengths, output counters, last tokens, output limits, stop tokens), and makes
chunks only for the sequences being prefilled and those admitted. Each step advances
the columns with a few array operations; Python runs only for what changes: a
sequence whose next token needs a new page (making room by preemption, as for a
chunk) or fills one (one step in `page_size`), one that ends (dropped at the next
plan), one whose prefill completed (appended), and those that keep logprobs (their
logprobs taken one by one).

With async scheduling the columns' last tokens are placeholders of the step in
flight (`src`: each one's row in that step's output, where the device reads it);
`advance` records a dispatched plan's placeholders, `resolve` the real tokens when
the step is read, ending those that sampled a stop token.

A step whose decodes are recorded another way (speculative proposals, whose chunks
change what a decode holds; an N-step loop; a plan pruned after a failure) leaves the
columns unable to tell what their sequences hold: the next plan makes them again from
the running list (with speculation, every plan does).
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
from paxkv.host.step_plan import (
    DecodeColumns,
    Scheduled,
    SchedulerOutput,
    all_running,
    rows_among,
    stop_tokens,
)

# The packed integer columns of `RunningColumns` (`i64`, `i32`), in order.
I64 = ("rows", "ends", "caps", "registered", "max_outputs")
I32 = ("counters", "tokens", "src")
_RUNNING = SeqStatus.RUNNING
_NEXT_END = np.array([0, 1, 0, 0, 0], np.int64)  # a step: cache length + 1
_NEXT_OUTPUT = np.array([1, 0, 0], np.int32)  # and output counter + 1


def is_decoding(seq: SequenceState, pending: Mapping[int, int]) -> bool:
    """Whether `seq`'s next step is a decode: running, every token but its last in the
    cache, and that last one an output the host knows or the in-flight step holds
    (`pending`: `id(seq)` to its row in that step's output, async scheduling)."""
    out = seq.output_token_ids
    return (
        seq.status is _RUNNING
        and seq.num_computed_tokens + 1 == seq.num_prompt + len(out)
        and bool(out)
        and (out[-1] >= 0 or id(seq) in pending)
    )


class RunningColumns:
    """The columns of the leading decoding sequences of a running batch.

    Args:
      seqs: the sequences (each `is_decoding`).
      kv: their pages.
      max_model_len: the longest sequence.
      eos_token_ids: the model's EOS ids the stop columns were made with.
      version: the scheduler's `SequenceQueues.version` they hold for.
      pending: `id(seq)` to its row in the in-flight step's output, for each sequence
        whose last token is a placeholder (see `decodes`).
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
        tracked = [s.track_top for s in seqs]  # keep logprobs and top logprobs
        self.track = np.array(tracked, bool)
        self.num_tracked = sum(tracked)
        self.last_times = np.array([s.last_token_time for s in seqs], np.float64)
        self.plan: SchedulerOutput | None = None  # planned, not yet recorded
        self.gone: np.ndarray | None = None  # bool[n]: `record`'s, of the step it recorded

    _ARRAYS = ("i64", "i32", "stop_table", "penalised", "track", "last_times")

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
        if self.num_tracked:
            self.num_tracked = int(self.track.sum())

    def extend(self, more: RunningColumns) -> None:
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
        self.num_tracked += more.num_tracked

    def plan_next(
        self,
        kv: KVCacheManager,
        register: Callable[[list[SequenceState], list[int]], None],
        grow: Callable[[list[SequenceState], list[int]], None],
        fail: Callable[[SequenceState, BaseException], None],
    ) -> DecodeColumns | None:
        """The next step's decodes (None: none left). Window groups let go of the pages
        a decode no longer reads; the sequences whose token starts a new page get it
        (`allocate_decodes`, or else `grow(seqs, ends)`, which makes room by preemption
        and fails a sequence whose work raises); the pages that fill are registered
        (`register(seqs, ends)`, one by one if that raises, `fail`ing the sequence whose
        registration raises).
        The sequences that stopped running meanwhile (preempted, failed) leave."""
        ps = self.page_size
        if kv.sliding:
            for seq, end in zip(self.seqs, self.ends.tolist(), strict=True):
                kv.slide(seq, end - 1)
        grow_at = np.flatnonzero(self.ends > self.caps)
        if grow_at.size:
            growing = [self.seqs[i] for i in grow_at.tolist()]
            wanted = self.ends[grow_at].tolist()
            try:
                granted = allocate_decodes(kv, growing, wanted)
            except Exception:  # `grow` retries each and isolates the fault
                granted = 0
            self.i64[grow_at[:granted], 2] = [kv.num_pages(seq) * ps for seq in growing[:granted]]
            if granted < len(growing):  # room made by preemption, or a fault isolated
                grow(growing[granted:], wanted[granted:])
                self.i64[grow_at, 2] = [kv.num_pages(seq) * ps for seq in growing]
                self._keep_running()
        if self.caching and len(self.seqs):
            filled = np.flatnonzero(self.ends // ps > self.registered)
            if filled.size:
                filling = [self.seqs[i] for i in filled.tolist()]
                ends = self.ends[filled].tolist()
                try:
                    register(filling, ends)
                except Exception:
                    for seq, end in zip(filling, ends, strict=True):
                        try:
                            register([seq], [end])
                        except Exception as e:  # isolated: only seq fails
                            fail(seq, e)
                    self._keep_running()
                    filled = np.flatnonzero(self.ends // ps > self.registered)
                    filling = [self.seqs[i] for i in filled.tolist()]
                self.i64[filled, 3] = [kv.num_keys(seq) for seq in filling]
        if not len(self.seqs):
            return None
        ends = self.ends
        return DecodeColumns(
            self.seqs,
            self.request_ids,
            self.rows,
            ends,
            -(-ends // ps),
            self.counters,
            self.tokens,
            self.src,
            self.stop_table,
            self.attached,
            track=self.track if self.num_tracked else None,
        )

    def _keep_running(self) -> None:
        """Drops the sequences that stopped running (a C loop when none did)."""
        if not all_running(self.seqs):
            self.keep(np.array([seq.status is _RUNNING for seq in self.seqs], bool))

    def record(
        self,
        toks: np.ndarray,
        now: float,
        dead: np.ndarray | None,
        tops: Callable[[int], tuple] | None = None,
        fail: Callable[[SequenceState, BaseException], None] | None = None,
    ) -> tuple[list[tuple[SequenceState, FinishReason]], np.ndarray]:
        """Appends the planned step's tokens (`toks`, i32[n]) to their sequences (cache
        length, penalty counts, token time, and for those keeping logprobs `tops(i)`:
        `(logprob, top logprobs)` of row i) and advances the columns; one that ended
        while the step ran (True in `dead`, bool[n], or None) takes nothing; one whose
        `tops` raises is `fail`ed alone. Returns those that end, with why (stop token, else length:
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
        failed = []
        if self.num_tracked:
            for i in np.flatnonzero(self.track).tolist():
                if alive[i]:
                    try:
                        logprob, top = tops(i)
                    except Exception as e:  # isolated: only this sequence fails
                        logprob, top = 0.0, None
                        failed.append((seqs[i], e))
                    seqs[i].logprobs.append(logprob)
                    seqs[i].top_logprobs.append(top)
        for seq, e in failed:
            fail(seq, e)
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
            if seqs[i].status is _RUNNING  # not failed
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
        if self.num_tracked:  # their logprobs arrive with the token (`resolve`)
            for i in np.flatnonzero(self.track).tolist():
                if alive[i]:
                    seqs[i].logprobs.append(0.0)
                    seqs[i].top_logprobs.append(None)
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


class RunningDecodes:
    """A scheduler's running decodes: every running sequence whose next step is a
    decode, as columns (`RunningColumns`) that each plan is made from (`plan`) and that
    record the steps made with them (`record`, `advance` and `resolve`).

    The columns persist across steps and change by what changed: sequences that ended
    leave, those whose prefill completed join (`plan`'s `joiners`). When they cannot
    tell what their sequences hold (a plan recorded another way: speculative proposals,
    an N-step loop, a weight update's preemptions), they are made again from the
    running list at the next plan (`drop`); with `rebuild_each_step` (speculation:
    proposals change a decode's tokens every step) always.

    Args:
      queues: the running sequences (and how they end).
      register: caches the pages the given decodes fill, shared within the step
        (`PrefixWriters.register_decodes`).
      grow: gives the given decodes the pages for their next token, preempting others
        to make room (`Scheduler`).
      max_model_len: the longest sequence.
      rebuild_each_step: make the columns from the running list at every plan.
    """

    def __init__(
        self,
        queues: SequenceQueues,
        register: Callable[[list[SequenceState], list[int]], None],
        grow: Callable[[list[SequenceState], list[int]], None],
        *,
        max_model_len: int,
        rebuild_each_step: bool = False,
    ) -> None:
        self.queues = queues
        self.register = register
        self.grow = grow
        self.max_model_len = max_model_len
        self.rebuild_each_step = rebuild_each_step
        self.eos_token_ids: tuple[int, ...] = ()  # the last `update`'s
        self.columns: RunningColumns | None = None
        # Async scheduling: `id(seq)` to its row in the in-flight step's output, for the
        # sequences whose last token is a placeholder of a chunk that sampled there.
        self.pending: dict[int, int] = {}
        self._pending_decodes: tuple[SequenceState, ...] = ()  # and the columns' (rows 0..)
        # The scheduler's departures when the last plan started (`unchanged`).
        self._departures = -1
        self._recorded: tuple | None = None  # `record`'s plan, departures, version, gone

    def drop(self) -> None:
        """Forgets the columns: the next plan makes them from the running list."""
        self.columns = None

    def after_update(
        self, eos_token_ids: tuple[int, ...], in_flight: SchedulerOutput | None = None
    ) -> None:
        """After a plan was recorded another way (`Scheduler.update` of all its chunks):
        the columns are made again at the next plan (`in_flight`: a step dispatched
        with its tokens unknown, whose placeholders the next plan reads on the device)."""
        self.eos_token_ids = eos_token_ids
        if in_flight is not None:
            self.pending = {id(c.seq): i for i, c in enumerate(in_flight.chunks) if c.samples}
            self._pending_decodes = ()
        self.columns = None

    def _all_pending(self) -> dict[int, int]:
        """`pending`, and the rows of the in-flight step's decodes if it was made with
        the columns (built only when the columns are made again)."""
        if not self._pending_decodes:
            return self.pending
        rows = {id(seq): i for i, seq in enumerate(self._pending_decodes)}
        return rows | self.pending

    def _columns(self, seqs: list[SequenceState], pending: Mapping[int, int]) -> RunningColumns:
        """New columns of `seqs` (each `is_decoding` with `pending`)."""
        s = self.queues
        return RunningColumns(
            seqs,
            s.kv_cache_manager,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            version=s.version,
            pending=pending,
        )

    def plan(
        self, joiners: Sequence[SequenceState], skip: Callable[[SequenceState], bool] | None
    ) -> tuple[DecodeColumns | None, Scheduled]:
        """The decodes of the next plan: every running sequence that decodes, after
        dropping from the columns those that ended and appending `joiners` (running
        sequences that started decoding since the last plan); made from the running
        list when the columns are gone, stale (a preemption since, their last plan not
        recorded) or `rebuild_each_step`, without those `skip` says wait a step. Gives
        the decodes their pages (preempting to make room) and registers the pages they
        fill. Returns them (None: no decode) and the set of scheduled sequences to go
        on with."""
        columns, s = self.columns, self.queues
        gone = s.take_departed_rows()
        self._departures = s.num_departures
        if (
            columns is None
            or self.rebuild_each_step
            or columns.version != s.version
            or columns.plan is not None  # its last plan was never recorded
            or columns.eos_token_ids != self.eos_token_ids
        ):
            pending = self._all_pending()
            seqs = [
                seq
                for seq in s.running
                if is_decoding(seq, pending) and (skip is None or not skip(seq))
            ]
            columns = self.columns = self._columns(seqs, pending)
        else:
            if gone:
                dead = rows_among(columns.rows, gone)
                if dead.any():
                    columns.keep(~dead)
            if joiners:
                columns.extend(self._columns(list(joiners), self.pending))
        decode = columns.plan_next(s.kv_cache_manager, self.register, self.grow, s.fail)
        columns.version = s.version  # its preemptions are absorbed: those preempted left
        if decode is None:
            return None, Scheduled(())
        return decode, Scheduled(decode.seqs)

    def planned(self, plan: SchedulerOutput) -> None:
        """The plan made with the columns' decodes, all of them (which `record` will
        record); preemptions while it was made took none of them."""
        self.columns.plan = plan
        self.columns.version = self.queues.version

    def unchanged(self, plan: SchedulerOutput) -> bool:
        """Whether `plan` is the columns' current plan and no sequence was preempted or
        stopped running since it started: then `plan.running()` is `plan`."""
        columns, s = self.columns, self.queues
        return (
            columns is not None
            and columns.plan is plan
            and columns.version == s.version
            and s.num_departures == self._departures
        )

    def _dead(self, columns: RunningColumns) -> np.ndarray | None:
        """bool[n]: the columns' sequences that stopped running since the plan started
        (their rows among the departed ones); None when none did."""
        gone = self.queues.departed_rows()
        return rows_among(columns.rows, gone) if gone else None

    def record(
        self,
        plan: SchedulerOutput,
        tokens: np.ndarray,
        eos_token_ids: tuple[int, ...],
        tops: Callable[[int], tuple] | None = None,
    ) -> tuple[list[SequenceState], np.ndarray] | None:
        """Records the decodes of a plan made with the columns: the `tokens` (i32[n])
        each of them sampled (with `tops(i)`, `(logprob, top logprobs)` of decode i, for
        those keeping logprobs); finishes the sequences that end. Returns those and each
        token's gap since its sequence's previous one; None (recording nothing) when
        `plan` is not the columns' current plan: the caller records it all with
        `Scheduler.update`."""
        columns, s = self.columns, self.queues
        if (
            columns is None
            or columns.plan is not plan
            or columns.version != s.version
            or columns.eos_token_ids != eos_token_ids
        ):
            return None
        now = time.monotonic()
        self.eos_token_ids = eos_token_ids
        ended, gaps = columns.record(tokens, now, self._dead(columns), tops, s.fail)
        for seq, reason in ended:
            s.finish(seq, reason, now)
        self._recorded = (plan, s.num_departures, s.version, columns.gone)
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
        tokens unknown (async scheduling; `RunningColumns.advance`), finishing those that
        reach their output limit, and notes the rows of its `extra` chunks that sample.
        False (recording nothing) when `plan` is not the columns' current plan: the
        caller records it all with `Scheduler.update`."""
        columns, s = self.columns, self.queues
        if columns is None or columns.plan is not plan or columns.version != s.version:
            return False
        now = time.monotonic()
        for seq in columns.advance(placeholder, self._dead(columns)):
            s.finish(seq, FinishReason.LENGTH, now)
        n = plan.num_decode
        self.pending = {id(c.seq): n + j for j, c in enumerate(plan.extra) if c.samples}
        self._pending_decodes = plan.decode.seqs  # rows 0 .. n - 1 (`_all_pending`)
        return True

    def resolve(
        self,
        decode: DecodeColumns,
        tokens: list[int],
        tops: Callable[[int], tuple] | None = None,
    ) -> list[float]:
        """Puts the tokens a step made with the columns sampled (`tokens`: one per
        decode; `tops(i)`: decode i's `(logprob, top logprobs)`, for those keeping them)
        in place of their placeholders, and ends the sequences whose token is a stop
        token there (reason "stop", as `SequenceQueues.resolve`). A sequence aborted, or
        ended at an earlier token, takes none. Returns, for each token taken, the time
        since its sequence's previous one."""
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
        if decode.track is not None:
            for i in np.flatnonzero(decode.track).tolist():
                if took[i]:
                    seq, index = decode.seqs[i], int(decode.counters[i])
                    try:
                        seq.logprobs[index], seq.top_logprobs[index] = tops(i)
                    except Exception as e:  # isolated: only this sequence fails
                        self.queues.fail(seq, e)
                        took[i] = False
        stop = stop_tokens(decode.stops, np.array(tokens, np.int64))
        stop &= np.array(took)
        for i in np.flatnonzero(stop).tolist():
            seq = decode.seqs[i]
            seq.truncate_outputs(int(decode.counters[i]) + 1)
            self.queues.end_stopped(seq, now)
        return gaps
