"""The steady decode: a running batch in which every sequence decodes, planned and
recorded over columns. No JAX.

While nothing changes which sequences run (`SequenceQueues.version`), step after step
every running sequence decodes one token. The scheduler then keeps the batch as NumPy
columns (rows, cache lengths, output counters, last tokens, output limits, stop
tokens) and advances them with a few array operations per step: planning does Python
work only for the sequences whose next token needs a new page or fills one (a page in
every `page_size` steps), and recording only appends each token to its sequence's
list (one short loop) and ends the sequences that stop. Anything else (an admission,
a preemption, a sequence that ends, an abort) changes the version, and the scheduler
plans the next step the general way, which makes new columns once the batch is
steady again.

Sequences whose steps need more than that keep the general path: top logprobs,
prompt scores, sliding windows, speculative proposals, async placeholders and
multi-step decoding (the engine turns the steady decode off for the last three).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from paxkv.host.kv_cache_manager import KVCacheManager
from paxkv.host.plan import DecodeColumns, SchedulerOutput
from paxkv.host.sequence import SequenceState
from paxkv.request import FinishReason

if TYPE_CHECKING:
    from paxkv.host.scheduler import Scheduler

# Stop tokens per sequence kept in the columns; a sequence with more keeps the general path.
MAX_STEADY_STOPS = 16


class SteadyDecode:
    """The columns of a running batch that only decodes, as of its last recorded step.

    Args:
      seqs: the running sequences, in the order of the scheduler's running list.
      kv: their pages.
      max_model_len: the longest sequence.
      eos_token_ids: the model's EOS ids the stop columns were made with.
      version: the scheduler's `SequenceQueues.version` they hold for.
    """

    def __init__(
        self,
        seqs: tuple[SequenceState, ...],
        kv: KVCacheManager,
        *,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        version: int,
    ) -> None:
        self.seqs = seqs
        self.request_ids = [s.request_id for s in seqs]
        self.version = version
        self.eos_token_ids = eos_token_ids
        ps = kv.page_size
        self.page_size = ps
        self.rows = np.array([kv.row(s) for s in seqs], np.int64)
        # The next step's cache lengths, outputs so far and input tokens.
        self.ends = np.array([s.num_computed_tokens + 1 for s in seqs], np.int64)
        self.counters = np.array([len(s.output_token_ids) for s in seqs], np.int32)
        self.tokens = np.array([s.output_token_ids[-1] for s in seqs], np.int32)
        self.caps = np.array([kv.num_pages(s) for s in seqs], np.int64) * ps
        self.registered = np.array([kv.num_keys(s) for s in seqs], np.int64)
        self.caching = kv.prefix_cache.enabled
        self.max_outputs = np.array(
            [min(s.params.max_tokens, max_model_len - s.num_prompt) for s in seqs], np.int64
        )
        stops = [s.stop_token_ids(eos_token_ids) for s in seqs]
        width = max(map(len, stops), default=0)
        self.stop_table = np.full((len(seqs), max(width, 1)), -1, np.int64)  # -1: no stop
        for i, ids in enumerate(stops):
            self.stop_table[i, : len(ids)] = ids
        self.penalised = [i for i, s in enumerate(seqs) if s.penalised]
        self.last_times = np.array([s.last_token_time for s in seqs], np.float64)
        self.plan: SchedulerOutput | None = None  # planned, not yet recorded

    @staticmethod
    def eligible(
        plan: SchedulerOutput, running: list[SequenceState], eos_token_ids: tuple[int, ...]
    ) -> bool:
        """Whether a recorded `plan` leaves a steady batch: every running sequence
        decoded one token in it (in running order), and none needs the general path."""
        chunks = plan.chunks
        if len(chunks) != len(running) or plan.preempted:
            return False
        for c, seq in zip(chunks, running, strict=True):
            if (
                c.seq is not seq
                or c.num_tokens != 1
                or not c.samples
                or c.num_draft
                or seq.track_top
                or seq.prompt_scores is not None
                or not seq.output_token_ids
                or seq.params.max_tokens == 0
                or len(seq.stop_set(eos_token_ids)) > MAX_STEADY_STOPS
            ):
                return False
        return True

    def plan_next(
        self, kv: KVCacheManager, register, version: int
    ) -> SchedulerOutput | None:  # register: (seq, end) -> None
        """The next step's plan: every sequence decodes. Allocates the pages of the
        sequences whose token starts a new one and registers (`register(seq, end)`)
        the pages that fill; None when a page cannot be had (the general path then
        preempts), keeping what it allocated."""
        ends = self.ends
        seqs = self.seqs
        for i in np.flatnonzero(ends > self.caps).tolist():
            seq = seqs[i]
            if not kv.allocate(seq, int(ends[i])):
                return None
            self.caps[i] = kv.num_pages(seq) * self.page_size
        if self.caching:
            ps = self.page_size
            for i in np.flatnonzero(ends // ps > self.registered).tolist():
                seq = seqs[i]
                register(seq, int(ends[i]))
                self.registered[i] = kv.num_keys(seq)
        num_pages = -(-ends // self.page_size)
        columns = DecodeColumns(
            seqs, self.request_ids, self.rows, ends, num_pages, self.counters, self.tokens
        )
        self.plan = plan = SchedulerOutput(None, (), decode=columns, version=version)
        return plan

    def record(
        self, tokens: list[int], logprobs: list[float], now: float
    ) -> tuple[list[tuple[SequenceState, FinishReason]], list[float]]:
        """Records the planned step's tokens: appends each to its sequence (its cache
        length, penalty counts and token time too) and advances the columns. Returns
        the sequences that end, with why (a stop token, else max_tokens or
        max_model_len: the caller finishes them), and each token's gap since the
        sequence's previous one."""
        ends = self.ends
        for seq, token, logprob, end in zip(
            self.seqs, tokens, logprobs, ends.tolist(), strict=True
        ):
            seq.output_token_ids.append(token)
            seq.logprobs.append(logprob)
            seq.num_computed_tokens = end
            seq.last_token_time = now
        for i in self.penalised:
            self.seqs[i]._count(tokens[i], 1)
        toks = np.array(tokens, np.int64)
        counters = self.counters + 1
        stop = (self.stop_table == toks[:, None]).any(axis=1)
        length = counters >= self.max_outputs
        ended = [
            (self.seqs[i], FinishReason.STOP if stop[i] else FinishReason.LENGTH)
            for i in np.flatnonzero(stop | length).tolist()
        ]
        gaps = (now - self.last_times).tolist()
        self.last_times = np.full(len(self.seqs), now)
        # The next step's columns: new arrays, since the recorded plan holds these.
        self.ends = ends + 1
        self.counters = counters
        self.tokens = toks.astype(np.int32)
        self.plan = None
        return ended, gaps


