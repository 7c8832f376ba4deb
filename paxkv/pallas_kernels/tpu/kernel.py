"""Kernel body of the TPU ragged paged attention: it sees only refs.

One grid step `(core, kv head block, w)` computes `k = items_per_step` work items in
turn, items `core_item(core, w * k + j)` for j < k; an item is one chunk of at most
`queries_per_block` query rows of one sequence against that sequence's pages, for
`kv_heads_per_block` KV heads. Several items per step make fewer grid steps, each with a
fixed cost, for decode batches of one-row items. The wrapper (`ragged_paged_attention.py`) builds the
work items and lays the query rows out so that each KV head's rows form one
`[M, D]` matrix: row `r` is token `r // G` of the item and query head `r % G` of the
group, so GQA/MQA groups share every K/V tile on the matrix unit.

The pages the item needs, `[first_page, end_page)`, are walked in blocks of
`pages_per_block`. Each page is one DMA from HBM into a double-buffered VMEM slot, K and
V of the block's KV heads together (the page layout `[P, Hkv, ps, 2 * D]` keeps them in
one contiguous run), and for 8-bit pages one more DMA for their K and V scales; the
copies of block `i + 1` are in flight while block `i` is computed, and during an item's
last block the copies of the first block of the core's next item (in this grid step or
the next, or the first item of the next head block), so no item starts with a cold copy
(RPA v2/v3 overlap the same way). Pages
outside that range (past the item's last row, or before its sliding window) are never
fetched.

The bfloat16 scales (`[P, Hkv, 2, L]`: the head axis is untiled, so a run of heads is
one DMA at any head index) are widened to float32, K's and V's apart, in VMEM once the
block has landed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..layout import KEY, VALUE, kv_lanes

# Finite, so a row that has seen nothing yet gives exp(MASK - MASK) = 1 (then zeroed
# by `where`) rather than exp(-inf + inf) = NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Width of the lane-replicated running max / sum scratch (one vreg row).
STATS_LANES = 128


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static parameters of one kernel instance."""

    page_size: int  # ps
    pages_per_block: int
    kv_heads_per_block: int
    group_size: int  # G = Hq // Hkv
    rows: int  # M: rows of one item's q tile per KV head (>= queries_per_block * G)
    pages_per_seq: int
    sm_scale: float
    soft_cap: float | None
    sliding_window: int | None
    quantized: bool
    compute_dtype: np.dtype  # operand dtype of both dots (`contract.compute_dtype`)
    items_per_step: int = 1  # work items one grid step runs in turn
    sinks: bool = False  # an SMEM input f32[Hq] of per-query-head sink logits

    @property
    def block_tokens(self) -> int:
        """KV positions covered by one block of pages (N)."""
        return self.pages_per_block * self.page_size


def core_item(core, step: Any, num_cores: int) -> Any:
    """The work item a core's `step`-th item step computes: items are dealt round robin
    (`c, c + cores, ...`), so a batch of two short decodes gives each core one."""
    return step * num_cores + core


def page_copy(
    src_hbm, dst_vmem, sem, *, page, slot, index, head_start, heads
) -> Any:  # pltpu.make_async_copy returns a descriptor JAX does not export
    """DMA of one page's `heads` KV heads from `head_start` into a VMEM buffer slot.

    The same copy serves pages (`[P, Hkv, ps, 2 * D]` -> `[2, ppb, hb, ps, 2 * D]`, K and
    V together) and their scales (`[P, Hkv, 2, L]` -> `[2, ppb, hb, 2, L]`): the page
    lands at `[slot, index]`.
    """
    return pltpu.make_async_copy(
        src_hbm.at[page, pl.ds(head_start, heads)], dst_vmem.at[slot, index], sem
    )


def _visible(cfg: KernelConfig, shape, col_start, first_pos, num_rows):
    """bool[M, N]: which (row, kv column) pairs a block attends to.

    Row r is token `i = r // G` at position `first_pos + i`; column c is kv position
    `j = col_start + c`. Causal `j <= first_pos + i` is `(j - first_pos) * G <= r`, and
    the window `j > first_pos + i - W` is `(j - first_pos + W) * G > r`: both without a
    vector division.
    """
    g = cfg.group_size
    r = lax.broadcasted_iota(jnp.int32, shape, 0)
    d = (col_start - first_pos + lax.broadcasted_iota(jnp.int32, shape, 1)) * g
    vis = (d <= r) & (r < num_rows * g)
    if cfg.sliding_window is not None:
        vis &= r < d + cfg.sliding_window * g
    return vis


