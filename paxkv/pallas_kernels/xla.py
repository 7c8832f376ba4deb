"""Ragged paged attention as a pure-JAX loop that does only the work a row needs.

The reference (`reference.py`) is written to be obviously right: every query row
gathers every page its table row could name, and padding rows cost as much as real
ones. This backend ("xla") computes the same function for speed where no Pallas
kernel runs, the CPU above all: rows are visited one at a time, padding rows are
skipped, and each row loops over blocks of pages from the first page holding a
visible position to the last (a sliding window skips the pages before it), with an
online softmax. Its cost follows the tokens actually attended to, not the padded
shapes. It is tested against the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .contract import AttentionInputs, attention_op, token_layout
from .layout import KEY, NULL_PAGE, VALUE, cdiv, kv_lanes
from .quantization import dequantize

_HIGHEST = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnames=("block_pages",))
def _xla_attention(inputs: AttentionInputs, *, block_pages: int) -> jax.Array:
    q, kv_pages, kv_scales = inputs.q, inputs.kv_pages, inputs.kv_scales
    sm_scale, soft_cap, sliding_window = inputs.sm_scale, inputs.soft_cap, inputs.sliding_window
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = kv_pages.shape
    pages_per_seq = inputs.block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    block_len = block_pages * page_size
    # Pad the table so a block never reads past its end.
    padded_pages = cdiv(pages_per_seq, block_pages) * block_pages
    tables = jnp.pad(
        inputs.block_tables, ((0, 0), (0, padded_pages - pages_per_seq)), constant_values=NULL_PAGE
    )
    seq_ids, positions, valid = token_layout(
        inputs.cu_q_lens, inputs.kv_lens, inputs.num_seqs, num_tokens
    )

    def gather(part, page_ids, keep):  # KEY or VALUE -> f32[Hkv, block_len, D]
        x = kv_pages[page_ids, :, :, kv_lanes(part, head_dim)]  # [block_pages, Hkv, ps, D]
        if kv_scales is not None:
            x = dequantize(x, kv_scales[page_ids, :, part, :page_size])
        x = x.astype(jnp.float32).transpose(1, 0, 2, 3).reshape(num_kv_heads, block_len, head_dim)
        return jnp.where(keep[None, :, None], x, 0.0)

    def attend(args):
        q_row, seq, pos = args
        qg = q_row.astype(jnp.float32).reshape(num_kv_heads, group, head_dim)
        lo = 0 if sliding_window is None else jnp.maximum(0, pos - sliding_window + 1)
        first, last = lo // block_len, pos // block_len  # blocks holding visible positions

        def block(b, carry):
            m, denom, acc = carry
            start = b * block_len
            kv_pos = start + jnp.arange(block_len)
            keep = (kv_pos >= lo) & (kv_pos <= pos)
            page_keep = jnp.any(keep.reshape(block_pages, page_size), axis=1)
            ids = jax.lax.dynamic_slice_in_dim(tables[seq], b * block_pages, block_pages)
            ids = jnp.where(page_keep, ids, NULL_PAGE)
            k = gather(KEY, ids, keep)
            v = gather(VALUE, ids, keep)
            s = jnp.einsum("kgd,kld->kgl", qg, k, precision=_HIGHEST) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(keep, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.where(keep, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            denom = denom * alpha + jnp.sum(p, axis=-1)
            acc = acc * alpha[..., None] + jnp.einsum("kgl,kld->kgd", p, v, precision=_HIGHEST)
            return m_new, denom, acc

        if inputs.sinks is None:
            m, denom = jnp.full((num_kv_heads, group), -jnp.inf), jnp.zeros((num_kv_heads, group))
        else:  # the sink is the state before any key: its logit, weight exp(0) = 1, no value
            m, denom = inputs.sinks.reshape(num_kv_heads, group), jnp.ones((num_kv_heads, group))
        init = (m, denom, jnp.zeros((num_kv_heads, group, head_dim)))
        # The first block always holds the row's own position, so m is finite after it
        # (and a sink of -inf, weighted exp(-inf - m) = 0 there, drops out).
        _, denom, acc = jax.lax.fori_loop(first, last + 1, block, init)
        return (acc / denom[..., None]).reshape(num_q_heads, head_dim)

    def row(args):
        q_row, seq, pos, ok = args
        return jax.lax.cond(
            ok, attend, lambda _: jnp.zeros((num_q_heads, head_dim), jnp.float32), (q_row, seq, pos)
        )

    out = jax.lax.map(row, (q, seq_ids, positions, valid))
    return out.astype(q.dtype)


@attention_op
def ragged_paged_attention_xla(inputs: AttentionInputs, *, block_pages: int = 8) -> jax.Array:
    """Ragged paged attention with the reference's semantics, at the cost of the real work.

    Called with the reference's arguments (see `attention_op`) and the keyword
    `block_pages`: pages gathered per loop iteration. Rows are processed in turn, which
    suits the CPU; on accelerators use the Pallas kernels. Returns `[T, Hq, D]`.
    """
    if block_pages < 1:
        raise ValueError(f"block_pages={block_pages} must be at least 1")
    return _xla_attention(inputs, block_pages=block_pages)