class SteadyDecoder:
    """A scheduler's steady decode: makes the columns once a recorded plan leaves the
    batch steady (`after_update`), plans from them (`plan`) and records into them
    (`record`) while the scheduler's version holds, and drops them otherwise.

    Args:
      scheduler: whose running batch (its `steady_decode` switches this on and off).
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.columns: SteadyDecode | None = None

    def drop(self) -> None:
        """Forgets the columns (the general path records the next step)."""
        self.columns = None

    def after_update(
        self,
        plan: SchedulerOutput,
        finished: list[SequenceState],
        eos_token_ids: tuple[int, ...],
    ) -> None:
        """Makes the columns if the plan `update` just recorded leaves a steady batch."""
        s = self.scheduler
        kv = s.kv_cache_manager
        if (
            s.steady_decode
            and not finished
            and plan.version == s.version
            and not kv.sliding
            and SteadyDecode.eligible(plan, s.running, eos_token_ids)
        ):
            self.columns = SteadyDecode(
                tuple(s.running),
                kv,
                max_model_len=s.max_model_len,
                eos_token_ids=eos_token_ids,
                version=s.version,
            )

    def plan(self) -> SchedulerOutput | None:
        """The next plan of a steady batch, or None when the general path must plan it:
        no columns, the running set changed, a waiting sequence could be admitted, or
        a page could not be had."""
        steady, s = self.columns, self.scheduler
        if steady is None:
            return None
        n = len(steady.seqs)
        if (
            not s.steady_decode
            or steady.version != s.version
            or steady.plan is not None  # its last plan was never recorded
            or n > s.max_num_batched_tokens
            or (s.waiting and n < min(s.max_num_seqs, s.max_num_batched_tokens))
        ):
            self.columns = None
            return None
        plan = steady.plan_next(s.kv_cache_manager, s._writers.register, s.version)
        if plan is None:
            self.columns = None
        return plan

    def record(
        self,
        plan: SchedulerOutput,
        tokens: list[int],
        logprobs: list[float],
        eos_token_ids: tuple[int, ...],
    ) -> tuple[list[SequenceState], list[float]] | None:
        """Records a steady plan's `tokens` and `logprobs` (one per sequence) and finishes
        the sequences that end. Returns them and each token's gap since its sequence's
        previous one; None (recording nothing) when `plan` is not the columns' current
        plan: the caller records it with `Scheduler.update`."""
        steady, s = self.columns, self.scheduler
        if (
            steady is None
            or steady.plan is not plan
            or plan.version != s.version
            or steady.eos_token_ids != eos_token_ids
        ):
            return None
        now = time.monotonic()
        ended, gaps = steady.record(tokens, logprobs, now)
        for seq, reason in ended:
            s._finish(seq, reason, now)
        if ended:
            self.columns = None
        else:
            steady.version = s.version
        return [seq for seq, _ in ended], gaps
