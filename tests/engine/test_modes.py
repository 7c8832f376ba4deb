"""Every execution mode is a strategy of one stepping loop, and they combine: greedy
tokens of sync/async x 1/N decode steps x speculation off/n-gram/draft model equal the
plain synchronous engine's, token for token; seeded samples equal across the modes
that promise it; the one combination refused says why."""

import itertools

import jax
import numpy as np
import pytest
from engine_configs import small_config
from flax import nnx
from test_speculative import _prompts, _run, _tokens

from paxkv import SamplingParams
from paxkv.engine import Engine, EngineConfig
from paxkv.models import load_model

NGRAM = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
DRAFT = {"method": "draft_model", "model": "unused-by-Engine", "num_speculative_tokens": 3}
SPECS = {"off": None, "ngram": NGRAM, "draft": DRAFT}
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
MODES = list(itertools.product((False, True), (1, 4), SPECS))


def _id(mode):
    async_scheduling, steps, spec = mode
    return f"{'async' if async_scheduling else 'sync'}-{steps}step-{spec}"


@pytest.fixture(scope="module")
def models():
    """The tiny target, and a draft that agrees with it often but not always: the target
    with its weights perturbed (so verdicts accept some proposals and reject others)."""
    config, model, _ = load_model("tiny", dtype="float32", seed=0)
    draft = nnx.clone(model)
    params = nnx.state(draft, nnx.Param)
    leaves = jax.tree.leaves(params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    noisy = jax.tree.unflatten(
        jax.tree.structure(params),
        [
            x + 0.2 * x.std() * jax.random.normal(k, x.shape)
            for x, k in zip(leaves, keys, strict=True)
        ],
    )
    nnx.update(draft, noisy)
    return config, model, draft


def _engine(models, mode, num_pages=256):
    _, model, draft = models
    async_scheduling, steps, spec = mode
    config = small_config(
        num_pages,
        async_scheduling=async_scheduling,
        num_decode_steps=steps,
        speculative_config=SPECS[spec],
    )
    return Engine(model, config, draft_model=draft if spec == "draft" else None)


@pytest.fixture(scope="module")
def plain(models):
    config = models[0]
    return _run(_engine(models, (False, 1, "off")), _prompts(config.vocab_size, seed=2), GREEDY)


@pytest.mark.parametrize("mode", MODES, ids=_id)
def test_greedy_tokens_of_every_mode_equal_plain_sync(models, plain, mode):
    config = models[0]
    async_scheduling, steps, spec = mode
    if async_scheduling and spec == "ngram":
        with pytest.raises(ValueError, match="looked up on the host"):
            _engine(models, mode)
        return
    engine = _engine(models, mode)
    got = _run(engine, _prompts(config.vocab_size, seed=2), GREEDY)
    assert _tokens(got) == _tokens(plain)
    # The logprobs reported for each token are the target's, whichever mode made it.
    for g, w in zip(got, plain, strict=True):
        lg = [next(iter(d.values())).logprob for d in g.outputs[0].logprobs]
        lw = [next(iter(d.values())).logprob for d in w.outputs[0].logprobs]
        np.testing.assert_allclose(lg, lw, atol=1e-4)
    stats = engine.stats()
    if steps > 1 and spec == "off":
        assert stats["num_decode_loops"] > 0
    if spec == "draft":  # proposals were both accepted and rejected
        assert 0.1 < stats["spec_decode_acceptance_rate"] < 0.95, stats
    if spec == "ngram":
        assert stats["spec_decode_num_accepted_tokens"] > 0


def test_draft_speculation_with_async_survives_preemption(models, plain):
    """Few pages: sequences are preempted while proposals recorded as accepted are in
    flight, and recompute exactly."""
    config = models[0]
    engine = _engine(models, (True, 1, "draft"), num_pages=26)
    got = _run(engine, _prompts(config.vocab_size, seed=2), GREEDY)
    assert _tokens(got) == _tokens(plain)
    assert engine.stats()["num_preemptions"] > 0


SEEDED = SamplingParams(temperature=0.9, top_k=20, max_tokens=16, seed=11, ignore_eos=True)


def test_seeded_samples_equal_across_sync_async_and_loops(models):
    """A seeded request samples the same tokens whether its steps are read at once or
    one step later, and whether decodes run one or N per call: each token's randomness
    is keyed by its seed and its index in the output. (With speculation the tokens are
    distributed as plain sampling, `test_speculative`, but which proposals a step
    carries decides which random draws make them, so they are not promised equal.)"""
    config = models[0]
    prompts = _prompts(config.vocab_size, seed=3)
    modes = [(False, 1, "off"), (True, 1, "off"), (False, 4, "off"), (True, 4, "off")]
    runs = [_tokens(_run(_engine(models, m), prompts, SEEDED)) for m in modes]
    for mode, got in zip(modes[1:], runs[1:], strict=True):
        assert got == runs[0], _id(mode)


def test_the_refusal_names_the_way_out():
    with pytest.raises(ValueError, match=r"use method .draft_model. .*or async_scheduling=False"):
        EngineConfig(speculative_config=NGRAM, async_scheduling=True)
