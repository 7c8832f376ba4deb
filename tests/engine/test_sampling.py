"""On-device sampling: greedy, truncation, seeds, and the sampled distribution itself."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv.engine.device.sampling import (
    Sampled,
    SamplingBatch,
    add_to_history,
    apply_penalties,
    sample,
)
from paxkv.host.request import SamplingParams

V = 12


def _logits(rows=1, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((rows, V)) * 2, jnp.float32)


def _batch(n, *, seeds=None, counter=0, **kw):
    seeds = list(range(n)) if seeds is None else seeds
    params = [SamplingParams(**kw)] * len(seeds)
    return SamplingBatch.create(params, n, seeds=seeds, counters=[counter] * len(seeds))


@jax.jit
def _sample(logits, batch):
    out = sample(logits, batch)
    return out.tokens, out.logprobs


def test_greedy_and_logprobs():
    logits = _logits(4)
    tokens, logprobs = _sample(logits, _batch(4, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(logits), -1))
    expected = jax.nn.log_softmax(logits)[jnp.arange(4), tokens]
    np.testing.assert_allclose(np.asarray(logprobs), np.asarray(expected), rtol=1e-6)


def test_padding_rows_are_greedy():
    batch = SamplingBatch.create([SamplingParams(seed=7)], 3)
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
    batch = _batch(4, seeds=[1, 2, 42, 5], counter=3)
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


# Penalties and top-k logprobs.


def _penalised_reference(logits, prompt, outputs, params):
    """vLLM's penalties by a plain loop over the vocabulary (float64)."""
    out = np.array(logits, np.float64)
    counts = np.bincount(np.asarray(outputs, np.int64), minlength=len(out))
    for t in range(len(out)):
        if t in prompt or counts[t]:
            rep = params.repetition_penalty
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        out[t] -= params.frequency_penalty * counts[t] + params.presence_penalty * (counts[t] > 0)
    return out


def _history(prompt, outputs):
    ids = list(dict.fromkeys([*prompt, *outputs]))
    counts = [outputs.count(t) for t in ids]
    return ids, counts, [int(t in prompt) for t in ids]


PENALISED = [
    SamplingParams(temperature=0.0, repetition_penalty=1.7),
    SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.6),
    SamplingParams(temperature=0.0),  # no penalty: its logits stay as they are
    SamplingParams(
        temperature=0.0, presence_penalty=-0.5, frequency_penalty=-1.0, repetition_penalty=0.6
    ),
]


def test_penalties_match_reference_loop():
    rng = np.random.default_rng(3)
    logits = _logits(len(PENALISED), seed=3)
    seqs = [
        (rng.integers(0, V, 4).tolist(), rng.integers(0, V, int(rng.integers(1, 6))).tolist())
        for _ in PENALISED
    ]
    histories = [
        _history(p, o) if sp.has_penalties else None
        for (p, o), sp in zip(seqs, PENALISED, strict=True)
    ]
    batch = SamplingBatch.create(PENALISED, len(PENALISED), histories=histories)
    got = np.asarray(jax.jit(apply_penalties)(logits, batch))
    for i, ((prompt, outputs), sp) in enumerate(zip(seqs, PENALISED, strict=True)):
        expected = _penalised_reference(np.asarray(logits[i]), prompt, outputs, sp)
        np.testing.assert_allclose(got[i], expected, rtol=1e-6, atol=1e-6)
        if not sp.has_penalties:
            np.testing.assert_array_equal(got[i], np.asarray(logits[i]))
    # Greedy picks the argmax of the penalised logits; logprobs stay raw.
    out = jax.jit(sample)(logits, batch)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.argmax(got, axis=-1))
    raw = np.asarray(jax.nn.log_softmax(logits))
    np.testing.assert_allclose(
        np.asarray(out.logprobs), raw[np.arange(len(PENALISED)), np.asarray(out.tokens)], rtol=1e-6
    )


