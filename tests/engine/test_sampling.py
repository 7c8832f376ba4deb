"""On-device sampling: greedy, truncation, seeds, and the sampled distribution itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv.engine.sampling import SamplingBatch, sample
from paxkv.request import SamplingParams

V = 12


def _logits(rows=1, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((rows, V)) * 2, jnp.float32)


def _batch(n, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, counter=0):
    seeds = range(n) if seeds is None else seeds
    return SamplingBatch.from_host(
        [(temperature, top_k, top_p, min_p, s, counter) for s in seeds], n
    )


_sample = jax.jit(sample)


def test_greedy_and_logprobs():
    logits = _logits(4)
    tokens, logprobs = _sample(logits, _batch(4, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(logits), -1))
    expected = jax.nn.log_softmax(logits)[jnp.arange(4), tokens]
    np.testing.assert_allclose(np.asarray(logprobs), np.asarray(expected), rtol=1e-6)


def test_padding_rows_are_greedy():
    batch = SamplingBatch.from_host([(1.0, 0, 1.0, 0.0, 7, 0)], 3)
    np.testing.assert_array_equal(np.asarray(batch.temperature), [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(batch.top_p), [1.0, 1.0, 1.0])


def _frequencies(logits, n, **kw):
    tokens, _ = _sample(jnp.repeat(logits, n, axis=0), _batch(n, **kw))
    return np.bincount(np.asarray(tokens), minlength=V) / n


def test_unmodified_sampling_follows_softmax():
    logits = _logits()
    n = 20_000
    freq = _frequencies(logits, n)
    p = np.asarray(jax.nn.softmax(logits[0]))
    # Five binomial standard deviations per token.
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-9)


def test_temperature_sharpens():
    logits = _logits()
    n = 20_000
    freq = _frequencies(logits, n, temperature=0.5)
    p = np.asarray(jax.nn.softmax(logits[0] / 0.5))
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-9)


def test_top_k_top_p_min_p_support():
    logits = _logits()
    order = np.argsort(-np.asarray(logits[0]))
    p = np.asarray(jax.nn.softmax(logits[0]))[order]
    n = 4000
    freq = _frequencies(logits, n, top_k=3)
    assert set(np.flatnonzero(freq)) <= set(order[:3]) and len(np.flatnonzero(freq)) == 3
    # top_p: the smallest prefix reaching the mass.
    top_p = float(p[:2].sum() + p[2] / 2)
    freq = _frequencies(logits, n, top_p=top_p)
    assert set(np.flatnonzero(freq)) == set(order[:3])
    # min_p: tokens with probability >= min_p * p_max.
    min_p = float(p[3] / p[0]) * 0.999
    freq = _frequencies(logits, n, min_p=min_p)
    assert set(np.flatnonzero(freq)) == set(order[:4])
    # Renormalised within the kept set.
    kept = p[:4] / p[:4].sum()
    got = freq[order[:4]]
    assert np.all(np.abs(got - kept) <= 5 * np.sqrt(kept * (1 - kept) / n))


def test_seed_reproduces_independent_of_batch():
    logits = _logits(1)
    alone, _ = _sample(logits, _batch(1, seeds=[42], counter=3))
    # The same request (seed 42, counter 3) in row 2 of a bigger batch.
    batch = SamplingBatch.from_host([(1.0, 0, 1.0, 0.0, s, 3) for s in (1, 2, 42, 5)], 4)
    together, _ = _sample(jnp.repeat(logits, 4, axis=0), batch)
    assert int(together[2]) == int(alone[0])
    # Different counters give different streams.
    draws = [int(_sample(logits, _batch(1, seeds=[42], counter=c))[0][0]) for c in range(30)]
    assert len(set(draws)) > 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"min_p": 2.0}, "min_p=2.0"),
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"n": 0}, "n=0"),
        ({"top_k": -2}, "top_k=-2"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
