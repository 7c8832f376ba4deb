"""Input contract shared by every ragged paged attention backend.

`attention_inputs` validates a call's arguments and bundles them (`AttentionInputs`);
`attention_op` gives each backend the one public signature built on it, so the
signature and its validation exist once. `compute_dtype` is the kernels' dot dtype.

Shape vocabulary (used in every shape comment in the project):
  T   packed query tokens of one step (padded)      S   sequence slots (padded)
  P   physical pages in the cache                   ps  tokens per page (page_size)
  Hq  query heads        Hkv  KV heads              D   head dim
  pages_per_seq  width of the block table

Page layout: one layer's pages are one array `kv_pages [P, Hkv, ps, 2 * D]`: for KV
head h, token j of a page is one row, its key in lanes `0 .. D - 1` and its value in
lanes `D .. 2 D - 1` (see `paxkv.pallas_kernels.layout`). A page is one contiguous block holding K and V
of every KV head of the layer, so moving a page (or a run of its heads) between HBM
and on-chip memory is a single DMA, and the per-head slices `[ps, D]` are the tiles the
matrix unit consumes. Quantized pages carry per-token-per-head scales
`kv_scales bf16[P, Hkv, 2, L]` beside them: `[p, h, KEY, j]` is token j's key scale,
`[p, h, VALUE, j]` its value scale, and lanes `j >= ps` (L >= ps; on TPU ps rounded up
to 128, see `layout.scale_lanes`) are padding, never read.

Attention sinks (gpt-oss): an optional learned logit per query head, `sinks f32[Hq]`,
that joins every softmax denominator and contributes no value (see the reference's
docstring). None (the default) is no sink, and compiles to exactly the kernels without
one: every backend branches on it in Python, at trace time.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .layout import (
    FLOAT_PAGE_DTYPES,
    MAX_PAGE_SIZE,
    MIN_PAGE_SIZE,
    QUANTIZED_PAGE_DTYPES,
    SCALE_DTYPE,
    cdiv,
    is_quantized,
)


@dataclasses.dataclass(frozen=True)
class AttentionShapes:
    """Static sizes of one ragged paged attention call, read off its inputs."""

    num_tokens: int  # T
    num_q_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    num_pages: int  # P
    page_size: int  # ps
    max_num_seqs: int  # S
    pages_per_seq: int
    quantized: bool
    scale_lanes: int = 0  # L of kv_scales [P, Hkv, 2, L] (>= ps); 0 for float pages

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA, Hq for MQA)."""
        return self.num_q_heads // self.num_kv_heads


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """One validated ragged paged attention call: its arrays and its static parameters.

    A pytree: the arrays are its leaves, and `sm_scale`, `soft_cap`, `sliding_window` and
    `shapes` are static, so a backend's jitted body takes the bundle as one argument and
    recompiles when a static field changes. Made by `attention_inputs`, which validates.
    """

    q: jax.Array  # [T, Hq, D]
    kv_pages: jax.Array  # [P, Hkv, ps, 2 * D]: each token's key, then its value
    kv_lens: jax.Array  # i32[S]
    block_tables: jax.Array  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array  # i32[S + 1]
    num_seqs: jax.Array  # i32[1]
    kv_scales: jax.Array | None  # bf16[P, Hkv, 2, L], quantized pages only
    sinks: jax.Array | None  # f32[Hq], attention sinks; None: no sink
    sm_scale: float = dataclasses.field(metadata=dict(static=True))
    soft_cap: float | None = dataclasses.field(metadata=dict(static=True))
    sliding_window: int | None = dataclasses.field(metadata=dict(static=True))
    shapes: AttentionShapes = dataclasses.field(metadata=dict(static=True))

    @property
    def scales(self) -> tuple[jax.Array, ...]:
        """`(kv_scales,)` for quantized pages, `()` for float pages."""
        return (self.kv_scales,) if self.shapes.quantized else ()


