"""The host side of a step: the scheduler's plan as padded NumPy arrays. No JAX.

The engine moves a `HostBatch` to the device in one transfer; keeping its build
free of JAX lets it be benchmarked and tested on its own.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from paxkv.host.batch_rows import BatchRows
from paxkv.host.plan import score_spans
from paxkv.host.sampling_columns import (
    INT_COLUMN,
    ROW_INT_SLICE,
    SAMPLING_INTS,
    has_penalties,
    padding_floats,
    sampling_floats,
)
from paxkv.pallas_kernels.layout import NULL_PAGE, cdiv

__all__ = ["Buckets", "HostBatch", "build_host_batch"]

if TYPE_CHECKING:
    from paxkv.host.plan import SchedulerOutput
    from paxkv.request import SamplingParams


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The declared padded sizes of a step: packed tokens, sequences, pages per sequence.

    With `seqs` empty the sequence count is tied to the token bucket (`min(T,
    max_seqs)`, always enough since every sequence has a token), so the engine
    compiles one step per (token, page) bucket pair instead of one per triple.
    """

    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    pages: tuple[int, ...]
    max_seqs: int

    @staticmethod
    def pick(n: int, sizes: tuple[int, ...], what: str) -> int:
        """The smallest of `sizes` that holds `n`; ValueError naming `what` if none does."""
        for b in sizes:
            if n <= b:
                return b
        raise ValueError(f"{what}={n} exceeds the largest bucket {sizes[-1]}")

    def seq_bucket(self, num_seqs: int, token_bucket: int) -> int:
        """The sequence bucket of a step with `num_seqs` sequences in token bucket `token_bucket`."""
        if not self.seqs:
            return min(token_bucket, self.max_seqs)
        return self.pick(num_seqs, self.seqs, "sequences in the step")

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every (T, S, pages per sequence) a step can have: what warm-up compiles."""
        pairs = (
            [(t, self.seq_bucket(0, t)) for t in self.tokens]
            if not self.seqs
            else [(t, s) for t in self.tokens for s in self.seqs if s <= t]
        )
        return [(t, s, p) for t, s in pairs for p in self.pages]


MIN_HISTORY = 16  # the shortest penalty history of an ad-hoc batch (`sampling_arrays`)


def history_length(pages_per_seq: int, page_size: int) -> int:
    """H of a step with penalties in page bucket `pages_per_seq`: the tokens its pages
    hold. A sequence samples only after the K/V of all its tokens is written, so its
    distinct tokens (the host's and those the device adds: a fed token, the tokens of a
    decode loop) fit; and H is fixed per step shape, so warm-up compiles it."""
    return pages_per_seq * page_size


def sampling_arrays(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    counters: Sequence[int],
    size: int,
    *,
    histories: Sequence[tuple[list[int], list[int], list[int]] | None] = (),
    history_len: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(floats, ints, history i32[3, size, H])` of the given sequences' sampling
    parameters, padded to `size` rows (columns: `paxkv.host.sampling_columns`).

    `histories[i]` is sequence i's `(ids, output counts, in prompt)` when it has penalties
    (`SequenceState.penalty_history`), else None; `history` holds them as rows padded
    with id -1 (`penalty_histories`). H is `history_len`, or with None 0 when no sequence
    has a history, else a power of two >= `MIN_HISTORY` with room for one more token.
    """
    n = len(params)
    floats = padding_floats(size)
    ints = np.zeros((size, len(SAMPLING_INTS)), np.int32)
    if n:
        floats[:n] = [sampling_floats(p) for p in params]
        ints[:n, INT_COLUMN["top_k"]] = [p.top_k for p in params]
        ints[:n, INT_COLUMN["seed"]] = seeds
        ints[:n, INT_COLUMN["counter"]] = counters
    if history_len is None:
        needed = max((len(h[0]) + 1 for h in histories if h is not None), default=0)
        history_len = max(MIN_HISTORY, 1 << (needed - 1).bit_length()) if needed else 0
    return floats, ints, penalty_histories(histories, size, history_len)


