"""The plan of one step, as the scheduler hands it to the batch layout. No JAX.

A `SchedulerOutput` is a snapshot: each chunk carries the tokens the step computes,
copied when it was planned, and names the row of the persistent batch that holds the
sequence's pages (`paxkv.host.batch_rows`), which the layout copies right after
planning. So building the step's batch does not depend on what happens to the
sequences afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from paxkv.host.sequence import SeqStatus, SequenceState


class ScheduledChunk(NamedTuple):
    """`num_tokens` tokens of `seq`, from position `start`, run this step.

    `token_ids` are those tokens, copied when the chunk was planned. The step reads and
    writes the sequence's first `num_pages` pages, which its row of the persistent batch
    (`row`, `paxkv.host.batch_rows`) holds; the step's block table is copied from the
    rows when the step is laid out, right after planning. `num_output_tokens` is how
    many tokens it had generated then (the sampling counter). `samples` is whether the
    step samples a token for it: the chunk reaches the end of its known tokens. `seq`
    names the sequence for `Scheduler.update`. `num_draft` of its tokens, its last
    ones, are speculative proposals after its last known token (`paxkv.host.speculative`):
    the step verifies them, and only those it accepts become the sequence's.
    """

    seq: SequenceState
    start: int
    num_tokens: int
    samples: bool
    token_ids: tuple[int, ...]
    row: int
    num_pages: int
    num_output_tokens: int
    num_draft: int = 0

    # A NamedTuple, not a frozen dataclass: the scheduler makes one per running
    # sequence per step, and a tuple is several times cheaper to make.

    @classmethod
    def of(
        cls, seq: SequenceState, start: int, num_tokens: int, row: int, page_size: int
    ) -> ScheduledChunk:
        """The chunk of `seq`'s tokens `start : start + num_tokens`, as they are now;
        `row` holds its pages."""
        end = start + num_tokens
        outputs = seq.output_token_ids
        total = len(seq.prompt_token_ids) + len(outputs)
        if num_tokens == 1 and end == total and outputs:  # a decode: its last token
            tokens = (outputs[-1],)
        else:
            tokens = tuple(seq.token_ids(start, end))
        return cls(
            seq,
            start,
            num_tokens,
            end == total,
            tokens,
            row,
            (end + page_size - 1) // page_size,
            len(outputs),
        )

    @property
    def end(self) -> int:
        """Tokens in the sequence's cache once the step has run (with proposals: at
        most; those it rejects are not the sequence's)."""
        return self.start + self.num_tokens


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """The plan of one step: chunks in batch order, and who was preempted to make room."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[SequenceState, ...]

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes, over all chunks."""
        return sum(c.num_tokens for c in self.chunks)

    def running(self) -> SchedulerOutput:
        """The plan without the chunks of sequences that ended since it was made
        (aborted, or failed); itself when there are none."""
        if all(c.seq.status is SeqStatus.RUNNING for c in self.chunks):
            return self
        kept = tuple(c for c in self.chunks if c.seq.status is SeqStatus.RUNNING)
        return SchedulerOutput(kept, self.preempted)


def score_spans(chunks: Sequence[ScheduledChunk]) -> list[tuple[int, int, int]]:
    """`(chunk index, lo, hi)` for each chunk of a plan that scores rows, in plan order:
    its positions lo .. hi - 1 (`PromptScores.rows`). The step's scored rows are these,
    concatenated; the layout and the recording both read them from here."""
    spans = []
    for i, c in enumerate(chunks):
        scores = c.seq.prompt_scores
        if scores is not None:
            lo, hi = scores.rows(c.start, c.start + c.num_tokens)
            if lo < hi:
                spans.append((i, lo, hi))
    return spans