def compute_dtype(q_dtype, page_dtype) -> np.dtype:
    """The operand dtype of the kernels' dots; they always accumulate in float32.

    Quantized (8-bit) pages meet a 16-bit query in its own dtype (their values convert
    exactly) and a float32 query in bfloat16: rounding q to bfloat16 (8 significant
    bits) adds less error than the pages' own quantization (int8 keeps a step of
    amax / 127, e4m3 four significant bits), and keeps the dots on the tensor cores and
    the MXU instead of float32 FMA loops. Float pages of the query's dtype meet it in
    that dtype; any other mix (float32 pages under a 16-bit query, or two different
    16-bit dtypes) goes through float32.
    """
    q_dtype, page_dtype = np.dtype(q_dtype), np.dtype(page_dtype)
    if is_quantized(page_dtype):
        return q_dtype if q_dtype.itemsize == 2 else np.dtype(ml_dtypes.bfloat16)
    if page_dtype == q_dtype:
        return q_dtype
    return np.dtype(np.float32)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def attention_inputs(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [P, Hkv, ps, 2 * D]
    kv_lens: jax.Array,  # i32[S]
    block_tables: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    kv_scales: jax.Array | None = None,  # bf16[P, Hkv, 2, L], L >= ps
    sinks: jax.Array | None = None,  # [Hq] float, any float dtype; used as f32
) -> AttentionInputs:
    """Validates the arguments of a ragged paged attention call and bundles them.

    These are the arguments of every backend (their meaning is the docstring of
    `ragged_paged_attention_reference`). Shape and dtype problems raise `ValueError` at
    trace time, naming the argument and showing the values. When the length arrays are
    concrete (an eager call, not under a user's `jit`), their values are checked too:
    lengths in range, `cu_q_lens` non-decreasing, every live sequence's
    `q_len <= kv_len`, and a block table wide enough for every `kv_len`.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got q.shape={q.shape}")
    if kv_pages.ndim != 4:
        raise ValueError(
            f"kv_pages must be [P, Hkv, page_size, 2 * D] (each token's key, then its "
            f"value), got kv_pages.shape={kv_pages.shape}"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, page_size, kv_lanes = kv_pages.shape
    if kv_lanes != 2 * head_dim:
        raise ValueError(
            f"head_dim mismatch: q has D={head_dim}, so kv_pages.shape[3]={kv_lanes} must be "
            f"2 * D={2 * head_dim} (a key and a value per row)"
        )
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads={num_q_heads} (q.shape[1]) must be a multiple of "
            f"num_kv_heads={num_kv_heads} (kv_pages.shape[1])"
        )
    if not (MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE) or page_size & (page_size - 1):
        raise ValueError(
            f"page_size={page_size} (kv_pages.shape[2]) must be a power of two in "
            f"[{MIN_PAGE_SIZE}, {MAX_PAGE_SIZE}]"
        )
    if jnp.dtype(q.dtype) not in FLOAT_PAGE_DTYPES:
        raise ValueError(f"q.dtype={q.dtype} must be one of {[str(d) for d in FLOAT_PAGE_DTYPES]}")
    page_dtype = jnp.dtype(kv_pages.dtype)
    quantized = page_dtype in QUANTIZED_PAGE_DTYPES
    if not quantized and page_dtype not in FLOAT_PAGE_DTYPES:
        raise ValueError(
            f"kv_pages.dtype={page_dtype} must be a float dtype "
            f"{[str(d) for d in FLOAT_PAGE_DTYPES]} or a quantized dtype "
            f"{[str(d) for d in QUANTIZED_PAGE_DTYPES]}"
        )
    if quantized:
        if kv_scales is None:
            raise ValueError(f"kv_pages.dtype={page_dtype} is quantized, so kv_scales is required")
        expected = (num_pages, num_kv_heads, 2)
        if kv_scales.ndim != 4 or kv_scales.shape[:3] != expected or kv_scales.shape[3] < page_size:
            raise ValueError(
                f"kv_scales.shape={kv_scales.shape} must be [P, Hkv, 2, L]=({num_pages}, "
                f"{num_kv_heads}, 2, L) with L >= page_size={page_size}"
            )
        if kv_scales.dtype != SCALE_DTYPE:
            raise ValueError(f"kv_scales.dtype={kv_scales.dtype} must be {SCALE_DTYPE}")
    elif kv_scales is not None:
        raise ValueError(f"kv_scales was given but kv_pages.dtype={page_dtype} is not quantized")

    if kv_lens.ndim != 1:
        raise ValueError(f"kv_lens must be i32[S], got kv_lens.shape={kv_lens.shape}")
    max_num_seqs = kv_lens.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != max_num_seqs:
        raise ValueError(
            f"block_tables.shape={block_tables.shape} must be [S, pages_per_seq] with S={max_num_seqs} "
            f"(kv_lens.shape[0])"
        )
    if cu_q_lens.shape != (max_num_seqs + 1,):
        raise ValueError(f"cu_q_lens.shape={cu_q_lens.shape} must be [S + 1]=({max_num_seqs + 1},)")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs.shape={num_seqs.shape} must be (1,)")
    for name, arr in (
        ("kv_lens", kv_lens),
        ("block_tables", block_tables),
        ("cu_q_lens", cu_q_lens),
        ("num_seqs", num_seqs),
    ):
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name}.dtype={arr.dtype} must be int32")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive int or None")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap={soft_cap!r} must be a positive float or None")
    if sinks is not None:
        if jnp.ndim(sinks) != 1 or jnp.shape(sinks)[0] != num_q_heads:
            raise ValueError(
                f"sinks.shape={jnp.shape(sinks)} must be [Hq]=({num_q_heads},): one logit per "
                f"query head"
            )
        if not jnp.issubdtype(jnp.result_type(sinks), jnp.floating):
            raise ValueError(f"sinks.dtype={jnp.result_type(sinks)} must be a float dtype")
        sinks = jnp.asarray(sinks, jnp.float32)

    shapes = AttentionShapes(
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_pages=num_pages,
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        pages_per_seq=block_tables.shape[1],
        quantized=quantized,
        scale_lanes=kv_scales.shape[3] if quantized else 0,
    )
    if all(_is_concrete(a) for a in (kv_lens, block_tables, cu_q_lens, num_seqs)):
        _check_lengths(
            shapes,
            np.asarray(kv_lens),
            np.asarray(block_tables),
            np.asarray(cu_q_lens),
            int(np.asarray(num_seqs)[0]),
        )
    return AttentionInputs(
        q,
        kv_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        kv_scales,
        sinks,
        sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=sliding_window,
        shapes=shapes,
    )


def attention_op(impl: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """Makes a backend that consumes `AttentionInputs` into a ragged paged attention op.

    `impl(inputs, *, <tunables>)` becomes `op(q, kv_pages, kv_lens, block_tables, cu_q_lens,
    num_seqs, *, sm_scale, soft_cap=None, sliding_window=None, kv_scales=None,
    sinks=None, <tunables>)`: the arguments of `attention_inputs`, then impl's own
    keyword-only tunables. The op validates them with `attention_inputs` and calls impl
    with the bundle, so the signature and its validation exist once for every backend.
    `op.impl` is impl itself, for a caller that holds a validated bundle already.
    """
    contract = inspect.signature(attention_inputs)
    own = list(inspect.signature(impl).parameters.values())[1:]
    names = {p.name for p in own}
    if any(p.kind is not inspect.Parameter.KEYWORD_ONLY for p in own) or names & set(
        contract.parameters
    ):
        raise TypeError(
            f"{impl.__name__} must take (inputs, *, <tunables>), with tunables that are not "
            f"arguments of attention_inputs"
        )
    signature = contract.replace(
        parameters=[*contract.parameters.values(), *own],
        return_annotation=inspect.signature(impl).return_annotation,
    )

    @functools.wraps(impl)
    def op(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments  # TypeError for a bad name
        tunables = {name: arguments.pop(name) for name in names if name in arguments}
        return impl(attention_inputs(**arguments), **tunables)

    op.__signature__ = signature
    op.impl = impl
    return op


def _check_lengths(
    shapes: AttentionShapes, kv_lens, block_tables, cu_q_lens, num_seqs: int
) -> None:
    if not 0 <= num_seqs <= shapes.max_num_seqs:
        raise ValueError(f"num_seqs={num_seqs} must be in [0, S={shapes.max_num_seqs}]")
    cu = cu_q_lens[: num_seqs + 1]
    if cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError(
            f"cu_q_lens[:num_seqs + 1]={cu.tolist()} must start at 0 and be non-decreasing"
        )
    if cu[-1] > shapes.num_tokens:
        raise ValueError(
            f"cu_q_lens[num_seqs]={cu[-1]} exceeds the number of query rows T={shapes.num_tokens}"
        )
    lens = kv_lens[:num_seqs]
    q_lens = np.diff(cu)
    if np.any(lens < q_lens):
        s = int(np.argmax(lens < q_lens))
        raise ValueError(f"sequence {s}: kv_len={lens[s]} is smaller than its q_len={q_lens[s]}")
    capacity = shapes.pages_per_seq * shapes.page_size
    if np.any(lens > capacity):
        s = int(np.argmax(lens > capacity))
        raise ValueError(
            f"block_tables too narrow: sequence {s} has kv_len={lens[s]} but pages_per_seq="
            f"{shapes.pages_per_seq} x page_size={shapes.page_size} holds only {capacity} tokens"
        )
    needed = cdiv(lens, shapes.page_size)
    for s in range(num_seqs):
        pages = block_tables[s, : needed[s]]
        if np.any((pages < 0) | (pages >= shapes.num_pages)):
            raise ValueError(
                f"block_tables[{s}, :{needed[s]}]={pages.tolist()} names a page outside [0, P={shapes.num_pages})"
            )


def token_layout(
    cu_q_lens: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    num_seqs: jax.Array,  # i32[1]
    num_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Maps each packed query row to `(seq_id i32[T], position i32[T], valid bool[T])`.

    Row t belongs to the sequence s with `cu_q_lens[s] <= t < cu_q_lens[s + 1]`, and sits
    at absolute position `kv_lens[s] - q_len[s] + (t - cu_q_lens[s])`. Rows at or past
    `cu_q_lens[num_seqs]` are padding (`valid=False`, seq_id and position 0).
    """
    max_num_seqs = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    n = num_seqs[0]
    # Ends of live sequences; padding sequences' ends are pushed past every row.
    live = jnp.arange(max_num_seqs) < n
    ends = jnp.where(live, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    seq = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)
    valid = t < cu_q_lens[n]
    seq = jnp.where(valid, jnp.minimum(seq, max_num_seqs - 1), 0)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, jnp.where(valid, pos, 0), valid
