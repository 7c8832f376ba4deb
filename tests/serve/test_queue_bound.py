"""The front end's bound on unfinished sequences holds for requests that arrive
together: a burst past it is refused (`QueueFull`, HTTP 429) however the requests'
validation interleaves, and the accepted ones all finish. The engine's steps wait on a
gate while the burst arrives, so no request finishes in between (the HTTP burst against
a real server: tests/serve/test_server.py)."""

import asyncio
import threading

import pytest

from paxkv import SamplingParams
from paxkv.engine import Engine, EngineConfig
from paxkv.engine.fake_runner import FakeRunner
from paxkv.serve.frontend import QueueFull, Submission
from paxkv.serve.replicas import ReplicaSet

CONFIG = EngineConfig(
    num_pages=128, page_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128
)


class GatedRunner(FakeRunner):
    """A fake runner whose steps wait until `gate` is set."""

    def __init__(self, config):
        super().__init__(1000, config)
        self.gate = threading.Event()

    def dispatch(self, hb):
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        return super().dispatch(hb)


@pytest.mark.parametrize("n", [1, 3])
def test_a_burst_past_the_bound_is_refused_and_the_rest_finish(n):
    runner = GatedRunner(CONFIG)
    engine = Engine(None, CONFIG, runner=lambda c: runner)
    params = SamplingParams(max_tokens=6, n=n, ignore_eos=True)
    # Room for max_num_seqs + max_queued = 4 + 8 = 12 sequences.
    fits = 12 // n
    subs = [Submission(f"r{i}", {"prompt_token_ids": [1, 2, i]}, params) for i in range(fits + 5)]

    async def main():
        rs = ReplicaSet([engine], max_queued=8)
        rs.start()
        try:
            tasks = [asyncio.create_task(rs.submit([s])) for s in subs]
            # The refusals come while every step waits: nothing finished in between.
            done, _ = await asyncio.wait(tasks[fits:], timeout=30)
            assert len(done) == 5
            refused = [t.exception() for t in tasks[fits:]]
            assert all(isinstance(e, QueueFull) for e in refused), refused
            assert "retry later" in str(refused[0])
            assert rs.fronts[0].num_unfinished == fits * n
            runner.gate.set()
            got = {}
            for group in await asyncio.gather(*tasks[:fits]):
                async for out in group:
                    for c in out.outputs:
                        got.setdefault((out.request_id, c.index), []).extend(c.token_ids)
            return got, rs.fronts[0].num_unfinished, await rs.stats()
        finally:
            runner.gate.set()
            await rs.close()

    got, unfinished, stats = asyncio.run(main())
    assert set(got) == {(f"r{i}", j) for i in range(fits) for j in range(n)}
    assert all(len(tokens) == 6 for tokens in got.values())
    assert unfinished == 0
    assert stats["kv_pages_in_use"] == 0 and stats["num_requests_running"] == 0
