"""Speculative verification inside the step: the target's verdict on each sequence's
proposals, from the logits of its 1 + k query rows.

Sequence s of a speculative step runs its last known token and `counts[s]` proposed
tokens as consecutive query rows; row j's logits are the target's next-token scores
after the first j proposals. Each position's distribution is the sampler's own
(`paxkv.engine.device.sampling.target_probs`: penalties, with the proposals before it counted
as generated, temperature and truncation), so `paxkv.engine.device.acceptance.accept` emits
tokens distributed exactly as plain sampling would. A sequence with no proposal keeps
the token `sample` drew for it, so speculation changes nothing for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paxkv.engine.device.acceptance import Accepted, accept
from paxkv.engine.device.sampling import (
    SamplingBatch,
    Speculated,
    add_to_history,
    apply_penalties,
    sampling_keys,
    score,
    target_probs,
)


def verify(
    logits: jax.Array,  # f32[S, k+1, V]; row j: after the sequence's first j proposals
    sampling: SamplingBatch,
    proposals: jax.Array,  # i32[S, k]
    counts: jax.Array,  # i32[S]; proposals per sequence, 0..k
    sampled: jax.Array,  # i32[S]; what `sample` drew from logits[:, 0]
    *,
    draft_probs: jax.Array | None = None,  # f32[S, k, V]; None: n-gram (point masses)
    num_logprobs: int = 0,
    position_masks: jax.Array | None = None,  # i32[S, k+1, W]; None: `sampling.allowed`
) -> Speculated:
    """Each sequence's accepted proposals and its next token from the target, with
    their logprobs, ranks and top `num_logprobs` under `log_softmax(logits)` (as
    `sample` reports them). Keys are the rows' sampling keys (seed, counter), so a
    seeded request's result does not depend on its batch. `position_masks` are the
    token masks (structured outputs) at each position, after the proposals before it."""
    num_seqs, width, vocab = logits.shape
    greedy_rows = sampling.temperature <= 0
    # When every row is greedy only the argmax matters: the sampler's distributions
    # (a sort of the vocabulary per row and position) are skipped at run time.
    verdict = jax.lax.cond(
        jnp.all(greedy_rows),
        lambda: _greedy_verdict(logits, sampling, proposals, counts, position_masks),
        lambda: _verdict(logits, sampling, proposals, counts, draft_probs, position_masks),
    )
    tokens = verdict.tokens.at[:, 0].set(jnp.where(counts == 0, sampled, verdict.tokens[:, 0]))
    scores = score(
        logits.reshape(num_seqs * width, vocab),
        jnp.maximum(tokens, 0).reshape(-1),
        num_logprobs=num_logprobs,
    )
    scores = jax.tree.map(lambda a: a.reshape(num_seqs, width, *a.shape[1:]), scores)
    return Speculated(verdict.num_accepted, tokens, scores)


def _histories(
    sampling: SamplingBatch,
    proposals: jax.Array,
    counts: jax.Array,
    position_masks: jax.Array | None,
) -> list:
    """The sampling batch at each position: the proposals before it counted as generated,
    and its own token masks (`position_masks[:, j]`) when there are any."""
    params, out = sampling, [sampling]
    for j in range(proposals.shape[1]):
        params = add_to_history(params, proposals[:, j], j < counts)
        out.append(params)
    if position_masks is not None:
        out = [p.replace(allowed=position_masks[:, j]) for j, p in enumerate(out)]
    return out


def _greedy_verdict(
    logits: jax.Array,
    sampling: SamplingBatch,
    proposals: jax.Array,
    counts: jax.Array,
    position_masks: jax.Array | None,
) -> Accepted:
    """`accept`'s verdict for greedy rows: the longest prefix equal to the argmax of the
    penalised logits, then the argmax."""
    argmax = jnp.stack(
        [
            jnp.argmax(apply_penalties(logits[:, j].astype(jnp.float32), params), axis=-1)
            for j, params in enumerate(_histories(sampling, proposals, counts, position_masks))
        ],
        axis=1,
    ).astype(jnp.int32)  # i32[S, k+1]
    k = proposals.shape[1]
    ok = (proposals == argmax[:, :k]) & (jnp.arange(k)[None, :] < counts[:, None])
    num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    slots = jnp.arange(k + 1)[None, :]
    tokens = jnp.where(slots < num_accepted[:, None], jnp.pad(proposals, ((0, 0), (0, 1))), -1)
    final = jnp.take_along_axis(argmax, num_accepted[:, None], axis=1)
    tokens = jnp.where(slots == num_accepted[:, None], final, tokens)
    return Accepted(num_accepted, tokens.astype(jnp.int32))


def _verdict(
    logits: jax.Array,
    sampling: SamplingBatch,
    proposals: jax.Array,
    counts: jax.Array,
    draft_probs: jax.Array | None,
    position_masks: jax.Array | None,
) -> Accepted:
    """`accept` against the sampler's distribution at each position."""
    probs, greedy = [], []
    for j, params in enumerate(_histories(sampling, proposals, counts, position_masks)):
        p, g = target_probs(logits[:, j], params)
        probs.append(p)
        greedy.append(g)
    return accept(
        jnp.stack(probs, axis=1),
        draft_probs,  # None: n-gram proposals, q a point mass
        proposals,
        counts,
        sampling_keys(sampling),
        sampling.temperature <= 0,
        jnp.stack(greedy, axis=1),
    )
