"""Speculative decoding through the engine: greedy outputs equal plain decoding token for
token (three model families, preemption, prefix hits, chunked prefill, n > 1, stops,
max_tokens), sampled outputs are distributed as plain sampling (a two-sample
chi-square, and a mutation it catches), and no page leaks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_configs import PAGE_SIZE, small_config
from scipy import stats

from paxkv import SamplingParams
from paxkv.engine import Engine, EngineConfig
from paxkv.engine.device import acceptance as spec_accept_module
from paxkv.engine.fake_runner import FakeRunner
from paxkv.models import load_model

SPEC = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen3", "tiny-gemma3"])
def family(request):
    config, model, _ = load_model(request.param, dtype="float32", seed=0)
    return request.param, config, model


def _prompts(vocab, seed=0):
    """Prompts a lookup finds matches in: a repeated motif, a shared long prefix (prefix
    hits; 90 tokens, chunked by the 64-token budget), and random tokens."""
    rng = np.random.default_rng(seed)
    motif = rng.integers(0, vocab, 5).tolist()
    shared = rng.integers(0, vocab, 90).tolist()
    return [
        motif * 4,
        shared + motif,
        shared + motif * 2,
        rng.integers(0, vocab, 7).tolist(),
        (motif + rng.integers(0, vocab, 3).tolist()) * 3,
    ]


def _run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
        engine.scheduler.kv_cache_manager.check_invariants()
    done = {o.request_id: o for o in outputs if o.finished}
    assert engine.pool.num_in_use == 0  # nothing held for rejected positions leaked
    engine.pool.check_invariants()
    return [done[str(i)] for i in range(len(prompts))]


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _spec_stats(engine):
    s = engine.stats()
    return s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]


def test_greedy_equals_plain_decoding(family):
    name, config, model = family
    prompts = _prompts(config.vocab_size)
    plain = Engine(model, small_config(256))  # Gemma 3's window groups hold pages each
    spec = Engine(model, small_config(256, speculative_config=SPEC))
    want, got = _run(plain, prompts, GREEDY), _run(spec, prompts, GREEDY)
    assert _tokens(got) == _tokens(want), name
    # Logprobs of the accepted tokens are the target's, as plain decoding reports them.
    for g, w in zip(got, want, strict=True):
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert lg.keys() == lw.keys()
            for t in lg:
                assert abs(lg[t].logprob - lw[t].logprob) < 1e-4, (name, t)
                assert lg[t].rank == lw[t].rank
    proposed, accepted = _spec_stats(spec)
    # Both verdicts happened: some proposals accepted, some rejected.
    assert 0 < accepted < proposed, (name, proposed, accepted)
    assert spec.stats()["prefix_cache_hits"] > 0
    assert spec.stats()["num_steps"] < plain.stats()["num_steps"]


def test_greedy_equal_under_preemption_and_with_n_stops_and_limits(tiny):
    config, model, _ = tiny
    vocab = config.vocab_size
    prompts = _prompts(vocab, seed=1)
    # A pool too small for all of them: sequences are preempted and recomputed.
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # never overshoot
        SamplingParams(temperature=0.0, max_tokens=20, n=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    ]
    plain = Engine(model, small_config(26))
    want = _run_each(plain, prompts, params)
    # A stop token in the middle of accepted proposals ends the output there.
    stop = want[3].outputs[0].token_ids[9]
    params[3] = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop])
    plain = Engine(model, small_config(26))
    want = _run_each(plain, prompts, params)
    spec = Engine(model, small_config(26, speculative_config=SPEC))
    got = _run_each(spec, prompts, params)
    assert _tokens(got) == _tokens(want)
    assert len(got[1].outputs[0].token_ids) == 7
    assert got[3].outputs[0].finish_reason == "stop"
    assert got[3].outputs[0].token_ids[-1] == stop
    assert spec.stats()["num_preemptions"] > 0
    proposed, accepted = _spec_stats(spec)
    assert 0 < accepted < proposed


def _run_each(engine, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    done = engine.run_until_done()
    assert engine.pool.num_in_use == 0
    return [done[str(i)] for i in range(len(prompts))]


# Sampling: the distribution of the first tokens with speculation equals plain sampling.

SAMPLES = 1200


def _sample_tokens(model, spec, seeds, prompt, penalties, proposals=()):
    """Each seed's first tokens; with `spec`, each decode proposes the next of
    `proposals` (by output index: a deterministic proposer, as the n-gram one is, whose
    proposals a random model accepts often enough to exercise the rule)."""
    params = [
        SamplingParams(
            temperature=1.0,
            top_k=6,
            max_tokens=4,
            ignore_eos=True,
            seed=s,
            frequency_penalty=0.7 if penalties else 0.0,
        )
        for s in seeds
    ]
    config = dict(max_num_seqs=64, max_num_batched_tokens=512, token_buckets=(512,))
    config |= dict(seq_buckets=(64,), page_buckets=(16,))
    engine = Engine(model, small_config(512, **config, speculative_config=spec))
    if spec is not None:
        engine.speculator.propose = lambda seq, n: tuple(
            proposals[len(seq.output_token_ids) : len(seq.output_token_ids) + n]
        )
    out = _run_each(engine, [prompt] * len(seeds), params)
    return np.array([o.outputs[0].token_ids for o in out]), engine


def _chi2_two_sample(a, b):
    """p-value that token arrays `a` and `b` come from one distribution."""
    values = np.union1d(a, b)
    table = np.array([[np.sum(a == v) for v in values], [np.sum(b == v) for v in values]])
    table = table[:, table.sum(0) >= 5]  # the test's rule of thumb: cells of >= 5
    return stats.chi2_contingency(table)[1]


@pytest.fixture(scope="module")
def sampled(tiny):
    """First tokens of many seeded requests, plain and speculative, and the prompt."""
    config, model, _ = tiny
    prompt = np.random.default_rng(3).integers(0, config.vocab_size, 12).tolist()
    plain, _ = _sample_tokens(model, None, range(SAMPLES), prompt, penalties=True)
    # Proposals: the most frequent token of each position among the plain samples.
    proposals = [int(np.bincount(plain[:, i]).argmax()) for i in range(plain.shape[1])]
    seeds = range(10**6, 10**6 + SAMPLES)
    spec, engine = _sample_tokens(model, SPEC, seeds, prompt, True, proposals)
    return model, prompt, plain, spec, engine, proposals


def test_sampled_distribution_equals_plain_sampling(sampled):
    _, _, plain, spec, engine, _ = sampled
    proposed, accepted = _spec_stats(engine)
    assert accepted > 0.05 * proposed  # proposals were accepted: the rule was exercised
    # Positions 1..3 are the ones speculation emits (position 0 comes from the prefill).
    for pos in range(1, 4):
        p = _chi2_two_sample(plain[:, pos], spec[:, pos])
        assert p > 1e-4, (pos, p)


def test_the_distribution_test_catches_a_wrong_acceptance_rule(sampled, monkeypatch):
    model, prompt, plain, _, _, proposals = sampled
    # The mutation: every proposal accepted (min(1, p/q) replaced by 1), then the
    # target's token at the bonus position.
    original = spec_accept_module.accept

    def accept_all(target_probs, draft_probs, proposals, counts, keys, greedy, argmax=None):
        out = original(target_probs, draft_probs, proposals, counts, keys, greedy, argmax)
        width = proposals.shape[1] + 1
        slots = jnp.arange(width)[None, :]
        padded = jnp.pad(proposals, ((0, 0), (0, 1)))
        tokens = jnp.where(slots < counts[:, None], padded, -1)
        last = jnp.argmax(target_probs[jnp.arange(counts.shape[0]), counts], axis=-1)
        tokens = jnp.where(slots == counts[:, None], last[:, None], tokens).astype(jnp.int32)
        return out.replace(num_accepted=counts, tokens=tokens)

    monkeypatch.setattr("paxkv.engine.device.verification.accept", accept_all)
    # A fresh jit of the sampler that verifies (its own programs), traced with the
    # mutation; the module's is restored untouched afterwards (no global cache clearing).
    # (A new function object: jit's trace cache is keyed by the function.)
    from paxkv.engine.device import step as steps

    fresh = functools.wraps(steps.resample_step)(lambda *a, **k: steps.resample_step(*a, **k))
    monkeypatch.setattr(
        steps, "RESAMPLE", jax.jit(fresh, static_argnames=("num_rows", "num_logprobs"))
    )
    seeds = range(10**6, 10**6 + SAMPLES)
    wrong, _ = _sample_tokens(model, SPEC, seeds, prompt, True, proposals)
    assert min(_chi2_two_sample(plain[:, pos], wrong[:, pos]) for pos in range(1, 4)) < 1e-6


# Configuration and the fake runner.


def test_bad_speculative_configs_are_refused():
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        EngineConfig(speculative_config={"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="num_speculative_tokens=17"):
        EngineConfig(speculative_config={"num_speculative_tokens": 17})
    with pytest.raises(ValueError, match="unknown keys"):
        EngineConfig(speculative_config={"num_speculative_tokenz": 2})
    with pytest.raises(ValueError, match="needs model="):
        EngineConfig(speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="needs method='draft_model'"):
        EngineConfig(speculative_config={"method": "ngram", "model": "tiny"})
    # A model and no method is a draft model, as vLLM infers it.
    inferred = EngineConfig(speculative_config={"model": "tiny", "num_speculative_tokens": 3})
    assert inferred.speculative_config.method == "draft_model"
    assert EngineConfig(speculative_config={}).speculative_config.method == "ngram"
    with pytest.raises(ValueError, match="method='eagle'"):
        EngineConfig(speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="prompt_lookup_min=4 exceeds"):
        EngineConfig(speculative_config={"prompt_lookup_min": 4, "prompt_lookup_max": 2})
    # n-gram proposals are looked up on the host: not in tokens async scheduling has not read.
    with pytest.raises(ValueError, match="method 'ngram' cannot be used with async_scheduling"):
        EngineConfig(speculative_config={}, async_scheduling=True)
    draft = {"method": "draft_model", "model": "tiny"}
    assert EngineConfig(speculative_config=draft, async_scheduling=True).async_scheduling
    assert EngineConfig(speculative_config={}, num_decode_steps=8).num_decode_steps == 8
    with pytest.raises(TypeError, match="speculative_config must be"):
        EngineConfig(speculative_config=4)
    c = EngineConfig(speculative_config={"prompt_lookup_max": 3})
    assert (c.speculative_config.prompt_lookup_min, c.speculative_config.prompt_lookup_max) == (
        3,
        3,
    )
    assert c.for_backend("gpu").num_decode_steps == 1  # not 8: steps emit several tokens


def _fake_engine(spec, num_pages=64, **kw):
    config = small_config(num_pages, speculative_config=spec, **kw)
    return Engine(None, config, runner=lambda c: FakeRunner(50, c))


def test_fake_runner_greedy_equal_and_the_adaptive_rule_pauses():
    prompts = [[i % 7 for i in range(30)], [3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    want = _run_each(_fake_engine(None), prompts, [params] * 2)
    spec = _fake_engine(SPEC)
    got = _run_each(spec, prompts, [params] * 2)
    assert _tokens(got) == _tokens(want)
    s = spec.stats()
    # The fake model's tokens do not repeat the prompt: few proposals are accepted, and
    # the adaptive rule pauses speculation (far fewer drafts than decode steps).
    assert s["spec_decode_num_drafts"] < 0.5 * 2 * 60
    assert s["spec_decode_acceptance_rate"] < 0.2
    off = _fake_engine(SPEC | {"min_acceptance": 0.0})
    _run_each(off, prompts, [params] * 2)
    assert off.stats()["spec_decode_num_drafts"] > s["spec_decode_num_drafts"]


def _decoding(spec, n, **config):
    """A fake engine whose speculator proposes 7s, with `n` sequences past prefill,
    and the plan of its next step."""
    engine = _fake_engine(spec, **config)
    engine.speculator.propose = lambda seq, m: (7,) * min(m, SPEC["num_speculative_tokens"])
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(n):
        engine.add_request(str(i), {"prompt_token_ids": [i + 1]}, params)
    engine.step()  # the prefills
    return engine, engine.scheduler.schedule()


def _drafts(plan):
    """Each chunk's proposals, in the order its requests arrived (a plan holds the
    decodes with proposals after the others)."""
    return [c.num_draft for c in sorted(plan.chunks, key=lambda c: c.seq.arrival_time)]


def test_speculation_uses_only_spare_budget_and_free_pages():
    # Proposals come after every other chunk, from the budget left, shared evenly: 8
    # decodes in a 12-token step leave 4 proposal tokens, one each for the first four.
    engine, plan = _decoding(SPEC, 8, max_num_batched_tokens=12, token_buckets=(12,))
    assert _drafts(plan) == [1, 1, 1, 1, 0, 0, 0, 0]
    assert plan.num_tokens == 12
    first = next(c for c in plan.chunks if c.seq.request_id == "0")
    assert first.num_pages == -(-first.end // PAGE_SIZE)
    assert first.token_ids == (first.token_ids[0], 7)
    for i in range(8):
        engine.abort(str(i))
    engine.step()
    assert engine.pool.num_in_use == 0
    # Only the padding of the step's own token bucket: 8 decodes fill the 8-token
    # bucket, and proposals would make it a 12-token step, unless allowed to.
    buckets = dict(max_num_batched_tokens=12, token_buckets=(8, 12))
    _, plan = _decoding(SPEC, 8, **buckets)
    assert _drafts(plan) == [0] * 8
    _, plan = _decoding(SPEC | {"grow_token_bucket": True}, 8, **buckets)
    assert _drafts(plan) == [1, 1, 1, 1, 0, 0, 0, 0]
    # 2 decodes in a 16-token bucket: 14 spare, at most k = 4 each.
    _, plan = _decoding(SPEC, 2)
    assert _drafts(plan) == [4, 4]
    # A full pool: decodes run, proposals that need a new page do not.
    engine = _fake_engine(SPEC, num_pages=5)  # 4 usable pages
    engine.speculator.propose = lambda seq, n: (7,) * min(n, 4)
    short = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [1] * 14}, short)
    engine.add_request("b", {"prompt_token_ids": [2] * 7}, short)
    engine.step()
    plan = engine.scheduler.schedule()
    # a holds 2 pages (its 15 tokens), b one (8 tokens): a's proposals take the one
    # free page, and b's, which would need another, are not made.
    assert _drafts(plan) == [4, 0]
    assert engine.pool.num_free == 0


def test_stop_strings_end_inside_an_accepted_run():
    from paxkv import LLM

    prompts = ["for i in range(10):\n    print(i)\nfor j in range(10):\n", "import os\n"]
    kw = dict(warmup=False, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    plain = LLM("tiny-py", **kw)
    spec = LLM("tiny-py", speculative_config=SPEC, **kw)
    for stop in (["    "], ["  ", "\n"]):
        for include in (False, True):
            p = SamplingParams(
                temperature=0.0, max_tokens=40, stop=stop, include_stop_str_in_output=include
            )
            want = plain.generate(prompts, p, use_tqdm=False)
            got = spec.generate(prompts, p, use_tqdm=False)
            for g, w in zip(got, want, strict=True):
                assert (g.outputs[0].text, g.outputs[0].token_ids) == (
                    w.outputs[0].text,
                    w.outputs[0].token_ids,
                )
                assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    assert spec.engine.pool.num_in_use == 0


def test_greedy_equal_with_scanned_layers():
    config, model, _ = load_model("tiny", dtype="float32", seed=0, scan_layers=True)
    prompts = _prompts(config.vocab_size, seed=6)
    want = _run(Engine(model, small_config(64)), prompts, GREEDY)
    spec = Engine(model, small_config(64, speculative_config=SPEC))
    assert _tokens(_run(spec, prompts, GREEDY)) == _tokens(want)
    proposed, accepted = _spec_stats(spec)
    assert 0 < accepted < proposed
