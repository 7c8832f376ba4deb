"""The running decodes' page work for many decodes at once against `KVCacheManager`'s
one sequence at a time: `allocate_decodes` (the same pages, rows and failures) and
`register_decodes` (the same prefix keys and cached pages)."""

import numpy as np
import pytest

from paxkv.host.kv_cache_manager import KVCacheManager, allocate_decodes, register_decodes
from paxkv.host.page_pool import PagePool
from paxkv.host.request import SamplingParams
from paxkv.host.sequence import SequenceState
from paxkv.host.step_plan import rows_among

PS = 4


def _manager(num_pages: int, max_model_len: int = 64) -> tuple[KVCacheManager, list]:
    kv = KVCacheManager(PagePool(num_pages), page_size=PS, max_model_len=max_model_len)
    seqs = []
    for i, length in enumerate([4, 8, 3, 12, 4]):
        seq = SequenceState(f"s{i}", f"s{i}", 0, [i + 1] * length, SamplingParams(), 0, 0.0)
        assert kv.allocate(seq, length)
        seq.num_computed_tokens = length
        seqs.append(seq)
    return kv, seqs


@pytest.mark.parametrize("num_pages", [64, 12])  # 12: the pool runs short part-way
def test_the_same_pages_as_one_at_a_time(num_pages):
    ends = [5, 9, 4, 13, 5]  # each but s2 starts a page
    batched, seqs_b = _manager(num_pages)
    single, seqs_s = _manager(num_pages)
    grow = [i for i, e in enumerate(ends) if e > batched.num_pages(seqs_b[i]) * PS]
    got = allocate_decodes(batched, [seqs_b[i] for i in grow], [ends[i] for i in grow])
    want = 0
    for i in grow:
        if not single.allocate(seqs_s[i], ends[i]):
            break
        want += 1
    assert got == want
    assert (got == len(grow)) == (num_pages == 64)
    for a, b in zip(seqs_b, seqs_s, strict=True):
        assert batched.tables(a) == single.tables(b)
    assert batched.pool.num_free == single.pool.num_free
    batched.check_invariants()
    single.check_invariants()


def test_a_row_past_its_width_changes_nothing():
    kv, seqs = _manager(64, max_model_len=12)  # rows of 3 pages: s3 holds them all
    free = kv.pool.num_free
    with pytest.raises(ValueError, match="pages_per_seq"):
        kv.rows.append_one([kv.row(seqs[3])], [0])
    grow = [seqs[0], seqs[3]]
    tables = [kv.tables(s)[0][:] for s in grow]
    with pytest.raises(ValueError):
        allocate_decodes(kv, grow, [5, 13])
    assert [kv.tables(s)[0] for s in grow] == tables
    assert kv.pool.num_free == free
    kv.check_invariants()


def test_registering_filled_pages_the_short_way_keys_them_alike():
    def run(batched):
        kv = KVCacheManager(PagePool(64), page_size=PS, max_model_len=64)
        seqs = []
        for i, prompt in enumerate([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9], [7] * 3]):
            seq = SequenceState(f"s{i}", f"s{i}", 0, prompt, SamplingParams(), 0, 0.0)
            assert kv.allocate(seq, len(prompt))
            kv.register_full_pages(seq, len(prompt))
            seq.num_computed_tokens = len(prompt)
            seqs.append(seq)
        registered, short = [], []
        filled = kv.prefix_cache.register_filled
        kv.prefix_cache.register_filled = lambda *a: short.extend(filled(*a)) or short[-len(a[0]) :]
        for step in range(12):  # each decodes a token; some fill a page (s2's first)
            for seq in seqs:
                seq.output_token_ids.append(10 + step)
            ends = [seq.num_tokens for seq in seqs]
            assert allocate_decodes(kv, seqs, ends) == len(seqs)
            if batched:
                registered.append(register_decodes(kv, seqs, ends))
            else:
                registered.append(
                    [kv.register_full_pages(s, e) for s, e in zip(seqs, ends, strict=True)]
                )
            for seq, end in zip(seqs, ends, strict=True):
                seq.num_computed_tokens = end
        keys = [kv._seqs[s].keys for s in seqs]
        cached = {p: kv.pool._page_to_key.get(p) for s in seqs for p in kv.tables(s)[0]}
        return registered, keys, cached, len(short) - short.count(None)

    *batched, short = run(True)
    *single, none = run(False)
    assert batched == single
    assert short >= 5 and none == 0  # the short way was taken


@pytest.mark.parametrize("k", [1, 3, 8, 9, 20])
def test_rows_among_is_isin(k):
    rng = np.random.default_rng(k)
    rows = rng.permutation(300)[:256].astype(np.int64)
    among = rng.integers(0, 300, size=k).tolist()
    np.testing.assert_array_equal(rows_among(rows, among), np.isin(rows, among))


def test_registering_past_the_known_tokens_keys_only_the_pages_they_fill():
    # A speculative step holds pages for its proposals and registers up to its cache
    # length before the accepted tokens are all appended: only pages whose tokens are
    # known get keys (and the one-group slice must stop there too).
    kv = KVCacheManager(PagePool(64), page_size=PS, max_model_len=64)
    seq = SequenceState("s", "s", 0, list(range(1, 10)), SamplingParams(), 0, 0.0)
    assert kv.allocate(seq, 20)  # 5 pages of 4 for 9 known tokens
    kv.register_full_pages(seq, 20)
    table = kv.tables(seq)[0]
    keyed = [kv.pool._page_to_key.get(p) for p in table]
    assert len(kv._seqs[seq].keys) == 2
    assert [k is not None for k in keyed] == [True, True, False, False, False]
    assert keyed[:2] == kv._seqs[seq].keys
