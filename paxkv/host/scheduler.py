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

Automatic prefix caching (on by default): every full page a sequence computes is
registered in the pool under a chained key of its tokens (`paxkv.host.prefix_cache`). A new
sequence first takes the longest run of cached pages matching its tokens (their
reference counts go up), and computes only the rest; at least its last token is
always computed, so the partial last page is handled by recompute. Freed pages keep
their keys and stay reusable, in LRU order, until allocation evicts them; a
preempted sequence therefore usually finds its own pages again.

`reservation` selects what a sequence holds, for comparisons at equal memory:
"paged" (the pages its tokens need), "max" (a contiguous-style reservation of
max_model_len slots at admission) or "guess" (prompt + `guess_tokens` at admission;
a sequence that outgrows its guess is preempted and readmitted with twice the guess).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import NamedTuple

from absl import logging

from paxkv.host.page_pool import PagePool
from paxkv.host.prefix_cache import PageKey, page_keys
from paxkv.request import FinishReason, SamplingParams

RESERVATIONS = ("paged", "max", "guess")
_MAX_LEADS = 8192  # first pages remembered for reporting sub-page prefix sharing


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
    cache_salt: str | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    keys: list[PageKey] = dataclasses.field(default_factory=list)  # of its full computed pages
    guess_growth: int = 1  # reservation="guess": multiplier of the guess after outgrowing it
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        # Kept as a plain attribute: the scheduler reads it several times per sequence
        # and step. `Scheduler.update` is the one place outputs are appended.
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, i: int) -> int:
        """Token i of prompt + output."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

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


class ScheduledChunk(NamedTuple):
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
      enable_prefix_caching: reuse cached pages of equal prefixes.
      reservation: "paged", "max" or "guess" (see the module docstring).
      guess_tokens: output tokens reserved per sequence when reservation="guess".
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
        reservation: str = "paged",
        guess_tokens: int = 256,
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"{max_num_batched_tokens=} and {max_num_seqs=} must be positive")
        if reservation not in RESERVATIONS:
            raise ValueError(f"reservation={reservation!r} must be one of {RESERVATIONS}")
        if reservation != "paged" and enable_prefix_caching:
            raise ValueError(
                f"reservation={reservation!r} models contiguous allocation: turn prefix caching off"
            )
        self.pool = pool
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.watermark_pages = int(watermark * pool.num_usable)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.enable_prefix_caching = enable_prefix_caching
        self.reservation = reservation
        self.guess_tokens = guess_tokens
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        self.short_prefix_misses = (
            0  # requests sharing their first 4+ tokens, but < 1 page, with a cached prefix
        )
        # Leading tokens of recently cached first pages (bounded), to notice prefixes
        # shared over less than a page.
        self._first_tokens: OrderedDict[tuple, None] = OrderedDict()
        self.peak_running = 0

    # Admission.

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raises ValueError when a request could never be served (rejected at submit)."""
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens + max_tokens={params.max_tokens} = {total} "
                f"exceeds max_model_len={self.max_model_len}"
            )
        pages = -(
            -max(total, self.max_model_len if self.reservation == "max" else 0) // self.page_size
        )
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

    def _reserved_tokens(self, seq: Sequence, num_tokens: int) -> int:
        """Token slots `seq` must hold to compute its first `num_tokens` tokens."""
        if self.reservation == "max":
            return self.max_model_len
        if self.reservation == "guess" and not seq.pages:
            guess = len(seq.prompt_token_ids) + self.guess_tokens * seq.guess_growth
            return max(num_tokens, min(self.max_model_len, guess))
        return num_tokens

    def _pages_for(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-self._reserved_tokens(seq, num_tokens) // self.page_size) - len(seq.pages))

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        if (
            self.reservation == "guess"
            and seq.pages
            and num_tokens > len(seq.pages) * self.page_size
        ):
            return False  # a contiguous reservation cannot grow in place
        need = self._pages_for(seq, num_tokens)
        if need == 0:
            return True
        pages = self.pool.allocate(need)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def _preempt(self, seq: Sequence) -> None:
        if self.reservation == "guess" and seq.num_tokens > len(seq.pages) * self.page_size:
            seq.guess_growth *= 2
        self.pool.free(reversed(seq.pages))
        self.num_recomputed_tokens += seq.num_computed_tokens
        seq.pages = []
        seq.keys = []
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
        decodes, prefills = [], []
        for s in running:
            (decodes if s.num_tokens - s.num_computed_tokens == 1 else prefills).append(s)
        paged = self.reservation == "paged"
        ps = self.page_size
        for seq in decodes + prefills:
            if budget == 0 or seq.status is not SeqStatus.RUNNING:
                continue
            n = self._chunk(seq, budget)
            fits = paged and seq.num_computed_tokens + n <= len(seq.pages) * ps  # the common case
            while not fits and not self._grow(seq, seq.num_computed_tokens + n):
                outgrown = (
                    self.reservation == "guess"
                    and seq.num_computed_tokens + n > len(seq.pages) * self.page_size
                )
                victims = [
                    s
                    for s in self.running
                    if id(s) not in scheduled and s is not seq and not outgrown
                ]
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
            if self._sibling_prefilling(seq):
                break  # it will share the sibling's prompt pages once they are cached
            hits = self._lookup(seq)
            evictable = sum(1 for p in hits if self.pool.refcount(p) == 0)
            whole = max(
                0, -(-self._reserved_tokens(seq, seq.num_tokens) // self.page_size) - len(hits)
            )
            if self.pool.num_free - evictable - whole < self.watermark_pages and self.running:
                break
            self.pool.touch(hits)
            seq.pages = list(hits)
            seq.num_computed_tokens = len(hits) * self.page_size
            n = self._chunk(seq, budget)
            if not self._grow(seq, seq.num_computed_tokens + n):
                self.pool.free(reversed(seq.pages))
                seq.pages, seq.num_computed_tokens = [], 0
                break
            self._count_lookup(seq, len(hits))
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            chunks.append(ScheduledChunk.of(seq, seq.num_computed_tokens, n))
            scheduled.add(id(seq))
            budget -= n
        self.peak_running = max(self.peak_running, len(self.running))
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _sibling_prefilling(self, seq: Sequence) -> bool:
        """Whether another completion of seq's request is still computing the cacheable
        (full) pages of their shared prompt, which seq will then reuse."""
        if not self.enable_prefix_caching or seq.params.n == 1 or seq.output_token_ids:
            return False
        shared = (len(seq.prompt_token_ids) - 1) // self.page_size * self.page_size
        return any(
            s.request_id == seq.request_id and s.num_computed_tokens < shared for s in self.running
        )

    def _lookup(self, seq: Sequence) -> list[int]:
        """Pages of the longest cached prefix of seq's tokens, leaving its last token to compute."""
        if not self.enable_prefix_caching:
            return []
        tokens = seq.prompt_token_ids + seq.output_token_ids
        seq.keys = page_keys(
            tokens,
            self.page_size,
            num_pages=(len(tokens) - 1) // self.page_size,
            salt=seq.cache_salt,
        )
        hits = []
        for key in seq.keys:
            page = self.pool.lookup(key)
            if page is None:
                break
            hits.append(page)
        del seq.keys[len(hits) :]
        return hits

    def _count_lookup(self, seq: Sequence, num_hit_pages: int) -> None:
        if not self.enable_prefix_caching or seq.num_preemptions:
            return  # a resumed sequence's hits are recompute savings, not prompt hits
        self.prefix_queries += len(seq.prompt_token_ids)
        hit_tokens = num_hit_pages * self.page_size
        self.prefix_hits += hit_tokens
        seq.num_cached_tokens = hit_tokens
        lead = self._lead(seq.prompt_token_ids, seq.cache_salt)
        if num_hit_pages == 0 and lead in self._first_tokens:
            self.short_prefix_misses += 1
            logging.log_first_n(
                logging.INFO,
                "paxkv: request %s shares a prefix shorter than one page (page_size=%d) with a "
                "cached one; prefixes are cached in whole pages, so it was not reused",
                10,
                seq.request_id,
                self.page_size,
            )

    def _lead(self, tokens: list[int], salt) -> tuple:
        return (salt, tuple(tokens[: min(4, self.page_size)]))

    def _register_pages(self, seq: Sequence) -> None:
        """Caches the full pages seq has computed since the last call."""
        full = min(seq.num_computed_tokens // self.page_size, len(seq.pages))
        if len(seq.keys) >= full:
            return
        tokens = seq.prompt_token_ids + seq.output_token_ids
        parent = seq.keys[-1] if seq.keys else None
        new = page_keys(
            tokens,
            self.page_size,
            num_pages=full - len(seq.keys),
            start=len(seq.keys),
            parent=parent,
            salt=seq.cache_salt,
        )
        for i, key in enumerate(new, start=len(seq.keys)):
            self.pool.mark_cached(seq.pages[i], key)
            if i == 0:
                lead = self._lead(tokens, seq.cache_salt)
                self._first_tokens[lead] = None
                self._first_tokens.move_to_end(lead)
                if len(self._first_tokens) > _MAX_LEADS:
                    self._first_tokens.popitem(last=False)
        seq.keys.extend(new)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to run now: all that remain, or a page-aligned prefix that fits."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining <= budget:
            return remaining
        end = seq.num_computed_tokens + budget
        aligned = end - end % self.page_size
        return aligned - seq.num_computed_tokens if aligned > seq.num_computed_tokens else budget

    def remaining_tokens(self, seq: Sequence) -> int:
        """Tokens `seq` may still generate before max_tokens or max_model_len ends it."""
        return min(
            seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens
        )

    def reserve_ahead(self, output: SchedulerOutput, num_steps: int) -> list[int] | None:
        """Reserves the pages for up to `num_steps` decode tokens of every chunk of a
        decode-only plan; returns each chunk's token limit, or None (reserving nothing)
        when the pool cannot hold them all."""
        added = []
        limits = []
        for c in output.chunks:
            seq = c.seq
            remaining = self.remaining_tokens(seq)
            steps = min(num_steps, remaining)
            before = len(seq.pages)
            if not self._grow(seq, c.start + steps):
                for s, n in added:
                    self.pool.free(reversed(s.pages[n:]))
                    del s.pages[n:]
                return None
            added.append((seq, before))
            limits.append(remaining)
        return limits

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
        caching, ps = self.enable_prefix_caching, self.page_size
        for chunk, result in zip(output.chunks, sampled, strict=True):
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            if caching and seq.num_computed_tokens // ps > len(seq.keys):
                self._register_pages(seq)
            if result is None:
                continue
            token, logprob = result
            seq.output_token_ids.append(int(token))
            seq.num_tokens += 1
            seq.logprobs.append(float(logprob))
            seq.first_token_time = seq.first_token_time or now
            seq.last_token_time = now
            reason = self._finish_reason(seq, int(token), eos_token_ids)
            if reason is not None:
                self._finish(seq, reason, now)
                finished.append(seq)
        return finished

    def resolve(
        self,
        seq: Sequence,
        index: int,
        token: int,
        logprob: float,
        eos_token_ids: tuple[int, ...],
        now: float,
    ) -> None:
        """Puts the real value of output `index` of `seq`, recorded by `update` as a
        placeholder (async scheduling), and ends the sequence there if it is a stop token:
        later placeholders are dropped, and a sequence already finished by length gets
        finish reason "stop", as it would have without the placeholder."""
        if seq.finish_reason is FinishReason.ABORT:
            return
        seq.output_token_ids[index] = token
        seq.logprobs[index] = logprob
        if index == 0:
            seq.first_token_time = now
        seq.last_token_time = now
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
            extra = len(seq.output_token_ids) - index - 1
            if extra:
                del seq.output_token_ids[index + 1 :]
                del seq.logprobs[index + 1 :]
                seq.num_tokens -= extra
            if seq.status is SeqStatus.FINISHED:
                seq.finish_reason = FinishReason.STOP
            else:
                self._finish(seq, FinishReason.STOP, now)

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
            "kv_utilization": used_slots / reserved if reserved else 1.0,
        }
