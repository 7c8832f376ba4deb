"""Automatic prefix caching and the reservation policies (the load benchmark's contiguous
baselines among them), scripted with exact page ids; and a
hypothesis-driven run of the scheduler with a fake model. No JAX."""

import collections
import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paxkv.host.batch import Buckets, build_host_batch
from paxkv.host.page_pool import PagePool
from paxkv.host.prefix_cache import page_keys
from paxkv.host.request import SamplingParams
from paxkv.host.scheduler import Scheduler
from paxkv.host.sequence import SeqStatus
from paxkv.host.sequence import SequenceState as Sequence
from paxkv.measure.page_tables import pad_page_table
from paxkv.measure.reservations import ContiguousGuess, ContiguousMax

PS = 4


def _seq(name, tokens, *, max_tokens=2, arrival=0.0, salt=None, n=1, index=0):
    return Sequence(
        seq_id=f"{name}/{index}",
        request_id=name,
        index=index,
        prompt_token_ids=list(tokens),
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n),
        seed=0,
        arrival_time=arrival,
        cache_salt=salt,
    )


def _sched(num_pages=32, budget=64, max_model_len=64, **kw):
    return Scheduler(
        PagePool(num_pages),
        page_size=PS,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        watermark=0.0,
        **kw,
    )


def _step(s, token=99):
    out = s.schedule()
    s.update(out, [(token, 0.0) if c.samples else None for c in out.chunks])
    s.pool.check_invariants()
    return out


def _finish(s):
    while s.has_unfinished():
        _step(s)


def test_page_keys_chain_and_salt():
    a = page_keys(list(range(10)), PS)
    assert len(a) == 2 and a[1][0] == hash(a[0])
    b = page_keys([*range(8), 50, 51], PS)
    assert b == a  # only full pages are keyed
    assert (
        page_keys([9, *range(1, 10)], PS)[1] != a[1]
    )  # a different first page changes page 1's key
    assert page_keys(list(range(10)), PS, salt="t")[0] != a[0]
    assert page_keys(list(range(10)), PS, start=1, num_pages=1, parent=a[0]) == a[1:]


def test_reuse_of_the_longest_cached_prefix_with_exact_pages():
    s = _sched()
    a = _seq("a", range(10))
    s.add(a)
    _step(s)
    assert s.kv_cache_manager.tables(a)[0] == [1, 2, 3]  # pages 1 and 2 are full and now cached
    _finish(s)
    assert s.pool.num_in_use == 0 and s.pool.num_cached == 2
    b = _seq("b", [*range(8), 70, 71, 72])
    s.add(b)
    out = _step(s)
    assert s.kv_cache_manager.tables(b)[0][:2] == [1, 2] and b.num_cached_tokens == 8
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (8, 3)
    assert (
        s.kv_cache_manager.prefix_cache.hits == 8
        and s.kv_cache_manager.prefix_cache.queries == 10 + 11
    )


def test_last_token_is_always_computed():
    s = _sched()
    s.add(_seq("a", range(8)))
    _finish(s)
    b = _seq("b", range(8))  # the same 2 full pages: only the first can be reused
    s.add(b)
    out = _step(s)
    assert b.num_cached_tokens == 4 and out.chunks[0].start == 4 and out.chunks[0].num_tokens == 4


def test_eviction_is_lru_and_tail_first():
    s = _sched(num_pages=7)  # 6 usable pages
    a = _seq("a", range(12), max_tokens=1)  # 3 full pages: 1, 2, 3
    s.add(a)
    _finish(s)
    assert s.pool.num_cached == 3
    c = _seq("c", range(100, 120), max_tokens=2)  # 5 pages: 3 free ones, then evictions
    s.add(c)
    _step(s)
    # Free pages 4, 5, 6 go first; then a's pages, freed last-first, so its tail (3) is
    # evicted before its head (1, 2).
    assert s.kv_cache_manager.tables(c)[0] == [4, 5, 6, 3, 2] and s.pool.num_evictions == 2
    assert [s.pool.lookup(k) for k in page_keys(list(range(12)), PS)] == [1, None, None]


def test_cache_salt_isolates():
    s = _sched()
    s.add(_seq("a", range(10), salt="tenant-1"))
    _finish(s)
    other = _seq("b", range(10), salt="tenant-2")
    same = _seq("c", range(10), salt="tenant-1")
    s.add(other)
    s.add(same)
    _step(s)
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 8


