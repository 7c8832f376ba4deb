"""Data-parallel replicas behind one front end (`paxkv.serve.replicas`), over fake-runner
engines: outputs equal one engine's, prefix routing beats round robin on cache hits,
stats merge, and a failed replica loses no request."""

import asyncio
import threading
import time

import numpy as np
import pytest

from paxkv import SamplingParams
from paxkv.engine import Engine, EngineConfig
from paxkv.engine.fake_runner import FakeRunner
from paxkv.engine.metrics import merge_stats
from paxkv.serve.frontend import EngineDead, Submission
from paxkv.serve.replicas import ReplicaSet

CONFIG = EngineConfig(
    num_pages=128, page_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128
)
VOCAB = 1000


class SlowRunner(FakeRunner):
    """A fake runner whose steps take `delay_s`, and raise once `fail` is set."""

    def __init__(self, config, delay_s: float = 0.0):
        super().__init__(VOCAB, config)
        self.delay_s = delay_s
        self.fail = threading.Event()

    def dispatch(self, hb):
        if self.fail.is_set():
            raise RuntimeError("injected replica failure")
        time.sleep(self.delay_s)
        return super().dispatch(hb)


def engines(num: int, delay_s: float = 0.0) -> list[Engine]:
    return [Engine(None, CONFIG, runner=lambda c: SlowRunner(c, delay_s)) for _ in range(num)]


def requests(seed: int, num: int, prefixes: int = 3) -> list[Submission]:
    """`num` requests whose prompts start with one of `prefixes` 3-page prefixes."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(0, VOCAB, 24).tolist() for _ in range(prefixes)]
    subs = []
    for i in range(num):
        prompt = heads[i % prefixes] + rng.integers(0, VOCAB, int(rng.integers(1, 9))).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(4, 20)), n=1 + i % 2)
        subs.append(Submission(f"r{i}", {"prompt_token_ids": prompt}, params))
    return subs


def reference(subs: list[Submission]) -> dict[str, dict[int, list[int]]]:
    """Each request's completions run on one engine."""
    (engine,) = engines(1)
    for s in subs:
        engine.add_request(s.request_id, s.prompt, s.params)
    done = engine.run_until_done()
    return {rid: {c.index: c.token_ids for c in out.outputs} for rid, out in done.items()}


async def collect(group) -> dict[str, dict[int, list[int]]]:
    """The completions of a group, from its delta outputs."""
    got: dict[str, dict[int, list[int]]] = {}
    async for out in group:
        for c in out.outputs:
            got.setdefault(out.request_id, {}).setdefault(c.index, []).extend(c.token_ids)
    return got


async def run(rs: ReplicaSet, subs: list[Submission], *, sequential: bool, stream: bool = False):
    """Submits `subs` (one group each), one at a time or all at once; their completions."""
    got = {}
    if sequential:
        for s in subs:
            got |= await collect(await rs.submit([s], stream=stream))
    else:
        groups = [await rs.submit([s], stream=stream) for s in subs]
        for g in await asyncio.gather(*(collect(g) for g in groups)):
            got |= g
    return got


@pytest.mark.parametrize("router", ["prefix", "round_robin"])
def test_replicas_give_one_engines_outputs(router):
    subs = requests(0, 24)

    async def main():
        rs = ReplicaSet(engines(3), max_queued=64, router=router)
        rs.start()
        try:
            got = await run(rs, subs[:12], sequential=True)
            got |= await run(rs, subs[12:], sequential=False, stream=True)
            # A request of several prompts is spread over the replicas, and comes back whole.
            group = await rs.submit(requests(1, 6), stream=False)
            assert group.request_ids == tuple(f"r{i}" for i in range(6))
            several = await collect(group)
            return got, several, await rs.stats()
        finally:
            await rs.close()

    got, several, stats = asyncio.run(main())
    assert got == reference(subs)
    assert several == reference(requests(1, 6))
    routed = [sum(r["routed"].values()) for r in stats["replicas"]]
    assert sum(routed) == 30 and min(routed) > 0, routed
    assert stats["replicas_up"] == [True] * 3
    assert stats["kv_pages_in_use"] == 0 and stats["num_requests_running"] == 0
    assert stats["generation_tokens"] == sum(r["generation_tokens"] for r in stats["replicas"])


def test_prefix_routing_hits_the_cache_more_than_round_robin():
    subs = requests(2, 30, prefixes=5)
    rates = {}
    for router in ("prefix", "round_robin"):

        async def main(router=router):
            rs = ReplicaSet(engines(3), max_queued=64, router=router)
            rs.start()
            try:
                await run(rs, subs, sequential=True)
                return await rs.stats()
            finally:
                await rs.close()

        stats = asyncio.run(main())
        rates[router] = stats["prefix_cache_hits"] / stats["prefix_cache_queries"]
        if router == "prefix":  # each prefix's requests all went where it was first sent
            by_rule = [r["routed"] for r in stats["replicas"]]
            assert sum(r.get("prefix", 0) for r in by_rule) == 30 - 5
    # Prefix routing misses only each prefix's first request (24 of its prompt tokens are
    # cacheable: 3 pages); round robin misses on every replica a prefix first meets.
    assert rates["prefix"] > rates["round_robin"], rates


