"""A draft model's proposals inside the step (`speculative_config` method "draft_model").

The draft model keeps its own paged KV cache with the target's page ids: the same
block tables index both, so the host allocates, shares (prefix caching), preempts and
frees pages once for both. Every step runs the draft over the step's packed tokens
first, so its cache holds what the target's holds. A sequence with k' proposal rows
(their tokens unknown to the host) then has the draft decode k' tokens after its last
one, drawing each from the draft's distribution q under the request's own sampling
parameters (greedy rows: the argmax), and writes the K/V of each, the last included,
so that whatever the target accepts, the draft's cache holds it. The proposals fill the
target's rows and q goes to the acceptance rule.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from paxkv.engine.device.sampling import SamplingBatch, add_to_history, sampling_keys, target_probs
from paxkv.host.kv_groups import KVCacheGroups
from paxkv.kv_cache import PagedKVCache, PageTable

DRAFT_SALT = 0x5EED  # folded into a row's key for the draft's draws (not the target's)


def check_draft_model(
    draft_config: Any, target_config: Any, draft_groups: KVCacheGroups, target_groups: KVCacheGroups
) -> None:
    """Raises ValueError unless a draft model of `draft_config` can propose for a target
    of `target_config`: one vocabulary (the target's tokenizer), and one KV-cache group
    in each (`draft_groups`, `target_groups`), since the target's one block table
    indexes the draft's cache too."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"the draft model's vocab_size={draft_config.vocab_size} differs from the target's "
            f"{target_config.vocab_size}: a draft must share the target's tokenizer"
        )
    if draft_groups.num_groups != 1 or target_groups.num_groups != 1:
        raise ValueError(
            "speculative_config method 'draft_model' needs one KV-cache group in the "
            "draft and the target (no hybrid sliding-window groups): the draft's cache "
            "is indexed by the target's one block table"
        )


def draft_proposals(
    model: nnx.Module,
    tokens: jax.Array,  # i32[T]; proposal rows hold anything
    positions: jax.Array,  # i32[T]
    cache: PagedKVCache,
    table: PageTable,
    last: jax.Array,  # i32[S]; each sequence's row of its last known token
    counts: jax.Array,  # i32[S]; proposals wanted per sequence, 0..k
    sampling: SamplingBatch,
    k: int,
    *,
    attention_backend: str,
) -> tuple[jax.Array, jax.Array, PagedKVCache]:
    """`(proposals i32[S, k], q f32[S, k, V], cache)`: the draft run over the step's
    tokens, then k' = counts[s] tokens decoded after each sequence's last one (see the
    module docstring). With k = 0 only the first run (the cache kept in step)."""
    hidden, cache = model(tokens, positions, cache, table, attention_backend=attention_backend)
    num_seqs, num_rows = last.shape[0], tokens.shape[0]
    if k == 0:
        return jnp.zeros((num_seqs, 0), jnp.int32), jnp.zeros((num_seqs, 0, 0)), cache
    logits = model.logits(hidden[last])  # f32[S, V]
    keys = jax.vmap(lambda key: jax.random.fold_in(key, DRAFT_SALT))(sampling_keys(sampling))
    start = positions[last]  # each sequence's last known position
    params = sampling
    proposals, qs = [], []
    for j in range(k):
        q, greedy = target_probs(logits, params)
        step_keys = jax.vmap(lambda key, j=j: jax.random.fold_in(key, j))(keys)
        drawn = jax.vmap(jax.random.categorical)(step_keys, jnp.log(q)).astype(jnp.int32)
        token = jnp.where(sampling.temperature > 0, drawn, greedy)
        proposals.append(token)
        qs.append(q)
        active = j < counts
        params = add_to_history(params, token, active)
        # Proposal j + 1 at position start + 1 + j: its K/V, and the next logits.
        q_lens = active.astype(jnp.int32)
        cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens)])
        rows = jnp.where(active, cu[:-1], num_rows)  # inactive sequences have no row
        step_tokens = jnp.zeros(num_rows, jnp.int32).at[rows].set(token, mode="drop")
        step_positions = jnp.zeros(num_rows, jnp.int32).at[rows].set(start + 1 + j, mode="drop")
        step_table = table.replace(
            kv_lens=jnp.where(active, start + 2 + j, table.kv_lens).astype(jnp.int32), cu_q_lens=cu
        )
        hidden, cache = model(
            step_tokens,
            step_positions,
            cache,
            step_table,
            attention_backend=attention_backend,
            decode_only=True,
        )
        logits = model.logits(hidden[jnp.where(active, cu[:-1], 0)])
    return jnp.stack(proposals, axis=1), jnp.stack(qs, axis=1), cache
