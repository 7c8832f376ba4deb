"""Speculative decoding with a draft model: greedy equals plain decoding token for
token (a draft that agrees, one that does not; three families; preemption), sampled
tokens are distributed as plain sampling, and incompatible drafts are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_configs import small_config
from flax import nnx
from test_speculative import SAMPLES, _chi2_two_sample, _prompts, _run, _run_each, _tokens

from paxkv import SamplingParams
from paxkv.engine import Engine
from paxkv.models import init_model, load_model

DRAFT = {"method": "draft_model", "model": "unused-by-Engine", "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def other():
    """A random draft unlike every target (the tiny preset, seed 1)."""
    return load_model("tiny", dtype="float32", seed=1)[1]


@pytest.mark.parametrize(
    "name",
    # Qwen3 and Gemma 3 with a draft are `-m slow` (CI's 25 minutes); with n-gram
    # proposals they run in test_speculative.
    [
        "tiny",
        pytest.param("tiny-qwen3", marks=pytest.mark.slow),
        pytest.param("tiny-gemma3", marks=pytest.mark.slow),
    ],
)
def test_greedy_equals_plain_decoding(name, other):
    config, model, _ = load_model(name, dtype="float32", seed=0)
    prompts = _prompts(config.vocab_size, seed=2)
    # Gemma 3's sliding-window layers in one page table: the draft reads the same one.
    cfg = dict(hybrid_kv_cache=False)
    want = _run(Engine(model, small_config(256, **cfg)), prompts, GREEDY)
    # For Llama the target as its own draft (accepted) and a random one (rejected); for
    # the others, whose compiles are longer, the small random draft (the verification
    # they share with n-gram proposals is tested with acceptance in test_speculative).
    drafts = ((model, True), (other, False)) if name == "tiny" else ((other, False),)
    for draft, agrees in drafts:
        spec = Engine(model, small_config(256, speculative_config=DRAFT, **cfg), draft_model=draft)
        got = _run(spec, prompts, GREEDY)
        assert _tokens(got) == _tokens(want), (name, agrees)
        for g, w in zip(got, want, strict=True):
            lg = [next(iter(d.values())).logprob for d in g.outputs[0].logprobs]
            lw = [next(iter(d.values())).logprob for d in w.outputs[0].logprobs]
            np.testing.assert_allclose(lg, lw, atol=1e-4)
        s = spec.stats()
        rate = s["spec_decode_acceptance_rate"]
        # The target as its own draft agrees almost always; a random one almost never.
        assert (rate > 0.9) if agrees else (rate < 0.2), (name, rate)
        assert s["spec_decode_num_drafts"] > 0
        assert s["prefix_cache_hits"] > 0


def test_greedy_equal_under_preemption(tiny, other):
    config, model, _ = tiny
    prompts = _prompts(config.vocab_size, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    want = _run_each(Engine(model, small_config(26)), prompts, [params] * len(prompts))
    spec = Engine(model, small_config(26, speculative_config=DRAFT), draft_model=model)
    got = _run_each(spec, prompts, [params] * len(prompts))
    assert _tokens(got) == _tokens(want)
    assert spec.stats()["num_preemptions"] > 0
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0


def test_lost_caches_are_restored_empty_in_their_shardings(tiny):
    config, model, _ = tiny
    spec = Engine(model, small_config(26, speculative_config=DRAFT), draft_model=model)
    runner = spec.runner
    assert not runner.restore_cache()  # nothing lost: nothing replaced
    for lost in ("draft", "target", "both"):
        placed = {"target": runner.target, "draft": runner.draft}
        old = {k: v.cache for k, v in placed.items()}
        shardings = {k: jax.tree.map(lambda a: a.sharding, c) for k, c in old.items()}
        for k in placed:
            if lost in (k, "both"):  # as a call that raised after the cache was donated
                jax.tree.map(lambda a: a.delete(), old[k])
        assert runner.restore_cache()
        for k, v in placed.items():
            if lost in (k, "both"):
                leaves = jax.tree.leaves(v.cache)
                assert not any(a.is_deleted() for a in leaves)
                assert all(not np.asarray(a).any() for a in leaves)  # empty
                assert jax.tree.map(lambda a: a.sharding, v.cache) == shardings[k]
            else:
                assert v.cache is old[k]
    # The restored caches serve: greedy tokens as plain decoding's.
    prompts = _prompts(config.vocab_size, seed=4)
    want = _run(Engine(model, small_config(26)), prompts, GREEDY)
    assert _tokens(_run(spec, prompts, GREEDY)) == _tokens(want)


def _perturbed(model, scale=0.3, seed=7):
    """A draft close to `model` but not equal: its weights plus noise of `scale` times
    each weight's spread, so its q differs from the target's p and the residual is used."""
    draft = nnx.clone(model)
    state = nnx.state(draft, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    noisy = [
        x + scale * jnp.std(x) * jax.random.normal(k, x.shape)
        for x, k in zip(leaves, keys, strict=True)
    ]
    nnx.update(draft, jax.tree.unflatten(tree, noisy))
    return draft


def test_sampled_distribution_equals_plain_sampling(tiny):
    config, model, _ = tiny
    prompt = np.random.default_rng(5).integers(0, config.vocab_size, 12).tolist()
    params = lambda s: SamplingParams(
        temperature=1.0, top_k=8, max_tokens=4, ignore_eos=True, seed=s, presence_penalty=0.5
    )
    big = dict(max_num_seqs=64, max_num_batched_tokens=512, token_buckets=(512,))
    big |= dict(seq_buckets=(64,), page_buckets=(16,))
    plain = Engine(model, small_config(512, **big))
    want = _run_each(plain, [prompt] * SAMPLES, [params(s) for s in range(SAMPLES)])
    draft = _perturbed(model)
    spec = Engine(model, small_config(512, speculative_config=DRAFT, **big), draft_model=draft)
    seeds = range(10**6, 10**6 + SAMPLES)
    got = _run_each(spec, [prompt] * SAMPLES, [params(s) for s in seeds])
    s = spec.stats()
    # Accepted often, rejected often: both branches of the rule ran.
    rate = s["spec_decode_acceptance_rate"]
    assert 0.2 < rate < 0.9, rate
    want, got = (np.array([o.outputs[0].token_ids for o in x]) for x in (want, got))
    for pos in range(1, 4):
        assert _chi2_two_sample(want[:, pos], got[:, pos]) > 1e-4, pos


def test_incompatible_drafts_are_refused(tiny):
    config, model, _ = tiny
    with pytest.raises(ValueError, match="vocab_size=300 differs"):
        draft = init_model(config.replace(vocab_size=300), 0)
        Engine(model, small_config(64, speculative_config=DRAFT), draft_model=draft)
    with pytest.raises(ValueError, match="needs draft_model="):
        Engine(model, small_config(64, speculative_config=DRAFT))
    with pytest.raises(ValueError, match="needs model="):
        small_config(64, speculative_config={"method": "draft_model"})
    gemma = load_model("tiny-gemma3", dtype="float32")[1]
    with pytest.raises(ValueError, match="one KV-cache group"):
        Engine(gemma, small_config(256, speculative_config=DRAFT), draft_model=model)


def test_llm_refuses_a_draft_with_another_tokenizer():
    from paxkv.engine import EngineConfig
    from paxkv.offline import llm as llm_module

    class Other:
        def encode(self, text):
            return [len(text)]

    config = EngineConfig(speculative_config={"method": "draft_model", "model": "tiny"})
    models = __import__("paxkv.models", fromlist=["load_model"])
    with pytest.raises(ValueError, match="tokenizer differs"):
        llm_module._draft_model(models, config, Other(), dtype="float32", seed=0, mesh=None)
