"""Tests for the host page pool: exact page ids, eviction order, bad input, a state machine."""

import os
import pathlib
import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from paxkv.host.page_pool import NULL_PAGE, InvariantError, PagePool

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def checked(pool: PagePool, result=None):
    """Checks the pool's invariants and passes `result` through, for one-line steps."""
    pool.check_invariants()
    return result


def test_scripted_allocate_and_free_exact_ids():
    pool = PagePool(6)
    checked(pool)
    assert (pool.num_pages, pool.num_usable, pool.num_free, pool.num_in_use) == (6, 5, 5, 0)
    assert checked(pool, pool.allocate(2)) == [1, 2]
    assert checked(pool, pool.allocate(2)) == [3, 4]
    assert checked(pool, pool.allocate(2)) is None
    assert (pool.num_free, pool.num_in_use, pool.usage) == (1, 4, 0.8)
    assert [pool.refcount(p) for p in range(1, 6)] == [1, 1, 1, 1, 0]
    pool.free([2, 1])  # reverse order: page 2 is evicted before page 1
    checked(pool)
    assert pool.num_free == 3
    assert checked(pool, pool.allocate(3)) == [5, 2, 1]
    assert checked(pool, pool.allocate(0)) == []
    assert checked(pool, pool.allocate(1)) is None
    assert pool.usage == 1.0
    pool.touch([3])  # an in-use page: one more reference
    checked(pool)
    assert pool.refcount(3) == 2
    pool.free([4, 3])
    checked(pool)
    assert (pool.refcount(3), pool.refcount(4)) == (1, 0)
    pool.free([3, 1, 2, 5])
    checked(pool)
    assert pool.num_free == pool.num_usable == 5
    assert checked(pool, pool.allocate(5)) == [4, 3, 1, 2, 5]
    assert pool.num_evictions == 0


def test_smallest_pool_has_one_page():
    pool = PagePool(2)
    assert pool.allocate(1) == [1]
    assert pool.allocate(1) is None
    checked(pool)


def test_eviction_is_lru_and_drops_each_key():
    pool = PagePool(6)
    assert pool.allocate(4) == [1, 2, 3, 4]
    for page, key in [(1, "a"), (2, "b"), (3, "c")]:
        assert checked(pool, pool.mark_cached(page, key)) is True
    assert (pool.num_cached, [pool.lookup(k) for k in "abc"]) == (3, [1, 2, 3])
    pool.free([3, 2, 1])
    checked(pool)
    # Queue is now 5, 3, 2, 1; cached pages keep their keys while evictable.
    assert (pool.num_free, pool.num_cached, pool.lookup("c")) == (4, 3, 3)
    assert checked(pool, pool.allocate(2)) == [5, 3]
    assert [pool.lookup(k) for k in "abc"] == [1, 2, None]
    assert (pool.num_cached, pool.num_evictions) == (2, 1)
    # A prefix hit on page 2 takes it out of the queue, so page 1 is evicted next.
    assert pool.lookup("b") == 2
    pool.touch([2])
    checked(pool)
    assert (pool.refcount(2), pool.num_free) == (1, 1)
    assert checked(pool, pool.allocate(1)) == [1]
    assert [pool.lookup(k) for k in "abc"] == [None, 2, None]
    assert checked(pool, pool.allocate(1)) is None
    assert pool.num_evictions == 2
    assert (pool.lookup("b"), pool.num_cached, pool.num_evictions) == (2, 1, 2)


def test_touch_of_in_use_cached_page_shares_it():
    pool = PagePool(4)
    [page] = pool.allocate(1)
    pool.mark_cached(page, "k")
    pool.touch([pool.lookup("k")])
    checked(pool)
    assert (pool.refcount(page), pool.num_free) == (2, 2)
    pool.free([page])
    assert pool.refcount(page) == 1
    pool.free([page])
    checked(pool)
    assert (pool.num_free, pool.lookup("k")) == (3, page)


def test_mark_cached_keeps_the_first_page_for_a_key():
    pool = PagePool(4)
    assert pool.allocate(2) == [1, 2]
    assert pool.mark_cached(1, "k") is True
    assert pool.mark_cached(1, "k") is True
    assert pool.mark_cached(2, "k") is False
    checked(pool)
    assert (pool.lookup("k"), pool.num_cached) == (1, 1)
    with pytest.raises(ValueError, match="page 1 already holds cache key 'k'"):
        pool.mark_cached(1, "other")
    with pytest.raises(ValueError, match="page 3 is not in use"):
        pool.mark_cached(3, "x")
    checked(pool)