def penalty_histories(
    histories: Sequence[tuple[list[int], list[int], list[int]] | None],
    size: int,
    length: int,
) -> np.ndarray:
    """i32[3, size, length]: the sequences' penalty histories (see `sampling_arrays`) as
    rows padded with id -1; ValueError if one is longer than `length`."""
    history = np.zeros((3, size, length), np.int32)
    if not length and histories.count(None) == len(histories):
        return history
    history[0] = -1
    for i, h in enumerate(histories):
        if h is not None:
            if len(h[0]) > length:
                raise ValueError(f"a penalty history of {len(h[0])} tokens exceeds {length=}")
            history[:, i, : len(h[0])] = h
    return history


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """A step's inputs, padded to bucket sizes (T tokens, S sequences, P pages each)."""

    tokens: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    block_tables: np.ndarray  # i32[S, P], or i32[G, S, P] with several KV-cache groups
    kv_lens: np.ndarray  # i32[S]
    cu_q_lens: np.ndarray  # i32[S + 1]
    num_seqs: np.ndarray  # i32[1]
    logits_indices: np.ndarray  # i32[S]; packed row of each sequence's last token
    # f32[S, len(SAMPLING_FLOATS)] and i32[S, len(SAMPLING_INTS)]: the columns of
    # `paxkv.host.sampling_columns`.
    sampling_floats: np.ndarray
    sampling_ints: np.ndarray
    penalty_history: np.ndarray  # i32[3, S, H]: see `sampling_arrays`; H = 0 or P * page size
    # (`history_length`)
    # i32[T]: for rows whose token the host does not know yet, the index of the
    # in-flight step's output that holds it (async scheduling); -1 elsewhere.
    token_src: np.ndarray
    # i32[R] each: the packed rows whose prompt logprob is wanted (`score_spans`, in
    # plan order) and their target tokens; padded with row 0 and target 0. R = 0 when
    # no chunk scores, else R = T (scored rows are some of the step's T rows), and the
    # step carries penalty histories: each step shape has one scoring variant, which
    # warm-up compiles (`EngineConfig.warmup_scoring`).
    score_rows: np.ndarray
    score_targets: np.ndarray
    # Speculative proposals: i32[S, k], sequence s's first draft_counts[s] entries are
    # the tokens of its rows after logits_indices[s] (`ScheduledChunk.num_draft`); k = 0
    # when no chunk has proposals, else the engine's `num_speculative_tokens`.
    draft_tokens: np.ndarray
    draft_counts: np.ndarray  # i32[S]


