"""Contiguous allocation, modelled as reservation policies, for the load benchmark's baselines.

Both run on the same engine and page pool as paged serving, so the comparison is at
equal KV memory: only what a sequence holds differs.

- `ContiguousMax` reserves max_model_len slots per sequence at admission (a
  max-length contiguous KV cache).
- `ContiguousGuess` reserves prompt + `guess_tokens` at admission; a sequence that
  outgrows its region cannot grow in place, so it is preempted and readmitted with
  twice the guess (and recomputes what it had).
"""

from __future__ import annotations

import weakref

from paxkv.host.reservation import PagedReservation
from paxkv.host.sequence import SequenceState


class ContiguousMax(PagedReservation):
    """Hold max_model_len token slots from admission on."""

    name = "max"
    shares_pages = False

    def tokens_to_hold(
        self, seq: SequenceState, num_pages: int, num_tokens: int, max_model_len: int
    ) -> int:
        """max_model_len, whatever the sequence has computed."""
        del seq, num_pages, num_tokens
        return max_model_len

    def tokens_at_submit(self, num_tokens: int, max_model_len: int) -> int:
        """A request needs room for a whole max_model_len region."""
        return max(num_tokens, max_model_len)


class ContiguousGuess(PagedReservation):
    """Hold prompt + `guess_tokens` (times a growth factor) from admission on."""

    name = "guess"
    shares_pages = False

    def __init__(self, guess_tokens: int = 256) -> None:
        if guess_tokens < 1:
            raise ValueError(f"guess_tokens={guess_tokens} must be at least 1")
        self.guess_tokens = guess_tokens
        # Multiplier of each sequence's guess, doubled every time it outgrows its region.
        self._growth: weakref.WeakKeyDictionary[SequenceState, int] = weakref.WeakKeyDictionary()

    def tokens_to_hold(
        self, seq: SequenceState, num_pages: int, num_tokens: int, max_model_len: int
    ) -> int:
        """At admission, the guessed region; afterwards the region cannot grow."""
        if num_pages:
            return num_tokens
        guess = len(seq.prompt_token_ids) + self.guess_tokens * self._growth.get(seq, 1)
        return max(num_tokens, min(max_model_len, guess))

    def can_grow(self, seq: SequenceState, num_pages: int, num_tokens: int, page_size: int) -> bool:
        """A contiguous region cannot grow in place."""
        del seq
        return num_tokens <= num_pages * page_size

    def on_preempt(self, seq: SequenceState, num_pages: int, page_size: int) -> None:
        """A sequence preempted for outgrowing its region comes back with twice the guess."""
        if seq.num_tokens > num_pages * page_size:
            self._growth[seq] = self._growth.get(seq, 1) * 2