def test_uncache_all_forgets_every_key_and_keeps_the_queue():
    pool = PagePool(5)
    a, b = pool.allocate(2)
    assert pool.mark_cached(a, "ka") and pool.mark_cached(b, "kb")
    pool.free([a])  # cached-evictable; b stays in use
    pool.uncache_all()
    checked(pool)
    assert (pool.lookup("ka"), pool.lookup("kb"), pool.num_cached) == (None, None, 0)
    assert (pool.refcount(a), pool.refcount(b), pool.num_free) == (0, 1, 3)
    assert pool.allocate(3) == [3, 4, a]  # order kept; nothing evicted
    assert pool.num_evictions == 0


@pytest.mark.parametrize("num_pages", [-1, 0, 1])
def test_too_few_pages_is_rejected(num_pages):
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(num_pages)


def test_negative_allocation_is_rejected():
    pool = PagePool(4)
    with pytest.raises(ValueError, match="n=-1"):
        pool.allocate(-1)
    checked(pool)
    assert pool.num_free == 3


@pytest.mark.parametrize(
    "pages, message",
    [
        ([2, NULL_PAGE], "page 0 is NULL_PAGE"),
        ([2, 6], r"page 6 is out of range \[1, 6\)"),
        ([2, -1], "page -1 is out of range"),
        ([2, 4], "page 4 is freed 1 time.* refcount 0"),
        ([2, 1, 1], "page 1 is freed 2 time.* refcount 1"),
    ],
)
def test_bad_free_names_the_page_and_changes_nothing(pages, message):
    pool = PagePool(6)
    assert pool.allocate(3) == [1, 2, 3]
    pool.free([3])
    with pytest.raises(ValueError, match=message):
        pool.free(pages)
    checked(pool)
    assert [pool.refcount(p) for p in range(1, 6)] == [1, 1, 0, 0, 0]
    assert pool.allocate(3) == [4, 5, 3]


def test_bad_touch_names_the_page_and_changes_nothing():
    pool = PagePool(6)
    pool.allocate(1)
    pool.mark_cached(1, "k")
    pool.free([1])
    with pytest.raises(ValueError, match="page 2 is free and holds no cache key"):
        pool.touch([1, 2])
    with pytest.raises(ValueError, match="page 0 is NULL_PAGE"):
        pool.touch([1, NULL_PAGE])
    with pytest.raises(ValueError, match="page 9 is out of range"):
        pool.touch([1, 9])
    checked(pool)
    assert (pool.refcount(1), pool.num_free) == (0, 5)


def test_queries_reject_bad_pages():
    pool = PagePool(3)
    for query in (pool.refcount, lambda page: pool.uncache(page, "k")):
        with pytest.raises(ValueError, match="page 0 is NULL_PAGE"):
            query(NULL_PAGE)
        with pytest.raises(ValueError, match="page 3 is out of range"):
            query(3)


def test_check_invariants_detects_corruption():
    pool = PagePool(4)
    pool.allocate(1)
    pool._refcounts[2] = 1  # referenced while still in the free queue
    with pytest.raises(InvariantError, match=r"pages \[2\] are in the free queue and referenced"):
        pool.check_invariants()
    pool = PagePool(4)
    pool._next[2] = 1  # a cycle 1 -> 2 -> 1
    with pytest.raises(InvariantError, match="free queue"):
        pool.check_invariants()
    pool = PagePool(4)
    pool.allocate(1)
    pool.mark_cached(1, "k")
    pool._key_to_page["k"] = 2
    with pytest.raises(InvariantError, match="page 1 holds key 'k' but the key maps to 2"):
        pool.check_invariants()


def test_importing_page_pool_does_not_import_jax():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; import paxkv.host.page_pool; assert 'jax' not in sys.modules",
        ],
        cwd=REPO_ROOT,
        env=env,
        check=True,
    )


