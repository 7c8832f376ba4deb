"""KV-cache groups (hybrid models): the layout, a window group's pages with exact ids,
prefix hits under vLLM's rule, and a hypothesis-driven run of the scheduler that
simulates the cache's contents page by page. No JAX."""

import collections
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_prefix_cache import _step

from paxkv.host.batch import Buckets, build_host_batch
from paxkv.host.kv_groups import KVCacheGroup, KVCacheGroups, first_page_read
from paxkv.host.page_pool import NULL_PAGE, PagePool
from paxkv.host.request import SamplingParams
from paxkv.host.scheduler import Scheduler
from paxkv.host.sequence import SeqStatus
from paxkv.host.sequence import SequenceState as Sequence

PS = 4


def _seq(name, tokens, *, max_tokens=2, arrival=0.0):
    return Sequence(
        seq_id=name,
        request_id=name,
        index=0,
        prompt_token_ids=list(tokens),
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
        seed=0,
        arrival_time=arrival,
    )


def _sched(layout, num_pages=64, budget=64, max_model_len=64, page_size=PS, **kw):
    return Scheduler(
        PagePool(num_pages),
        page_size=page_size,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        watermark=0.0,
        kv_groups=layout,
        **kw,
    )


# One global layer and one window-8 layer.
HYBRID = KVCacheGroups.from_windows([None, 8])


def test_layout_of_gemma3_1b():
    # 26 layers, every sixth global (5, 11, 17, 23), the others a 512-token window.
    windows = [None if i % 6 == 5 else 512 for i in range(26)]
    layout = KVCacheGroups.from_windows(windows)
    assert [(g.window, len(g.layers)) for g in layout.groups] == [
        (None, 4),
        *[(512, 4)] * 5,
        (512, 2),
    ]
    assert layout.groups[0].layers == (5, 11, 17, 23)
    assert layout.groups[1].layers == (0, 1, 2, 3)
    assert layout.num_slots == 4
    assert layout.layer_group[5] == 0 and layout.layer_slot[5] == 0
    assert layout.layer_group[6] == 2 and layout.layer_slot[6] == 1  # 6 is local #5
    assert layout.layer_group[25] == 6 and layout.layer_slot[25] == 1
    # Every (group, slot) pair is one layer's: no two layers share bytes of a page.
    pairs = list(zip(layout.layer_group, layout.layer_slot, strict=True))
    assert len(set(pairs)) == 26


def test_layout_uniform_cases():
    assert KVCacheGroups.from_windows([None] * 4) == KVCacheGroups.uniform(4)
    mistral = KVCacheGroups.from_windows([4096] * 3)
    assert mistral.groups == (KVCacheGroup(4096, (0, 1, 2)),) and mistral.has_windows
    assert not KVCacheGroups.from_windows([4096] * 3, hybrid=False).has_windows
    off = KVCacheGroups.from_windows([None, 8, 8], hybrid=False)
    assert off.groups == (KVCacheGroup(None, (0, 1, 2)),) and not off.hybrid
    gemma2 = KVCacheGroups.from_windows([4096, None] * 3)
    assert [(g.window, g.layers) for g in gemma2.groups] == [(None, (1, 3, 5)), (4096, (0, 2, 4))]
    with pytest.raises(ValueError, match="window=0"):
        KVCacheGroups.from_windows([0, None])


def test_window_group_lets_go_of_pages_behind_it():
    s = _sched(HYBRID, num_pages=32)
    a = _seq("a", range(20), max_tokens=12)
    s.add(a)
    _step(s)  # the 20-token prompt: 5 pages in each group
    assert s.kv_cache_manager.tables(a)[0] == [1, 2, 3, 4, 5] and s.kv_cache_manager.tables(a)[
        1:
    ] == [[6, 7, 8, 9, 10]]
    out = _step(s)  # decode from 20: the window starts at token 13, page 3
    assert out.chunks[0].start == 20
    assert s.kv_cache_manager.tables(a)[0] == [1, 2, 3, 4, 5, 11]
    assert s.kv_cache_manager.tables(a)[1:] == [[0, 0, 0, 9, 10, 12]]
    assert s.pool.num_in_use == 9
    for _ in range(4):  # decodes from 21..24: the window start reaches token 17, page 4
        _step(s)
    assert s.kv_cache_manager.tables(a)[1:][0][:5] == [0, 0, 0, 0, 10]
    s.kv_cache_manager.check_invariants()
    while s.has_unfinished():
        _step(s)
    assert s.pool.num_in_use == 0


def test_window_group_needs_few_pages_at_submit():
    s = _sched(HYBRID, num_pages=24, budget=16, max_model_len=256)
    # A window-8 group holds one chunk (16) and the window before it: at most
    # cdiv(8 - 1 + 16, 4) + 1 = 7 pages; the global group all of them.
    with pytest.raises(ValueError, match="needs 57 pages but the whole pool has 23"):
        s.check_fits(190, SamplingParams(max_tokens=10))  # 50 + 7
    s.check_fits(50, SamplingParams(max_tokens=10))  # 15 + 7
    window_only = _sched(KVCacheGroups.from_windows([8, 8]), num_pages=24, budget=16)
    window_only.max_model_len = window_only.kv_cache_manager.max_model_len = 256
    window_only.check_fits(190, SamplingParams(max_tokens=10))  # 7 pages at any length


