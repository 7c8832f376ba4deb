"""The host side of a step: the scheduler's plan as padded NumPy arrays. No JAX.

The engine moves a `HostBatch` to the device in one transfer; keeping its build
free of JAX lets it be benchmarked and tested on its own.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from paxkv.pallas_kernels.layout import NULL_PAGE, cdiv

if TYPE_CHECKING:
    from paxkv.host.scheduler import SchedulerOutput


def pad_page_table(
    pages: Sequence[Sequence[int]],
    kv_lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    page_size: int,
    max_num_seqs: int,
    pages_per_seq: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(block_tables i32[S, pages_per_seq], kv_lens i32[S], cu_q_lens i32[S + 1], num_seqs i32[1])`.

    Live sequence s holds `pages[s]` and has `kv_lens[s]` tokens after the step, of which
    `q_lens[s]` are new. Unused entries point at `NULL_PAGE`; padding sequences have
    length 0 and no query rows.
    """
    n = len(kv_lens)
    if not (len(pages) == n == len(q_lens)):
        raise ValueError(f"pages, kv_lens and q_lens have lengths {len(pages)}, {n}, {len(q_lens)}")
    if n > max_num_seqs:
        raise ValueError(f"{n} sequences exceed max_num_seqs={max_num_seqs}")
    held = np.fromiter((len(row) for row in pages), np.int64, count=n)
    lens = np.zeros(max_num_seqs, np.int32)
    lens[:n] = kv_lens
    if n and held.max() > pages_per_seq:
        s = int(np.argmax(held > pages_per_seq))
        raise ValueError(
            f"sequence {s} holds {held[s]} pages, more than pages_per_seq={pages_per_seq}"
        )
    short = cdiv(lens[:n], page_size) > held
    if short.any():
        s = int(np.argmax(short))
        raise ValueError(f"sequence {s}: kv_len={lens[s]} needs more than its {held[s]} pages")
    # One scatter of every sequence's pages into the padded table.
    table = np.full((max_num_seqs, pages_per_seq), NULL_PAGE, np.int32)
    flat = np.fromiter(itertools.chain.from_iterable(pages), np.int32, count=int(held.sum()))
    rows = np.repeat(np.arange(n), held)
    starts = np.cumsum(held) - held
    table[rows, np.arange(flat.size) - np.repeat(starts, held)] = flat
    cu = np.zeros(max_num_seqs + 1, np.int32)
    np.cumsum(q_lens, out=cu[1 : n + 1])
    cu[n + 1 :] = cu[n]
    return table, lens, cu, np.array([n], np.int32)


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


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """A step's inputs, padded to bucket sizes (T tokens, S sequences, P pages each)."""

    tokens: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    block_tables: np.ndarray  # i32[S, P]
    kv_lens: np.ndarray  # i32[S]
    cu_q_lens: np.ndarray  # i32[S + 1]
    num_seqs: np.ndarray  # i32[1]
    logits_indices: np.ndarray  # i32[S]; packed row of each sequence's last token
    sampling_floats: np.ndarray  # f32[S, 3]: temperature, top_p, min_p
    sampling_ints: np.ndarray  # i32[S, 3]: top_k, seed, counter
    # i32[T]: for rows whose token the host does not know yet, the index of the
    # in-flight step's output that holds it (async scheduling); -1 elsewhere.
    token_src: np.ndarray


def build_host_batch(
    plan: SchedulerOutput,
    *,
    page_size: int,
    buckets: Buckets,
    pending: dict[int, int] | None = None,
) -> HostBatch:
    """Lays out one scheduled step: its chunks' tokens packed in plan order.

    Reads only the plan's snapshot: each chunk's tokens, and its pages as the block-table
    row (with `Scheduler.reserve_ahead`, the pages of the decode steps ahead too).
    `pending` (async scheduling) maps `id(seq)` to the row of the in-flight step's output
    that holds the token the sequence's last row needs; `token_src` points there.
    """
    chunks = plan.chunks
    ends = [c.end for c in chunks]
    n_pages = [len(c.pages) for c in chunks]
    t_pad = Buckets.pick(plan.num_tokens, buckets.tokens, "tokens in the step")
    s_pad = buckets.seq_bucket(len(chunks), t_pad)
    p_pad = Buckets.pick(max(n_pages), buckets.pages, "pages per sequence")
    token_list: list[int] = []
    position_list: list[int] = []
    float_rows, int_rows = [], []
    for c in chunks:
        token_list.extend(c.token_ids)
        position_list.extend(range(c.start, c.end))
        p = c.seq.params
        float_rows.append((p.temperature, p.top_p, p.min_p))
        int_rows.append((p.top_k, c.seq.seed, c.num_output_tokens))
    num = len(token_list)
    tokens = np.zeros(t_pad, np.int32)
    tokens[:num] = token_list
    positions = np.zeros(t_pad, np.int32)
    positions[:num] = position_list
    q_lens = [c.num_tokens for c in chunks]
    logits_indices = np.zeros(s_pad, np.int32)
    np.cumsum(q_lens, out=logits_indices[: len(chunks)])
    logits_indices[: len(chunks)] -= 1
    floats = np.zeros((s_pad, 3), np.float32)
    floats[:, 1] = 1.0  # padding rows: greedy, no truncation
    floats[: len(chunks)] = float_rows
    ints = np.zeros((s_pad, 3), np.int32)
    ints[: len(chunks)] = int_rows
    table, kv_lens, cu_q_lens, num_seqs = pad_page_table(
        [c.pages for c in chunks],
        ends,
        q_lens,
        page_size=page_size,
        max_num_seqs=s_pad,
        pages_per_seq=p_pad,
    )
    token_src = np.full(t_pad, -1, np.int32)
    if pending:
        row = 0
        for c in chunks:
            if c.samples and id(c.seq) in pending:  # its last token is in flight
                token_src[row + c.num_tokens - 1] = pending[id(c.seq)]
            row += c.num_tokens
    return HostBatch(
        tokens,
        positions,
        table,
        kv_lens,
        cu_q_lens,
        num_seqs,
        logits_indices,
        floats,
        ints,
        token_src,
    )