class PagePoolMachine(RuleBasedStateMachine):
    """Drives a pool against an independent model: a plain-list free queue and key maps.

    Each handle is one owner's list of pages, holding one reference to each.
    """

    @initialize(num_pages=st.integers(2, 10))
    def create(self, num_pages):
        self.pool = PagePool(num_pages)
        self.num_evictions = 0
        self.handles: list[list[int]] = []
        self.queue = list(range(1, num_pages))
        self.refcounts = dict.fromkeys(range(1, num_pages), 0)
        self.page_to_key = {}
        self.key_to_page = {}

    @rule(n=st.integers(0, 5))
    def allocate(self, n):
        pages = self.pool.allocate(n)
        if n > len(self.queue):
            assert pages is None
            return
        expected, self.queue = self.queue[:n], self.queue[n:]
        assert pages == expected
        expected_evictions = [(p, self.page_to_key[p]) for p in pages if p in self.page_to_key]
        self.num_evictions += len(expected_evictions)
        assert self.pool.num_evictions == self.num_evictions
        for page, key in expected_evictions:
            assert self.pool.lookup(key) is None
            del self.page_to_key[page], self.key_to_page[key]
        for page in pages:
            self.refcounts[page] = 1
        self.handles.append(pages)

    @rule(i=st.integers(0, 100))
    def touch_in_use(self, i):
        if not self.handles:
            return
        pages = self.handles[i % len(self.handles)]
        self.pool.touch(pages)  # pages a handle holds are in use: one more reference each
        for page in pages:
            self.refcounts[page] += 1
        self.handles.append(list(pages))

    @rule(i=st.integers(0, 100))
    def free(self, i):
        if not self.handles:
            return
        pages = self.handles.pop(i % len(self.handles))
        self.pool.free(reversed(pages))
        for page in reversed(pages):
            self.refcounts[page] -= 1
            if self.refcounts[page] == 0:
                self.queue.append(page)

    @rule(i=st.integers(0, 100), j=st.integers(0, 100), key=st.integers(0, 5))
    def mark_cached(self, i, j, key):
        nonempty = [h for h in self.handles if h]
        if not nonempty:
            return
        handle = nonempty[i % len(nonempty)]
        page = handle[j % len(handle)]
        held = self.page_to_key.get(page, key)
        if held != key:
            with pytest.raises(ValueError, match=f"page {page} already holds cache key"):
                self.pool.mark_cached(page, key)
            return
        owner = self.key_to_page.get(key, page)
        assert self.pool.mark_cached(page, key) is (owner == page)
        if owner == page:
            self.page_to_key[page] = key
            self.key_to_page[key] = page

    @rule(key=st.integers(0, 5))
    def touch_via_lookup(self, key):
        page = self.pool.lookup(key)
        assert page == self.key_to_page.get(key)
        if page is None:
            return
        self.pool.touch([page])
        if self.refcounts[page] == 0:
            self.queue.remove(page)
        self.refcounts[page] += 1
        self.handles.append([page])

    @invariant()
    def matches_model(self):
        self.pool.check_invariants()
        assert self.pool.num_free == len(self.queue)
        assert self.pool.num_in_use == sum(1 for rc in self.refcounts.values() if rc > 0)
        assert self.pool.num_cached == len(self.page_to_key)
        for page, rc in self.refcounts.items():
            assert self.pool.refcount(page) == rc
        for key in range(6):  # every key the rules use
            assert self.pool.lookup(key) == self.key_to_page.get(key)

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        while self.handles:
            self.pool.free(reversed(self.handles.pop()))
            self.pool.check_invariants()
        assert self.pool.num_free == self.pool.num_usable
        assert self.pool.num_in_use == 0
        assert self.pool.allocate(self.pool.num_usable) is not None


PagePoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPagePoolMachine = PagePoolMachine.TestCase


def test_mark_cached_many_marks_in_order():
    """One pass over many pages (what `mark_cached` does for one): a key another page
    holds stays with it, a repeated pair changes nothing, and a bad entry raises after
    marking those before it and none after."""

    def pool_with_taken():
        pool = PagePool(16)
        pool.allocate(6)
        pool.mark_cached(4, "taken")
        return pool

    many = pool_with_taken()
    many.mark_cached_many([1, 2, 3, 2, 5], ["x", "y", "taken", "y", "z"])
    assert many._page_to_key == {1: "x", 2: "y", 4: "taken", 5: "z"}
    assert many._key_to_page == {"x": 1, "y": 2, "taken": 4, "z": 5}
    many.check_invariants()
    # (bad page, its key, what the error says); page 2 holds "y" already
    for bad, key, why in [(9, "w", "not in use"), (0, "w", "NULL_PAGE"), (2, "w", "already holds")]:
        many = pool_with_taken()
        many.mark_cached(2, "y")
        with pytest.raises(ValueError, match=why):
            many.mark_cached_many([1, bad, 3], ["x", key, "v"])
        # the entry before the bad one is marked, none after it
        assert many._page_to_key.get(1) == "x" and 3 not in many._page_to_key
