"""The plan of one step, as the scheduler hands it to the batch layout. No JAX.

A `SchedulerOutput` is a snapshot: each chunk carries the tokens the step computes,
copied when it was planned, and names the row of the persistent batch that holds the
sequence's pages (`paxkv.host.batch_rows`), which the layout copies right after
planning. So building the step's batch does not depend on what happens to the
sequences afterwards.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from paxkv.host.sequence import SeqStatus, SequenceState

if TYPE_CHECKING:
    from paxkv.host.kv_cache_manager import KVCacheManager


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


@dataclasses.dataclass(frozen=True, eq=False)
class DecodeColumns:
    """The decodes of a plan as columns (`Scheduler`'s running decodes): sequence i
    computes one token, its last, at position `ends[i] - 1`, and samples the next. Made
    by a few NumPy operations per step for the whole batch, with no object per
    sequence."""

    seqs: tuple[SequenceState, ...]
    request_ids: list[str]  # of each sequence
    rows: np.ndarray  # i64[n]: rows of the persistent batch
    ends: np.ndarray  # i64[n]: tokens in the cache once the step has run
    num_pages: np.ndarray  # i64[n]: pages the step reads and writes
    counters: np.ndarray  # i32[n]: outputs each had generated (the sampling counter)
    tokens: np.ndarray  # i32[n]: each one's last token, the step's input (< 0: unknown)
    # i32[n]: the row of the in-flight step's output that holds each unknown last token
    # (async scheduling), -1 where it is known.
    src: np.ndarray
    stops: np.ndarray  # i64[n, k]: each one's stop tokens (k: the most of one), -1 padded
    # What the engine keeps for each sequence while it stays in the columns (None until
    # it sets it): the columns' own list, which follows them as sequences leave and
    # join, so the engine finds it again without a lookup per sequence.
    attached: list = dataclasses.field(default_factory=list)
    # bool[n]: those that keep logprobs and top logprobs (None: none does).
    track: np.ndarray | None = None

    def kept(self, mask: np.ndarray) -> DecodeColumns | None:
        """The decodes where `mask` (bool[n]) is True (None: none)."""
        if not mask.any():
            return None
        keep = mask.tolist()
        return DecodeColumns(
            tuple(itertools.compress(self.seqs, keep)),
            list(itertools.compress(self.request_ids, keep)),
            self.rows[mask],
            self.ends[mask],
            self.num_pages[mask],
            self.counters[mask],
            self.tokens[mask],
            self.src[mask],
            self.stops[mask],
            list(itertools.compress(self.attached, keep)),
            track=None if self.track is None else self.track[mask],
        )

    def chunks(self) -> tuple[ScheduledChunk, ...]:
        """The same plan as chunks."""
        return tuple(
            ScheduledChunk(seq, end - 1, 1, True, (token,), row, pages, counter)
            for seq, end, token, row, pages, counter in zip(
                self.seqs,
                self.ends.tolist(),
                self.tokens.tolist(),
                self.rows.tolist(),
                self.num_pages.tolist(),
                self.counters.tolist(),
                strict=True,
            )
        )


class SchedulerOutput:
    """The plan of one step: chunks in batch order, and who was preempted to make room.

    A plan made with the running decodes' columns holds its leading decodes as `decode`
    (`DecodeColumns`) and the chunks after them as `extra`; its `chunks` (all of them)
    are then made only if someone asks. `version` is the scheduler's
    `SequenceQueues.version` when it was made (-1: not recorded).
    """

    __slots__ = ("_chunks", "decode", "extra", "preempted", "version")

    def __init__(
        self,
        chunks: tuple[ScheduledChunk, ...],
        preempted: tuple[SequenceState, ...],
        *,
        decode: DecodeColumns | None = None,
        version: int = -1,
    ) -> None:
        self.decode = decode
        self.extra = chunks  # after the decodes (all of them without)
        self._chunks = chunks if decode is None else None
        self.preempted = preempted
        self.version = version

    @property
    def chunks(self) -> tuple[ScheduledChunk, ...]:
        """Its chunks, in batch order."""
        if self._chunks is None:
            self._chunks = self.decode.chunks() + self.extra
        return self._chunks

    @property
    def num_decode(self) -> int:
        """How many leading chunks are the columns' decodes."""
        return 0 if self.decode is None else len(self.decode.seqs)

    @property
    def num_chunks(self) -> int:
        """How many sequences it runs."""
        return self.num_decode + len(self.extra)

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes, over all chunks."""
        return self.num_decode + sum(c.num_tokens for c in self.extra)

    def sampled_request_ids(self) -> list[str]:
        """The request ids of its chunks that sample (repeated for n > 1)."""
        extra = [c.seq.request_id for c in self.extra if c.samples]
        return extra if self.decode is None else self.decode.request_ids + extra

    def running(self) -> SchedulerOutput:
        """The plan without the chunks of sequences that ended since it was made
        (aborted, or failed); itself when there are none."""
        running = SeqStatus.RUNNING
        if all(c.seq.status is running for c in self.extra) and (
            self.decode is None or all_running(self.decode.seqs)
        ):
            return self
        kept = tuple(c for c in self.chunks if c.seq.status is running)
        return SchedulerOutput(kept, self.preempted)

    def __repr__(self) -> str:
        return f"SchedulerOutput(chunks={self.chunks!r}, preempted={self.preempted!r})"


def all_running(seqs: Sequence[SequenceState]) -> bool:
    """Whether every sequence of `seqs` is running (a C loop, no Python per sequence)."""
    return list(map(_STATUS, seqs)).count(SeqStatus.RUNNING) == len(seqs)


_STATUS = operator.attrgetter("status")


def reserve_ahead(
    kv: KVCacheManager, output: SchedulerOutput, num_steps: int, max_model_len: int
) -> tuple[SchedulerOutput, list[int]] | None:
    """Reserves in `kv` the pages for up to `num_steps` decode tokens of every chunk of
    a decode-only plan (multi-step decoding). Returns the plan with each chunk's pages
    extended to them and each chunk's token limit, or None (reserving nothing) when
    the pool cannot hold them all."""
    limits = [c.seq.remaining_tokens(max_model_len) for c in output.chunks]
    wanted = [
        (c.seq, c.start + min(num_steps, limit))
        for c, limit in zip(output.chunks, limits, strict=True)
    ]
    if not kv.reserve_ahead(wanted):
        return None
    ps = kv.page_size
    chunks = tuple(
        c._replace(num_pages=-(-end // ps))
        for c, (_, end) in zip(output.chunks, wanted, strict=True)
    )
    return SchedulerOutput(chunks, output.preempted), limits


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


def stop_tokens(table: np.ndarray, tokens: np.ndarray) -> np.ndarray:  # bool[n]
    """Which of `tokens` (i64[n]) is among its row's stop tokens (`table` i64[n, k], -1
    padded)."""
    if not table.shape[1]:
        return np.zeros(len(tokens), bool)
    return (table == tokens[:, None]).any(axis=1)


def rows_among(rows: np.ndarray, among: list[int]) -> np.ndarray:  # bool[n]
    """Which of `rows` (i64[n]) are in `among` (a few: one comparison each)."""
    if len(among) > 8:
        return np.isin(rows, among)
    found = rows == among[0]
    for row in among[1:]:
        found |= rows == row
    return found


class Scheduled:
    """The sequences already in the plan being made: the columns' and those added
    (`add`), by id; `in` asks (the columns' ids are collected only if asked)."""

    def __init__(self, columns: Sequence[SequenceState]) -> None:
        self.columns = columns
        self.ids: set[int] = set()
        self._column_ids: set[int] | None = None

    def add(self, seq_id: int) -> None:
        """Notes `id(seq)` of a sequence added to the plan."""
        self.ids.add(seq_id)

    def __contains__(self, seq_id: int) -> bool:
        if seq_id in self.ids:
            return True
        if self._column_ids is None:
            self._column_ids = {id(s) for s in self.columns}
        return seq_id in self._column_ids
