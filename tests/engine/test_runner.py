"""The step-runner seam: the fake runner drives the same host path as the model."""

import numpy as np
import pytest
from engine_configs import SMALL
from test_engine import _engine

from paxkv import SamplingParams
from paxkv.engine import Engine, EngineConfig
from paxkv.engine.fake_runner import FakeRunner, fake_token
from paxkv.host.scheduler import Scheduler

CONFIG = SMALL | dict(num_pages=24)  # tight: preemptions happen


def _requests(vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, vocab, size=int(n)).tolist(), int(m))
        for n, m in zip(rng.integers(1, 40, 10), rng.integers(1, 24, 10), strict=True)
    ]


def _schedule_of(engine, requests, monkeypatch):
    """Every step's plan as (seq id, start, tokens) triples, and the final outputs."""
    plans = []
    original = Scheduler.schedule

    def recording(self):
        out = original(self)
        plans.append([(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks])
        return out

    with monkeypatch.context() as m:
        m.setattr(Scheduler, "schedule", recording)
        for i, (prompt, max_tokens) in enumerate(requests):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        final = engine.run_until_done()
    return plans, final


@pytest.mark.parametrize("mode", [{}, {"async_scheduling": True}, {"num_decode_steps": 3}])
def test_fake_runner_schedules_as_the_model_does(tiny, monkeypatch, mode):
    config, model, _ = tiny
    requests = _requests(config.vocab_size)
    real_plans, real = _schedule_of(_engine(model, **CONFIG, **mode), requests, monkeypatch)
    fake = Engine(
        None,
        EngineConfig(**CONFIG, **mode),
        runner=lambda c: FakeRunner(config.vocab_size, c),
    )
    fake_plans, final = _schedule_of(fake, requests, monkeypatch)
    assert fake_plans == real_plans
    assert fake.stats()["num_preemptions"] > 0
    for i, (_, max_tokens) in enumerate(requests):
        assert len(final[str(i)].outputs[0].token_ids) == max_tokens
        assert len(real[str(i)].outputs[0].token_ids) == max_tokens
    assert fake.pool.num_in_use == 0


def test_fake_tokens_follow_the_last_token_and_position():
    """Whatever the mode, a sequence's fake tokens are fake_token of its last token and
    position, one after another."""
    prompt, n = [5, 9, 200], 12
    for mode in ({}, {"async_scheduling": True}, {"num_decode_steps": 4}):
        engine = Engine(None, EngineConfig(**CONFIG, **mode), runner=lambda c: FakeRunner(256, c))
        engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=n))
        got = engine.run_until_done()["r"].outputs[0].token_ids
        expected, tokens = [], list(prompt)
        for _ in range(n):
            nxt = int(fake_token(np.array([tokens[-1]]), np.array([len(tokens) - 1]), 256)[0])
            expected.append(nxt)
            tokens.append(nxt)
        assert got == expected, mode