def test_preempted_sequence_finds_its_pages_again():
    s = _sched(num_pages=5)  # 4 usable pages
    a = _seq("a", range(8), max_tokens=3, arrival=0.0)
    b = _seq("b", range(50, 58), max_tokens=6, arrival=1.0)
    s.add(a)
    s.add(b)
    _step(s)
    assert (s.kv_cache_manager.tables(a)[0], s.kv_cache_manager.tables(b)[0]) == ([1, 2], [3, 4])
    out = _step(s)  # a needs a third page: b (later) is preempted
    assert out.preempted == (b,)
    # b's pages were freed tail first and keep their keys; a's new page evicted b's tail.
    assert s.kv_cache_manager.tables(a)[0] == [1, 2, 4] and s.pool.num_evictions == 1
    out = _step(s)  # a's last token; b does not fit beside it yet
    assert a.status is SeqStatus.FINISHED and [c.seq for c in out.chunks] == [a]
    out = _step(s)
    (chunk,) = out.chunks
    # b recomputes prompt + its 1 output (9 tokens) but finds its first page cached;
    # its other pages come from the front of the free queue.
    assert (
        chunk.seq is b
        and s.kv_cache_manager.tables(b)[0] == [3, 4, 2]
        and (chunk.start, chunk.num_tokens) == (4, 5)
    )
    _finish(s)
    assert s.pool.num_in_use == 0 and len(b.output_token_ids) == 6


def test_short_shared_prefix_is_reported():
    s = Scheduler(
        PagePool(32),
        page_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=64,
        watermark=0.0,
    )
    s.add(_seq("a", range(20)))
    _finish(s)
    d = _seq("d", [0, 1, 2, 3, 4, 90, 91, 92, 93, 94])  # shares 5 tokens, less than a page
    s.add(d)
    _step(s)
    assert d.num_cached_tokens == 0 and s.kv_cache_manager.prefix_cache.short_prefix_misses == 1
    e = _seq("e", [7, 7, 7, 7, 7, 7, 7, 7, 7])  # shares nothing
    s.add(e)
    _step(s)
    assert s.kv_cache_manager.prefix_cache.short_prefix_misses == 1


_LOG_TWO_SHORT_PREFIXES = """
import logging
from absl import logging as absl_logging
from paxkv.host.page_pool import PagePool
from paxkv.host.scheduler import Scheduler
from paxkv.host.sequence import SequenceState
from paxkv.host.request import SamplingParams

lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())
absl_logging.get_absl_logger().addHandler(handler)
absl_logging.set_verbosity(absl_logging.INFO)
s = Scheduler(PagePool(32), page_size=8, max_num_seqs=8, max_num_batched_tokens=64,
              max_model_len=64, watermark=0.0)
def run(name, tokens):
    s.add(SequenceState(name, name, 0, tokens, SamplingParams(max_tokens=1), 0, 0.0))
    while s.has_unfinished():
        out = s.schedule()
        s.update(out, [(99, 0.0) if c.samples else None for c in out.chunks])
run("a", list(range(20)))
run("d", [0, 1, 2, 3, 4, 90, 91, 92, 93, 94])
run("e", [0, 1, 2, 3, 5, 80, 81, 82, 83, 84])
assert s.kv_cache_manager.prefix_cache.short_prefix_misses == 2
print(sum("shares a prefix shorter than one page" in line for line in lines))
"""


