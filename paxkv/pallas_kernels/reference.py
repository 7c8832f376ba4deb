"""Pure-JAX ragged paged attention: the oracle that every kernel is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .contract import AttentionInputs, attention_op, token_layout
from .layout import KEY, NULL_PAGE, VALUE, kv_lanes
from .quantization import dequantize

# Bytes of gathered K/V one lax.map iteration may hold; bounds the reference's memory.
_GATHER_BUDGET_BYTES = 64 * 1024 * 1024


def visible_kv(
    position: jax.Array,  # i32[...]
    kv_len: jax.Array,  # i32[...]
    valid: jax.Array,  # bool[...]
    kv_positions: jax.Array,  # i32[L]
    sliding_window: int | None,
) -> jax.Array:  # bool[..., L]
    """Which kv positions a query at `position` attends to.

    Causal: `j <= position` (and `j < kv_len`); with a sliding window W, also
    `j > position - W`, i.e. the query sees itself and the W - 1 tokens before it.
    """
    p = position[..., None]
    mask = (kv_positions <= p) & (kv_positions < kv_len[..., None]) & valid[..., None]
    if sliding_window is not None:
        mask &= kv_positions > p - sliding_window
    return mask


@jax.jit
def _reference(inputs: AttentionInputs) -> jax.Array:
    q, kv_lens, block_tables = inputs.q, inputs.kv_lens, inputs.block_tables
    sm_scale, soft_cap, sliding_window = inputs.sm_scale, inputs.soft_cap, inputs.sliding_window
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = inputs.kv_pages.shape
    pages_per_seq = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    max_len = pages_per_seq * page_size
    kv_positions = jnp.arange(max_len, dtype=jnp.int32)
    seq_ids, positions, valid = token_layout(inputs.cu_q_lens, kv_lens, inputs.num_seqs, num_tokens)
    sinks = None
    if inputs.sinks is not None:
        sinks = inputs.sinks.reshape(num_kv_heads, group, 1)  # f32[Hkv, G, 1]

    def one_row(args):
        q_row, seq, pos, ok = args  # [Hq, D], (), (), ()
        kv_len = kv_lens[seq]
        mask = visible_kv(pos, kv_len, ok, kv_positions, sliding_window)  # bool[L]
        # Pages holding no visible position are replaced by the null page before the
        # gather, so the table's entries for them are never dereferenced.
        page_used = jnp.any(mask.reshape(pages_per_seq, page_size), axis=1)
        pages = jnp.where(page_used, block_tables[seq], NULL_PAGE)  # i32[pages_per_seq]

        def gather(part):  # KEY or VALUE
            x = inputs.kv_pages[
                pages, :, :, kv_lanes(part, head_dim)
            ]  # [pages_per_seq, Hkv, ps, D]
            if inputs.kv_scales is not None:
                x = dequantize(x, inputs.kv_scales[pages, :, part, :page_size])
            x = x.astype(jnp.float32).transpose(1, 0, 2, 3).reshape(num_kv_heads, max_len, head_dim)
            return jnp.where(mask[None, :, None], x, 0.0)  # a poisoned entry must not leak

        k = gather(KEY)  # f32[Hkv, L, D]
        v = gather(VALUE)
        qg = q_row.astype(jnp.float32).reshape(num_kv_heads, group, head_dim)
        s = jnp.einsum("kgd,kld->kgl", qg, k, precision=jax.lax.Precision.HIGHEST) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask, s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)  # [Hkv, G, 1]
        if sinks is not None:
            m = jnp.maximum(m, sinks)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.where(mask, jnp.exp(s - m), 0.0)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        if sinks is not None:  # the sink's share of the denominator; it has no value
            denom += jnp.exp(sinks - m)
        o = jnp.einsum("kgl,kld->kgd", p, v, precision=jax.lax.Precision.HIGHEST)
        o = o / jnp.where(denom > 0, denom, 1.0)
        return o.reshape(num_q_heads, head_dim)

    row_bytes = 2 * num_kv_heads * max_len * head_dim * 4
    batch = max(1, min(num_tokens, _GATHER_BUDGET_BYTES // max(row_bytes, 1)))
    out = jax.lax.map(one_row, (q, seq_ids, positions, valid), batch_size=batch)
    return out.astype(q.dtype)


@attention_op
def ragged_paged_attention_reference(inputs: AttentionInputs) -> jax.Array:  # [T, Hq, D], q.dtype
    """Attention of a ragged batch of new query tokens over a paged KV cache.

    Called as `ragged_paged_attention_reference(q, kv_pages, kv_lens, block_tables,
    cu_q_lens, num_seqs, *, sm_scale, soft_cap=None, sliding_window=None,
    kv_scales=None, sinks=None)` (see `attention_op`), with the shapes of
    `attention_inputs`; returns `[T, Hq, D]` in `q.dtype`.

    Semantics (every backend implements exactly this):

    * Sequences `s < num_seqs[0]` are live; the others are padding. Live sequence s
      owns the packed query rows `cu_q_lens[s] : cu_q_lens[s + 1]` (its `q_len` new
      tokens; 1 for decode, more for prefill or a prefill chunk) and has `kv_lens[s]`
      tokens in the cache, counting those new tokens, so `q_len <= kv_len`.
    * Token j of sequence s lives in page `block_tables[s, j // ps]` at offset
      `j % ps`: for KV head h its key is `kv_pages[page, h, j % ps, :D]` and its value
      `kv_pages[page, h, j % ps, D:]`. Quantized pages (int8, float8) are dequantized
      as `key.astype(f32) * kv_scales[page, h, j % ps]` and
      `value.astype(f32) * kv_scales[page, h, ps + j % ps]`.
    * Query row i of sequence s (0-based within its chunk) is at position
      `p = kv_len - q_len + i` and attends to the kv positions j with `j <= p`; with
      `sliding_window=W` also `j > p - W` (itself and the W - 1 tokens before it).
    * Query head h reads KV head `h // (Hq // Hkv)` (MHA, GQA and MQA alike).
    * Logits are `sm_scale * (q . k)`, then `soft_cap * tanh(logits / soft_cap)` when
      `soft_cap` is set; softmax over the visible positions; output the weighted sum
      of the values. Everything is computed in float32 at HIGHEST precision and the
      result is cast to `q.dtype`.
    * Attention sinks: with `sinks` (`f32[Hq]`), query head h's sink logit `s_h` joins
      the softmax's denominator and brings no value: with `x_j` the visible logits
      (soft-capped if set; the sink is not scaled or capped) and
      `m = max(s_h, max_j x_j)`, the output is
      `sum_j exp(x_j - m) v_j / (exp(s_h - m) + sum_j exp(x_j - m))`. A sink of
      `-inf` is no sink.
    * Padding rows (at or past `cu_q_lens[num_seqs]`) and rows that see no position
      are exactly zero, never NaN.
    * Block-table entries that hold no visible position of a live row are never
      dereferenced (the null page 0 is read in their place and masked), so their
      contents, NaN included, cannot affect the output.

    Raises:
      ValueError: at trace time, for inconsistent shapes or dtypes, naming the
        argument; for an eager call, also for out-of-range lengths or a block table
        too narrow for a `kv_len`.
    """
    return _reference(inputs)