def test_add_to_history_counts_seen_and_new_tokens():
    sp = SamplingParams(frequency_penalty=1.0)
    batch = SamplingBatch.create(
        [sp, sp, SamplingParams()], 3, histories=[([5, 2], [0, 1], [1, 0]), ([7], [2], [0]), None]
    )
    assert batch.history.shape == (3, 3, 16)
    step = jax.jit(add_to_history)
    # Row 0 generates a prompt token (5) and then a new one (9); row 1 repeats 7; row 2
    # (no penalties, an empty history) is masked out.
    batch = step(batch, jnp.array([5, 7, 4]), jnp.array([True, True, False]))
    batch = step(batch, jnp.array([9, 3, 4]), jnp.array([True, False, False]))
    ids, counts, in_prompt = (np.asarray(a) for a in batch.history)
    assert ids[0, :3].tolist() == [5, 2, 9] and counts[0, :3].tolist() == [1, 1, 1]
    assert in_prompt[0, :3].tolist() == [1, 0, 0]
    assert ids[1, :2].tolist() == [7, -1] and counts[1, 0] == 3
    assert (ids[2] == -1).all() and (counts[2] == 0).all()


def test_top_logprobs_match_dense_softmax():
    logits = _logits(5, seed=4)
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([0, 1, 1, 0.5, 2])]
    out = jax.jit(functools.partial(sample, num_logprobs=4))(
        logits, SamplingBatch.create(params, 5)
    )
    dense = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64)))
    for i in range(5):
        order = np.argsort(-dense[i], kind="stable")
        assert np.asarray(out.top_ids[i]).tolist() == order[:4].tolist()
        np.testing.assert_allclose(np.asarray(out.top_logprobs[i]), dense[i, order[:4]], atol=1e-6)
        token = int(out.tokens[i])
        assert int(out.ranks[i]) == 1 + int(np.sum(dense[i] > dense[i, token]))
    assert int(out.ranks[0]) == 1  # greedy takes the most likely token


def test_penalised_sample_is_batch_independent():
    """A row samples the same alone as in a batch whose other rows have longer
    histories (so a bigger history bucket) and other parameters."""
    logits = jnp.asarray(np.random.default_rng(5).standard_normal((1, 64)) * 2, jnp.float32)
    mine = SamplingParams(temperature=0.8, seed=11, presence_penalty=1.0, repetition_penalty=1.3)
    hist = _history([1, 2, 3], [4, 4])
    alone = SamplingBatch.create([mine], 1, histories=[hist], counters=[2])
    other = SamplingParams(temperature=1.0, seed=3, frequency_penalty=0.5)
    long_hist = _history(list(range(20, 50)), [])
    together = SamplingBatch.create(
        [other, mine, SamplingParams(seed=1)],
        3,
        histories=[long_hist, hist, None],
        counters=[0, 2, 0],
    )
    assert together.history.shape[2] > alone.history.shape[2]
    a = jax.jit(sample)(logits, alone)
    b = jax.jit(sample)(jnp.repeat(logits, 3, axis=0), together)
    assert int(b.tokens[1]) == int(a.tokens[0])


def test_rows_from_slices_every_per_row_array():
    """`Sampled.rows_from` (its direct slicing without speculation) equals slicing each
    per-row leaf, and keeps the step-wide `scored` and `routing` as they are."""
    rng = np.random.default_rng(0)
    s = Sampled(
        rng.integers(0, 50, 6).astype(np.int32),
        rng.normal(size=6).astype(np.float32),
        rng.integers(0, 50, (6, 2)).astype(np.int32),
        rng.normal(size=(6, 2)).astype(np.float32),
        rng.integers(1, 9, 6).astype(np.int32),
        routing=np.arange(12).reshape(1, 6, 2),
    )
    got = s.rows_from(4)
    for name in ("tokens", "logprobs", "top_ids", "top_logprobs", "ranks"):
        np.testing.assert_array_equal(getattr(got, name), getattr(s, name)[4:])
    assert got.routing is s.routing and got.scored is None and got.spec is None
