"""The README's CPU demo runs and its numbers are consistent."""

import numpy as np

from paxkv.measure.ragged_batch_demo import format_result, run_demo
from paxkv.pallas_kernels.layout import cdiv


def test_demo_numbers():
    r = run_demo(num_seqs=6, max_model_len=512, page_size=16, seed=3)
    lens = np.asarray(r.kv_lens)
    assert r.max_abs_error < 1e-5
    assert r.pages_used == int(cdiv(lens, 16).sum())  # exactly the pages the tokens need
    assert r.tokens_stored == lens.sum()
    assert r.pages_used * 16 - r.tokens_stored < 6 * 16  # under one page of waste per sequence
    assert r.contiguous_bytes == 6 * 512 * 2 * 2 * 64 * 4
    assert r.paged_bytes < r.contiguous_bytes
    text = format_result(r, max_model_len=512, page_size=16)
    assert "on 'xla'" in text and "less KV memory" in text
