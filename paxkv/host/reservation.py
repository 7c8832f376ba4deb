"""How many token slots a sequence holds: the policy behind page allocation. No JAX.

`PagedReservation`, the engine's policy, holds exactly the pages a sequence's computed
tokens need and grows them a page at a time. Other policies (the load benchmark's
contiguous baselines, `paxkv.measure.reservations`) subclass it to hold more up front.
"""

from __future__ import annotations

from paxkv.host.sequence import SequenceState


class PagedReservation:
    """Hold the pages a sequence's tokens need, no more; grow one page at a time."""

    name = "paged"
    # Whether pages can be shared through the prefix cache. A contiguous reservation
    # owns its whole region, so it cannot.
    shares_pages = True

    def tokens_to_hold(
        self, seq: SequenceState, num_pages: int, num_tokens: int, max_model_len: int
    ) -> int:
        """Token slots `seq`, holding `num_pages` table entries, must hold to compute its
        first `num_tokens` tokens."""
        del seq, num_pages, max_model_len
        return num_tokens

    def can_grow(self, seq: SequenceState, num_pages: int, num_tokens: int, page_size: int) -> bool:
        """Whether `seq`, holding `num_pages` table entries, may take more pages to reach
        `num_tokens`; False preempts it."""
        del seq, num_pages, num_tokens, page_size
        return True

    def on_preempt(self, seq: SequenceState, num_pages: int, page_size: int) -> None:
        """Called when `seq` is preempted, holding `num_pages` table entries, before its
        pages are freed."""
        del seq, num_pages, page_size

    def tokens_at_submit(self, num_tokens: int, max_model_len: int) -> int:
        """Token slots a request of `num_tokens` (prompt + max_tokens) must be able to hold."""
        del max_model_len
        return num_tokens
