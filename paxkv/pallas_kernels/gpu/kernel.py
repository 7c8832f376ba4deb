"""Kernel bodies of the GPU ragged paged attention (Pallas, Triton lowering); they see only refs.

Both kernels compute one tile of query rows against the KV cache of one sequence and one
KV head, and share the inner loop `_attend_kv_blocks`:

* the decode kernel (grid `(work items, Hkv)`) takes the single new token of one decode
  sequence; its tile rows are the G = Hq / Hkv query heads of one KV head (padded to at
  least 16 rows, the smallest M of a tensor-core dot), and work item w covers a
  contiguous share of one sequence's visible KV blocks (split-K, flash-decoding), as the
  wrapper's split plan assigns them from the live lengths;
* the prefill kernel (grid `(query blocks, Hkv)`) takes `rows` consecutive query tokens of
  one prefill sequence times the G query heads of one KV head, in row-major
  `(token, head)` order, and loops over every KV block the tile can see.

Both write the rows they own straight into the call's output. KV blocks that every row
of the tile sees whole (before the causal edge, inside the sliding window) run without
masks; only the blocks at the edges build one.

Every ref is a whole array in HBM (no BlockSpecs): the kernels gather K/V rows through the
block table themselves. Pages the table does not name for a visible position are never
dereferenced: their table entry is replaced by `NULL_PAGE` before the load (the null page is
then read and masked, like the reference does). Masked logits and scales are removed
with `jnp.where` and V rows outside the visible positions are not loaded (a masked load
gives zeros), so NaN anywhere outside the visible positions cannot leak.
Stores are masked per row, and masked rows point past the end of the output, so a program
never writes a row it does not own.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..layout import KEY, NULL_PAGE, VALUE
from .jax_compat import plgpu


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static facts both kernel bodies need, resolved by the wrapper."""

    num_q_heads: int  # Hq
    group_size: int  # G = Hq / Hkv
    group_padded: int  # G rounded up to a power of two: the head stride of a tile row
    page_size: int  # ps
    kv_block: int  # KV tokens per inner-loop step (a power of two >= 16)
    sm_scale: float
    soft_cap: float | None
    sliding_window: int | None
    compute_dtype: jnp.dtype  # operand dtype of both dots (their accumulators are f32)
    quantized: bool
    sinks: bool = False  # an input f32[Hq] of per-query-head sink logits after the pages

    @property
    def precision(self) -> lax.Precision | None:
        """Precision of both dots: IEEE f32 for f32 operands, the default otherwise."""
        # f32 operands: IEEE f32 (Triton's "ieee"), never TF32, so f32 results match the
        # reference to ~1e-6. 16-bit operands use the tensor cores with f32 accumulation.
        if self.compute_dtype == jnp.float32:
            return lax.Precision.HIGHEST
        return None

    @property
    def mask_free_interior(self) -> bool:
        """Whether KV blocks that every row sees whole run in a loop without masks: for
        16-bit dots. With f32 dots (FMA, unrolled by Triton) the second copy of the loop
        body doubles the compiled spills of prefill (20 to 40 KB at head_dim 128)."""
        return self.compute_dtype.itemsize == 2


class KvRefs(NamedTuple):
    """The paged cache of one layer, as the kernels see it (`kv_views`): the key/value
    half an axis of its own, indexed by `KEY` or `VALUE`."""

    block_tables: object  # i32[S, pages_per_seq]
    pages: object  # [P, Hkv, ps, 2, D]: [..., KEY, :] a token's key, [..., VALUE, :] its value
    scales: object | None  # bf16[P, Hkv, 2, L]: [..., KEY, j] token j's key scale


