"""The host-side scheduler: which sequences run in the next compiled step, and with what pages.

Plain Python: it never imports JAX, and runs between compiled steps. Each step it
fills a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`):
running decodes first, then the prefill chunks of running sequences, then new
sequences admitted first-come-first-served. A sequence holds exactly the pages its
computed tokens need (the pages come from the host `PagePool`). When a running
sequence needs a page and none is left, the scheduler preempts by recompute: the
victim (lowest priority, then latest arrival) frees its pages and goes back to the
front of the waiting queue, and later re-prefills its prompt plus the tokens it had
generated, so its output continues exactly.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import deque
from collections.abc import Iterable

from paxkv.page_pool import PagePool
from paxkv.request import FinishReason, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One completion being generated: a prompt, the tokens so far, and the pages it holds."""

    seq_id: str
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float
    priority: int = 0  # lower runs first, as in vLLM
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens `start:stop` of prompt + output."""
        prompt = self.prompt_token_ids
        if stop <= len(prompt):
            return prompt[start:stop]
        out = self.output_token_ids
        return prompt[start:] + out[max(0, start - len(prompt)) : stop - len(prompt)]

    def precedence(self) -> tuple[int, float]:
        """Sort key: who keeps running when pages run out (smallest first)."""
        return (self.priority, self.arrival_time)


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at position `start`, run this step.

    `samples` is whether the step samples a token for the sequence: its chunk reaches
    the end of the tokens known when it was scheduled.
    """

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool

    @classmethod
    def of(cls, seq: Sequence, start: int, num_tokens: int) -> ScheduledChunk:
        return cls(seq, start, num_tokens, start + num_tokens == seq.num_tokens)


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """The plan of one step: chunks in batch order, and who was preempted to make room."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Sequence, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


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
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"{max_num_batched_tokens=} and {max_num_seqs=} must be positive")
        self.pool = pool
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.watermark_pages = int(watermark * pool.num_usable)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0

    # Admission.

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raises ValueError when a request could never be served (rejected at submit)."""
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens + max_tokens={params.max_tokens} = {total} "
                f"exceeds max_model_len={self.max_model_len}"
            )
        pages = -(-total // self.page_size)
        if pages > self.pool.num_usable:
            raise ValueError(
                f"prompt + max_tokens needs {pages} pages but the whole pool has {self.pool.num_usable}"
            )

    def add(self, seq: Sequence) -> None:
        """Queues a validated sequence (see `check_fits`)."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # Scheduling.

    def _pages_for(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(seq.pages))

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self._pages_for(seq, num_tokens)
        if need == 0:
            return True
        pages = self.pool.allocate(need)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.pool.free(reversed(seq.pages))
        self.num_recomputed_tokens += seq.num_computed_tokens
        seq.pages = []
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        """Plans the next step and reserves its pages. Call `update` with its results."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        scheduled: set[int] = set()
        now = time.monotonic()
        running = sorted(self.running, key=Sequence.precedence)
        # Decodes (one token left to compute) first, then prefill chunks.
        order = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        order += [s for s in running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in order:
            if budget == 0 or seq.status is not SeqStatus.RUNNING:
                continue
            n = self._chunk(seq, budget)
            while not self._grow(seq, seq.num_computed_tokens + n):
                victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
                victim = max(victims, key=Sequence.precedence) if victims else seq
                if victim.precedence() < seq.precedence() or victim is seq:
                    victim = seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            chunks.append(ScheduledChunk.of(seq, seq.num_computed_tokens, n))
            scheduled.add(id(seq))
            budget -= n
        # Admit waiting sequences first-come-first-served while they fit.
        while self.waiting and budget > 0 and len(chunks) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            whole = self._pages_for(seq, seq.num_tokens)
            if self.pool.num_free - whole < self.watermark_pages and self.running:
                break
            n = self._chunk(seq, budget)
            if not self._grow(seq, n):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            chunks.append(ScheduledChunk.of(seq, 0, n))
            scheduled.add(id(seq))
            budget -= n
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to run now: all that remain, or a page-aligned prefix that fits."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining <= budget:
            return remaining
        end = seq.num_computed_tokens + budget
        aligned = end - end % self.page_size
        return aligned - seq.num_computed_tokens if aligned > seq.num_computed_tokens else budget

    # Results.

    def update(
        self,
        output: SchedulerOutput,
        sampled: Iterable[tuple[int, float] | None],
        *,
        eos_token_ids: tuple[int, ...] = (),
    ) -> list[Sequence]:
        """Records a step's results and returns the sequences it finished.

        `sampled` holds `(token, logprob)` for each chunk in `output.chunks` that samples,
        and None for the others.
        """
        now = time.monotonic()
        finished = []
        for chunk, result in zip(output.chunks, sampled, strict=True):
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            if result is None:
                continue
            token, logprob = result
            seq.output_token_ids.append(int(token))
            seq.logprobs.append(float(logprob))
            seq.first_token_time = seq.first_token_time or now
            seq.last_token_time = now
            reason = self._finish_reason(seq, int(token), eos_token_ids)
            if reason is not None:
                self._finish(seq, reason, now)
                finished.append(seq)
        return finished

    def _finish_reason(
        self, seq: Sequence, token: int, eos_token_ids: tuple[int, ...]
    ) -> FinishReason | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
            return FinishReason.STOP
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        self.pool.free(reversed(seq.pages))
        seq.pages = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = now
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    def abort(self, seqs: Iterable[Sequence]) -> None:
        """Ends these sequences now and frees everything they hold."""
        now = time.monotonic()
        for seq in seqs:
            if seq.status is not SeqStatus.FINISHED:
                self._finish(seq, FinishReason.ABORT, now)

    # Metrics.

    def kv_usage(self) -> dict[str, float]:
        """Pages and token slots in use, and the slots reserved but not holding a token."""
        used_slots = sum(s.num_computed_tokens for s in self.running)
        reserved = sum(len(s.pages) for s in self.running) * self.page_size
        return {
            "pages_in_use": self.pool.num_in_use,
            "pages_total": self.pool.num_usable,
            "page_usage": self.pool.usage,
            "token_slots_used": used_slots,
            "token_slots_reserved": reserved,
            "wasted_slots": reserved - used_slots,
        }
