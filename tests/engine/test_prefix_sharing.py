"""Same-step prefix sharing: requests admitted together share the pages of a common
prompt prefix as the first of them computes it."""

import numpy as np
from test_engine import _engine, _run

from paxkv import SamplingParams
from paxkv.engine import Engine, EngineConfig
from paxkv.engine.fake_runner import FakeRunner


def test_sixteen_requests_arriving_together_compute_a_shared_prefix_once():
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 32000, 256).tolist()
    prompts = [[*prefix, *rng.integers(0, 32000, 10).tolist()] for _ in range(16)]
    config = EngineConfig(
        num_pages=1024,
        page_size=16,
        max_num_seqs=16,
        max_num_batched_tokens=8192,
        max_model_len=512,
    )
    engine = Engine(None, config, runner=lambda c: FakeRunner(32000, c))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(max_tokens=4))
    first_step = engine.scheduler.schedule
    plans = []

    def recording():
        out = first_step()
        plans.append(out)
        return out

    engine.scheduler.schedule = recording
    final = engine.run_until_done()
    # All 16 ran in the first step; 15 of them read the prefix's 16 pages from the first.
    assert len(plans[0].chunks) == 16
    assert [c.start for c in plans[0].chunks] == [0] + [256] * 15
    assert sorted(o.num_cached_tokens for o in final.values()) == [0] + [256] * 15
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == 15 * 256
    assert engine.pool.num_in_use == 0


def test_shared_pages_written_in_the_same_step_give_the_solo_outputs(tiny):
    """The real model: a request that reads prefix pages another request writes in the
    same step generates exactly what it generates alone."""
    config, model, _ = tiny
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, config.vocab_size, 24).tolist()
    prompts = [[*prefix, *rng.integers(0, config.vocab_size, n).tolist()] for n in (3, 5, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    solo = [_run(_engine(model, enable_prefix_caching=False), [p], params)[0] for p in prompts]
    engine = _engine(model)  # 64 tokens a step: all three prompts in the first step
    together = _run(engine, prompts, params)
    assert [o.num_cached_tokens for o in together] == [0, 24, 24]
    for a, b in zip(together, solo, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
