"""After `warmup()`, no request compiles a program of the model: every sampling feature
(prompt logprobs and score requests included), in every execution mode, runs on the
step shapes warm-up compiled. The only programs compiled later are the small samplers
of a step that mixes penalties with scored rows, proposals or token masks (structured
outputs), or proposals with masks, which warm-up leaves to their first use
(`ModelRunner.warmup`).

Engines share compilations (the steps are jitted at module level), so an earlier test
may have compiled some of these shapes already; what is asserted is only that the
count does not move after warm-up, which holds either way. The shapes here (a 4-page
bucket, a 24-token bucket) are ones no other test uses, so run alone this file also
checks that warm-up compiles them itself.
"""

import numpy as np
import pytest
from engine_configs import small_config

from paxkv import SamplingParams
from paxkv.engine import Engine

# Two token and two page buckets: short prompts and long ones land in different shapes.
BUCKETS = dict(token_buckets=(24, 64), page_buckets=(4, 16))
MODES = {
    "sync": {},
    "multi_step": {"num_decode_steps": 4},
    "async": {"async_scheduling": True},
    "speculative": {"speculative_config": {"num_speculative_tokens": 3, "prompt_lookup_min": 1}},
}


def _workload(vocab_size: int) -> list[tuple[list[int], SamplingParams]]:
    """Every sampling feature, on short and long prompts."""
    rng = np.random.default_rng(0)
    short = [7, 8, 9]
    # 110 distinct tokens: a penalty history as long as the step's pages allow at the end.
    longest = rng.permutation(vocab_size)[:110].tolist()
    medium = rng.integers(0, vocab_size, 40).tolist()
    sampled = dict(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True)
    cases = [
        SamplingParams(presence_penalty=0.7, **sampled),
        SamplingParams(frequency_penalty=0.5, **sampled),
        SamplingParams(repetition_penalty=1.3, **sampled),
        SamplingParams(
            presence_penalty=-0.5, frequency_penalty=1.0, repetition_penalty=0.8, **sampled
        ),
        SamplingParams(temperature=0.0, frequency_penalty=0.5, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0),
        SamplingParams(logprobs=5, **sampled),
        SamplingParams(logprobs=20, frequency_penalty=0.2, **sampled),
        SamplingParams(n=3, **sampled),
        SamplingParams(n=2, repetition_penalty=1.2, **sampled),
        SamplingParams(top_k=5, **sampled),
        SamplingParams(top_p=0.8, **sampled),
        SamplingParams(min_p=0.2, **sampled),
        SamplingParams(top_k=3, top_p=0.9, min_p=0.05, presence_penalty=0.3, **sampled),
        SamplingParams(stop=["a", "zz"], temperature=1.0, seed=2, max_tokens=8),
        SamplingParams(stop_token_ids=[3, 4, 5], temperature=1.0, seed=3, max_tokens=8),
        # Prompt logprobs (what the server's `echo` with logprobs asks for): scored rows.
        SamplingParams(prompt_logprobs=0, **sampled),
        SamplingParams(prompt_logprobs=5, logprobs=2, n=2, **sampled),
        SamplingParams(prompt_logprobs=1, frequency_penalty=0.3, **sampled),
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3),
        # Structured outputs: the token masks' sampler.
        SamplingParams(structured_outputs={"regex": "[a-f]{2,9}"}, **sampled),
        SamplingParams(structured_outputs={"choice": ["yes", "no"]}, n=2, **sampled),
        SamplingParams(
            structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True},
            logprobs=1,
            **sampled,
        ),
    ]
    work = [(p, c) for p in (short, medium) for c in cases]
    # The longest sequence the engine serves (110 + 18 = max_model_len), with penalties.
    work.append((longest, SamplingParams(frequency_penalty=0.4, max_tokens=18, ignore_eos=True)))
    work.append((longest, SamplingParams(max_tokens=18, ignore_eos=True, logprobs=3)))
    work.append((longest, SamplingParams(max_tokens=1, prompt_logprobs=2)))
    return work


def _scores(vocab_size: int) -> list[tuple[list[int], list[int], int]]:
    """Score requests (`Engine.add_score_request`): prompt, completion, top logprobs;
    short and long, fitting one step and spanning several."""
    rng = np.random.default_rng(1)
    lengths = [(3, 2, 0), (20, 30, 4), (60, 50, 1), (1, 100, 2)]
    return [
        (rng.integers(0, vocab_size, p).tolist(), rng.integers(0, vocab_size, c).tolist(), k)
        for p, c, k in lengths
    ]


@pytest.mark.parametrize("mode", MODES)
def test_no_request_compiles_after_warmup(tiny, mode):
    config, model, tokenizer = tiny
    engine = Engine(
        model,
        small_config(num_pages=128, **BUCKETS, **MODES[mode]),
        tokenizer=tokenizer,
    )
    engine.warmup()
    warm = engine.num_compilations
    warmed = len(engine.runner.programs_compiled)
    work = _workload(config.vocab_size)
    scores = _scores(config.vocab_size)

    def add(name: str) -> None:
        for i, (prompt, params) in enumerate(work):
            engine.add_request(f"{name}{i}", {"prompt_token_ids": prompt}, params)
            yield
        for i, (prompt, completion, k) in enumerate(scores):
            engine.add_score_request(f"{name}-score{i}", prompt, completion, top_logprobs=k)
            yield

    # Each request alone (penalised or not, scoring or not, every bucket), then all at
    # once, then a mix where each request joins a batch already running.
    finished = {}
    for _ in add("alone"):
        finished |= engine.run_until_done()
    for _ in add("all"):
        pass
    finished |= engine.run_until_done()
    for _ in add("mix"):
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    finished |= engine.run_until_done()
    assert len(finished) == 3 * (len(work) + len(scores))
    # The scoring requests got every score (a NaN is a position never computed).
    scoring = sum(p.prompt_logprobs is not None for _, p in work) + len(scores)
    scored = [o for o in finished.values() if o.scores is not None]
    assert len(scored) == 3 * scoring
    assert all(np.isfinite(o.scores).all() and len(o.scores) > 0 for o in scored)
    # None failed (a request whose step cannot be laid out is aborted, not compiled).
    reasons = {c.finish_reason for o in finished.values() for c in o.outputs}
    assert reasons <= {"length", "stop"}, reasons
    if mode == "speculative":  # the proposals' step variant ran
        assert engine.stats()["spec_decode_num_drafts"] > 0
    later = engine.runner.programs_compiled[warmed:]
    # Penalties with scored rows, proposals or masks; proposals with masks.
    mixes = [
        (name, key)
        for name, key in later
        if name == "resample" and ((key[2] and (key[3] or key[4] or key[7])) or (key[4] and key[7]))
    ]
    assert later == mixes, f"programs compiled after warm-up ({mode}): {later}"
    assert engine.num_compilations == warm + len(later)
