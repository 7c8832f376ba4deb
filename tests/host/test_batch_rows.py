"""The persistent batch's rows: assigned, grown, written, cut and released in place."""

import numpy as np
import pytest

from paxkv.host.batch_rows import BatchRows
from paxkv.host.request import SamplingParams
from paxkv.host.sampling_columns import FLOAT_COLUMN, ROW_INTS
from paxkv.pallas_kernels.layout import NULL_PAGE


def test_rows_grow_and_keep_their_contents():
    rows = BatchRows(pages_per_seq=4, capacity=2)
    params = [SamplingParams(temperature=0.1 * i, top_k=i) for i in range(5)]
    held = {}
    for i, p in enumerate(params):
        row = rows.acquire(p, seed=100 + i)
        held[row] = [10 + i, 20 + i]
        rows.append(row, held[row])
    assert rows.num_rows_in_use == 5 and len(rows.block_tables) >= 5  # doubled twice
    assert sorted(held) == [0, 1, 2, 3, 4]
    for row, pages in held.items():
        rows.check(row, [pages])
        i = pages[0] - 10
        assert rows.ints[row].tolist() == [params[i].top_k, 100 + i, 0]  # no LoRA slot
        np.testing.assert_allclose(rows.floats[row, FLOAT_COLUMN["temperature"]], 0.1 * i)
    # Cut one, release another: its row is cleared and handed to the next sequence.
    first, freed = list(held)[1], list(held)[3]
    rows.truncate(first, 1)
    held[first] = held[first][:1]
    rows.release(freed)
    del held[freed]
    assert (rows.block_tables[freed] == NULL_PAGE).all()
    new = rows.acquire(SamplingParams(temperature=0.5), seed=9)
    assert new == freed
    rows.append(new, [99])
    held[new] = [99]
    for row, pages in held.items():
        rows.check(row, [pages])
    assert rows.num_rows_in_use == 5
    assert ROW_INTS == ("top_k", "seed", "lora_slot")


def test_rows_count_the_sequences_of_each_lora_slot():
    rows = BatchRows(pages_per_seq=2)
    a = rows.acquire(SamplingParams(), seed=1, lora_slot=2)
    b = rows.acquire(SamplingParams(), seed=2, lora_slot=2)
    c = rows.acquire(SamplingParams(), seed=3)
    assert rows.ints[a].tolist() == [0, 1, 2] and rows.ints[c].tolist() == [0, 3, 0]
    assert rows.slot_in_use(2) and not rows.slot_in_use(1)
    rows.release(a)
    assert rows.slot_in_use(2)
    rows.release(b)
    assert not rows.slot_in_use(2)
    assert rows.acquire(SamplingParams(), seed=4) in (a, b)  # a reused row holds no slot
    assert not rows.slot_in_use(2)


def test_a_row_never_holds_more_than_pages_per_seq():
    rows = BatchRows(pages_per_seq=2)
    row = rows.acquire(SamplingParams(), seed=0)
    rows.append(row, [1, 2])
    with pytest.raises(ValueError, match=r"would hold 3 pages, more than pages_per_seq=2"):
        rows.append(row, [3])


def test_check_catches_a_stale_page():
    rows = BatchRows(pages_per_seq=4, num_groups=2)
    row = rows.acquire(SamplingParams(), seed=0)
    rows.append(row, [1, 2], [[NULL_PAGE, 3]])
    rows.check(row, [[1, 2], [NULL_PAGE, 3]])
    with pytest.raises(AssertionError):
        rows.check(row, [[1], [NULL_PAGE]])  # row holds 2 entries, not 1
    rows.clear(row, 1, 1)
    rows.check(row, [[1, 2], [NULL_PAGE, NULL_PAGE]])
