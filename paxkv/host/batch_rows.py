"""The persistent batch: per-sequence rows of the step's arrays that live across steps. No JAX.

Every sequence that holds pages owns a row: its block table (page ids, `NULL_PAGE`
beyond what it holds; one table per KV-cache group, `paxkv.host.kv_groups`) and its
sampling parameters. A row changes only where something
changed: pages appended, pages given back, a sequence admitted (row assigned) or ended
(row released). A step's arrays are one gather of its sequences' rows
(`paxkv.host.batch.build_host_batch`), never a rebuild from Python lists, so the host's
work per step does not grow with the length of the sequences. The KV-cache manager
(`paxkv.host.kv_cache_manager`) owns the rows and mirrors every change of a
sequence's pages here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paxkv.host.request import SamplingParams
from paxkv.host.sampling_columns import ROW_INTS, padding_floats, penalises, sampling_floats
from paxkv.pallas_kernels.layout import NULL_PAGE

_LORA_SLOT = ROW_INTS.index("lora_slot")


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
        self.floats = padding_floats(capacity)  # f32[rows, len(SAMPLING_FLOATS)]
        self.ints = np.zeros((capacity, len(ROW_INTS)), np.int32)  # i32[rows, len(ROW_INTS)]
        self._free = list(range(capacity - 1, -1, -1))
        self._held = np.zeros(capacity, np.int64)  # pages written in each row
        # Rows in use whose sampling applies a penalty (their steps carry histories).
        self.penalised: set[int] = set()
        # Rows in use whose sampling adds logit biases (their steps carry them).
        self.biased: set[int] = set()
        # Rows in use whose output follows a constraint (their steps carry token masks).
        self.constrained: set[int] = set()
        # Rows in use per LoRA slot (`paxkv.host.lora_slots`: a slot in use is not evicted).
        self.lora_rows: dict[int, int] = {}

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
        ints = np.zeros((new, len(ROW_INTS)), np.int32)
        ints[:old] = self.ints
        held = np.zeros(new, np.int64)
        held[:old] = self._held
        self.tables, self.floats, self.ints, self._held = tables, floats, ints, held
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    def acquire(self, params: SamplingParams, seed: int, lora_slot: int = 0) -> int:
        """A free row holding no pages, with the sampling parameters `params`, `seed`
        and the LoRA slot its sequence runs under (0: none)."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.floats[row] = sampling_floats(params)
        if penalises(params):
            self.penalised.add(row)
        if params.biased:
            self.biased.add(row)
        if params.structured_outputs is not None:
            self.constrained.add(row)
        own = {"seed": seed, "lora_slot": lora_slot}
        self.ints[row] = [own[n] if n in own else getattr(params, n) for n in ROW_INTS]
        if lora_slot:
            self.lora_rows[lora_slot] = self.lora_rows.get(lora_slot, 0) + 1
        return row

    def slot_in_use(self, lora_slot: int) -> bool:
        """Whether a row in use runs under LoRA slot `lora_slot`."""
        return self.lora_rows.get(lora_slot, 0) > 0

    def append(self, row: int, pages: list[int], group_pages: Sequence[list[int]] = ()) -> None:
        """Writes `pages` (group 0's) and `group_pages` (groups 1.., as many each) after
        the pages `row` holds."""
        n = int(self._held[row])
        if n + len(pages) > self.pages_per_seq:
            raise ValueError(
                f"row {row} would hold {n + len(pages)} pages, more than "
                f"pages_per_seq={self.pages_per_seq}"
            )
        self.tables[0, row, n : n + len(pages)] = pages
        for g, more in enumerate(group_pages, start=1):
            self.tables[g, row, n : n + len(more)] = more
        self._held[row] = n + len(pages)

    def append_one(self, rows: list[int], pages: list[int]) -> None:
        """`append` of one page `pages[i]` to each row `rows[i]` (one group), in one
        write."""
        rows_at = np.array(rows, np.int64)
        at = self._held[rows_at]
        if int(at.max()) >= self.pages_per_seq:
            raise ValueError(f"a row would hold more than pages_per_seq={self.pages_per_seq}")
        self.tables[0, rows_at, at] = pages
        self._held[rows_at] = at + 1

    def held(self, rows: np.ndarray) -> np.ndarray:  # i64[n]
        """Pages written in each of `rows` (i64[n])."""
        return self._held.take(rows)

    def clear(self, row: int, group: int, index: int) -> None:
        """Sets entry `index` of `row`'s table of `group` to `NULL_PAGE` (a page a window
        group let go of)."""
        self.tables[group, row, index] = NULL_PAGE

    def truncate(self, row: int, num_pages: int) -> None:
        """Keeps the first `num_pages` pages of `row`."""
        n = int(self._held[row])
        if num_pages < n:
            self.tables[:, row, num_pages:n] = NULL_PAGE
            self._held[row] = num_pages

    def release(self, row: int) -> None:
        """Clears `row` and frees it for another sequence."""
        self.truncate(row, 0)
        self.penalised.discard(row)
        self.biased.discard(row)
        self.constrained.discard(row)
        slot = int(self.ints[row, _LORA_SLOT])
        if slot:
            self.lora_rows[slot] -= 1
            self.ints[row, _LORA_SLOT] = 0
        self._free.append(row)

    def check(self, row: int, tables: Sequence[list[int]]) -> None:
        """Raises AssertionError unless `row` holds exactly `tables` (one per group)."""
        n = len(tables[0])
        for g, pages in enumerate(tables):
            held = self.tables[g, row]
            assert held[:n].tolist() == pages, f"row {row}: {held[:n]} != {pages}"
            assert (held[n:] == NULL_PAGE).all(), f"row {row}: stale pages after {n}"
        assert self._held[row] == n, f"row {row}: {self._held[row]} pages written, {n} held"
        assert row not in self._free, f"row {row} is held and free"