def test_prefix_hit_needs_the_window_pages_at_its_end():
    s = _sched(HYBRID, num_pages=40)
    kv = s.kv_cache_manager
    prompt = list(range(100, 125))  # 25 tokens: 6 full pages can be looked up
    a = _seq("a", prompt, max_tokens=1)
    s.add(a)
    _step(s)
    assert not s.has_unfinished()
    # a's pages are cached and free. The same prompt hits all 6 pages: the global group
    # needs them all, the window group those from token 24 - 8 + 1 = 17 on (pages 4, 5).
    c = _seq("c", prompt)
    hits = kv.prefix_cache.lookup(c)
    assert len(hits.tables[0]) == 6 and all(hits.tables[0])
    assert hits.tables[1][:4] == [NULL_PAGE] * 4 and all(hits.tables[1][4:])
    # Without window page 5, a hit of 5 pages needs window pages 3 and 4 (from token
    # 20 - 7 = 13), which a freed with their keys: the hit drops by one page only.
    kv.pool.uncache(hits.tables[1][5], (1, hits.keys[5]))
    hits = kv.prefix_cache.lookup(c)
    assert len(hits.tables[0]) == 5
    assert hits.tables[1][:3] == [NULL_PAGE] * 3 and all(hits.tables[1][3:])
    b = _seq("b", prompt, max_tokens=1)
    s.add(b)
    out = _step(s)
    assert out.chunks[0].start == 20 and b.num_cached_tokens == 20


_arrivals = st.lists(
    st.builds(
        lambda step, prefix, extra, max_tokens, abort_at: dataclasses.make_dataclass(
            "A", ["step", "prompt", "max_tokens", "abort_at"]
        )(step, [7] * prefix + [step * 31 + i for i in range(extra)], max_tokens, abort_at),
        step=st.integers(0, 20),
        prefix=st.integers(0, 14),
        extra=st.integers(1, 16),
        max_tokens=st.integers(1, 14),
        abort_at=st.one_of(st.none(), st.integers(0, 30)),
    ),
    min_size=1,
    max_size=10,
)


def _prefix_id(seq, j):
    return hash(tuple(seq.token_ids(0, j + 1)))


@settings(max_examples=200, deadline=None)
@given(
    arrivals=_arrivals,
    windows=st.lists(st.sampled_from([None, 3, 5, 8, 13]), min_size=1, max_size=4),
    page_size=st.sampled_from([2, 4, 8]),
    num_pages=st.integers(16, 48),
    budget=st.integers(8, 40),
    caching=st.booleans(),
)
def test_random_workloads_with_groups(arrivals, windows, page_size, num_pages, budget, caching):
    """The scheduler runs a fake model while the test keeps what every page of every
    group holds (the prefix identity of each slot's token). After each step: every
    token a chunk's queries read is in its group's table with the right contents, a
    window group holds no page wholly behind its window, every page in use has as many
    holders as its reference count, and the step's arrays equal the tables."""
    layout = KVCacheGroups.from_windows(windows)
    s = _sched(
        layout,
        num_pages=num_pages,
        budget=budget,
        max_model_len=44,
        page_size=page_size,
        enable_prefix_caching=caching,
    )
    kv = s.kv_cache_manager
    contents: dict[int, dict[int, int]] = collections.defaultdict(dict)  # page -> slot -> id
    seqs = []
    for step in range(500):
        for i, a in enumerate(arrivals):
            if a.step == step:
                q = _seq(str(i), a.prompt, max_tokens=a.max_tokens, arrival=float(step))
                try:
                    s.check_fits(len(a.prompt), q.params)
                except ValueError:
                    continue
                s.add(q)
                seqs.append((q, a))
        for q, a in seqs:
            if a.abort_at == step and q.status is not SeqStatus.FINISHED:
                s.abort([q])
        out = s.schedule()
        # The step writes every chunk's tokens in every group, then each layer reads.
        for c in out.chunks:
            for table in kv.tables(c.seq):
                for j in range(c.start, c.end):
                    page = table[j // page_size]
                    assert page != NULL_PAGE
                    contents[page][j % page_size] = _prefix_id(c.seq, j)
        for c in out.chunks:
            for g, table in enumerate(kv.tables(c.seq)):
                first = first_page_read(kv.windows[g], c.start, page_size)
                window = kv.windows[g]
                lo = 0 if window is None else max(0, c.start - window + 1)
                for j in range(lo, c.end):
                    assert contents[table[j // page_size]][j % page_size] == _prefix_id(c.seq, j)
                assert all(p == NULL_PAGE for p in table[:first])
        if out.chunks:
            pad = -(-44 // page_size)
            buckets = Buckets(tokens=(64,), seqs=(8,), pages=(pad,), max_seqs=8)
            hb = build_host_batch(out, page_size=page_size, buckets=buckets, rows=s.batch_rows)
            tables = hb.block_tables if layout.hybrid else hb.block_tables[None]
            for i, c in enumerate(out.chunks):
                for g, table in enumerate(kv.tables(c.seq)):
                    want = table[: c.num_pages] + [NULL_PAGE] * (pad - c.num_pages)
                    np.testing.assert_array_equal(tables[g, i], want)
        s.update(out, [((step * 7 + c.start) % 4, 0.0) if c.samples else None for c in out.chunks])
        s.pool.check_invariants()
        kv.check_invariants()
        holders = collections.Counter(
            p
            for q, _ in seqs
            if q.status is not SeqStatus.FINISHED
            for t in kv.tables(q)
            for p in t
            if p != NULL_PAGE
        )
        assert len(holders) == s.pool.num_in_use
        assert all(s.pool.refcount(p) == n for p, n in holders.items())
        if step > 20 and not s.has_unfinished():
            break
    assert not s.has_unfinished(), "a request never ended"
    for q, _ in seqs:
        assert q.status is SeqStatus.FINISHED
        assert kv.tables(q) == [[] for _ in range(kv.num_groups)]
    assert s.pool.num_in_use == 0
    assert s.pool.num_free == s.pool.num_usable
