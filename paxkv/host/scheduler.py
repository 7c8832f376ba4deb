"""The host-side scheduler: which sequences run in the next compiled step. No JAX.

Each step it fills a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`): running decodes first, then the prefill chunks of running sequences,
then new sequences admitted first-come-first-served. Which pages a sequence holds is the
`KVCacheManager`'s business (prefix reuse included). When a running sequence needs a
page and none is left, the scheduler preempts by recompute: the victim (lowest
priority, then latest arrival) frees its pages and goes back to the front of the
waiting queue, and later re-prefills its prompt plus the tokens it had generated, so
its output continues exactly.

`schedule` returns a `SchedulerOutput` (`paxkv.host.plan`), a snapshot of the step.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable

from paxkv.host.kv_cache_manager import KVCacheManager
from paxkv.host.kv_groups import KVGroupLayout
from paxkv.host.page_pool import PagePool
from paxkv.host.plan import ScheduledChunk, SchedulerOutput
from paxkv.host.reservation import PagedReservation
from paxkv.host.sequence import SeqStatus, SequenceState, TopLogprobs
from paxkv.kv_layout import NULL_PAGE, cdiv
from paxkv.request import FinishReason, SamplingParams

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerOutput"]


class Scheduler:
    """Continuous batching with chunked prefill and preemption by recompute.

    Args:
      pool: the host page pool of the device cache.
      page_size: tokens per page.
      max_num_seqs: most sequences in one step.
      max_num_batched_tokens: most tokens in one step (the token budget).
      max_model_len: longest sequence (prompt + output).
      watermark: fraction of the pool kept free when admitting a new sequence, so
        running sequences can grow without an immediate preemption.
      enable_prefix_caching: reuse cached pages of equal prefixes.
      reservation: how many token slots a sequence holds (default: the pages it needs;
        see `paxkv.host.reservation`).
      layout: the KV-cache groups (`paxkv.host.kv_groups`; default: one global group).
    """

    def __init__(
        self,
        pool: PagePool,
        *,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        reservation: PagedReservation | None = None,
        layout: KVGroupLayout | None = None,
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"{max_num_batched_tokens=} and {max_num_seqs=} must be positive")
        self.kv_cache = KVCacheManager(
            pool,
            page_size=page_size,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            reservation=reservation,
            layout=layout,
            max_chunk_tokens=max_num_batched_tokens,
        )
        self.pool = pool
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.watermark_pages = int(watermark * pool.num_usable)
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.peak_running = 0
        self._failed: list[tuple[SequenceState, str]] = []
        # Pages the plan being made will write, registered in the prefix cache already:
        # page -> the sequence writing it (see `_register`).
        self._writers: dict[int, SequenceState] = {}

    # Admission.

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raises ValueError when a request could never be served (rejected at submit)."""
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens + max_tokens={params.max_tokens} = {total} "
                f"exceeds max_model_len={self.max_model_len}"
            )
        pages = self.kv_cache.pages_at_submit(total)
        if pages > self.pool.num_usable:
            raise ValueError(
                f"prompt + max_tokens needs {pages} pages but the whole pool has {self.pool.num_usable}"
            )

    def add(self, seq: SequenceState) -> None:
        """Queues a validated sequence (see `check_fits`)."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    # Scheduling.

    def _preempt(self, seq: SequenceState) -> None:
        self.num_recomputed_tokens += seq.num_computed_tokens
        self.kv_cache.preempt(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def preempt_all(self) -> None:
        """Preempts every running sequence (each recomputes its K/V when it runs again,
        e.g. under new weights), keeping their order at the front of the queue."""
        for seq in reversed(list(self.running)):
            self._preempt(seq)

    def schedule(self) -> SchedulerOutput:
        """Plans the next step and reserves its pages. Call `update` with its results."""
        budget = self.max_num_batched_tokens
        self._writers = {}
        chunks: list[ScheduledChunk] = []
        preempted: list[SequenceState] = []
        scheduled: set[int] = set()
        now = time.monotonic()
        ps = self.page_size
        caching = self.kv_cache.enable_prefix_caching
        sliding = self.kv_cache.sliding
        # Decodes (one token left to compute) first, then prefill chunks; each in order of
        # precedence, which `self.running` keeps.
        prefills = []
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted to make room for a sequence before it
            outputs = seq.output_token_ids
            end = seq.num_computed_tokens + 1
            if end != seq.num_prompt + len(outputs):
                prefills.append(seq)
                continue
            if budget == 0:
                continue
            try:
                if outputs and end <= len(seq.pages) * ps:  # the common decode: no new page
                    if sliding and end > seq.slide_at:  # a page falls behind a window
                        self.kv_cache.slide(seq, end - 1)
                    chunk = ScheduledChunk(
                        seq, end - 1, 1, True, (outputs[-1],), seq.row, -(-end // ps), len(outputs)
                    )
                else:
                    chunk = self._schedule_running(seq, budget, scheduled, preempted)
                if chunk is None:
                    continue
                if caching and end // ps > len(seq.keys):
                    self._register(seq, end)
            except Exception as e:  # isolated: only seq fails
                self.fail(seq, e)
                continue
            chunks.append(chunk)
            scheduled.add(id(seq))
            budget -= 1
        for seq in prefills:
            if budget == 0 or seq.status is not SeqStatus.RUNNING:
                continue
            try:
                chunk = self._schedule_running(seq, budget, scheduled, preempted)
                if chunk is not None:
                    self._register(seq, chunk.end)
            except Exception as e:  # isolated: only seq fails
                self.fail(seq, e)
                continue
            if chunk is not None:
                chunks.append(chunk)
                scheduled.add(id(seq))
                budget -= chunk.num_tokens
        # Admit waiting sequences first-come-first-served while they fit.
        while self.waiting and budget > 0 and len(chunks) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            try:
                chunk = self._admit(seq, budget, now)
            except Exception as e:  # isolated: only seq fails
                self.fail(seq, e)
                continue
            if chunk is None:
                break
            chunks.append(chunk)
            scheduled.add(id(seq))
            budget -= chunk.num_tokens
            try:
                self._register(seq, chunk.end)
            except Exception as e:  # isolated: only seq fails
                self.fail(seq, e)
        self.peak_running = max(self.peak_running, len(self.running))
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _schedule_running(
        self,
        seq: SequenceState,
        budget: int,
        scheduled: set[int],
        preempted: list[SequenceState],
    ) -> ScheduledChunk | None:
        """The chunk of running `seq` this step, making room by preemption; None if seq
        itself gave way."""
        kv = self.kv_cache
        n = self._chunk(seq, budget)
        end = seq.num_computed_tokens + n
        if kv.sliding:
            kv.slide(seq, seq.num_computed_tokens)
        while not kv.fits(seq, end) and not kv.allocate(seq, end):
            # A sequence the policy will not grow gives way itself.
            victims = (
                [s for s in self.running if id(s) not in scheduled and s is not seq]
                if kv.can_grow(seq, end)
                else []
            )
            victim = max(victims, key=SequenceState.precedence) if victims else seq
            if victim.precedence() < seq.precedence():
                victim = seq
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                break
        if seq.status is not SeqStatus.RUNNING:
            return None
        return ScheduledChunk.of(seq, seq.num_computed_tokens, n, self.page_size)

    def _register(self, seq: SequenceState, end: int) -> None:
        """Caches the full pages of seq's planned chunk now, so sequences admitted later
        in this step share them (the step writes each layer's K/V before attention reads
        them), and remembers who writes them (`depends_on`)."""
        kv = self.kv_cache
        if not kv.enable_prefix_caching or end // self.page_size <= len(seq.keys):
            return
        before = len(seq.keys)
        kv.register_full_pages(seq, end)
        for page in kv.held(seq, before, len(seq.keys)):
            self._writers[page] = seq

    def prune(self, plan: SchedulerOutput) -> SchedulerOutput:
        """`plan` without the chunks of sequences that ended since it was made (failed
        or aborted), and without those that read pages such a chunk was to write (they
        fail too: the prefix they share was never computed)."""
        pruned = plan.running()
        while pruned is not plan:
            plan = pruned
            gone = {id(c.seq) for c in plan.chunks}
            ended = {id(s) for s in self._writers.values() if id(s) not in gone}
            if not ended:
                break
            for c in plan.chunks:
                if any(id(w) in ended for w in self.depends_on(c.seq)):
                    self.fail(
                        c.seq,
                        "the shared prefix it read was being computed by a request that failed",
                    )
            pruned = plan.running()
        return pruned

    def depends_on(self, seq: SequenceState) -> set[SequenceState]:
        """The sequences whose chunks in the current plan write pages `seq`'s prefix hits
        read (same-step prefix sharing): if one of those chunks does not run, seq's
        must not either."""
        writers = self._writers
        if not writers:
            return set()
        return {
            w for p in self.kv_cache.held(seq) if (w := writers.get(p)) is not None and w is not seq
        }

    def _admit(self, seq: SequenceState, budget: int, now: float) -> ScheduledChunk | None:
        """Admits the first waiting sequence with its first chunk, or None if it must wait."""
        kv = self.kv_cache
        if self._sibling_prefilling(seq):
            return None  # it will share the sibling's prompt pages once they are cached
        hits = kv.lookup(seq)
        num_hits = len(hits[0])
        held = sum(1 for t in hits for p in t if p != NULL_PAGE)
        whole = max(0, kv.pages_at_peak(seq, seq.num_tokens) - held)
        if self.pool.num_free - kv.evictable(hits) - whole < self.watermark_pages and (
            self.running
        ):
            return None
        kv.take_hits(seq, hits)
        n = self._chunk(seq, budget)
        if not kv.allocate(seq, seq.num_computed_tokens + n):
            kv.free(seq)
            seq.num_computed_tokens = 0
            return None
        kv.count_lookup(seq, num_hits)
        self.waiting.popleft()
        seq.status = SeqStatus.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        bisect.insort(self.running, seq, key=SequenceState.precedence)
        return ScheduledChunk.of(seq, seq.num_computed_tokens, n, self.page_size)

    def _sibling_prefilling(self, seq: SequenceState) -> bool:
        """Whether another completion of seq's request is still computing the cacheable
        (full) pages of their shared prompt, which seq will then reuse."""
        if not self.kv_cache.enable_prefix_caching or seq.params.n == 1 or seq.output_token_ids:
            return False
        shared = (len(seq.prompt_token_ids) - 1) // self.page_size * self.page_size
        return any(
            s.request_id == seq.request_id and s.num_computed_tokens < shared for s in self.running
        )

    def _chunk(self, seq: SequenceState, budget: int) -> int:
        """Tokens of `seq` to run now: all that remain, or a page-aligned prefix that fits."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining <= budget:
            return remaining
        end = seq.num_computed_tokens + budget
        aligned = end - end % self.page_size
        return aligned - seq.num_computed_tokens if aligned > seq.num_computed_tokens else budget

    def reserve_ahead(
        self, output: SchedulerOutput, num_steps: int
    ) -> tuple[SchedulerOutput, list[int]] | None:
        """Reserves the pages for up to `num_steps` decode tokens of every chunk of a
        decode-only plan. Returns the plan with each chunk's pages extended to them and
        each chunk's token limit, or None (reserving nothing) when the pool cannot hold
        them all."""
        limits = [c.seq.remaining_tokens(self.max_model_len) for c in output.chunks]
        wanted = [
            (c.seq, c.start + min(num_steps, limit))
            for c, limit in zip(output.chunks, limits, strict=True)
        ]
        if not self.kv_cache.reserve_ahead(wanted):
            return None
        chunks = tuple(
            c._replace(num_pages=cdiv(end, self.page_size))
            for c, (_, end) in zip(output.chunks, wanted, strict=True)
        )
        return SchedulerOutput(chunks, output.preempted), limits

    # Results.

    def update(
        self,
        output: SchedulerOutput,
        sampled: Iterable[tuple[int, float] | None],
        *,
        eos_token_ids: tuple[int, ...] = (),
    ) -> list[SequenceState]:
        """Records a step's results and returns the sequences it finished.

        `sampled` holds `(token, logprob)` or `(token, logprob, top_logprobs)` for each
        chunk in `output.chunks` that samples, and None for the others.
        """
        now = time.monotonic()
        finished = []
        ps, max_len = self.page_size, self.max_model_len
        caching = self.kv_cache.enable_prefix_caching
        for chunk, result in zip(output.chunks, sampled, strict=True):
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted while the step ran
            try:
                seq.num_computed_tokens = end = chunk.start + chunk.num_tokens
                if caching and end // ps > len(seq.keys):
                    self.kv_cache.register_full_pages(seq)
                if result is None:
                    continue
                token = result[0]
                seq.append_output(token, result[1], result[2] if len(result) > 2 else None)
                if seq.first_token_time is None:
                    seq.first_token_time = now
                seq.last_token_time = now
                outputs = len(seq.output_token_ids)
                if token in seq.stop_set(eos_token_ids):
                    reason = FinishReason.STOP
                elif outputs >= seq.params.max_tokens or seq.num_prompt + outputs >= max_len:
                    reason = FinishReason.LENGTH
                else:
                    continue
            except Exception as e:  # isolated: only seq fails
                self.fail(seq, e)
                continue
            self._finish(seq, reason, now)
            finished.append(seq)
        return finished

    def resolve(
        self,
        seq: SequenceState,
        index: int,
        token: int,
        logprob: float,
        eos_token_ids: tuple[int, ...],
        now: float,
        top: TopLogprobs | None = None,
    ) -> None:
        """Puts the real value of output `index` of `seq`, recorded by `update` as a
        placeholder (async scheduling), and ends the sequence there if it is a stop token:
        later placeholders are dropped, and a sequence already finished by length gets
        finish reason "stop", as it would have without the placeholder."""
        if seq.finish_reason is FinishReason.ABORT:
            return
        seq.set_output(index, token, logprob, top)
        if index == 0:
            seq.first_token_time = now
        seq.last_token_time = now
        if seq.is_stop_token(token, eos_token_ids):
            seq.truncate_outputs(index + 1)
            if seq.status is SeqStatus.FINISHED:
                seq.finish_reason = FinishReason.STOP
            else:
                self._finish(seq, FinishReason.STOP, now)

    def _finish(self, seq: SequenceState, reason: FinishReason, now: float) -> None:
        self.kv_cache.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = now
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    def stop(self, seq: SequenceState, num_output_tokens: int) -> None:
        """Ends `seq` with finish reason "stop" after its first `num_output_tokens`
        outputs (a stop string matched on the text): later tokens, placeholders of a step
        in flight included, are dropped. A sequence already ended keeps its pages freed
        and takes reason "stop" unless it was aborted."""
        if seq.finish_reason is FinishReason.ABORT:
            return
        seq.truncate_outputs(num_output_tokens)
        if seq.status is SeqStatus.FINISHED:
            seq.finish_reason = FinishReason.STOP
        else:
            self._finish(seq, FinishReason.STOP, time.monotonic())

    def fail(self, seq: SequenceState, error: BaseException | str) -> None:
        """Ends `seq` (finish reason "abort") because something tied to it failed, frees
        what it holds, and records why for `take_failed`. Safe on a sequence caught
        half-way through scheduling: whatever pages it took go back."""
        if seq.status is SeqStatus.FINISHED:  # ended, but its output failed: not a success
            seq.finish_reason = FinishReason.ABORT
        else:
            self.kv_cache.free(seq)
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = FinishReason.ABORT
            seq.finished_time = time.monotonic()
            if seq in self.running:
                self.running.remove(seq)
            if seq in self.waiting:
                self.waiting.remove(seq)
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self._failed.append((seq, message))

    def take_failed(self) -> list[tuple[SequenceState, str]]:
        """The sequences `fail` ended since the last call, with why; forgets them."""
        failed, self._failed = self._failed, []
        return failed

    def abort(self, seqs: Iterable[SequenceState]) -> None:
        """Ends these sequences now and frees everything they hold."""
        now = time.monotonic()
        for seq in seqs:
            if seq.status is not SeqStatus.FINISHED:
                self._finish(seq, FinishReason.ABORT, now)

    # Metrics.

    def kv_usage(self) -> dict[str, float]:
        """Pages and token slots in use, and the slots reserved but not holding a token."""
        return self.kv_cache.usage(self.running)