def build_host_batch(
    plan: SchedulerOutput,
    *,
    page_size: int,
    buckets: Buckets,
    rows: BatchRows,
    pending: Mapping[int, int] | None = None,
    draft_width: int = 0,
) -> HostBatch:
    """Lays out one scheduled step: its chunks' tokens packed in plan order.

    The block table and the sampling parameters are one gather of the chunks' rows of
    the persistent batch `rows` (a table per KV-cache group when there are several;
    each row cut to the chunk's `num_pages`; with
    `paxkv.host.plan.reserve_ahead`, the pages of the decode steps ahead too); the tokens are
    the plan's snapshot. `pending` (async scheduling) maps `id(seq)` to the row of the
    in-flight step's output that holds the token the sequence's last row needs (a
    placeholder in the chunk's tokens; the columns carry theirs as `DecodeColumns.src`);
    `token_src` points there. A step where a sequence with penalties samples, or that
    scores prompt rows, carries histories of `history_length(P, page_size)` tokens, else
    of none. A step where a chunk has speculative proposals carries them as
    `draft_tokens` of width `draft_width` (the most a chunk may have), else of width 0.
    """
    extra = plan.extra
    decode = plan.decode
    nd = plan.num_decode
    # One transposition of the chunk tuples, then a NumPy array per field.
    (seqs, start_col, q_col, samples_col, tokens_col, row_col, pages_col, out_col, draft_col) = (
        zip(*extra, strict=True) if extra else ((),) * 9
    )
    drafts = any(draft_col)
    if decode is not None and not extra:  # the steady decode's columns alone
        seqs = decode.seqs
        q_lens = np.ones(nd, np.int32)
        starts = decode.ends - 1
        num_pages = decode.num_pages
        row_ids = decode.rows
        counters = decode.counters
        num_draft = np.zeros(nd, np.int32)
        flat = decode.tokens
    else:
        q_lens = np.array(q_col, np.int32)
        starts = np.array(start_col, np.int64)
        num_pages = np.array(pages_col, np.int64)
        row_ids = np.array(row_col, np.int64)
        counters = np.array(out_col, np.int32)
        num_draft = np.array(draft_col, np.int32)
        flat = np.fromiter(itertools.chain.from_iterable(tokens_col), np.int32, count=-1)
    if decode is not None and extra:  # the steady decode's columns first: one token each
        seqs = decode.seqs + seqs
        q_lens = np.concatenate([np.ones(nd, np.int32), q_lens])
        starts = np.concatenate([decode.ends - 1, starts])
        num_pages = np.concatenate([decode.num_pages, num_pages])
        row_ids = np.concatenate([decode.rows, row_ids])
        counters = np.concatenate([decode.counters, counters])
        num_draft = np.zeros(nd + len(num_draft), np.int32)
        num_draft[nd:] = draft_col
        flat = np.concatenate([decode.tokens, flat])
    n = len(seqs)
    num = int(q_lens.sum())
    t_pad = Buckets.pick(num, buckets.tokens, "tokens in the step")
    s_pad = buckets.seq_bucket(n, t_pad)
    p_pad = Buckets.pick(int(num_pages.max()), buckets.pages, "pages per sequence")
    if n > s_pad:
        raise ValueError(f"{n} sequences exceed the sequence bucket {s_pad}")
    ends = starts + q_lens
    # The columns' pages are their lengths' by construction (`SteadyDecode.plan_next`).
    short = cdiv(ends[nd:], page_size) > num_pages[nd:]
    if short.any():
        s = nd + int(np.argmax(short))
        raise ValueError(f"sequence {s}: kv_len={ends[s]} needs more than its {num_pages[s]} pages")

    tokens = np.zeros(t_pad, np.int32)
    tokens[:num] = flat
    cu = np.zeros(s_pad + 1, np.int32)
    np.cumsum(q_lens, dtype=np.int32, out=cu[1 : n + 1])
    cu[n + 1 :] = cu[n]
    positions = np.zeros(t_pad, np.int32)
    positions[:num] = np.arange(num) + np.repeat(starts - cu[:n], q_lens)
    logits_indices = np.zeros(s_pad, np.int32)
    logits_indices[:n] = cu[1 : n + 1] - 1
    if drafts:
        logits_indices[:n] -= num_draft
        padded = ((),) * nd + tokens_col  # `samples_col`, `tokens_col`: extra's alone
        draft_tokens, draft_counts = _drafts(padded, num_draft, s_pad, draft_width)
    else:
        draft_tokens, draft_counts = np.zeros((s_pad, 0), np.int32), np.zeros(s_pad, np.int32)

    # One gather of every group's rows, each cut to the chunk's pages (a row holds
    # NULL_PAGE past its pages: only rows holding more than their chunk's are cut).
    groups = rows.num_groups
    table = _null_pages((groups, s_pad, p_pad))
    if groups == 1:  # whole rows taken, then cut (faster than one mixed index)
        gathered = rows.tables[0].take(row_ids, axis=0)[None, :, :p_pad]
    else:
        gathered = rows.tables[:, row_ids, :p_pad]
    if (rows.held(row_ids) > num_pages).any():
        cut = np.arange(p_pad)[None, None, :] < num_pages[None, :, None]
        gathered = np.where(cut, gathered, NULL_PAGE)
    table[:, :n] = gathered
    if groups == 1:
        table = table[0]
    kv_lens = np.zeros(s_pad, np.int32)
    kv_lens[:n] = ends

    floats = padding_floats(s_pad)
    floats[:n] = rows.floats[row_ids]
    ints = np.zeros((s_pad, len(SAMPLING_INTS)), np.int32)
    ints[:n, ROW_INT_SLICE] = rows.ints[row_ids]
    ints[:n, INT_COLUMN["counter"]] = counters
    # Only the chunks with penalties build their histories.
    penalised = np.flatnonzero(has_penalties(floats[:n])) if rows.penalised else np.zeros(0, int)
    histories: list = [None] * n
    for i in penalised.tolist():
        if i < nd or samples_col[i - nd]:
            histories[i] = seqs[i].penalty_history()
    # Only `extra` chunks score (the columns' decodes do not).
    score_rows, score_targets = _scored_rows(extra, cu[nd:], t_pad)
    # A step that scores carries histories even with no penalties (rows of id -1 change
    # nothing), so a shape has three variants, not four.
    carries = score_rows.size > 0 or any(histories[i] is not None for i in penalised.tolist())
    history = penalty_histories(
        histories, s_pad, history_length(p_pad, page_size) if carries else 0
    )
    token_src = np.full(t_pad, -1, np.int32)
    if decode is not None:  # the columns' rows are their first nd packed rows
        token_src[:nd] = decode.src
    if pending is not None:
        for i in range(nd, n):  # a chunk whose last token is in flight
            if samples_col[i - nd] and tokens_col[i - nd][-1] < 0:
                token_src[cu[i + 1] - 1] = pending[id(seqs[i])]
    return HostBatch(
        tokens,
        positions,
        table,
        kv_lens,
        cu,
        np.array([n], np.int32),
        logits_indices,
        floats,
        ints,
        history,
        token_src,
        score_rows,
        score_targets,
        draft_tokens,
        draft_counts,
    )