def _start_softmax(cfg: KernelConfig, sinks_ref, stats, head_start) -> None:
    """Resets the online-softmax state `(m, l, acc)` of every head of the block for a new
    item.

    Without sinks: `m = MASK_VALUE`, `l = 0`. With sinks, each row starts as if it had
    seen its query head's sink logit and nothing else: `m = s_h`, `l = exp(s_h - m) = 1`
    and no value, so the sink enters the denominator once and is rescaled with it (as
    JAX's splash attention starts its rows). A sink of -inf is exact too: the first
    block's `alpha = exp(-inf - m_new)` is 0.
    """
    m_ref, l_ref, acc_ref = stats
    if not cfg.sinks:
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        return
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
    g = cfg.group_size
    shape = (cfg.rows, STATS_LANES)
    # Row r is query head r % G of the group (padding rows past the item's tokens too;
    # they see nothing and give zeros whatever their sink).
    head_of_row = lax.rem(lax.broadcasted_iota(jnp.int32, shape, 0), g)

    def head(h, carry):
        first = (head_start + h) * g  # the group's first query head
        m = jnp.full(shape, sinks_ref[first], jnp.float32)
        for j in range(1, g):
            m = jnp.where(head_of_row == j, sinks_ref[first + j], m)
        m_ref[h] = m
        return carry

    lax.fori_loop(0, cfg.kv_heads_per_block, head, 0)


