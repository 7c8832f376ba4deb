"""On-device sampling of the next token of every sequence in a step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class SamplingBatch:
    """Per-sequence sampling parameters of one step, padded to the step's S."""

    temperature: jax.Array  # f32[S]; 0 = greedy
    top_k: jax.Array  # i32[S]; <= 0 = off
    top_p: jax.Array  # f32[S]; 1 = off
    min_p: jax.Array  # f32[S]; 0 = off
    seeds: jax.Array  # i32[S]
    counters: jax.Array  # i32[S]; index of the token being sampled within its completion

    @classmethod
    def from_host(
        cls, params: list[tuple[float, int, float, float, int, int]], size: int
    ) -> SamplingBatch:
        """Pads `(temperature, top_k, top_p, min_p, seed, counter)` rows to `size` rows (greedy)."""
        rows = np.zeros((size, 6), np.float64)
        rows[:, 2] = 1.0
        if params:
            rows[: len(params)] = np.asarray(params, np.float64)
        return cls(
            temperature=jnp.asarray(rows[:, 0], jnp.float32),
            top_k=jnp.asarray(rows[:, 1], jnp.int32),
            top_p=jnp.asarray(rows[:, 2], jnp.float32),
            min_p=jnp.asarray(rows[:, 3], jnp.float32),
            seeds=jnp.asarray(rows[:, 4], jnp.int32),
            counters=jnp.asarray(rows[:, 5], jnp.int32),
        )


def sample(
    logits: jax.Array,  # f32[S, V]
    params: SamplingBatch,
) -> tuple[jax.Array, jax.Array]:  # (i32[S] tokens, f32[S] logprobs)
    """Samples one token per row and returns it with its log-probability.

    Greedy rows (temperature 0) take the argmax. Other rows scale by temperature, keep
    the `top_k` most likely tokens, then the smallest set whose probability reaches
    `top_p`, then drop tokens below `min_p` times the most likely one's probability,
    and draw from what is left with the key `fold_in(PRNGKey(seed), counter)`, so a
    request's samples do not depend on what it is batched with. The log-probability
    is under the unmodified distribution `log_softmax(logits)`.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    temp = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    order = jnp.argsort(-logits, axis=-1)  # descending
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1) / temp
    rank = jnp.arange(vocab)[None, :]
    keep = (params.top_k[:, None] <= 0) | (rank < params.top_k[:, None])
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(masked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ahead of each token
    keep &= before < params.top_p[:, None]
    keep &= probs >= params.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    masked = jnp.where(keep, sorted_logits, -jnp.inf)

    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(
        params.seeds, params.counters
    )
    choice = jax.vmap(jax.random.categorical)(keys, masked)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    tokens = jnp.where(params.temperature > 0, sampled, greedy)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