def kv_views(kv_pages: jax.Array, kv_scales: jax.Array | None) -> tuple[jax.Array, ...]:
    """Pages `[P, Hkv, ps, 2 * D]` as `[P, Hkv, ps, 2, D]` (the same memory, a free
    reshape), with the key/value half a scalar index as in the scales `[P, Hkv, 2, L]`
    (passed as they are).

    A K tile and a V tile then differ only by a constant in their offsets. Selecting the
    half with a computed index (`VALUE * ps + offset` rows, in the layout of rows) made
    Triton build the V tile's 32-bit offsets as a second tensor (the sum cannot be split
    from the sign-extended address): 104 registers in the bf16 decode kernel at head_dim
    128, against 84 with the half as an axis (`benchmarks.kernel_compile`).
    """
    p, h, ps, lanes = kv_pages.shape
    pages = kv_pages.reshape(p, h, ps, 2, lanes // 2)
    return (pages,) if kv_scales is None else (pages, kv_scales)


def decode_tile_rows(group_padded: int) -> int:
    """M of the decode tile: the padded group, at least 16 rows (a tensor-core dot's M)."""
    return max(16, group_padded)


def _i32(x: int) -> jax.Array:
    return jnp.int32(x)


def _dot(a: jax.Array, b: jax.Array, *, contract_b: int, precision) -> jax.Array:
    """`a @ b.T` (contract_b=1) or `a @ b` (contract_b=0), accumulated in f32."""
    return lax.dot_general(
        a,
        b,
        (((1,), (contract_b,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


def visible_range(
    first_pos: jax.Array, last_pos: jax.Array, cfg: KernelConfig
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """KV positions `[lo, hi]` that query rows at positions `first_pos..last_pos` can see
    together, and the position `start` where the KV block loop begins.

    `start` is `lo` rounded down to a KV block or page boundary (whichever is smaller), so
    the loop starts in the first page that holds a visible position: with a sliding window,
    pages before the window are skipped, not read and masked.
    """
    hi = last_pos
    lo = _i32(0)
    if cfg.sliding_window is not None:
        lo = jnp.maximum(first_pos - _i32(cfg.sliding_window - 1), lo)
    unit = min(cfg.kv_block, cfg.page_size)
    start = lax.div(lo, _i32(unit)) * _i32(unit)
    num_blocks = pl.cdiv(jnp.maximum(hi + 1 - start, 0), cfg.kv_block)
    return lo, hi, start, num_blocks


def interior_blocks(
    first_pos: jax.Array, last_pos: jax.Array, start: jax.Array, num_blocks: jax.Array, cfg
) -> tuple[jax.Array, jax.Array]:
    """Blocks `[full_lo, full_hi)` of the loop `visible_range` describes in which every
    query row at a position in `first_pos..last_pos` sees every KV position: blocks wholly
    at or before `first_pos` (causal) and, with a sliding window, wholly inside the window
    of `last_pos`. Those blocks need no mask; the ones around them do.
    """
    bk = _i32(cfg.kv_block)
    full_hi = jnp.clip(lax.div(first_pos + 1 - start, bk), 0, num_blocks)
    full_lo = _i32(0)
    if cfg.sliding_window is not None:
        first_inside = jnp.maximum(last_pos - _i32(cfg.sliding_window - 1) - start, 0)
        full_lo = jnp.minimum(pl.cdiv(first_inside, bk), full_hi)
    return full_lo, full_hi


def _attend_kv_blocks(
    q, pos, row_ok, kv: KvRefs, *, seq, kv_head, lo, hi, start, block_lo, block_hi, full, cfg
):
    """Online softmax of a tile of query rows over KV blocks `[block_lo, block_hi)`.

    q: [M, D] (compute dtype, zero in masked rows); pos: i32[M] positions of the rows;
    row_ok: bool[M]. Block i holds KV positions `start + i * kv_block + [0, kv_block)`; only
    the pages holding a position in `[lo, hi]` (what some row of the tile sees) are read,
    and only those positions enter the softmax and the values. `full = (full_lo, full_hi)`
    are the blocks every row sees whole (`interior_blocks`): they run without masks
    (`cfg.mask_free_interior`).
    Returns the unnormalized `(acc f32[M, D], row_max f32[M], denom f32[M])`: the weighted
    sum of values, the running max logit and the softmax denominator; `row_max = -inf` and
    `denom = 0` for a row that saw nothing. Rows where `row_ok` is False hold finite
    garbage: callers never store them.
    """
    num_rows, head_dim = q.shape
    bk, ps = cfg.kv_block, cfg.page_size
    first_page, last_page = lax.div(lo, _i32(ps)), lax.div(hi, _i32(ps))
    pages_per_seq, num_pages = kv.block_tables.shape[1], kv.pages.shape[0]

    def body(i, carry, *, masked: bool):
        acc, row_max, denom = carry
        j = start + i * _i32(bk) + lax.iota(jnp.int32, bk)  # KV positions of this block
        page_idx = lax.div(j, _i32(ps))
        # The clamps only matter for inputs that break the contract (a kv_len past the
        # table's width, a page id out of range; unchecked under jit): they turn what would
        # be an illegal address on the GPU into a wrong answer.
        if masked:
            kv_ok = (j >= lo) & (j <= hi)
            page_ok = (page_idx >= first_page) & (page_idx <= last_page)
            entry = kv.block_tables[
                seq, jnp.where(page_ok, jnp.minimum(page_idx, pages_per_seq - 1), 0)
            ]
            page = jnp.where(page_ok, jnp.clip(entry, 0, num_pages - 1), NULL_PAGE)
        else:
            entry = kv.block_tables[seq, jnp.minimum(page_idx, pages_per_seq - 1)]
            page = jnp.clip(entry, 0, num_pages - 1)
        offset = lax.rem(j, _i32(ps))
        k = kv.pages[page, kv_head, offset, KEY, :].astype(cfg.compute_dtype)  # [bk, D]

        s = _dot(q, k, contract_b=1, precision=cfg.precision) * cfg.sm_scale  # f32[M, bk]
        if cfg.quantized:  # per-token K scales scale the logit columns
            s = s * kv.scales[page, kv_head, KEY, offset].astype(jnp.float32)[None, :]
        if cfg.soft_cap is not None:
            s = cfg.soft_cap * jnp.tanh(s / cfg.soft_cap)
        if masked:
            visible = row_ok[:, None] & kv_ok[None, :] & (j[None, :] <= pos[:, None])
            if cfg.sliding_window is not None:
                visible &= j[None, :] > pos[:, None] - _i32(cfg.sliding_window)
            s = jnp.where(visible, s, -jnp.inf)
            max_next = jnp.maximum(row_max, jnp.max(s, axis=1))
            max_safe = jnp.where(max_next == -jnp.inf, 0.0, max_next)  # rows that saw nothing
            p = jnp.where(visible, jnp.exp(s - max_safe[:, None]), 0.0)
            # A masked load rather than a `where` after it: Triton then feeds the loaded
            # tile straight to the dot (pipelined in shared memory in the dot's layout)
            # instead of copying it through registers.
            v = _load_rows(kv.pages, (page, kv_head, offset, VALUE), kv_ok)
        else:  # every position is visible to every row: finite logits, nothing to mask
            max_next = max_safe = jnp.maximum(row_max, jnp.max(s, axis=1))
            p = jnp.exp(s - max_safe[:, None])
            v = kv.pages[page, kv_head, offset, VALUE, :]
        alpha = jnp.exp(row_max - max_safe)
        denom = alpha * denom + jnp.sum(p, axis=1)
        if cfg.quantized:  # per-token V scales weight the rows of V: fold them into p
            v_scale = kv.scales[page, kv_head, VALUE, offset].astype(jnp.float32)
            p = p * (jnp.where(kv_ok, v_scale, 0.0) if masked else v_scale)[None, :]
        v = v.astype(cfg.compute_dtype)
        pv = _dot(p.astype(cfg.compute_dtype), v, contract_b=0, precision=cfg.precision)
        return alpha[:, None] * acc + pv, max_next, denom

    masked_body = functools.partial(body, masked=True)
    carry = (
        jnp.zeros((num_rows, head_dim), jnp.float32),
        jnp.full((num_rows,), -jnp.inf, jnp.float32),
        jnp.zeros((num_rows,), jnp.float32),
    )
    # Blocks before the interior (the window's edge), the interior, then the blocks after
    # it (the causal edge and a partly filled last block).
    if not cfg.mask_free_interior:
        return lax.fori_loop(block_lo, block_hi, masked_body, carry)
    full_lo = jnp.clip(full[0], block_lo, block_hi)
    full_hi = jnp.clip(full[1], full_lo, block_hi)
    if cfg.sliding_window is not None:
        carry = lax.fori_loop(block_lo, full_lo, masked_body, carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
    return lax.fori_loop(full_hi, block_hi, masked_body, carry)


def _load_rows(ref, index, row_ok) -> jax.Array:
    """`ref[index[0][n], index[1][n], ..., :]` for each n: [N, last dim of ref], with rows
    where `row_ok` is False zero and not read (a masked load).

    `index` holds one entry per leading dim of `ref`: a scalar, or i32[N] per row; as in
    `_store_rows`, every index is an array, the form the interpreter and Triton share.
    """
    rows = [i[:, None] if jnp.ndim(i) else i for i in index]
    cols = lax.iota(jnp.int32, ref.shape[-1])[None, :]
    mask = jnp.broadcast_to(row_ok[:, None], (row_ok.shape[0], ref.shape[-1]))
    return plgpu.load(ref.at[(*rows, cols)], mask=mask, other=jnp.zeros((), ref.dtype))


def _normalize(acc, denom):
    """acc / denom, and exact zeros for rows that saw no position."""
    return jnp.where(denom[:, None] > 0, acc / jnp.where(denom > 0, denom, 1.0)[:, None], 0.0)


def _store_rows(ref, index, value, row_ok):
    """Masked store of the tile rows `value[m]` into `ref[index[0][m], index[1][m], ...]`.

    `index` holds one entry per leading dim of `ref`: a scalar, or i32[M] per tile row. A
    2-D `value` fills the trailing dim. Every index is an array (no slices): the Pallas
    interpreter implements masked stores only in that form, and Triton lowers it to one
    pointer tensor. Masked rows point past the end of the array, so even a masked lane
    never names a row another program owns.
    """
    index = [
        jnp.where(row_ok, i, ref.shape[dim]) if jnp.ndim(i) else i for dim, i in enumerate(index)
    ]
    if value.ndim == 1:
        plgpu.store(ref.at[tuple(index)], value, mask=row_ok)
        return
    rows = [i[:, None] if jnp.ndim(i) else i for i in index]
    cols = lax.iota(jnp.int32, value.shape[1])[None, :]
    mask = jnp.broadcast_to(row_ok[:, None], value.shape)
    plgpu.store(ref.at[(*rows, cols)], value, mask=mask)


def _unpack(refs, cfg: KernelConfig, num_outputs: int):
    """Splits a kernel's refs into `(inputs, scales, sinks, outputs)` (scales and sinks
    None when the call has none). The first input, the output buffer the call aliases to
    its first output, is dropped: the kernel writes it through the output ref."""
    inputs, outputs = refs[1 : len(refs) - num_outputs], refs[len(refs) - num_outputs :]
    scales = sinks = None
    if cfg.sinks:
        *inputs, sinks = inputs
    if cfg.quantized:
        *inputs, scales = inputs
    return inputs, scales, sinks, outputs


def _add_sinks(state, sinks_ref, heads, row_ok, include):
    """The softmax state `(acc f32[M, D], row_max f32[M], denom f32[M])` of
    `_attend_kv_blocks` with each row's attention sink added: its query head's logit
    (`sinks_ref f32[Hq]` at `heads i32[M]`) joins the denominator, rescaled to the new max,
    and adds no value. Only where `include` (a bool scalar): the program that holds its
    sequence's first KV block, so the shares of a split sequence count the sink once.

    Merged after the KV loop rather than as the loop's initial state: the loop keeps its
    constant initial carry, and the kernels their registers (as a loop carry, the sink
    spilled 12 bytes in the bf16 decode kernel at head_dim 256, which fits 128 registers
    exactly without it). A sink of -inf adds nothing; a row that saw nothing and has a
    finite sink gets `acc = 0`, `denom = 1`: zeros.
    """
    acc, row_max, denom = state
    sink = sinks_ref[jnp.where(row_ok, heads, 0)].astype(jnp.float32)
    sink = jnp.where(include, sink, -jnp.inf)
    top = jnp.maximum(row_max, sink)
    top_safe = jnp.where(top == -jnp.inf, 0.0, top)  # neither a key nor a sink
    scale = jnp.exp(row_max - top_safe)
    return scale[:, None] * acc, top, scale * denom + jnp.exp(sink - top_safe)


def decode_kernel(*refs, cfg: KernelConfig, split: bool) -> None:
    """Program (w, h): work item w (a share of one decode sequence's KV blocks) for KV
    head h.

    Refs: the output buffer (aliased to `o`), item_seq i32[W] (the decode sequence of each
    work item, -1 for an idle one), item_lo, item_hi i32[W] (its KV blocks `[lo, hi)` of
    the loop `visible_range` describes), kv_lens, block_tables, cu_q_lens, q [T, Hq, D],
    kv_pages [P, Hkv, ps, 2, D], (kv_scales [P, Hkv, 2, L]) as in `kv_views`; outputs
    `o [T, Hq, D]` (q dtype) and, when `split`, the partials `acc f32[W, Hq, D], row_max f32[W, Hq], denom f32[W, Hq]`. An
    item that covers its whole sequence writes the normalized row of `o` (the sequence's
    one query token) itself; an item that covers a share writes its partials, which
    `combine_splits` merges. Idle items read no KV block and store nothing. With sinks
    (`sinks f32[Hq]` after the pages and scales), the item holding a sequence's first KV
    block adds it (`_add_sinks`).
    """
    (
        (item_seq, item_lo, item_hi, kv_lens, block_tables, cu_q_lens, q_ref, pages),
        scales,
        sinks_ref,
        outs,
    ) = _unpack(refs, cfg, 4 if split else 1)
    kv = KvRefs(block_tables, pages, scales)
    item, kv_head = pl.program_id(0), pl.program_id(1)
    # Idle items have an empty block range and masked rows, rather than a `pl.when`
    # around the body: the branch costs the compiled kernel 16 registers.
    seq_or_none = item_seq[item]
    seq = jnp.maximum(seq_or_none, 0)
    num_rows = decode_tile_rows(cfg.group_padded)
    q_start, last = cu_q_lens[seq], kv_lens[seq] - 1
    g = lax.iota(jnp.int32, num_rows)
    row_ok = (g < cfg.group_size) & (seq_or_none >= 0)
    heads = kv_head * cfg.group_size + g
    q = q_ref[q_start, jnp.where(row_ok, heads, 0), :]
    q = jnp.where(row_ok[:, None], q.astype(cfg.compute_dtype), 0)
    lo, hi, start, num_blocks = visible_range(last, last, cfg)
    block_lo, block_hi = item_lo[item], item_hi[item]
    acc, row_max, denom = _attend_kv_blocks(
        q, jnp.full((num_rows,), last, jnp.int32), row_ok, kv, seq=seq, kv_head=kv_head,
        lo=lo, hi=hi, start=start, block_lo=block_lo, block_hi=block_hi,
        full=interior_blocks(last, last, start, num_blocks, cfg), cfg=cfg,
    )  # fmt: skip
    if sinks_ref is not None:
        state = (acc, row_max, denom)
        acc, row_max, denom = _add_sinks(state, sinks_ref, heads, row_ok, block_lo == 0)
    whole = (block_lo == 0) & (block_hi == num_blocks)
    o_ref = outs[0]
    out = _normalize(acc, denom).astype(o_ref.dtype)
    _store_rows(o_ref, (q_start, heads), out, row_ok & whole)
    if split:
        acc_ref, max_ref, denom_ref = outs[1:]
        share = row_ok & ~whole
        _store_rows(acc_ref, (item, heads), acc, share)
        _store_rows(max_ref, (item, heads), row_max, share)
        _store_rows(denom_ref, (item, heads), denom, share)


def prefill_kernel(*refs, cfg: KernelConfig, rows: int) -> None:
    """Program (b, h): query block b (`rows` tokens of one prefill sequence) for KV head h.

    Refs: the output buffer (aliased to `o`), block_seq i32[NB] (the sequence of each
    query block, -1 past the last one), block_index i32[NB] (its index within the
    sequence), kv_lens, block_tables, cu_q_lens, q [T, Hq, D], kv_pages, (kv_scales), viewed
    as in `kv_views`; output o [T, Hq, D] (q dtype), of which the program writes its
    own rows only. Idle blocks exit at once.
    """
    (
        (block_seq, block_index, kv_lens, block_tables, cu_q_lens, q_ref, pages),
        scales,
        sinks_ref,
        (o_ref,),
    ) = _unpack(refs, cfg, 1)
    kv = KvRefs(block_tables, pages, scales)
    block, kv_head = pl.program_id(0), pl.program_id(1)
    seq = block_seq[block]

    @pl.when(seq >= 0)
    def _():
        gp = cfg.group_padded
        num_rows = rows * gp
        q_start = cu_q_lens[seq]
        q_len = cu_q_lens[seq + 1] - q_start
        kv_len = kv_lens[seq]
        first = block_index[block] * _i32(rows)  # chunk-local index of the first token

        m_idx = lax.iota(jnp.int32, num_rows)
        local = first + lax.div(m_idx, _i32(gp))
        g = lax.rem(m_idx, _i32(gp))
        row_ok = (g < cfg.group_size) & (local < q_len)
        tokens = q_start + local
        heads = kv_head * cfg.group_size + g
        q = q_ref[jnp.where(row_ok, tokens, 0), jnp.where(row_ok, heads, 0), :]
        q = jnp.where(row_ok[:, None], q.astype(cfg.compute_dtype), 0)
        context = kv_len - q_len  # tokens cached before this chunk

        first_pos = context + first
        last_pos = jnp.minimum(first_pos + _i32(rows - 1), kv_len - 1)
        lo, hi, start, num_blocks = visible_range(first_pos, last_pos, cfg)
        state = _attend_kv_blocks(
            q, context + local, row_ok, kv, seq=seq, kv_head=kv_head, lo=lo, hi=hi,
            start=start, block_lo=_i32(0), block_hi=num_blocks,
            full=interior_blocks(first_pos, last_pos, start, num_blocks, cfg), cfg=cfg,
        )  # fmt: skip
        if sinks_ref is not None:
            state = _add_sinks(state, sinks_ref, heads, row_ok, True)
        acc, _, denom = state
        out = _normalize(acc, denom).astype(o_ref.dtype)
        _store_rows(o_ref, (tokens, heads), out, row_ok)
