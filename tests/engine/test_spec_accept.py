"""Speculative acceptance: greedy against a NumPy loop, and the sampled output
distribution against the target's (the theorem the rule exists for)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from paxkv.engine.device import acceptance as spec_accept
from paxkv.engine.device.acceptance import PAD_TOKEN, accept

V = 5
DRAWS = 20000
# A chi-square statistic over V - 1 degrees of freedom this large has probability 1e-7.
CHI2_LIMIT = stats.chi2.isf(1e-7, V - 1)

P = np.array([0.35, 0.05, 0.3, 0.2, 0.1], np.float32)  # the target
Q = np.array([0.1, 0.4, 0.1, 0.3, 0.1], np.float32)  # a draft unlike it


def _accept(*args):
    # A fresh function per call: jit's cache is keyed by it, and a monkeypatched
    # `_residual` must be traced anew.
    return jax.jit(lambda *a: accept(*a))(*args)


def _keys(n, seed=0):
    return jax.random.split(jax.random.PRNGKey(seed), n)


def _random_probs(rng, shape):
    x = rng.random(shape).astype(np.float32) ** 3 + 1e-3
    return x / x.sum(-1, keepdims=True)


def _chi2(tokens, p):
    observed = np.bincount(np.asarray(tokens), minlength=len(p))
    expected = len(tokens) * np.asarray(p, np.float64)
    return float(((observed - expected) ** 2 / expected).sum())


def test_greedy_matches_a_numpy_loop():
    rng = np.random.default_rng(0)
    num_seqs, k, vocab = 16, 4, 7
    target = _random_probs(rng, (num_seqs, k + 1, vocab))
    argmax = target.argmax(-1)
    counts = rng.integers(0, k + 1, num_seqs)
    # Proposals agree with the argmax on a random prefix, then disagree.
    agree = rng.integers(0, k + 1, num_seqs)
    proposals = np.where(np.arange(k) < agree[:, None], argmax[:, :k], (argmax[:, :k] + 1) % vocab)
    proposals[np.arange(k) >= counts[:, None]] = 10**6  # padding is never read
    out = _accept(
        jnp.asarray(target),
        None,
        jnp.asarray(proposals, jnp.int32),
        jnp.asarray(counts, jnp.int32),
        _keys(num_seqs),
        jnp.ones(num_seqs, bool),
    )
    for s in range(num_seqs):
        n = 0
        while n < counts[s] and proposals[s, n] == argmax[s, n]:
            n += 1
        expected = list(proposals[s, :n]) + [argmax[s, n]] + [PAD_TOKEN] * (k - n)
        assert int(out.num_accepted[s]) == n
        np.testing.assert_array_equal(np.asarray(out.tokens[s]), expected)


def test_greedy_rows_ignore_keys_and_draft():
    rng = np.random.default_rng(1)
    target = jnp.asarray(_random_probs(rng, (3, 3, V)))
    draft = jnp.asarray(_random_probs(rng, (3, 2, V)))
    proposals = jnp.argmax(target[:, :2], -1).astype(jnp.int32)
    counts = jnp.array([2, 1, 0], jnp.int32)
    a = _accept(target, draft, proposals, counts, _keys(3, 0), jnp.ones(3, bool))
    b = _accept(target, None, proposals, counts, _keys(3, 1), jnp.ones(3, bool))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.num_accepted), [2, 1, 0])


def _first_tokens(k, draft, seed=0):
    """The acceptance of DRAWS sequences, each proposing k tokens, where
    every position's target is P and proposals are drawn from `draft` (None: the
    fixed proposal 1, a point mass, where P is small)."""
    key_props = jax.random.PRNGKey(seed)
    target = jnp.broadcast_to(jnp.asarray(P), (DRAWS, k + 1, V))
    if draft is None:
        proposals = jnp.ones((DRAWS, k), jnp.int32)
        draft_probs = None
    else:
        draft_probs = jnp.broadcast_to(jnp.asarray(draft), (DRAWS, k, V))
        proposals = jax.random.categorical(key_props, jnp.log(draft_probs)).astype(jnp.int32)
    out = _accept(
        target,
        draft_probs,
        proposals,
        jnp.full(DRAWS, k, jnp.int32),
        _keys(DRAWS, seed + 1),
        jnp.zeros(DRAWS, bool),
    )
    return out


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("draft", ["model", "point_mass"])
def test_first_token_is_distributed_as_the_target(k, draft):
    out = _first_tokens(k, Q if draft == "model" else None)
    assert _chi2(out.tokens[:, 0], P) < CHI2_LIMIT


@pytest.mark.parametrize("draft", ["model", "point_mass"])
def test_a_wrong_residual_is_caught(monkeypatch, draft):
    """Mutation: resampling from p instead of max(0, p - q) biases the output, and the
    distribution test sees it."""
    monkeypatch.setattr(spec_accept, "_residual", lambda p, q: p)
    out = _first_tokens(1, Q if draft == "model" else None)
    assert _chi2(out.tokens[:, 0], P) > CHI2_LIMIT


def test_accepted_count_mean_for_a_point_mass_draft():
    """Proposal j is accepted with probability p_j(x_j), independently, until the
    first rejection: E[accepted] = sum_j prod_{i <= j} p_i(x_i)."""
    k = 3
    proposals = np.array([0, 2, 1], np.int32)
    target = np.array(
        [
            [0.8, 0.05, 0.05, 0.05, 0.05],
            [0.1, 0.1, 0.6, 0.1, 0.1],
            [0.1, 0.7, 0.1, 0.05, 0.05],
            P,
        ],
        np.float32,
    )
    p_x = target[np.arange(k), proposals]  # 0.8, 0.6, 0.7
    per_pos = np.cumprod(p_x)
    mean = per_pos.sum()
    # Var from the distribution of the count: P(N >= j) = per_pos[j-1].
    dist = -np.diff(np.concatenate([[1.0], per_pos, [0.0]]))  # P(N = 0..k)
    std = np.sqrt((dist * (np.arange(k + 1) - mean) ** 2).sum() / DRAWS)
    out = _accept(
        jnp.broadcast_to(jnp.asarray(target), (DRAWS, k + 1, V)),
        None,
        jnp.broadcast_to(jnp.asarray(proposals), (DRAWS, k)),
        jnp.full(DRAWS, k, jnp.int32),
        _keys(DRAWS, 7),
        jnp.zeros(DRAWS, bool),
    )
    accepted = np.asarray(out.num_accepted)
    assert abs(accepted.mean() - mean) < 5 * std
    assert _chi2(accepted, dist) < stats.chi2.isf(1e-7, k)
    # The emitted prefix is the proposals themselves.
    tokens = np.asarray(out.tokens)
    for n in range(1, k + 1):
        rows = accepted >= n
        np.testing.assert_array_equal(tokens[rows, n - 1], proposals[n - 1])


def test_padding_rows_emit_one_token_from_p():
    """Rows with count 0 ignore their (poisoned) proposals and draft, accept nothing,
    and draw one token from p at position 0."""
    k = 2
    target = np.full((DRAWS, k + 1, V), np.nan, np.float32)  # poisoned past position 0
    target[:, 0] = P
    draft = np.full((DRAWS, k, V), np.nan, np.float32)
    out = _accept(
        jnp.asarray(target),
        jnp.asarray(draft),
        jnp.full((DRAWS, k), 10**6, jnp.int32),
        jnp.zeros(DRAWS, jnp.int32),
        _keys(DRAWS, 3),
        jnp.zeros(DRAWS, bool),
    )
    np.testing.assert_array_equal(np.asarray(out.num_accepted), 0)
    np.testing.assert_array_equal(np.asarray(out.tokens[:, 1:]), PAD_TOKEN)
    assert _chi2(out.tokens[:, 0], P) < CHI2_LIMIT


def test_all_accepted_draws_the_bonus_token_from_the_last_position():
    bonus = np.array([0.0, 0.0, 0.0, 0.0, 1.0], np.float32)
    target = np.stack([np.eye(V, dtype=np.float32)[2], np.eye(V, dtype=np.float32)[3], bonus])
    out = _accept(
        jnp.asarray(target[None]),
        None,
        jnp.array([[2, 3]], jnp.int32),
        jnp.array([2], jnp.int32),
        _keys(1),
        jnp.zeros(1, bool),
    )
    np.testing.assert_array_equal(np.asarray(out.tokens), [[2, 3, 4]])


def test_bad_shapes():
    with pytest.raises(ValueError, match=r"target_probs\.shape"):
        accept(
            jnp.zeros((2, 2, V)),
            None,
            jnp.zeros((2, 2), jnp.int32),
            jnp.zeros(2, jnp.int32),
            _keys(2),
            jnp.zeros(2, bool),
        )
