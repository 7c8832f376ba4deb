"""The host tier's index (`paxkv.host.host_tier`): LRU slots, pins, the copies it records,
and the KV-cache manager continuing a prefix from it."""

import pytest

from paxkv.host.host_tier import HostKVTier
from paxkv.host.kv_cache_manager import KVCacheManager
from paxkv.host.page_pool import PagePool
from paxkv.host.prefix_cache import page_keys
from paxkv.host.request import SamplingParams
from paxkv.host.sequence import SequenceState


def test_evicted_keys_get_slots_least_recently_used_first():
    tier = HostKVTier(2, page_bytes=10)
    tier.save([(5, "a"), (6, "b")])
    assert tier.take_copies() == ([(5, 0), (6, 1)], [])
    tier.save([(7, "a")])  # held already: made the most recent, nothing copied
    assert not tier.pending
    tier.landed([0, 1])
    tier.save([(8, "c")])  # "b" is now the least recent: its slot goes to "c"
    assert tier.take_copies() == ([(8, 1)], [])
    assert "b" not in tier and "a" in tier and "c" in tier
    assert (tier.evictions, tier.saved) == (1, 3)
    tier.check_invariants()


def test_a_pinned_slot_is_never_reused():
    tier = HostKVTier(2, page_bytes=10)
    tier.save([(5, "a"), (6, "b")])
    tier.take_copies()
    tier.landed([0, 1])
    assert [tier.holds(k) for k in "axb"] == [True, False, True]
    tier.load(["a"], [9])  # slot 0 pinned until the copies are taken
    assert (tier.queries, tier.hits) == (3, 1)
    tier.save([(3, "c")])  # "a" is the most recent anyway; "b" (slot 1) goes
    tier.save([(4, "d")])  # every slot pinned or being saved: skipped
    assert tier.skipped == 1 and "d" not in tier
    assert tier.take_copies() == ([(3, 1)], [(0, 9)])
    tier.landed([1])
    tier.save([(4, "d")])  # unpinned now: "a" goes
    assert "a" not in tier and "d" in tier
    tier.check_invariants()


def test_clear_forgets_every_key_and_copy():
    tier = HostKVTier(3, page_bytes=10)
    tier.save([(5, "a"), (6, "b")])
    tier.take_copies()
    tier.load(["b"], [2])
    tier.save([(7, "c")])
    tier.clear()  # new weights: nothing is found again, no copy is left to make
    assert tier.num_used == 0 and not tier.holds("a") and not tier.pending
    assert tier.take_copies() == ([], [])
    tier.check_invariants()
    tier.save([(1, "x"), (2, "y"), (3, "z")])
    assert sorted(s for _, s in tier.take_copies()[0]) == [0, 1, 2]


def test_dropped_copies_forget_the_keys_whose_bytes_never_landed():
    tier = HostKVTier(4, page_bytes=10)
    tier.save([(5, "a"), (7, "c")])
    saves, _ = tier.take_copies()
    tier.landed([slot for page, slot in saves if page == 5])  # "c" is still in transit
    tier.save([(6, "b")])
    tier.load(["a"], [3])
    tier.drop_pending()  # the device cache was lost
    assert "a" in tier and "b" not in tier and "c" not in tier and not tier.pending
    tier.check_invariants()
    tier.save([(1, "x"), (2, "y"), (3, "z")])  # the three free slots, none evicted
    assert tier.evictions == 0 and "a" in tier
    tier.check_invariants()


def test_a_slot_in_transit_is_never_handed_to_another_key():
    tier = HostKVTier(1, page_bytes=10)
    tier.save([(5, "a")])
    tier.take_copies()  # its bytes have not landed
    tier.save([(6, "b")])
    assert tier.skipped == 1 and "a" in tier
    tier.landed([0])
    tier.save([(6, "b")])
    assert "b" in tier and "a" not in tier


def _manager(num_pages, tier):
    return KVCacheManager(PagePool(num_pages), page_size=4, max_model_len=64, host_tier=tier)


def _seq(seq_id, tokens):
    return SequenceState(
        str(seq_id), str(seq_id), 0, list(tokens), SamplingParams(max_tokens=4), 0, 0.0
    )


def test_a_prefix_continues_from_the_host_tier_past_the_device_hits():
    tier = HostKVTier(8, page_bytes=10)
    kv = _manager(6, tier)  # 5 usable pages
    tokens = list(range(17))  # 4 full pages, the last token computed anyway
    first = _seq(0, tokens)
    assert kv.allocate(first, 17)
    first.num_computed_tokens = 17
    kv.register_full_pages(first)
    kv.free(first)  # the plain page, then its 4 keyed ones last page first
    other = _seq(1, [100 + i for i in range(12)])
    assert kv.allocate(other, 12)  # the plain page, then its last two pages evicted
    kv.save_evicted()
    saves, _ = tier.take_copies()
    assert len(saves) == 2
    again = _seq(2, tokens)
    assert kv.prefix_cache.lookup(again).num_pages == 2  # its first two pages are left
    kv.free(other)
    prefix = kv.lookup(again)  # and the next two are in the tier
    assert prefix.num_pages == 4 and prefix.from_host() == [(0, 2), (0, 3)]
    assert prefix.host_tokens(4) == 8
    assert kv.take_hits(again, prefix) == 16
    assert tier.pending
    _, loads = tier.take_copies()
    assert [slot for slot, _ in loads] == [s for _, s in saves][::-1]  # evicted last first
    keys = page_keys(tokens, 4)
    assert [kv.pool.lookup(k) for k in keys[2:]] == [p for _, p in loads]
    assert kv.tables(again)[0] == prefix.tables[0][:2] + [p for _, p in loads]
    kv.check_invariants()
    kv.pool.check_invariants()


def test_a_tier_needs_prefix_caching():
    with pytest.raises(ValueError, match="turn prefix caching on"):
        KVCacheManager(
            PagePool(8),
            page_size=4,
            max_model_len=64,
            enable_prefix_caching=False,
            host_tier=HostKVTier(2, 10),
        )
