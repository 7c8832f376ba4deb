"""The host-side scheduler: which sequences run in the next compiled step. No JAX.

Each step it fills a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`): running decodes first, then the prefill chunks of running sequences,
then new sequences admitted first-come-first-served. Which pages a sequence holds is the
`KVCacheManager`'s business (prefix reuse included). When a running sequence needs a
page and none is left, the scheduler preempts by recompute: the victim (lowest
priority, then latest arrival) frees its pages and goes back to the front of the
waiting queue, and later re-prefills its prompt plus the tokens it had generated, so
its output continues exactly.

`schedule` returns a `SchedulerOutput` (`paxkv.host.step_plan`), a snapshot of the step.
Pages it registers in the prefix cache while planning are shared within the step
(`paxkv.host.prefix_writers`).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable

import numpy as np

from paxkv.host.admission import Admission, chunk_tokens
from paxkv.host.batch_rows import BatchRows
from paxkv.host.host_tier import HostKVTier
from paxkv.host.kv_cache_manager import KVCacheManager
from paxkv.host.kv_groups import KVCacheGroups
from paxkv.host.kv_usage import kv_usage
from paxkv.host.lora_slots import LoRASlots
from paxkv.host.page_pool import PagePool
from paxkv.host.prefix_writers import PrefixWriters
from paxkv.host.queues import SequenceQueues
from paxkv.host.request import FinishReason, SamplingParams
from paxkv.host.reservation import PagedReservation
from paxkv.host.running_decodes import RunningDecodes, is_decoding
from paxkv.host.sequence import SeqStatus, SequenceState
from paxkv.host.speculative import Speculator, add_proposals, record_proposed, record_verified
from paxkv.host.step_plan import DecodeColumns, ScheduledChunk, SchedulerOutput

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerOutput"]


class Scheduler(SequenceQueues):
    """Continuous batching with chunked prefill and preemption by recompute, over the
    queues of `SequenceQueues` (which also end sequences: `fail`, `abort`, `stop`).

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
      kv_groups: the KV-cache groups (`paxkv.host.kv_groups`; default: one global group).
      speculator: gives decodes speculative proposals out of each step's spare budget
        (`paxkv.host.speculative`); None: no speculation.
      host_tier: keeps evicted prefix-cache pages in host memory (`paxkv.host.host_tier`).
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
        kv_groups: KVCacheGroups | None = None,
        speculator: Speculator | None = None,
        host_tier: HostKVTier | None = None,
        max_loras: int = 0,
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"{max_num_batched_tokens=} and {max_num_seqs=} must be positive")
        super().__init__(
            KVCacheManager(
                pool,
                page_size=page_size,
                max_model_len=max_model_len,
                enable_prefix_caching=enable_prefix_caching,
                reservation=reservation,
                kv_groups=kv_groups,
                max_chunk_tokens=max_num_batched_tokens,
                host_tier=host_tier,
            )
        )
        self.pool = pool
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # The device's LoRA adapter slots (`paxkv.host.lora_slots`); None: no adapters.
        self.lora_slots = (
            LoRASlots(max_loras, self.kv_cache_manager.rows.slot_in_use) if max_loras else None
        )
        self.admission = Admission(
            self.kv_cache_manager,
            watermark_pages=int(watermark * pool.num_usable),
            lora_slots=self.lora_slots,
        )
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.peak_running = 0
        self._writers = PrefixWriters(self.kv_cache_manager)
        self.speculator = speculator
        # `(seq, proposals) -> how many its constraint allows` for constrained sequences'
        # n-gram proposals (`add_proposals`); None: they take none. Set by the engine.
        self.allowed_prefix: Callable[[SequenceState, tuple[int, ...]], int] | None = None
        self._prefilling: list[SequenceState] = []  # running, not decoding: in precedence order
        self._preempted_now: list[SequenceState] = []  # by the plan being made
        # Every running sequence that decodes, as columns the plans are made from.
        self.decodes = RunningDecodes(
            self,
            self._writers.register_decodes,
            self._grow_decodes,
            max_model_len=max_model_len,
            rebuild_each_step=speculator is not None,
        )

    @property
    def batch_rows(self) -> BatchRows:
        """The persistent batch that holds the planned chunks' rows (`ScheduledChunk.row`)."""
        return self.kv_cache_manager.rows

    # Admission.

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raises ValueError when a request could never be served (rejected at submit)."""
        self.admission.check_fits(num_prompt_tokens, params)

    # Scheduling.

    def _preempt(self, seq: SequenceState) -> None:
        self.version += 1
        self.num_recomputed_tokens += seq.num_computed_tokens
        self.kv_cache_manager.preempt(seq)
        seq.num_computed_tokens = 0
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
        """Plans the next step and reserves its pages. Call `update` with its results.

        Every running sequence that decodes is planned from the running decodes'
        columns (`paxkv.host.running_decodes`); chunks are made for the others (prefill)
        and for the sequences admitted, in order of precedence, then out of the budget
        left, speculative proposals turn some decodes into chunks."""
        self._writers.new_plan()
        self._preempted_now = preempted = []
        now = time.monotonic()
        decodes = self.decodes
        # The sequences being prefilled; those that started decoding join the decodes.
        prefills, joiners = [], []
        for seq in self._prefilling:
            if seq.status is not SeqStatus.RUNNING:
                continue  # ended or preempted (admitted again later)
            if is_decoding(seq, decodes.pending):
                joiners.append(seq)
            else:
                prefills.append(seq)
        self._prefilling = prefills[:]
        decode, scheduled = decodes.plan(joiners, self._waits)
        n = len(decode.seqs) if decode is not None else 0
        budget = self.max_num_batched_tokens - n
        chunks: list[ScheduledChunk] = []
        for seq in prefills:
            if budget == 0 or seq.status is not SeqStatus.RUNNING:
                continue  # preempted to make room for a sequence before it
            try:
                chunk = self._schedule_running(seq, budget, scheduled, preempted)
                if chunk is not None:
                    self._writers.register(seq, chunk.end)
            except Exception as e:  # isolated: only seq fails
                self.fail(seq, e)
                continue
            if chunk is not None:
                chunks.append(chunk)
                scheduled.add(id(seq))
                budget -= chunk.num_tokens
        # Admit waiting sequences first-come-first-served while they fit; one whose
        # LoRA adapter finds no free slot is passed over (it keeps its place).
        passed: list[SequenceState] = []
        while self.waiting and budget > 0 and n + len(chunks) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            try:
                if not self.admission.has_lora_slot(seq):
                    passed.append(self.waiting.popleft())
                    continue
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
                self._writers.register(seq, chunk.end)
            except Exception as e:  # isolated: only seq fails
                self.fail(seq, e)
        self.waiting.extendleft(reversed(passed))
        self.peak_running = max(self.peak_running, len(self.running))
        spec = self.speculator
        if spec is not None and decode is not None:
            if budget > 0 and spec.new_step(len(self.running)):
                spare = spec.spare_tokens(self.max_num_batched_tokens - budget, budget)
                decode, drafted = self._propose(decode, spare)
                chunks[:0] = drafted
            # Recorded as chunks (`update`): proposals change what a decode holds.
            return SchedulerOutput(tuple(chunks), tuple(preempted), decode=decode)
        if decode is None:
            return SchedulerOutput(tuple(chunks), tuple(preempted), version=self.version)
        plan = SchedulerOutput(tuple(chunks), tuple(preempted), decode=decode)
        decodes.planned(plan)
        return plan

    def _propose(
        self, decode: DecodeColumns, spare: int
    ) -> tuple[DecodeColumns | None, list[ScheduledChunk]]:
        """Gives decodes proposals out of `spare` tokens (`add_proposals`); returns the
        decodes left without and the chunks of those with (their token and proposals)."""
        proposed = list(decode.chunks())
        add_proposals(
            proposed,
            spare,
            self.speculator,
            self.kv_cache_manager,
            max_model_len=self.max_model_len,
            fail=self.fail,
            allowed_prefix=self.allowed_prefix,
        )
        plain = [not c.num_draft for c in proposed]
        if all(plain):
            return decode, []
        drafted = [c for c in proposed if c.num_draft]
        return decode.kept(np.array(plain, bool)), drafted

    def _waits(self, seq: SequenceState) -> bool:
        """Whether running decode `seq` sits this step out: its proposals are in flight
        unverified (async speculation) and, as if all were accepted, it is one token
        from its limit (a placeholder now would end it, which a rejection would not)."""
        return bool(seq.num_unverified) and seq.remaining_tokens(self.max_model_len) <= 1

    def _grow_decodes(self, seqs: list[SequenceState], ends: list[int]) -> None:
        """Gives each running decode `seqs[i]` the pages for its first `ends[i]` tokens,
        in order, making room by preemption as `_schedule_running` does; one whose work
        raises fails alone."""
        kv = self.kv_cache_manager
        for seq, end in zip(seqs, ends, strict=True):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted to make room for one before it
            try:
                while kv.needs_pages(seq, end) and not kv.allocate(seq, end):
                    victims = (
                        [s for s in self.running if s is not seq] if kv.can_grow(seq, end) else []
                    )
                    victim = max(victims, key=SequenceState.precedence) if victims else seq
                    if victim.precedence() < seq.precedence():
                        victim = seq
                    self._preempt(victim)
                    self._preempted_now.append(victim)
                    if victim is seq:
                        break
            except Exception as e:  # isolated: only seq fails
                self.fail(seq, e)

    def _schedule_running(
        self,
        seq: SequenceState,
        budget: int,
        scheduled: set[int],
        preempted: list[SequenceState],
    ) -> ScheduledChunk | None:
        """The chunk of running `seq` this step, making room by preemption; None if seq
        itself gave way."""
        kv = self.kv_cache_manager
        n = chunk_tokens(seq, budget, self.page_size)
        end = seq.num_computed_tokens + n
        if kv.sliding:
            kv.slide(seq, seq.num_computed_tokens)
        while kv.needs_pages(seq, end) and not kv.allocate(seq, end):
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
        return self._chunk_of(seq, n)

    def _chunk_of(self, seq: SequenceState, num_tokens: int) -> ScheduledChunk:
        row = self.kv_cache_manager.row(seq)
        return ScheduledChunk.of(seq, seq.num_computed_tokens, num_tokens, row, self.page_size)

    def prune(self, plan: SchedulerOutput) -> SchedulerOutput:
        """`plan` without the chunks of sequences that ended since it was made (failed
        or aborted), and without those that read pages such a chunk was to write (they
        fail too: the prefix they share was never computed)."""
        return plan if self.decodes.unchanged(plan) else self._writers.prune(plan, self.fail)

    def _admit(self, seq: SequenceState, budget: int, now: float) -> ScheduledChunk | None:
        """Admits the first waiting sequence with its first chunk, or None if it must wait."""
        n = self.admission.admit(seq, budget, self.running)
        if n is None:
            return None
        self.waiting.popleft()
        seq.status = SeqStatus.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        bisect.insort(self.running, seq, key=SequenceState.precedence)
        bisect.insort(self._prefilling, seq, key=SequenceState.precedence)
        return self._chunk_of(seq, n)

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
        chunk in `output.chunks` that samples, and None for the others; for a chunk with
        speculative proposals, a list of them: its accepted proposals, then the target's
        token (pages held only for rejected proposals go back to the pool), or
        placeholders for all of them (async scheduling: recorded as accepted until
        `resolve_verified`). The running decodes record their own (`RunningDecodes`):
        a plan's decodes recorded here instead leave its columns to be made again at
        the next plan (`RunningDecodes.after_update`).
        """
        now = time.monotonic()
        finished = []
        kv = self.kv_cache_manager
        for chunk, result in zip(output.chunks, sampled, strict=True):
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted while the step ran
            try:
                if chunk.num_draft and result is not None:
                    record = record_proposed if result[0][0] < 0 else record_verified
                    reason = record(
                        self.speculator, kv, chunk, result, eos_token_ids, self.max_model_len, now
                    )
                    if reason is None:
                        continue
                else:
                    seq.num_computed_tokens = end = chunk.start + chunk.num_tokens
                    if kv.needs_registering(seq, end):
                        kv.register_full_pages(seq)
                    if result is None:
                        continue
                    top = result[2] if len(result) > 2 else None
                    reason = seq.record_sample(
                        result[0], result[1], top, eos_token_ids, self.max_model_len, now
                    )
                    if reason is None:
                        continue
            except Exception as e:  # isolated: only seq fails
                self.fail(seq, e)
                continue
            self.finish(seq, reason, now)
            finished.append(seq)
        return finished

    def resolve_verified(
        self,
        seq: SequenceState,
        index: int,
        num_proposed: int,
        emitted: list[tuple],
        eos_token_ids: tuple[int, ...],
        now: float,
    ) -> int:
        """Puts the verdict on `num_proposed` proposals of `seq` in place of the
        placeholders `update` recorded for them as accepted, from output `index` on:
        `emitted` as `update` takes a verified chunk's. Drops the placeholders of the
        rejected ones and moves seq's computed tokens back by them (its pages stay until
        `release_rejected`: the step in flight after it may write them); ends seq at a
        stop token, as `resolve` does. Returns how many were rejected."""
        self.speculator.on_verified(seq, num_proposed, len(emitted) - 1)
        seq.num_unverified = 0
        if seq.finish_reason is FinishReason.ABORT:
            return 0
        rejected = num_proposed + 1 - len(emitted)
        if rejected:
            seq.truncate_outputs(index + len(emitted))
            if seq.status is SeqStatus.RUNNING:
                seq.num_computed_tokens -= rejected
        for j, r in enumerate(emitted):
            top = r[2] if len(r) > 2 else None
            if seq.resolve_output(index + j, r[0], r[1], top, eos_token_ids, now):
                self.end_stopped(seq, now)
                break
        return rejected if seq.status is SeqStatus.RUNNING else 0

    def release_rejected(self, seqs: Iterable[SequenceState]) -> None:
        """Gives back the pages running `seqs` hold beyond their tokens: those taken
        for proposals their verdicts rejected (`resolve_verified`), once no step in
        flight writes them."""
        kv = self.kv_cache_manager
        for seq in seqs:
            if seq.status is SeqStatus.RUNNING:
                kv.trim(seq, seq.num_tokens)

    # Metrics.

    def kv_usage(self) -> dict[str, float]:
        """Pages and token slots in use, and the slots reserved but not holding a token."""
        return kv_usage(self.kv_cache_manager, self.running)
