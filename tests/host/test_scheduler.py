"""The host scheduler with a fake model: budgets, chunking, preemption, abort. No JAX."""

import subprocess
import sys

import pytest

from paxkv.host.page_pool import PagePool
from paxkv.host.request import SamplingParams
from paxkv.host.scheduler import Scheduler
from paxkv.host.sequence import SeqStatus
from paxkv.host.sequence import SequenceState as Sequence

PS = 4


def _seq(name, prompt_len, *, max_tokens=4, arrival=0.0, priority=0):
    return Sequence(
        seq_id=name,
        request_id=name,
        index=0,
        # Distinct tokens per name: these tests are not about prefix sharing.
        prompt_token_ids=[sum(map(ord, name)) * 1000 + i for i in range(prompt_len)],
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
        seed=0,
        arrival_time=arrival,
        priority=priority,
    )


def _sched(num_pages=64, max_num_seqs=4, budget=16, max_model_len=64):
    pool = PagePool(num_pages)
    return Scheduler(
        pool,
        page_size=PS,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        watermark=0.0,
    )


def _run(sched, out, token=7):
    """The fake model: every sampling chunk gets `token`."""
    finished = sched.update(out, [(token, -1.0) if c.samples else None for c in out.chunks])
    sched.pool.check_invariants()
    return finished


def test_budget_chunking_and_decode_first():
    s = _sched(budget=10)
    a, b = _seq("a", 6), _seq("b", 9)
    s.add(a)
    s.add(b)
    out = s.schedule()
    # a's whole prompt (6) fits; b gets the page-aligned part of the remaining 4 tokens.
    assert [(c.seq.seq_id, c.start, c.num_tokens, c.samples) for c in out.chunks] == [
        ("a", 0, 6, True),
        ("b", 0, 4, False),
    ]
    assert s.kv_cache_manager.tables(a)[0] == [1, 2] and s.kv_cache_manager.tables(b)[0] == [3]
    _run(s, out)
    out = s.schedule()
    # a decodes first, then b's next chunk: budget 9 left -> 5 remaining tokens fit.
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks] == [("a", 6, 1), ("b", 4, 5)]
    _run(s, out)
    assert a.output_token_ids == [7, 7] and b.output_token_ids == [7]


def test_page_aligned_chunks():
    s = _sched(budget=7)
    a = _seq("a", 20)
    s.add(a)
    sizes = []
    while not a.output_token_ids:
        out = s.schedule()
        sizes.append(out.chunks[0].num_tokens)
        _run(s, out)
    assert sizes == [4, 4, 4, 4, 4]  # 7-token budget, cut at page boundaries
    assert (
        len(s.kv_cache_manager.tables(a)[0]) == 5 and a.num_computed_tokens == 20
    )  # exactly the pages its tokens need


def test_finish_frees_pages_and_max_seqs():
    s = _sched(max_num_seqs=2)
    seqs = [_seq(str(i), 3, max_tokens=2) for i in range(3)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert [c.seq.seq_id for c in out.chunks] == ["0", "1"]
    _run(s, out)
    _run(s, s.schedule())  # second tokens: 0 and 1 finish
    assert all(q.status is SeqStatus.FINISHED for q in seqs[:2])
    assert s.pool.num_in_use == 0
    out = s.schedule()
    assert [c.seq.seq_id for c in out.chunks] == ["2"]


def test_preemption_by_recompute_picks_latest_arrival():
    # 4 usable pages; two sequences of 8 prompt tokens (2 full pages each) then decode.
    s = _sched(num_pages=5, budget=32)
    a, b = _seq("a", 8, max_tokens=8, arrival=0.0), _seq("b", 8, max_tokens=8, arrival=1.0)
    s.add(a)
    s.add(b)
    _run(s, s.schedule())
    assert s.pool.num_free == 0
    out = s.schedule()  # a and b each need a 3rd page for position 8; b (later) is preempted
    assert [c.seq.seq_id for c in out.chunks] == ["a"]
    assert out.preempted == (b,)
    assert (
        b.status is SeqStatus.WAITING
        and s.kv_cache_manager.tables(b)[0] == []
        and b.num_computed_tokens == 0
    )
    assert s.waiting[0] is b and s.num_preemptions == 1 and s.num_recomputed_tokens == 8
    _run(s, out)
    # b keeps its generated token and will recompute prompt + output (9 tokens).
    assert b.output_token_ids == [7] and b.num_tokens == 9


def test_priority_protects_from_preemption():
    s = _sched(num_pages=5, budget=32)
    a = _seq("a", 8, max_tokens=8, arrival=0.0, priority=1)
    b = _seq("b", 8, max_tokens=8, arrival=1.0, priority=0)
    s.add(a)
    s.add(b)
    _run(s, s.schedule())
    out = s.schedule()
    assert out.preempted == (a,)  # lower priority value wins; a has the larger one


def test_abort_frees_everything():
    s = _sched()
    a, b = _seq("a", 9), _seq("b", 5)
    s.add(a)
    s.add(b)
    _run(s, s.schedule())
    s.abort([a])
    assert a.status is SeqStatus.FINISHED and a.finish_reason.value == "abort"
    assert s.pool.num_in_use == len(s.kv_cache_manager.tables(b)[0])
    s.abort([b])
    assert s.pool.num_in_use == 0 and not s.has_unfinished()
    s.pool.check_invariants()


def test_rejects_what_can_never_fit():
    s = _sched(num_pages=5, max_model_len=64)
    with pytest.raises(ValueError, match="exceeds max_model_len=64"):
        s.check_fits(60, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="needs 5 pages but the whole pool has 4"):
        s.check_fits(17, SamplingParams(max_tokens=1))


def test_scheduler_never_imports_jax():
    code = "import sys, paxkv.host.scheduler, paxkv.host.request; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
