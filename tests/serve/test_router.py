"""The replica routers' rules, on the host alone (`paxkv.serve.router`)."""

import pytest

from paxkv.host.prefix_cache import page_keys
from paxkv.serve.router import PrefixRouter, RoundRobinRouter, Route, make_router

PS = 4


def router(num_replicas=3, capacity_pages=100, balance_slack=2) -> PrefixRouter:
    return PrefixRouter(
        num_replicas, page_size=PS, capacity_pages=capacity_pages, balance_slack=balance_slack
    )


def test_an_idle_set_fills_evenly_then_prefixes_stick():
    r = router()
    prompts = [[10 * i + j for j in range(9)] for i in range(3)]  # 2 full pages each
    first = []
    for p in prompts:
        route = r.choose(p, None, [0, 0, 0])
        assert route.rule == "least_loaded" and route.matched_pages == 0
        r.routed(route.replica, p, None)
        first.append(route.replica)
    assert first == [0, 1, 2]  # ties rotate
    for i, p in enumerate(prompts):
        longer = [*p, 7, 7, 7, 7, 7]
        route = r.choose(longer, None, [1, 1, 1])
        assert (route.replica, route.rule, route.matched_pages) == (first[i], "prefix", 2)


def test_the_longest_match_wins_and_less_than_a_page_matches_nothing():
    r = router()
    base = list(range(12))  # 3 pages
    r.routed(0, base[:4], None)  # 1 page
    r.routed(1, base[:8], None)  # 2 pages
    assert r.choose(base, None, [0, 0, 0]).replica == 1
    assert r.choose([*base[:8], 99], None, [0, 0, 0]).matched_pages == 2
    # Same first page but a different second: replica 0 and 1 match one page each; the
    # less loaded of them wins.
    route = r.choose([*base[:4], 50, 51, 52, 53], None, [3, 1, 0])
    assert (route.replica, route.matched_pages) == (1, 1)
    # Shorter than a page: no prefix to match, the least loaded.
    assert r.choose(base[:3], None, [2, 0, 1]) == Route(1, "least_loaded", 0)


def test_balance_slack_sends_a_hit_elsewhere_when_its_replica_is_busy():
    r = router(balance_slack=2)
    p = list(range(8))
    r.routed(2, p, None)
    assert r.choose(p, None, [0, 0, 2]).rule == "prefix"  # 2 more than the least: within
    route = r.choose(p, None, [0, 1, 3])
    assert (route.replica, route.rule) == (0, "least_loaded")


def test_salts_never_match_each_other():
    r = router()
    p = list(range(8))
    r.routed(1, p, "tenant-a")
    assert r.choose(p, "tenant-a", [0, 0, 0]).replica == 1
    assert r.choose(p, "tenant-b", [5, 5, 0]).rule == "least_loaded"
    assert r.choose(p, None, [5, 5, 0]).rule == "least_loaded"


def test_dead_or_full_replicas_are_never_chosen():
    r = router()
    p = list(range(8))
    r.routed(1, p, None)
    route = r.choose(p, None, [4, None, 0])
    assert route.replica == 2 and route.rule == "least_loaded"
    with pytest.raises(ValueError, match="no replica"):
        r.choose(p, None, [None, None, None])
    r.forget(1)
    assert r.choose(p, None, [0, 0, 0]).rule == "least_loaded"


def test_capacity_forgets_the_least_recent_pages():
    r = router(capacity_pages=4)
    old, new = list(range(8)), list(range(100, 108))
    r.routed(0, old, None)
    r.routed(0, new, None)  # 4 pages: exactly full
    assert r.matched_pages(0, [hash(k) for k in page_keys(old, PS)]) == 2
    r.routed(0, list(range(200, 204)), None)  # one more: the oldest page goes
    assert r.matched_pages(0, [hash(k) for k in page_keys(old, PS)]) == 0
    assert r.matched_pages(0, [hash(k) for k in page_keys(new, PS)]) == 2


def test_round_robin_cycles_over_live_replicas():
    rr = make_router("round_robin", 3, page_size=PS, capacity_pages=1, balance_slack=0)
    assert isinstance(rr, RoundRobinRouter)
    got = [rr.choose([1] * 8, None, [0, 9, 0]).replica for _ in range(4)]
    assert got == [0, 1, 2, 0]
    assert [rr.choose([], None, [0, None, 0]).replica for _ in range(3)] == [2, 0, 2]
    with pytest.raises(ValueError, match="router='nearest' must be one of"):
        make_router("nearest", 3, page_size=PS, capacity_pages=1, balance_slack=0)
