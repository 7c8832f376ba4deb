"""The host side of a step: the scheduler's plan as padded NumPy arrays. No JAX.

The engine moves a `HostBatch` to the device in one transfer; keeping its build
free of JAX lets it be benchmarked and tested on its own.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from paxkv.host.batch_rows import BatchRows
from paxkv.host.sampling_columns import (
    INT_COLUMN,
    ROW_INT_SLICE,
    SAMPLING_INTS,
    has_penalties,
    padding_floats,
    sampling_floats,
)
from paxkv.host.step_plan import score_spans
from paxkv.pallas_kernels.layout import NULL_PAGE, cdiv

__all__ = ["Buckets", "HostBatch", "build_host_batch"]

if TYPE_CHECKING:
    from paxkv.host.request import SamplingParams
    from paxkv.host.step_plan import SchedulerOutput


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
    # no chunk scores, else R = T (scored rows are some of the step's T rows).
    score_rows: np.ndarray
    score_targets: np.ndarray
    # Speculative proposals: i32[S, k], sequence s's first draft_counts[s] entries are
    # the tokens of its rows after logits_indices[s] (`ScheduledChunk.num_draft`); k = 0
    # when no chunk has proposals, else the engine's `num_speculative_tokens`.
    draft_tokens: np.ndarray
    draft_counts: np.ndarray  # i32[S]
    # Logit biases (`SequenceState.logit_bias`): sequence s adds bias_values[s, j] to
    # token bias_ids[s, j]'s logit (ids -1 pad). B = 0 when no sequence has any, else a
    # power of two >= MIN_BIAS with room for the most any sequence has.
    bias_ids: np.ndarray  # i32[S, B]
    bias_values: np.ndarray  # f32[S, B]
    # Token bitmasks of constrained sequences (`paxkv.host.constrained`): token t may be
    # sampled by sequence s at its speculative position j (0: its next token; k = the
    # width of draft_tokens) when bit t % 32 of allowed[s * (k + 1) + j, t // 32] is set.
    # W = 0 (and S rows) when no sequence in the persistent batch is constrained, else
    # the model's mask words; every bit set (-1) until the host fills the rows of the
    # step's constrained sequences, which it does while the step's forward runs (the
    # sampler reads them after).
    allowed: np.ndarray  # i32[S * (k + 1), W]


MIN_BIAS = 8  # the narrowest bias arrays of a step that has biases


def mask_words(vocab_size: int) -> int:
    """Words (int32) of a token bitmask over `vocab_size` tokens (`HostBatch.allowed`)."""
    return (vocab_size + 31) // 32


def bias_arrays(
    biases: Sequence[list[tuple[int, float]] | None], size: int
) -> tuple[np.ndarray, np.ndarray]:
    """`(ids i32[size, B], values f32[size, B])` of the sequences' (id, bias) lists
    (None: none), B as `HostBatch.bias_ids` says; ids -1 and values 0 pad."""
    most = max((len(b) for b in biases if b), default=0)
    if not most:
        return _constant("no bias", size)
    width = max(MIN_BIAS, 1 << (most - 1).bit_length())
    ids = np.full((size, width), -1, np.int32)
    values = np.zeros((size, width), np.float32)
    for i, b in enumerate(biases):
        if b:
            ids[i, : len(b)] = [t for t, _ in b]
            values[i, : len(b)] = [v for _, v in b]
    return ids, values


def pad_host_batch(
    hb: HostBatch, num_tokens: int, num_seqs: int, pages_per_seq: int, *, page_size: int
) -> HostBatch:
    """`hb` padded to a larger step shape (T, S, P): what the step computes is unchanged.

    Padded rows run token 0 at position 0 and belong to no sequence; padded sequences
    have no rows, no tokens and the null page, greedy sampling and no penalty; a penalty
    history grows to `history_length(P, page_size)` with empty slots, scored rows (R = T)
    with row 0 and target 0. Engines whose warm-up compiles in the background run a
    step on the smallest compiled shape that holds it (`ModelRunner.dispatch`).
    """
    t, s = hb.tokens.shape[0], hb.logits_indices.shape[0]
    p = hb.block_tables.shape[-1]
    if (num_tokens, num_seqs, pages_per_seq) == (t, s, p):
        return hb
    if num_tokens < t or num_seqs < s or pages_per_seq < p:
        raise ValueError(
            f"cannot pad a step of {(t, s, p)=} to {(num_tokens, num_seqs, pages_per_seq)}"
        )
    dt, ds, dp = num_tokens - t, num_seqs - s, pages_per_seq - p

    def rows(a: np.ndarray, extra: int, value=0, axis: int = 0) -> np.ndarray:
        width = [(0, 0)] * a.ndim
        width[axis] = (0, extra)
        return np.pad(a, width, constant_values=value)

    tables = rows(rows(hb.block_tables, ds, NULL_PAGE, axis=-2), dp, NULL_PAGE, axis=-1)
    history = hb.penalty_history
    if history.shape[2]:
        grow = history_length(pages_per_seq, page_size) - history.shape[2]
        ids = rows(rows(history[0], ds, -1), grow, -1, axis=1)
        counts = rows(rows(history[1:], ds, axis=1), grow, axis=2)
        history = np.concatenate([ids[None], counts])
    else:
        history = np.zeros((3, num_seqs, 0), np.int32)
    scored = hb.score_rows.shape[0] > 0
    return HostBatch(
        tokens=rows(hb.tokens, dt),
        positions=rows(hb.positions, dt),
        block_tables=tables,
        kv_lens=rows(hb.kv_lens, ds),
        cu_q_lens=rows(hb.cu_q_lens, ds, hb.cu_q_lens[-1]),
        num_seqs=hb.num_seqs,
        logits_indices=rows(hb.logits_indices, ds),
        sampling_floats=np.concatenate([hb.sampling_floats, padding_floats(ds)]),
        sampling_ints=rows(hb.sampling_ints, ds),
        penalty_history=history,
        token_src=rows(hb.token_src, dt, -1),
        score_rows=rows(hb.score_rows, dt) if scored else hb.score_rows,
        score_targets=rows(hb.score_targets, dt) if scored else hb.score_targets,
        draft_tokens=rows(hb.draft_tokens, ds),
        draft_counts=rows(hb.draft_counts, ds),
        bias_ids=rows(hb.bias_ids, ds, -1),
        bias_values=rows(hb.bias_values, ds),
        allowed=rows(hb.allowed, ds * (hb.allowed.shape[0] // s), -1),
    )


def build_host_batch(
    plan: SchedulerOutput,
    *,
    page_size: int,
    buckets: Buckets,
    rows: BatchRows,
    pending: Mapping[int, int] | None = None,
    num_speculative_tokens: int = 0,
    eos_token_ids: tuple[int, ...] = (),
    mask_words: int = 0,
) -> HostBatch:
    """Lays out one scheduled step: its chunks' tokens packed in plan order.

    The block table and the sampling parameters are one gather of the chunks' rows of
    the persistent batch `rows` (a table per KV-cache group when there are several;
    each row cut to the chunk's `num_pages`; with
    `paxkv.host.step_plan.reserve_ahead`, the pages of the decode steps ahead too); the tokens are
    the plan's snapshot. `pending` (async scheduling) maps `id(seq)` to the row of the
    in-flight step's output that holds the token the sequence's last row needs (a
    placeholder in the chunk's tokens; the columns carry theirs as `DecodeColumns.src`);
    `token_src` points there. A step where a sequence with penalties samples carries
    histories of `history_length(P, page_size)` tokens, else of none. A step where a chunk has speculative proposals carries them as
    `draft_tokens` of width `num_speculative_tokens` (the most a chunk may have), else of width 0.
    Sequences with logit biases (`SequenceState.biased`; `eos_token_ids` are the stop
    tokens `min_tokens` holds back) carry them as `bias_ids` / `bias_values`. A step with
    a constrained sequence carries `allowed` of `mask_words` words, all set.
    """
    extra = plan.extra
    decode = plan.decode
    nd = plan.num_decode
    ne = len(extra)
    n = nd + ne
    # One transposition of the extra chunks' tuples; the columns' decodes (one token
    # each, their rows first) are laid out from their arrays without per-chunk work.
    (seqs, start_col, q_col, samples_col, tokens_col, row_col, pages_col, out_col, draft_col) = (
        zip(*extra, strict=True) if extra else ((),) * 9
    )
    drafts = any(draft_col)
    num_x = sum(q_col)  # the extra chunks' tokens
    most_pages = max(pages_col, default=0)
    if ne:
        q_x = np.array(q_col, np.int32)
        ends_x = np.array(start_col, np.int64) + q_x
        pages_x = np.array(pages_col, np.int64)
        # The columns' pages are their lengths' by construction (`RunningColumns.plan_next`).
        short = cdiv(ends_x, page_size) > pages_x
        if short.any():
            s = nd + int(np.argmax(short))
            raise ValueError(
                f"sequence {s}: kv_len={ends_x[s - nd]} needs more than its {pages_x[s - nd]} pages"
            )
    if decode is not None:
        seqs = decode.seqs + seqs
        most_pages = max(most_pages, int(decode.num_pages.max()))
        row_ids = np.concatenate([decode.rows, row_col]) if ne else decode.rows
        num_pages = np.concatenate([decode.num_pages, pages_x]) if ne else decode.num_pages
    else:
        row_ids = np.array(row_col, np.int64)
        num_pages = pages_x
    num = nd + num_x
    t_pad = Buckets.pick(num, buckets.tokens, "tokens in the step")
    s_pad = buckets.seq_bucket(n, t_pad)
    p_pad = Buckets.pick(most_pages, buckets.pages, "pages per sequence")
    if n > s_pad:
        raise ValueError(f"{n} sequences exceed the sequence bucket {s_pad}")

    tokens = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    cu = np.empty(s_pad + 1, np.int32)
    kv_lens = np.zeros(s_pad, np.int32)
    logits_indices = np.zeros(s_pad, np.int32)
    if nd:  # the columns: packed row i is decode i's one token
        tokens[:nd] = decode.tokens
        positions[:nd] = decode.ends - 1
        cu[: nd + 1] = _arange(nd + 1)
        kv_lens[:nd] = decode.ends
        logits_indices[:nd] = cu[:nd]
    else:
        cu[0] = 0
    if ne:
        tokens[nd:num] = np.fromiter(itertools.chain.from_iterable(tokens_col), np.int32, num_x)
        x_cu = cu[nd + 1 : n + 1]
        np.cumsum(q_x, dtype=np.int32, out=x_cu)
        # Chunk i's rows hold positions start_i, start_i + 1, ... (x_cu: their ends).
        positions[nd:num] = _arange(num_x) + np.repeat(ends_x - x_cu, q_x)
        x_cu += nd
        kv_lens[nd:n] = ends_x
        logits_indices[nd:n] = x_cu - 1
    cu[n + 1 :] = num
    if drafts:
        num_draft = np.zeros(n, np.int32)
        num_draft[nd:] = draft_col
        logits_indices[:n] -= num_draft
        padded = ((),) * nd + tokens_col  # `samples_col`, `tokens_col`: extra's alone
        draft_tokens, draft_counts = _drafts(padded, num_draft, s_pad, num_speculative_tokens)
    else:
        draft_tokens, draft_counts = _constant("no drafts", s_pad)

    # One gather of every group's rows, each cut to the chunk's pages (a row holds
    # NULL_PAGE past its pages: only rows holding more than their chunk's are cut).
    groups = rows.num_groups
    table = _null_pages((groups, s_pad, p_pad))
    if groups == 1:  # whole rows taken, then cut (faster than one mixed index or `out=`)
        table[0, :n] = rows.tables[0].take(row_ids, axis=0)[:, :p_pad]
    else:
        table[:, :n] = rows.tables[:, row_ids, :p_pad]
    if (rows.held(row_ids) > num_pages).any():
        cut = np.arange(p_pad)[None, None, :] < num_pages[None, :, None]
        table[:, :n] = np.where(cut, table[:, :n], NULL_PAGE)
    if groups == 1:
        table = table[0]

    floats = padding_floats(s_pad)
    floats[:n] = rows.floats.take(row_ids, axis=0)
    ints = np.zeros((s_pad, len(SAMPLING_INTS)), np.int32)
    ints[:n, ROW_INT_SLICE] = rows.ints.take(row_ids, axis=0)
    counter = INT_COLUMN["counter"]
    if nd:
        ints[:nd, counter] = decode.counters
    ints[nd:n, counter] = out_col
    # Only the chunks with penalties build their histories.
    penalised = np.flatnonzero(has_penalties(floats[:n])).tolist() if rows.penalised else ()
    histories: list = [None] * n
    for i in penalised:
        if i < nd or samples_col[i - nd]:
            histories[i] = seqs[i].penalty_history()
    # Only `extra` chunks score (the columns' decodes do not).
    score_rows, score_targets = _scored_rows(extra, cu[nd:], t_pad)
    carries = any(histories[i] is not None for i in penalised)
    if carries or penalised:
        history = penalty_histories(
            histories, s_pad, history_length(p_pad, page_size) if carries else 0
        )
    else:
        history = _constant("no history", s_pad)
    token_src = np.full(t_pad, -1, np.int32)
    if decode is not None:  # the columns' rows are their first nd packed rows
        token_src[:nd] = decode.src
    if pending is not None:
        for i in range(nd, n):  # a chunk whose last known token is in flight
            j = i - nd
            if samples_col[j] and tokens_col[j][-1 - draft_col[j]] < 0:
                token_src[logits_indices[i]] = pending[id(seqs[i])]
    return HostBatch(
        tokens,
        positions,
        table,
        kv_lens,
        cu,
        _constant("num seqs", n),
        logits_indices,
        floats,
        ints,
        history,
        token_src,
        score_rows,
        score_targets,
        draft_tokens,
        draft_counts,
        # Only while a row in use is biased are the step's sequences looked at.
        *bias_arrays([s.logit_bias(eos_token_ids) if s.biased else None for s in seqs], s_pad)
        if rows.biased
        else _constant("no bias", s_pad),
        # Only while a row in use is constrained are the step's sequences looked at.
        np.full((s_pad * (1 + draft_tokens.shape[1]), mask_words), -1, np.int32)
        if rows.constrained and mask_words and any(s.constrained for s in seqs)
        else _constant("no mask", s_pad),
    )


_ARANGE = np.arange(0, dtype=np.int32)


def _arange(n: int) -> np.ndarray:
    """i32[n]: 0 .. n - 1, a read-only view of one array kept across steps (the view
    is of the array this call read or made: engines stepping in threads may grow it
    at once)."""
    global _ARANGE
    full = _ARANGE
    if n > len(full):
        full = np.arange(max(n, 2 * len(full), 1024), dtype=np.int32)
        full.flags.writeable = False
        _ARANGE = full
    return full[:n]


@functools.cache
def _constant(what: str, size: int) -> np.ndarray | tuple[np.ndarray, ...]:
    """The arrays of a step that are the same every step of their size, made once and
    read-only (a step's consumers never write its arrays): "no drafts" (draft tokens
    i32[size, 0] and counts i32[size]), "no scores" (rows and targets, i32[0] each),
    "no history" (i32[3, size, 0]), "num seqs" (i32[1] holding `size`), "no bias" (ids
    i32[size, 0] and values f32[size, 0]), "no mask" (i32[size, 0])."""
    if what == "no drafts":
        out = (np.zeros((size, 0), np.int32), np.zeros(size, np.int32))
    elif what == "no scores":
        out = (np.zeros(0, np.int32), np.zeros(0, np.int32))
    elif what == "no history":
        out = (np.zeros((3, size, 0), np.int32),)
    elif what == "num seqs":
        out = (np.array([size], np.int32),)
    elif what == "no bias":
        out = (np.zeros((size, 0), np.int32), np.zeros((size, 0), np.float32))
    elif what == "no mask":
        out = (np.zeros((size, 0), np.int32),)
    else:
        raise ValueError(f"no constant {what!r}")
    for a in out:
        a.flags.writeable = False
    return out if len(out) > 1 else out[0]


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
        return _constant("no scores", 0)
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
