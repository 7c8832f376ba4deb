"""Several decode steps in one compiled call, with the page table threaded through the loop.

The host reserves, before the call, the pages that the next `num_steps` tokens of every
sequence will need; the device then runs `num_steps` iterations of write-K/V, attend
and sample in a `lax.fori_loop`, feeding each sampled token to the next iteration and
advancing the lengths itself. A sequence that samples a stop token or reaches its
token limit is masked out of the remaining iterations (its query length drops to 0,
so it neither writes nor reads), exactly where the host will later see it finish.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from paxkv.engine.sampling import sample
from paxkv.engine.state import PagedKVCache

MAX_STOP_IDS = 8  # stop + EOS token ids a sequence may have in the multi-step path
TRACES = [0]  # traces of `decode_loop` in this process


@struct.dataclass
class DecodeLimits:
    """Per-sequence stop conditions of a multi-step call, padded to S."""

    stop_ids: jax.Array  # i32[S, MAX_STOP_IDS]; -1 pads
    remaining: jax.Array  # i32[S]; tokens the sequence may still generate (>= 1 if live)

    @classmethod
    def from_host(
        cls, stops: list[tuple[int, ...]], remaining: list[int], size: int
    ) -> DecodeLimits:
        ids = np.full((size, MAX_STOP_IDS), -1, np.int32)
        for i, s in enumerate(stops):
            ids[i, : len(s)] = s
        rem = np.zeros(size, np.int32)
        rem[: len(remaining)] = remaining
        return cls(stop_ids=jnp.asarray(ids), remaining=jnp.asarray(rem))


def decode_loop(
    graphdef,
    params,
    kv_cache: PagedKVCache,
    batch,  # paxkv.engine.StepBatch of a decode-only plan: row s is sequence s
    limits: DecodeLimits,
    *,
    attention_backend: str,
    num_steps: int,
):
    """Runs `num_steps` decode iterations. Returns `(tokens i32[N, S], logprobs f32[N, S],
    valid bool[N, S], kv_cache)`; `valid[i, s]` says sequence s produced token i."""
    TRACES[0] += 1  # runs at trace time only
    model = nnx.merge(graphdef, params)
    table = batch.table
    num_rows = batch.tokens.shape[0]
    num_slots = table.kv_lens.shape[0]
    live = jnp.arange(num_slots) < table.num_seqs[0]
    first_tokens = (
        jnp.zeros(num_slots, jnp.int32)
        .at[: min(num_slots, num_rows)]
        .set(batch.tokens[: min(num_slots, num_rows)])
    )

    def body(i, carry):
        cache, current, kv_lens, active, out_tokens, out_logprobs, out_valid = carry
        q_lens = active.astype(jnp.int32)
        cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens)])
        rows = jnp.where(active, cu[:-1], num_rows)  # inactive sequences have no row
        tokens = jnp.zeros(num_rows, jnp.int32).at[rows].set(current, mode="drop")
        positions = jnp.zeros(num_rows, jnp.int32).at[rows].set(kv_lens - 1, mode="drop")
        step_table = table.replace(kv_lens=kv_lens, cu_q_lens=cu)
        hidden, cache = model(
            tokens, positions, cache, step_table, attention_backend=attention_backend
        )
        logits = model.logits(hidden[jnp.where(active, cu[:-1], 0)])
        sampling = batch.sampling.replace(ints=batch.sampling.ints.at[:, 2].add(i))
        new, logprobs = sample(logits, sampling)
        stop = jnp.any(new[:, None] == limits.stop_ids, axis=1) | (i + 1 >= limits.remaining)
        out_tokens = out_tokens.at[i].set(jnp.where(active, new, -1))
        out_logprobs = out_logprobs.at[i].set(jnp.where(active, logprobs, 0.0))
        out_valid = out_valid.at[i].set(active)
        still = active & ~stop
        return (
            cache,
            jnp.where(still, new, current),
            kv_lens + still,
            still,
            out_tokens,
            out_logprobs,
            out_valid,
        )

    carry = (
        kv_cache,
        first_tokens,
        table.kv_lens,
        live,
        jnp.full((num_steps, num_slots), -1, jnp.int32),
        jnp.zeros((num_steps, num_slots), jnp.float32),
        jnp.zeros((num_steps, num_slots), bool),
    )
    kv_cache, _, _, _, tokens, logprobs, valid = jax.lax.fori_loop(0, num_steps, body, carry)
    return tokens, logprobs, valid, kv_cache


DECODE_LOOP = jax.jit(
    decode_loop, static_argnames=("attention_backend", "num_steps"), donate_argnames=("kv_cache",)
)
