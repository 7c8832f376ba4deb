"""Admission: which requests can ever be served, and when a waiting sequence may start. No JAX.

A request is validated once, at submit (`check_fits`): its prompt plus max_tokens must
fit `max_model_len` and, at its longest, the whole pool. A waiting sequence is then
admitted when the pool keeps `watermark_pages` free after it takes its pages (cached
prefix hits count as already held), so running sequences can grow without an
immediate preemption; the first sequence is admitted whatever the watermark.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from paxkv.host.kv_cache_manager import KVCacheManager
from paxkv.host.lora_slots import LoRASlots
from paxkv.host.request import SamplingParams
from paxkv.host.sequence import SequenceState


def chunk_tokens(seq: SequenceState, budget: int, page_size: int) -> int:
    """Tokens of `seq` to run now: all that remain, or a page-aligned prefix that fits
    `budget` (the whole budget when no page boundary is in reach)."""
    computed = seq.num_computed_tokens
    remaining = seq.num_tokens - computed
    if remaining <= budget:
        return remaining
    end = computed + budget
    aligned = end - end % page_size
    return aligned - computed if aligned > computed else budget


class Admission:
    """The admission policy over `kv_cache_manager`'s pool.

    Args:
      kv_cache_manager: whose pages admitted sequences take.
      watermark_pages: pages kept free when admitting a sequence while others run.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        watermark_pages: int,
        lora_slots: LoRASlots | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.watermark_pages = watermark_pages
        self.lora_slots = lora_slots
        # `name -> the key of its current weights, or None once removed`: a sequence
        # admitted for the first time runs under its adapter's weights then; a preempted
        # one keeps the weights it started with (set by the engine).
        self.lora_current: Callable[[str], tuple | None] | None = None

    def has_lora_slot(self, seq: SequenceState) -> bool:
        """Gives waiting `seq` its adapter's device slot (`seq.lora_slot`, recording a
        load if the adapter is not resident); False when every slot is held by running
        sequences (seq waits, and sequences behind it may go first)."""
        if seq.lora_key is None:
            return True
        if self.lora_slots is None:
            raise ValueError(f"sequence {seq.seq_id} names a LoRA adapter; enable_lora is off")
        if self.lora_current is not None and seq.first_scheduled_time is None:
            key = self.lora_current(seq.lora_key[0])
            if key is None:
                raise ValueError(f"LoRA adapter {seq.lora_key[0]!r} was removed before it ran")
            seq.lora_key = key
        slot = self.lora_slots.acquire(seq.lora_key)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raises ValueError when a request could never be served (rejected at submit)."""
        total = num_prompt_tokens + params.max_tokens
        max_model_len = self.kv_cache_manager.max_model_len
        if total > max_model_len:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens + max_tokens={params.max_tokens} = {total} "
                f"exceeds {max_model_len=}"
            )
        pages = self.kv_cache_manager.pages_at_submit(total)
        usable = self.kv_cache_manager.pool.num_usable
        if pages > usable:
            raise ValueError(
                f"prompt + max_tokens needs {pages} pages but the whole pool has {usable}"
            )

    def admit(
        self, seq: SequenceState, budget: int, running: Sequence[SequenceState]
    ) -> int | None:
        """Gives waiting `seq` its cached prefix and the pages of its first chunk, within
        `budget` tokens; returns the chunk's tokens, or None (holding nothing) if it
        must wait. Sets `seq.num_computed_tokens` (and at first admission
        `num_cached_tokens`)."""
        kv = self.kv_cache_manager
        if self._sibling_prefilling(seq, running):
            return None  # it will share the sibling's prompt pages once they are cached
        prefix = kv.lookup(seq)
        whole = max(0, kv.pages_at_peak(seq, seq.num_tokens) - len(prefix.pages()))
        free = kv.pool.num_free - kv.prefix_cache.evictable(prefix) - whole
        if free < self.watermark_pages and running:
            return None
        seq.num_computed_tokens = kv.take_hits(seq, prefix)
        loaded = prefix.host_tokens(kv.page_size)  # of them, copied from the host tier
        n = chunk_tokens(seq, budget, kv.page_size)
        if not kv.allocate(seq, seq.num_computed_tokens + n):
            kv.free(seq)
            seq.num_computed_tokens = 0
            return None
        cached = kv.prefix_cache.count(seq, prefix.num_pages - loaded // kv.page_size, loaded)
        if cached is not None:
            seq.num_cached_tokens = cached + loaded
        elif seq.num_preemptions:  # a resumed sequence: what it need not recompute
            kv.prefix_cache.resumed_hits += seq.num_computed_tokens
        return n

    def _sibling_prefilling(self, seq: SequenceState, running: Sequence[SequenceState]) -> bool:
        """Whether another completion of seq's request is still computing the cacheable
        (full) pages of their shared prompt, which seq will then reuse."""
        kv = self.kv_cache_manager
        if not kv.prefix_cache.enabled or seq.params.n == 1 or seq.output_token_ids:
            return False
        shared = (len(seq.prompt_token_ids) - 1) // kv.page_size * kv.page_size
        return any(
            s.request_id == seq.request_id and s.num_computed_tokens < shared for s in running
        )