def test_a_failed_replica_loses_no_request():
    subs = requests(3, 12)
    streams = [
        Submission(f"s{i}", {"prompt_token_ids": [5, 6, 7, i]}, SamplingParams(max_tokens=40))
        for i in range(3)
    ]

    async def main():
        es = engines(3, delay_s=0.01)
        rs = ReplicaSet(es, max_queued=64, router="round_robin")
        rs.start()
        try:
            # One stream per replica (round robin), then the non-streamed requests.
            stream_groups = [await rs.submit([s], stream=True) for s in streams]
            groups = [await rs.submit([s], stream=False) for s in subs]
            iters = [g.__aiter__() for g in stream_groups]
            firsts = [await it.__anext__() for it in iters]  # every stream has started
            es[0].runner.fail.set()
            results = await asyncio.gather(*(collect(g) for g in groups))
            ended = []
            for it in iters:
                try:
                    async for _ in it:
                        pass
                    ended.append("finished")
                except EngineDead as e:
                    ended.append(str(e))
            return firsts, results, ended, await rs.stats()
        finally:
            await rs.close()

    firsts, results, ended, stats = asyncio.run(main())
    got = {}
    for r in results:
        got |= r
    assert got == reference(subs)  # every non-streamed request whole, as if nothing failed
    assert stats["router"]["retried_requests"] > 0
    assert stats["replicas_up"] == [False, True, True]
    assert all(f.outputs[0].token_ids for f in firsts)
    # The stream on the failed replica had sent output: it ends with an error, not a hang.
    assert "replica 0 failed after part of the stream was sent" in ended[0]
    assert ended[1:] == ["finished", "finished"]
    assert stats["router"]["cut_streams"] == 1
    assert all(r["kv_pages_in_use"] == 0 for r in stats["replicas"][1:])


def test_requests_go_elsewhere_once_a_replica_failed_and_none_when_all_did():
    async def main():
        es = engines(2)
        rs = ReplicaSet(es, max_queued=16)
        rs.start()
        try:
            es[1].runner.fail.set()
            # Whatever reaches replica 1 fails there and runs again on replica 0.
            got = await run(rs, requests(4, 6), sequential=False)
            assert rs.fronts[1].dead and not rs.dead
            es[0].runner.fail.set()
            with pytest.raises(EngineDead):
                await collect(await rs.submit(requests(5, 1), stream=False))
            with pytest.raises(EngineDead, match="every replica has failed"):
                await rs.submit(requests(6, 1))
            return got, rs.dead
        finally:
            await rs.close()

    got, dead = asyncio.run(main())
    assert got == reference(requests(4, 6)) and dead


def test_merge_stats_sums_and_recomputes_ratios():
    a = {
        "num_requests_running": 2,
        "kv_pages_in_use": 10,
        "kv_pages_total": 100,
        "kv_cache_usage_perc": 0.1,
        "prefix_cache_hits": 30,
        "prefix_cache_queries": 40,
        "prefix_cache_hit_rate": 0.75,
        "requests_finished": {"stop": 3},
        "time_to_first_token_seconds": {"p50": 0.1, "p90": 0.2, "p99": 0.3, "mean": 0.1},
        "elapsed_s": 5.0,
        "output_tok_per_s": 10.0,
    }
    b = a | {
        "num_requests_running": 1,
        "kv_pages_in_use": 50,
        "kv_cache_usage_perc": 0.5,
        "prefix_cache_hits": 0,
        "prefix_cache_queries": 60,
        "prefix_cache_hit_rate": 0.0,
        "requests_finished": {"stop": 1, "length": 2},
        "time_to_first_token_seconds": {"p50": 0.4, "p90": None, "p99": 0.1, "mean": 0.2},
        "elapsed_s": 7.0,
    }
    m = merge_stats([a, b])
    assert m["num_requests_running"] == 3 and m["output_tok_per_s"] == 20.0
    assert m["kv_cache_usage_perc"] == 60 / 200 and m["prefix_cache_hit_rate"] == 30 / 100
    assert m["requests_finished"] == {"stop": 4, "length": 2}
    assert m["time_to_first_token_seconds"] == {"p50": 0.4, "p90": 0.2, "p99": 0.3, "mean": 0.2}
    assert m["elapsed_s"] == 7.0
    assert merge_stats([a]) == a and merge_stats([]) == {}
