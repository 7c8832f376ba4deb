"""Serving while compiling: a background warm-up compiles the largest shape first, and
every step runs on the smallest compiled shape that holds it (`pad_host_batch`).

Greedy outputs equal a fully compiled engine's token for token whichever shape ran each
step, and no step waits for a program it does not need: with the background compiler
held back (a compiler that never finishes until released), requests still finish.
"""

import threading

import numpy as np
import pytest
from engine_configs import small_config

from paxkv import SamplingParams
from paxkv.engine import Engine
from paxkv.engine.programs import Programs
from paxkv.host.batch import HostBatch, history_length, pad_host_batch

# Shapes of this file only (engines of one process share compiled programs).
BUCKETS = dict(max_num_batched_tokens=40, token_buckets=(8, 24, 40), page_buckets=(4, 16))
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(vocab_size):
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab_size, n).tolist() for n in (3, 30, 9, 17, 1)]


def _run(engine, prompts, params=GREEDY):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = engine.run_until_done()
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


@pytest.fixture(scope="module")
def full(tiny):
    config, model, _ = tiny
    engine = Engine(model, small_config(num_pages=96, **BUCKETS))
    engine.warmup()
    return _run(engine, _prompts(config.vocab_size))


def test_steps_run_on_compiled_shapes_while_the_rest_compiles(tiny, full, monkeypatch):
    config, model, _ = tiny
    release = threading.Event()
    real = Programs._compile_one

    def held_back(self, lowered):
        if threading.current_thread().name.startswith("paxkv-background"):
            assert release.wait(600), "never released"
        return real(self, lowered)

    monkeypatch.setattr(Programs, "_compile_one", held_back)
    # Its own pool size: programs no other engine of this process compiled.
    engine = Engine(model, small_config(num_pages=80, **BUCKETS))
    try:
        engine.warmup(background=True)
        runner = engine.runner
        compiled_now = list(runner.programs_compiled) + [None] * runner.programs_reused
        assert engine.compiling
        # Every step ran while no background program could finish: on the top shape.
        assert _run(engine, _prompts(config.vocab_size)) == full
        assert engine.compiling
        assert len(runner.programs_compiled) + runner.programs_reused == len(compiled_now)
    finally:
        release.set()
    assert engine.wait_compiled(600)
    first, second = runner.warmup_programs(engine.config.buckets().shapes())
    assert len(runner.programs_compiled) + runner.programs_reused == len(first) + len(second)
    # Now on their own shapes: the same tokens.
    assert _run(engine, _prompts(config.vocab_size)) == full
    engine.pool.check_invariants()


def test_penalties_and_scores_during_a_background_warmup(tiny):
    config, model, _ = tiny
    engine = Engine(model, small_config(num_pages=88, **BUCKETS))
    engine.warmup(background=True)
    penalised = SamplingParams(temperature=0.0, max_tokens=6, frequency_penalty=0.5)
    scoring = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    prompts = _prompts(config.vocab_size)
    a = _run(engine, prompts, penalised)
    b = _run(engine, prompts, scoring)
    engine.wait_compiled(600)
    assert _run(engine, prompts, penalised) == a and _run(engine, prompts, scoring) == b


def _host_batch(t, s, p, *, h=0, r=0, k=0, b=0, w=0, groups=()):
    rng = np.random.default_rng(0)
    ints = lambda *shape: rng.integers(1, 50, shape).astype(np.int32)
    history = ints(3, s, h)
    return HostBatch(
        tokens=ints(t),
        positions=ints(t),
        block_tables=ints(*groups, s, p),
        kv_lens=ints(s),
        cu_q_lens=np.cumsum(np.r_[0, np.ones(s, np.int32)]).astype(np.int32),
        num_seqs=np.array([s - 1], np.int32),
        logits_indices=ints(s),
        sampling_floats=rng.random((s, 6)).astype(np.float32),
        sampling_ints=ints(s, 3),
        penalty_history=history,
        token_src=ints(t),
        score_rows=ints(r),
        score_targets=ints(r),
        draft_tokens=ints(s, k),
        draft_counts=ints(s),
        bias_ids=ints(s, b),
        bias_values=rng.random((s, b)).astype(np.float32),
        allowed=ints(s, w),
    )


@pytest.mark.parametrize("groups", [(), (2,)])
def test_padding_keeps_every_value_and_pads_with_nothing(groups):
    hb = _host_batch(8, 4, 2, h=history_length(2, 4), r=8, k=3, b=8, w=2, groups=groups)
    out = pad_host_batch(hb, 24, 6, 5, page_size=4)
    assert out.tokens.shape == (24,) and out.block_tables.shape == (*groups, 6, 5)
    np.testing.assert_array_equal(out.tokens[:8], hb.tokens)
    assert not out.tokens[8:].any() and (out.token_src[8:] == -1).all()
    np.testing.assert_array_equal(out.block_tables[..., :4, :2], hb.block_tables)
    assert not out.block_tables[..., 4:, :].any() and not out.block_tables[..., 2:].any()
    np.testing.assert_array_equal(out.cu_q_lens[:5], hb.cu_q_lens)
    assert (out.cu_q_lens[5:] == hb.cu_q_lens[-1]).all()  # padded sequences have no rows
    assert out.num_seqs[0] == 3 and not out.kv_lens[4:].any()
    assert out.penalty_history.shape == (3, 6, history_length(5, 4))
    np.testing.assert_array_equal(out.penalty_history[:, :4, :8], hb.penalty_history)
    assert (out.penalty_history[0, :, 8:] == -1).all() and (out.penalty_history[0, 4:] == -1).all()
    assert not out.penalty_history[1:, :, 8:].any() and not out.penalty_history[1:, 4:].any()
    assert out.score_rows.shape == (24,) and not out.score_rows[8:].any()
    assert out.draft_tokens.shape == (6, 3) and not out.draft_counts[4:].any()
    np.testing.assert_array_equal(out.bias_ids[:4], hb.bias_ids)
    assert out.bias_ids.shape == (6, 8) and (out.bias_ids[4:] == -1).all()
    assert not out.bias_values[4:].any()
    np.testing.assert_array_equal(out.allowed[:4], hb.allowed)
    assert out.allowed.shape == (6, 2) and (out.allowed[4:] == -1).all()  # all allowed
    greedy = out.sampling_floats[4:, 0]  # temperature 0, no penalty
    assert not greedy.any() and (out.sampling_floats[4:, 5] == 1.0).all()
    assert pad_host_batch(hb, 8, 4, 2, page_size=4) is hb
    with pytest.raises(ValueError, match="cannot pad"):
        pad_host_batch(hb, 4, 4, 2, page_size=4)
