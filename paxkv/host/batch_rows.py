"""The persistent batch: per-sequence rows of the step's arrays that live across steps. No JAX.

Every sequence that holds pages owns a row: its block table (page ids, `NULL_PAGE`
beyond what it holds; one table per KV-cache group, `paxkv.host.kv_groups`) and its
sampling parameters. A row changes only where something
changed: pages appended, pages given back, a sequence admitted (row assigned) or ended
(row released). A step's arrays are one gather of its sequences' rows
(`paxkv.host.batch.build_host_batch`), never a rebuild from Python lists, so the host's
work per step does not grow with the length of the sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paxkv.host.sequence import SequenceState
from paxkv.kv_layout import NULL_PAGE
from paxkv.request import SamplingParams

# Columns of the per-sequence sampling arrays (`paxkv.engine.sampling.SamplingBatch`),
# and the values of padding rows: greedy, no truncation, no penalty.
SAMPLING_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
SAMPLING_INTS = ("top_k", "seed", "counter")
FLOAT_PADDING = (0.0, 1.0, 0.0, 0.0, 0.0, 1.0)


def sampling_floats(params: SamplingParams) -> tuple[float, ...]:
    """The float columns (`SAMPLING_FLOATS`) of `params`, in order."""
    return tuple(getattr(params, name) for name in SAMPLING_FLOATS)


def padding_floats(rows: int) -> np.ndarray:
    """f32[rows, 6] of padding rows (`FLOAT_PADDING`)."""
    return np.tile(np.asarray(FLOAT_PADDING, np.float32), (rows, 1))


def sampling_row(seq: SequenceState) -> tuple[tuple[float, ...], tuple[int, int]]:
    """`(floats, (top_k, seed))` of `seq`'s sampling parameters, in column order."""
    return sampling_floats(seq.params), (seq.params.top_k, seq.seed)


class BatchRows:
    """Rows of page ids and sampling parameters, one per sequence holding pages.

    Args:
      pages_per_seq: block-table entries of a row (the longest sequence's pages).
      capacity: rows to start with; the arrays double when they fill.
      num_groups: page tables per sequence (KV-cache groups).
    """

    def __init__(self, pages_per_seq: int, capacity: int = 64, num_groups: int = 1) -> None:
        self.pages_per_seq = pages_per_seq
        self.num_groups = num_groups
        # i32[G, rows, pages_per_seq]
        self.tables = np.full((num_groups, capacity, pages_per_seq), NULL_PAGE, np.int32)
        self.floats = padding_floats(capacity)
        self.ints = np.zeros((capacity, 2), np.int32)  # top_k, seed
        self._free = list(range(capacity - 1, -1, -1))
        self._held = np.zeros(capacity, np.int64)  # pages written in each row

    @property
    def block_tables(self) -> np.ndarray:  # i32[rows, pages_per_seq]
        """Group 0's block tables (the only ones without hybrid groups)."""
        return self.tables[0]

    @property
    def num_rows_in_use(self) -> int:
        """Rows owned by a sequence."""
        return len(self._held) - len(self._free)

    def _grow(self) -> None:
        old = len(self._held)
        new = old * 2
        tables = np.full((self.num_groups, new, self.pages_per_seq), NULL_PAGE, np.int32)
        tables[:, :old] = self.tables
        floats = padding_floats(new)
        floats[:old] = self.floats
        ints = np.zeros((new, 2), np.int32)
        ints[:old] = self.ints
        held = np.zeros(new, np.int64)
        held[:old] = self._held
        self.tables, self.floats, self.ints, self._held = tables, floats, ints, held
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    def _row(self, seq: SequenceState) -> int:
        if seq.row is None:
            if not self._free:
                self._grow()
            seq.row = row = self._free.pop()
            self.floats[row], self.ints[row] = sampling_row(seq)
        return seq.row

    def append(
        self, seq: SequenceState, pages: list[int], group_pages: Sequence[list[int]] = ()
    ) -> None:
        """Writes `pages` (group 0's) and `group_pages` (groups 1.., as many each) after
        the pages `seq`'s row holds (assigning it a row)."""
        row = self._row(seq)
        n = int(self._held[row])
        if n + len(pages) > self.pages_per_seq:
            raise ValueError(
                f"sequence {seq.seq_id} would hold {n + len(pages)} pages, more than "
                f"pages_per_seq={self.pages_per_seq}"
            )
        self.tables[0, row, n : n + len(pages)] = pages
        for g, more in enumerate(group_pages, start=1):
            self.tables[g, row, n : n + len(more)] = more
        self._held[row] = n + len(pages)

    def clear(self, seq: SequenceState, group: int, index: int) -> None:
        """Sets entry `index` of `seq`'s table of `group` to `NULL_PAGE` (a page a window
        group let go of)."""
        self.tables[group, seq.row, index] = NULL_PAGE

    def truncate(self, seq: SequenceState, num_pages: int) -> None:
        """Keeps the first `num_pages` pages of `seq`'s row."""
        if seq.row is None:
            return
        n = int(self._held[seq.row])
        if num_pages < n:
            self.tables[:, seq.row, num_pages:n] = NULL_PAGE
            self._held[seq.row] = num_pages

    def release(self, seq: SequenceState) -> None:
        """Clears `seq`'s row and frees it for another sequence."""
        if seq.row is None:
            return
        self.truncate(seq, 0)
        self._free.append(seq.row)
        seq.row = None

    def check(self, seqs: list[SequenceState]) -> None:
        """Raises AssertionError unless each sequence's row equals its pages (tests)."""
        for seq in seqs:
            if seq.row is None:
                assert not seq.pages, f"{seq.seq_id} holds pages but no row"
                continue
            n = len(seq.pages)
            for g, pages in enumerate([seq.pages, *seq.group_pages]):
                row = self.tables[g, seq.row]
                assert row[:n].tolist() == pages, f"{seq.seq_id}: row {row[:n]} != {pages}"
                assert (row[n:] == NULL_PAGE).all(), f"{seq.seq_id}: stale pages after {n}"
            assert self._held[seq.row] == n