def _null_pages(shape: tuple[int, ...]) -> np.ndarray:
    """i32[shape] of `NULL_PAGE` (zeroed memory when it is 0)."""
    if NULL_PAGE == 0:
        return np.zeros(shape, np.int32)
    return np.full(shape, NULL_PAGE, np.int32)


def _drafts(
    tokens_col: Sequence[tuple[int, ...]], num_draft: np.ndarray, size: int, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """`(draft_tokens i32[size, k], draft_counts i32[size])` of chunks whose last
    `num_draft[i]` tokens are proposals; k = `width`, or 0 when no chunk has one."""
    counts = np.zeros(size, np.int32)
    if not num_draft.any():
        return np.zeros((size, 0), np.int32), counts
    if int(num_draft.max()) > width:
        raise ValueError(f"a chunk has {int(num_draft.max())} proposals, more than {width=}")
    tokens = np.zeros((size, width), np.int32)
    for i in np.flatnonzero(num_draft).tolist():
        d = int(num_draft[i])
        tokens[i, :d] = tokens_col[i][-d:]
    counts[: len(num_draft)] = num_draft
    return tokens, counts


def _scored_rows(chunks: Sequence, cu: np.ndarray, t_pad: int) -> tuple[np.ndarray, np.ndarray]:
    """`(score_rows, score_targets)` of a step of `t_pad` packed rows whose chunk i
    starts at packed row cu[i]: none, or `t_pad` of each (see `HostBatch.score_rows`)."""
    spans = score_spans(chunks)
    if not spans:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    rows = np.zeros(t_pad, np.int32)
    targets = np.zeros(t_pad, np.int32)
    at = 0
    for i, lo, hi in spans:
        c = chunks[i]
        first = cu[i] + lo - c.start
        rows[at : at + hi - lo] = np.arange(first, first + hi - lo)
        targets[at : at + hi - lo] = c.seq.prompt_scores.targets(lo, hi)
        at += hi - lo
    return rows, targets
