"""The acceptance rule of speculative decoding, batched over ragged proposals.

`paxkv.engine.device.verification` applies it to a step's target scores.

Sequence s proposes `counts[s] <= k` tokens (padded to k). The target model scored
them: `target_probs[s, j]` is its next-token distribution after the sequence's tokens
and its first j proposals, for j = 0..counts[s]; position counts[s] is the bonus
position. Sampling rows use the rule of Leviathan et al. and Chen et al. (2023): the
j-th proposal x is accepted with probability min(1, p(x) / q(x)); at the first
rejection one token is drawn from the normalised residual max(0, p - q), and when all
proposals pass, a bonus token is drawn from p at the bonus position. The emitted tokens
are then distributed exactly as tokens sampled from the target one at a time. Greedy
rows accept the longest prefix equal to the target's argmax and then append the argmax.
A row with counts[s] = 0 is a plain decode: one token from p at position 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

PAD_TOKEN = -1  # fills `Accepted.tokens` after the emitted tokens


@struct.dataclass
class Accepted:
    """What each sequence emits: its first `num_accepted` proposals, then one target
    token (the residual sample, the bonus sample or the greedy argmax);
    `tokens[s, num_accepted[s] + 1:]` is `PAD_TOKEN`."""

    num_accepted: jax.Array  # i32[S]; in 0..counts[s]
    tokens: jax.Array  # i32[S, k+1]


def _residual(p: jax.Array, q: jax.Array) -> jax.Array:  # f32[S, V] -> f32[S, V]
    """The (unnormalised) distribution to resample from after a rejection."""
    return jnp.maximum(p - q, 0.0)


def accept(
    target_probs: jax.Array,  # f32[S, k+1, V]
    draft_probs: jax.Array | None,  # f32[S, k, V]; None: each proposal is a point mass
    proposals: jax.Array,  # i32[S, k]
    counts: jax.Array,  # i32[S]; proposals per sequence, 0..k
    keys: jax.Array,  # one PRNG key per sequence, e.g. vmap(PRNGKey)(seeds): u32[S, 2]
    greedy: jax.Array,  # bool[S]; rows that take the argmax (temperature 0)
    target_argmax: jax.Array | None = None,  # i32[S, k+1]; None: argmax(target_probs)
) -> Accepted:
    """Verifies each sequence's proposals against the target (see the module docstring).

    `target_probs` is the distribution the sampler would draw from (after penalties,
    temperature and truncation); `draft_probs` is the one the proposals were drawn from,
    and None means deterministic proposals (n-gram), for which q is one-hot at the
    proposal and the rule accepts x with probability p(x). Entries past a row's count
    (proposals, draft rows, target rows past the bonus position) are never read into the
    result, so they may hold anything, NaN included. `target_argmax` is what a greedy
    row takes at each position (the sampler's argmax of the penalised logits, whose
    ties `target_probs` may not keep). Jittable; `keys` give each row its
    own draws, so a row's result does not depend on what it is batched with.
    """
    num_seqs, k, vocab = proposals.shape[0], proposals.shape[1], target_probs.shape[-1]
    if target_probs.shape[:2] != (num_seqs, k + 1):
        raise ValueError(f"{target_probs.shape=} must be (S, k+1, V) for {proposals.shape=}")
    if draft_probs is not None and draft_probs.shape != (num_seqs, k, vocab):
        raise ValueError(f"{draft_probs.shape=} must be {(num_seqs, k, vocab)}")
    target_probs = target_probs.astype(jnp.float32)
    positions = jnp.arange(k)
    valid = positions[None, :] < counts[:, None]  # bool[S, k]
    proposals = jnp.where(valid, proposals, 0)

    # p(x_j), q(x_j) at each proposal position.
    p_x = jnp.take_along_axis(target_probs[:, :k], proposals[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_x = jnp.ones_like(p_x)
    else:
        q_x = jnp.take_along_axis(draft_probs, proposals[..., None], axis=-1)[..., 0]
    accept_keys, final_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(accept_keys)  # f32[S, k]
    sampled_ok = u * q_x < p_x  # u < p/q without dividing by q

    if target_argmax is None:
        target_argmax = jnp.argmax(target_probs, axis=-1).astype(jnp.int32)  # i32[S, k+1]
    greedy_ok = proposals == target_argmax[:, :k]
    ok = jnp.where(greedy[:, None], greedy_ok, sampled_ok) & valid
    num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # i32[S]

    # The final token: from p at the first rejection (residual) or at the bonus position.
    rows = jnp.arange(num_seqs)
    p_final = target_probs[rows, num_accepted]  # f32[S, V]
    rejected = num_accepted < counts
    if k == 0:
        q_final = jnp.zeros_like(p_final)
    else:
        last = jnp.minimum(num_accepted, k - 1)  # the rejected position, when rejected
        if draft_probs is None:
            q_final = jax.nn.one_hot(proposals[rows, last], vocab, dtype=jnp.float32)
        else:
            q_final = draft_probs[rows, last].astype(jnp.float32)
        q_final = jnp.where(rejected[:, None], q_final, 0.0)
    residual = _residual(p_final, q_final)
    # A residual of zero mass has probability zero of being needed (p == q); sample p.
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_final)
    drawn = jax.vmap(jax.random.categorical)(final_keys, jnp.log(residual)).astype(jnp.int32)
    final = jnp.where(greedy, target_argmax[rows, num_accepted], drawn)

    slots = jnp.arange(k + 1)[None, :]
    tokens = jnp.where(
        slots < num_accepted[:, None], jnp.pad(proposals, ((0, 0), (0, 1))), PAD_TOKEN
    )
    tokens = jnp.where(slots == num_accepted[:, None], final[:, None], tokens)
    return Accepted(num_accepted, tokens.astype(jnp.int32))
