"""The persistent batch's rows: assigned, grown, written, cut and released in place."""

import numpy as np
import pytest

from paxkv.host.batch_rows import BatchRows
from paxkv.host.sequence import SequenceState
from paxkv.kv_layout import NULL_PAGE
from paxkv.request import SamplingParams


def _seq(i, **params):
    return SequenceState(
        f"s{i}", f"s{i}", 0, [1, 2, 3], SamplingParams(**params), seed=i, arrival_time=0.0
    )


def test_rows_grow_and_keep_their_contents():
    rows = BatchRows(pages_per_seq=4, capacity=2)
    seqs = [_seq(i, temperature=0.1 * i, top_k=i) for i in range(5)]
    for i, s in enumerate(seqs):
        s.pages = [10 + i, 20 + i]
        rows.append(s, s.pages)
    assert rows.num_rows_in_use == 5 and len(rows.block_tables) >= 5  # doubled twice
    rows.check(seqs)
    for s in seqs:
        assert rows.ints[s.row].tolist() == [s.params.top_k, s.seed]
        np.testing.assert_allclose(rows.floats[s.row, 0], s.params.temperature)
    # Cut one, release another: its row is cleared and handed to the next sequence.
    seqs[1].pages = seqs[1].pages[:1]
    rows.truncate(seqs[1], 1)
    freed = seqs[3].row
    rows.release(seqs[3])
    seqs[3].pages = []
    assert (rows.block_tables[freed] == NULL_PAGE).all()
    new = _seq(9, temperature=0.5)
    new.pages = [99]
    rows.append(new, new.pages)
    assert new.row == freed
    rows.check([*seqs, new])


def test_a_row_never_holds_more_than_pages_per_seq():
    rows = BatchRows(pages_per_seq=2)
    s = _seq(0)
    rows.append(s, [1, 2])
    with pytest.raises(ValueError, match=r"would hold 3 pages, more than pages_per_seq=2"):
        rows.append(s, [3])
