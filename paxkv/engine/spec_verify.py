"""Speculative verification inside the step: the target's verdict on each sequence's
proposals, from the logits of its 1 + k query rows.

Sequence s of a speculative step runs its last known token and `counts[s]` proposed
tokens as consecutive query rows; row j's logits are the target's next-token scores
after the first j proposals. Each position's distribution is the sampler's own
(`paxkv.engine.sampling.target_probs`: penalties, with the proposals before it counted
as generated, temperature and truncation), so `paxkv.engine.spec_accept.accept` emits
tokens distributed exactly as plain sampling would. A sequence with no proposal keeps
the token `sample` drew for it, so speculation changes nothing for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paxkv.engine.sampling import (
    SamplingBatch,
    Speculated,
    add_to_history,
    sampling_keys,
    score,
    target_probs,
)
from paxkv.engine.spec_accept import accept


def verify(
    logits: jax.Array,  # f32[S, k+1, V]; row j: after the sequence's first j proposals
    sampling: SamplingBatch,
    proposals: jax.Array,  # i32[S, k]
    counts: jax.Array,  # i32[S]; proposals per sequence, 0..k
    sampled: jax.Array,  # i32[S]; what `sample` drew from logits[:, 0]
    *,
    num_logprobs: int = 0,
) -> Speculated:
    """Each sequence's accepted proposals and its next token from the target, with
    their logprobs, ranks and top `num_logprobs` under `log_softmax(logits)` (as
    `sample` reports them). Keys are the rows' sampling keys (seed, counter), so a
    seeded request's result does not depend on its batch."""
    num_seqs, width, vocab = logits.shape
    k = width - 1
    probs, greedy = [], []
    params = sampling
    for j in range(width):
        p, g = target_probs(logits[:, j], params)
        probs.append(p)
        greedy.append(g)
        if j < k:  # the proposal at j counts as generated for the positions after it
            params = add_to_history(params, proposals[:, j], j < counts)
    verdict = accept(
        jnp.stack(probs, axis=1),
        None,  # n-gram proposals: q is a point mass
        proposals,
        counts,
        sampling_keys(sampling),
        sampling.temperature <= 0,
        jnp.stack(greedy, axis=1),
    )
    tokens = verdict.tokens.at[:, 0].set(jnp.where(counts == 0, sampled, verdict.tokens[:, 0]))
    scores = score(
        logits.reshape(num_seqs * width, vocab),
        jnp.maximum(tokens, 0).reshape(-1),
        num_logprobs=num_logprobs,
    )
    scores = jax.tree.map(lambda a: a.reshape(num_seqs, width, *a.shape[1:]), scores)
    return Speculated(verdict.num_accepted, tokens, scores)