def test_short_shared_prefix_is_logged_once_per_process():
    # A fresh process: the note is once per process, so an earlier test must not count.
    out = subprocess.run(
        [sys.executable, "-c", _LOG_TWO_SHORT_PREFIXES], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1"]  # two such requests, one line


def test_parallel_sampling_shares_prompt_pages():
    s = _sched()
    seqs = [_seq("r", range(9), n=3, index=i, max_tokens=3) for i in range(3)]
    for q in seqs:
        s.add(q)
    out = _step(s)
    assert [c.seq for c in out.chunks] == [seqs[0]]  # siblings wait for the shared prompt
    _step(s)
    # Siblings reuse the 2 full prompt pages and recompute only the last prompt token.
    assert (
        s.kv_cache_manager.tables(seqs[1])[0][:2]
        == s.kv_cache_manager.tables(seqs[0])[0][:2]
        == s.kv_cache_manager.tables(seqs[2])[0][:2]
    )
    assert s.pool.refcount(s.kv_cache_manager.tables(seqs[0])[0][0]) == 3
    _finish(s)
    assert s.pool.num_in_use == 0


def test_contiguous_max_reservation():
    s = _sched(max_model_len=32, enable_prefix_caching=False, reservation=ContiguousMax())
    a = _seq("a", range(5))
    s.add(a)
    _step(s)
    assert len(s.kv_cache_manager.tables(a)[0]) == 8  # max_model_len / page_size at admission
    usage = s.kv_usage()
    assert usage["token_slots_reserved"] == 32 and usage["token_slots_used"] == 5


def test_contiguous_guess_reservation_preempts_when_outgrown():
    s = _sched(
        max_model_len=64, enable_prefix_caching=False, reservation=ContiguousGuess(guess_tokens=4)
    )
    a = _seq("a", range(5), max_tokens=10)
    s.add(a)
    _step(s)
    assert len(s.kv_cache_manager.tables(a)[0]) == 3  # 5 + 4 = 9 tokens -> 3 pages
    while a.num_preemptions == 0:
        _step(s)
    assert len(a.output_token_ids) == 8  # 13 tokens outgrew the 12 slots reserved
    _finish(s)
    assert a.finish_reason.value == "length" and len(a.output_token_ids) == 10
    assert s.pool.num_in_use == 0


@dataclasses.dataclass
class _Arrival:
    step: int
    prompt: list[int]
    max_tokens: int
    salt: str | None
    abort_at: int | None


_arrivals = st.lists(
    st.builds(
        _Arrival,
        step=st.integers(0, 12),
        prompt=st.lists(
            st.integers(0, 3), min_size=1, max_size=30
        ),  # small alphabet: shared prefixes
        max_tokens=st.integers(1, 12),
        salt=st.sampled_from([None, None, "x"]),
        abort_at=st.one_of(st.none(), st.integers(0, 20)),
    ),
    min_size=1,
    max_size=12,
)


def _check_batch_against_scratch(s, out):
    """The step's arrays from the persistent rows equal a build from scratch out of each
    sequence's page list and tokens."""
    buckets = Buckets(tokens=(64,), seqs=(4,), pages=(11,), max_seqs=4)
    hb = build_host_batch(out, page_size=PS, buckets=buckets, rows=s.batch_rows)
    chunks = out.chunks
    table, kv_lens, cu, num = pad_page_table(
        [s.kv_cache_manager.tables(c.seq)[0][: c.num_pages] for c in chunks],
        [c.end for c in chunks],
        [c.num_tokens for c in chunks],
        page_size=PS,
        max_num_seqs=4,
        pages_per_seq=11,
    )
    for got, want in ((hb.block_tables, table), (hb.kv_lens, kv_lens), (hb.cu_q_lens, cu)):
        np.testing.assert_array_equal(got, want)
    assert hb.num_seqs.tolist() == num.tolist()
    tokens = [t for c in chunks for t in c.seq.token_ids(c.start, c.end)]
    positions = [p for c in chunks for p in range(c.start, c.end)]
    assert hb.tokens[: len(tokens)].tolist() == tokens
    assert hb.positions[: len(positions)].tolist() == positions
    for i, c in enumerate(chunks):
        p = c.seq.params
        assert hb.sampling_floats[i].tolist() == pytest.approx(
            [
                p.temperature,
                p.top_p,
                p.min_p,
                p.presence_penalty,
                p.frequency_penalty,
                p.repetition_penalty,
            ]
        )
        assert hb.sampling_ints[i].tolist() == [p.top_k, c.seq.seed, 0, c.num_output_tokens]


@settings(max_examples=60, deadline=None)
@given(
    arrivals=_arrivals,
    num_pages=st.integers(12, 40),
    budget=st.integers(8, 48),
    caching=st.booleans(),
)
def test_random_workloads_end_cleanly(arrivals, num_pages, budget, caching):
    s = Scheduler(
        PagePool(num_pages),
        page_size=PS,
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        max_model_len=44,
        watermark=0.0,
        enable_prefix_caching=caching,
    )
    seqs = []
    for step in range(400):
        for i, a in enumerate(arrivals):
            if a.step == step:
                q = _seq(
                    str(i), a.prompt, max_tokens=a.max_tokens, arrival=float(step), salt=a.salt
                )
                s.check_fits(len(a.prompt), q.params)
                s.add(q)
                seqs.append((q, a))
        for q, a in seqs:
            if a.abort_at == step and q.status is not SeqStatus.FINISHED:
                s.abort([q])
        out = s.schedule()
        if out.chunks:
            _check_batch_against_scratch(s, out)
        s.update(out, [((step * 7 + c.start) % 4, 0.0) if c.samples else None for c in out.chunks])
        s.pool.check_invariants()
        s.kv_cache_manager.check_invariants()
        # Every page in use is held by a live sequence, once per holder: no leak.
        holders = collections.Counter(
            p
            for q, _ in seqs
            if q.status is not SeqStatus.FINISHED
            for p in s.kv_cache_manager.tables(q)[0]
        )
        assert len(holders) == s.pool.num_in_use
        assert all(s.pool.refcount(p) == n for p, n in holders.items())
        for q, _ in seqs:
            if q.status is SeqStatus.RUNNING:
                assert len(s.kv_cache_manager.tables(q)[0]) * PS >= q.num_computed_tokens
        if step > 12 and not s.has_unfinished():
            break
    assert not s.has_unfinished(), "a request never ended"
    assert len(seqs) == len(arrivals)
    for q, a in seqs:
        assert q.status is SeqStatus.FINISHED
        assert q.finish_reason.value in ("stop", "length", "abort")
        if q.finish_reason.value == "length":
            assert len(q.output_token_ids) == a.max_tokens
    assert s.pool.num_in_use == 0  # every page is free or cached
    assert s.pool.num_free == s.pool.num_usable