def _attend_block(
    cfg: KernelConfig, bufs, stats, slot, col_start, first_pos, num_rows, hi, *, masked
):
    """Online-softmax update of every head's (m, l, acc) with one block of pages.

    `masked=False` is the fast path for blocks every row sees in full (no causal,
    window or length boundary inside): no mask is built. `hi` is one past the item's
    last position; columns at or past it may be stale or poisoned, so in the masked
    path their values are removed with `where`, never by multiplying by zero. The
    widened scales are `f32[1, ppb, hb, ps]`, the block's heads.
    """
    q_ref, kvbuf, k_scales, v_scales = bufs
    d = kvbuf.shape[-1] // 2
    keys, values = kv_lanes(KEY, d), kv_lanes(VALUE, d)
    m_ref, l_ref, acc_ref = stats
    rows, n = cfg.rows, cfg.block_tokens
    mm = cfg.compute_dtype
    precision = lax.Precision.HIGHEST if mm == np.float32 else lax.Precision.DEFAULT
    dot = functools.partial(
        lax.dot_general, preferred_element_type=jnp.float32, precision=precision
    )
    if masked:
        vis = _visible(cfg, (rows, n), col_start, first_pos, num_rows)
        live_row = col_start + lax.broadcasted_iota(jnp.int32, (1, n), 1) < hi  # [1, N]
        live_col = col_start + lax.broadcasted_iota(jnp.int32, (n, 1), 0) < hi  # [N, 1]

    def head(h, carry):
        q = q_ref[h].astype(mm)  # [M, D]
        k = kvbuf[slot, :, h, :, keys].reshape(n, -1).astype(mm)  # [ppb, ps, D] -> [N, D]
        s = dot(q, k, (((1,), (1,)), ((), ())))  # [M, N] f32
        if cfg.quantized:  # dequantize through the logits: q . (k * s_j) = (q . k) * s_j
            s = s * (k_scales[0, :, h].reshape(1, n) * cfg.sm_scale)
        else:
            s = s * cfg.sm_scale
        if cfg.soft_cap is not None:
            s = cfg.soft_cap * jnp.tanh(s / cfg.soft_cap)
        if masked:
            s = jnp.where(vis, s, MASK_VALUE)
        m_prev = m_ref[h][:, :1]  # [M, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        if masked:
            p = jnp.where(vis, p, 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * l_ref[h][:, :1] + jnp.sum(p, axis=1, keepdims=True)
        v = kvbuf[slot, :, h, :, values].reshape(n, -1)  # [N, D]
        if cfg.quantized:
            v_scale = v_scales[0, :, h].reshape(1, n)  # [ppb, ps] -> [1, N]
            if masked:
                v_scale = jnp.where(live_row, v_scale, 0.0)
            p = p * v_scale
        if masked:
            v = jnp.where(live_col, v, jnp.zeros_like(v))
        pv = dot(p.astype(mm), v.astype(mm), (((1,), (0,)), ((), ())))  # [M, D]
        acc_ref[h] = alpha * acc_ref[h] + pv
        m_ref[h] = jnp.broadcast_to(m_new, (rows, STATS_LANES))
        l_ref[h] = jnp.broadcast_to(l_new, (rows, STATS_LANES))
        return carry

    lax.fori_loop(0, cfg.kv_heads_per_block, head, 0)


def ragged_paged_attention_kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,  # i32[S]
    block_tables_ref,  # i32[S * pages_per_seq], row-major
    cu_q_lens_ref,  # i32[S + 1]
    num_seqs_ref,  # i32[1]
    item_seq_ref,  # i32[NB]  sequence of each work item
    item_start_ref,  # i32[NB]  first query row of the item within its sequence's chunk
    item_rows_ref,  # i32[NB]  query rows of the item (0: padding item)
    # Inputs.
    q_ref,  # [hb, k, M, D] VMEM block of this step's k items
    kv_hbm,  # [P, Hkv, ps, 2 * D] HBM
    *refs,  # ([scales_hbm] bf16[P, Hkv, 2, L]), ([sinks] f32[Hq] SMEM), o_ref, scratch...
    cfg: KernelConfig,
) -> None:
    """Grid step `(core, kv head block, w)`: attention of k items' rows for `hb` heads.

    Writes `o_ref [hb, k, M, D]`: each item's query tile against the pages of its sequence
    from the first one its window can see to the one holding its last row, exact zeros
    for rows that see nothing (padding items and slots).
    """
    scales_hbm = sinks_ref = k_scales = v_scales = None
    if cfg.quantized:
        scales_hbm, *refs = refs
    if cfg.sinks:
        sinks_ref, *refs = refs
    o_ref, kvbuf, *refs = refs
    if cfg.quantized:
        sbuf, k_scales, v_scales, *refs = refs
    sems, slot_ref, m_ref, l_ref, acc_ref = refs
    ps, ppb, pps = cfg.page_size, cfg.pages_per_block, cfg.pages_per_seq
    hb = cfg.kv_heads_per_block
    # Grid step (core, head block, w): items `core_item(core, w * k + j)`. One core runs
    # its steps in order, head block by head block, so each item may start the next
    # one's copies.
    core, head_block, w = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_cores, num_head_blocks = pl.num_programs(0), pl.num_programs(1)
    per_core = pl.num_programs(2) * cfg.items_per_step  # items each core runs per head block

    def geometry(item):
        """(seq, rows, first position, one past the last, first page, end page, blocks)."""
        seq = item_seq_ref[item]
        num_rows = item_rows_ref[item]
        live = (num_rows > 0) & (seq < num_seqs_ref[0])
        q_len = cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq]
        first_pos = kv_lens_ref[seq] - q_len + item_start_ref[item]  # position of row 0
        hi = first_pos + num_rows  # one past the last row's position
        lo = first_pos - cfg.sliding_window + 1 if cfg.sliding_window is not None else 0
        # Truncating division: the operands of a live item are non-negative.
        first_page = lax.div(jnp.maximum(lo, 0), ps)
        end_page = pl.cdiv(hi, ps)
        num_blocks = jnp.where(live, pl.cdiv(end_page - first_page, ppb), 0)
        return seq, num_rows, first_pos, hi, first_page, end_page, num_blocks

    def for_each_page_copy(geo, head_start, block, slot, action):
        """Applies `action` to the copy of every stream of every page block `block` of
        the item of geometry `geo` needs, for the KV heads from `head_start`."""
        seq, _, _, _, first_page, end_page, _ = geo
        # (source, VMEM buffer) of each stream a page's heads are copied in: its K and
        # V, and their scales.
        streams = [(kv_hbm, kvbuf)]
        if cfg.quantized:
            streams.append((scales_hbm, sbuf))
        block_first = first_page + block * ppb
        num_pages = jnp.minimum(ppb, end_page - block_first)  # the last block may be short

        def one_page(i, carry):
            page = block_tables_ref[seq * pps + block_first + i]
            for stream, (src, dst) in enumerate(streams):
                copy = page_copy(
                    src,
                    dst,
                    sems.at[stream, slot],
                    page=page,
                    slot=slot,
                    index=i,
                    head_start=head_start,
                    heads=hb,
                )
                action(copy)
            return carry

        lax.fori_loop(0, num_pages, one_page, 0)

    head_start = head_block * hb

    def run_item(j, carry):
        """The step's `j`-th item: its query tile against its pages, into its output."""
        item_step = w * cfg.items_per_step + j  # this item's place in the core's order
        q_item, o_item = q_ref.at[:, j], o_ref.at[:, j]  # [hb, M, D] each
        geo = geometry(core_item(core, item_step, num_cores))
        _, num_rows, first_pos, hi, first_page, _, num_blocks = geo
        # The core's next item, whose first block this one starts during its last.
        step = head_block * per_core + item_step
        has_next = step + 1 < num_head_blocks * per_core
        next_w = jnp.where(item_step + 1 < per_core, item_step + 1, 0)
        next_head_block = jnp.where(item_step + 1 < per_core, head_block, head_block + 1)
        next_geo = geometry(jnp.where(has_next, core_item(core, next_w, num_cores), 0))
        prefetch_next = has_next & (next_geo[-1] > 0)

        def start(block, slot):
            for_each_page_copy(geo, head_start, block, slot, lambda copy: copy.start())

        def wait(block, slot):
            for_each_page_copy(geo, head_start, block, slot, lambda copy: copy.wait())

        def start_next(slot):
            head = next_head_block * hb
            for_each_page_copy(next_geo, head, 0, slot, lambda copy: copy.start())

        # Block b of this item is in slot (base + b) % 2. The core's first item starts its
        # own first block; every later one finds it started by the item before, in the
        # slot that item left in `slot_ref` (SMEM scratch persists across grid steps).
        @pl.when(step == 0)
        def _():
            slot_ref[0] = 0

            @pl.when(num_blocks > 0)
            def _():
                start(0, 0)

        base = slot_ref[0]

        @pl.when((num_blocks == 0) & prefetch_next)
        def _():  # nothing of its own to overlap: the next item's block goes into `base`
            start_next(base)

        bufs = (q_item, kvbuf, k_scales, v_scales)
        stats = (m_ref, l_ref, acc_ref)
        _start_softmax(cfg, sinks_ref, stats, head_start)

        def body(block, carry):
            slot = lax.rem(base + block, 2)

            @pl.when(block + 1 < num_blocks)
            def _():
                start(block + 1, 1 - slot)

            @pl.when((block + 1 == num_blocks) & prefetch_next)
            def _():  # the last block: the next item's first block, into the other slot
                start_next(1 - slot)

            wait(block, slot)
            if cfg.quantized:
                k_scales[0] = sbuf[slot, :, :, KEY, :ps].astype(jnp.float32)
                v_scales[0] = sbuf[slot, :, :, VALUE, :ps].astype(jnp.float32)
            col_start = (first_page + block * ppb) * ps
            # Every row sees every column: all columns at or before the first row's
            # position and, with a window, inside the last row's window.
            inside = col_start + cfg.block_tokens <= first_pos + 1
            if cfg.sliding_window is not None:
                inside &= col_start > hi - 1 - cfg.sliding_window
            args = (cfg, bufs, stats, slot, col_start, first_pos, num_rows, hi)
            lax.cond(
                inside,
                lambda: _attend_block(*args, masked=False),
                lambda: _attend_block(*args, masked=True),
            )
            return carry

        lax.fori_loop(0, num_blocks, body, 0)
        slot_ref[0] = lax.rem(base + num_blocks, 2)  # where the next item's first block is

        denom = l_ref[...][:, :, :1]  # [hb, M, 1]
        # Rows that saw nothing (padding) have denom 0, or a sink's share and acc 0: exact
        # zeros, never 0 / 0.
        out = jnp.where(denom > 0, acc_ref[...] / jnp.where(denom > 0, denom, 1.0), 0.0)
        o_item[...] = out.astype(o_item.dtype)
        return carry

    lax.fori_loop(0, cfg.items_per_step, run_item, 0)
