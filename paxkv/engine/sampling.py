"""On-device sampling of the next token of every sequence in a step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class SamplingBatch:
    """Per-sequence sampling parameters of one step, padded to the step's S.

    Two arrays, so the host moves them in two transfers: `floats` holds temperature
    (0 = greedy), top_p (1 = off) and min_p (0 = off); `ints` holds top_k (<= 0 = off),
    the seed, and the counter (index of the token being sampled in its completion).
    """

    floats: jax.Array  # f32[S, 3]
    ints: jax.Array  # i32[S, 3]

    temperature = property(lambda self: self.floats[:, 0])
    top_p = property(lambda self: self.floats[:, 1])
    min_p = property(lambda self: self.floats[:, 2])
    top_k = property(lambda self: self.ints[:, 0])
    seeds = property(lambda self: self.ints[:, 1])
    counters = property(lambda self: self.ints[:, 2])

    @staticmethod
    def host_rows(size: int) -> tuple[np.ndarray, np.ndarray]:
        """Padding rows (greedy, no truncation) to fill: `(floats f32[size, 3], ints i32[size, 3])`."""
        floats = np.zeros((size, 3), np.float32)
        floats[:, 1] = 1.0
        return floats, np.zeros((size, 3), np.int32)

    @classmethod
    def from_host(cls, params, size: int) -> SamplingBatch:
        """Pads `(temperature, top_k, top_p, min_p, seed, counter)` rows to `size` rows."""
        floats, ints = cls.host_rows(size)
        for i, (temperature, top_k, top_p, min_p, seed, counter) in enumerate(params):
            floats[i] = (temperature, top_p, min_p)
            ints[i] = (top_k, seed, counter)
        return cls(floats=jnp.asarray(floats), ints=jnp.asarray(ints))


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
