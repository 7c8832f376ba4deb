"""Random ragged paged-attention batches and an independent float64 oracle.

`make_case` lays a ragged batch out in a paged cache the way the host pool would
(scattered, non-contiguous pages), and poisons everything a correct implementation
must not read: unused pages, the unused tail of each sequence's last page, the null
page, padding block-table entries and padding query rows. `naive_attention` is a
per-sequence, per-token, per-head NumPy float64 loop that shares no code with the
library; it applies the case's attention sinks, when it has them, as gpt-oss defines
them: one more logit per head in the softmax, with no value.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from paxkv.pallas_kernels.contract import compute_dtype

# Relative tolerances keyed by the dtype of the output.
TOLERANCES = {np.dtype(np.float32): 1e-5, np.dtype(ml_dtypes.bfloat16): 2e-2}


def tolerance(q_dtype, page_dtype, table=TOLERANCES) -> float:
    """A kernel's relative tolerance: that of its output dtype, or of its dots' operand
    dtype (`compute_dtype`: bfloat16 for quantized pages under float32 queries) when
    that is coarser."""
    return max(table[np.dtype(q_dtype)], table[np.dtype(compute_dtype(q_dtype, page_dtype))])


@dataclasses.dataclass
class Case:
    q: np.ndarray  # [T, Hq, D]
    kv_pages: np.ndarray  # [P, Hkv, ps, 2 * D]: each token's key, then its value
    kv_lens: np.ndarray  # i32[S]
    block_tables: np.ndarray  # i32[S, pages_per_seq]
    cu_q_lens: np.ndarray  # i32[S + 1]
    num_seqs: np.ndarray  # i32[1]
    kv_scales: np.ndarray | None  # bf16[P, Hkv, 2, L]: [.., 0, j] key scale, [.., 1, j] value
    sm_scale: float
    sinks: np.ndarray | None = None  # f32[Hq]: attention sink logits

    def args(self):
        """Positional arguments of the attention call, as jax arrays."""
        return tuple(
            jnp.asarray(a)
            for a in (
                self.q,
                self.kv_pages,
                self.kv_lens,
                self.block_tables,
                self.cu_q_lens,
                self.num_seqs,
            )
        )

    @property
    def page_size(self) -> int:
        return self.kv_pages.shape[2]

    def array_kwargs(self):
        """The call's optional array arguments: `kv_scales` and `sinks`, where the case has them."""
        kwargs = {}
        if self.kv_scales is not None:
            kwargs["kv_scales"] = jnp.asarray(self.kv_scales)
        if self.sinks is not None:
            kwargs["sinks"] = jnp.asarray(self.sinks)
        return kwargs


def _quantize_np(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    dtype = np.dtype(dtype)
    qmax = 127.0 if dtype == np.int8 else float(ml_dtypes.finfo(dtype).max)
    amax = np.abs(x).max(axis=-1)
    # Rounded to the stored scale dtype before dividing, as the KV write does.
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(ml_dtypes.bfloat16)
    y = np.clip(x / scale[..., None].astype(np.float32), -qmax, qmax)
    if dtype == np.int8:
        y = np.round(y)
    return y.astype(dtype), scale


def make_case(
    seed: int,
    *,
    q_lens,
    kv_lens,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype=np.float32,
    page_dtype=None,
    extra_pages: int = 3,
    pad_seqs: int = 1,
    pad_tokens: int = 3,
    pad_pages_per_seq: int = 1,
    sinks: bool = False,
) -> Case:
    """A ragged batch: live sequence s has `q_lens[s]` new tokens and `kv_lens[s]` in cache.

    With `sinks`, a sink logit per query head, drawn from [-2, 6) (from a weight below
    every key's to one that takes most of the softmax); with 4 heads or more, the last
    one is -inf (no sink).
    """
    rng = np.random.default_rng(seed)
    q_lens = np.asarray(q_lens, np.int32)
    kv_lens = np.asarray(kv_lens, np.int32)
    assert np.all(q_lens <= kv_lens)
    dtype = np.dtype(dtype)
    page_dtype = np.dtype(page_dtype or dtype)
    quantized = page_dtype in (
        np.dtype(np.int8),
        np.dtype(ml_dtypes.float8_e4m3fn),
        np.dtype(ml_dtypes.float8_e5m2),
    )
    n = len(kv_lens)
    pages_needed = -(-kv_lens // page_size)
    pages_per_seq = int(max(1, pages_needed.max(initial=0))) + pad_pages_per_seq
    num_pages = 1 + int(pages_needed.sum()) + extra_pages
    max_num_seqs = n + pad_seqs

    # Scattered physical pages, like a pool after some churn; page 0 is the null page.
    perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    unused = perm[pages_needed.sum() :]
    poison_pages = np.concatenate([[0], unused]).astype(np.int32)
    block_tables = rng.choice(poison_pages, size=(max_num_seqs, pages_per_seq)).astype(np.int32)
    live = np.zeros((num_pages, page_size), bool)  # slots a correct kernel may read
    start = 0
    for s in range(n):
        pages = perm[start : start + pages_needed[s]]
        start += pages_needed[s]
        block_tables[s, : pages_needed[s]] = pages
        for j in range(kv_lens[s]):
            live[pages[j // page_size], j % page_size] = True

    shape = (num_pages, num_kv_heads, page_size, head_dim)
    k = rng.standard_normal(shape, np.float32)
    v = rng.standard_normal(shape, np.float32)
    dead = ~live[:, None, :, None]
    if quantized:
        (k, k_scales), (v, v_scales) = _quantize_np(k, page_dtype), _quantize_np(v, page_dtype)
        kv_scales = np.stack([k_scales, v_scales], axis=2)  # [P, Hkv, 2, ps]: key, value
        kv_scales[~np.broadcast_to(live[:, None, None], kv_scales.shape)] = np.nan
        # Lanes past ps, padded to 128 (none from page size 128 up) and poisoned: every
        # backend takes scales of any L >= ps and reads none of them.
        pad = -page_size % 128
        kv_scales = np.pad(kv_scales, [(0, 0)] * 3 + [(0, pad)], constant_values=np.nan)
    else:
        kv_scales = None
    kv = np.concatenate([k, v], axis=3)  # each token's row: its key, then its value
    if page_dtype != np.int8:  # float pages (and float8) can hold NaN themselves
        kv = np.where(dead, np.nan, kv.astype(np.float32))
    kv = kv.astype(page_dtype)

    total_q = int(q_lens.sum())
    cu_q_lens = np.full(max_num_seqs + 1, total_q, np.int32)
    cu_q_lens[: n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    q = rng.standard_normal((total_q + pad_tokens, num_q_heads, head_dim), np.float32)
    q[total_q:] = np.nan
    kv_lens_padded = np.zeros(max_num_seqs, np.int32)
    kv_lens_padded[:n] = kv_lens
    kv_lens_padded[n:] = rng.integers(0, pages_per_seq * page_size + 1, size=pad_seqs)
    sink_logits = None
    if sinks:  # drawn last, so a case's other arrays are the same with or without sinks
        sink_logits = rng.uniform(-2.0, 6.0, num_q_heads).astype(np.float32)
        if num_q_heads >= 4:
            sink_logits[-1] = -np.inf
    return Case(
        q=q.astype(dtype),
        kv_pages=kv,
        kv_lens=kv_lens_padded,
        block_tables=block_tables,
        cu_q_lens=cu_q_lens,
        num_seqs=np.array([n], np.int32),
        kv_scales=kv_scales,
        sm_scale=1.0 / float(np.sqrt(head_dim)),
        sinks=sink_logits,
    )


def naive_attention(case: Case, *, soft_cap=None, sliding_window=None) -> np.ndarray:
    """Float64 loop over sequences, query tokens and heads. Returns `[T, Hq, D]` float64.

    With `case.sinks`, head h's sink logit `s_h` is one more term of the softmax's
    denominator (not scaled, not soft-capped) that weights no value.
    """
    q = case.q.astype(np.float64)
    num_tokens, num_q_heads, head_dim = q.shape
    page_size = case.page_size
    group = num_q_heads // case.kv_pages.shape[1]
    out = np.zeros((num_tokens, num_q_heads, head_dim))
    for s in range(int(case.num_seqs[0])):
        q_start, q_end = int(case.cu_q_lens[s]), int(case.cu_q_lens[s + 1])
        q_len, kv_len = q_end - q_start, int(case.kv_lens[s])

        def gather(part, s=s, kv_len=kv_len):  # 0: K, 1: V; float64 [kv_len, Hkv, D]
            rows = []
            for j in range(kv_len):
                page = case.block_tables[s, j // page_size]
                lanes = slice(part * head_dim, (part + 1) * head_dim)  # key, then value
                x = case.kv_pages[page, :, j % page_size, lanes].astype(np.float64)
                if case.kv_scales is not None:
                    scale = case.kv_scales[page, :, part, j % page_size]  # [Hkv]
                    x = x * scale.astype(np.float64)[:, None]
                rows.append(x)
            return np.stack(rows) if rows else np.zeros((0, num_q_heads // group, head_dim))

        keys, vals = gather(0), gather(1)
        for i in range(q_len):
            pos = kv_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(num_q_heads):
                kh = h // group
                logits = case.sm_scale * (keys[lo : pos + 1, kh] @ q[q_start + i, h])
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                top, sink_weight = logits.max(), 0.0
                if case.sinks is not None:
                    sink = float(case.sinks[h])
                    top = max(top, sink)
                    sink_weight = np.exp(sink - top)
                w = np.exp(logits - top)
                out[q_start + i, h] = (w @ vals[lo : pos + 1, kh]) / (w.sum() + sink_weight)
    return out


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """One configuration of the shared test grid (reference and every kernel)."""

    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "float32"
    page_dtype: str | None = None
    soft_cap: float | None = None
    sliding_window: int | None = None
    sinks: bool = False

    def case(self, seed: int = 0) -> Case:
        return make_case(
            seed,
            q_lens=self.q_lens,
            kv_lens=self.kv_lens,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            page_size=self.page_size,
            dtype=np.dtype(self.dtype),
            page_dtype=None if self.page_dtype is None else np.dtype(self.page_dtype),
            sinks=self.sinks,
        )

    def attention_kwargs(self, case: Case) -> dict:
        return dict(
            sm_scale=case.sm_scale,
            soft_cap=self.soft_cap,
            sliding_window=self.sliding_window,
            **case.array_kwargs(),
        )


def _decode(ps):  # kv_len 1, a page boundary +-1, and a few pages
    return (1, 1, 1, 1, 1), (1, ps - 1, ps, ps + 1, 3 * ps + 5)


def _prefill(ps):
    lens = (1, ps, ps + 1, 2 * ps - 1, 3 * ps + 2)
    return lens, lens


def _mixed(ps):  # decode, an empty sequence, prefills and prefill chunks
    return (1, 0, 5, 1, ps + 1, 3), (ps + 1, 0, 5, 1, 3 * ps, 2 * ps + 7)


def _long(ps):  # long decode and a chunked-prefill chunk at the end of a long context
    return (1, 1, 24), (2048, 2100 + ps // 2, 2048 + 24)


def _grid() -> list[GridPoint]:
    g = []

    def add(name, lens, hq, hkv, d, ps, **kw):
        q_lens, kv_lens = lens(ps)
        g.append(GridPoint(name, q_lens, kv_lens, hq, hkv, d, ps, **kw))

    add("decode-mha-d64-p16", _decode, 4, 4, 64, 16)
    add("decode-mqa-d128-p8-softcap", _decode, 8, 1, 128, 8, soft_cap=30.0)
    add("decode-gqa2-d64-p32-int8-softcap", _decode, 4, 2, 64, 32, page_dtype="int8", soft_cap=20.0)
    add("prefill-gqa2-d64-p32-window", _prefill, 4, 2, 64, 32, sliding_window=7)
    add(
        "prefill-mha-d128-p8-fp8-softcap",
        _prefill,
        2,
        2,
        128,
        8,
        page_dtype="float8_e4m3fn",
        soft_cap=10.0,
    )
    add("prefill-mqa-d64-p16-window1", _prefill, 4, 1, 64, 16, sliding_window=1)
    add(
        "mixed-gqa8-d128-p16-softcap-window",
        _mixed,
        16,
        2,
        128,
        16,
        soft_cap=25.0,
        sliding_window=20,
    )
    add("mixed-gqa2-d64-p8-int8", _mixed, 4, 2, 64, 8, page_dtype="int8")
    add(
        "mixed-gqa8-d64-p16-fp8-window",
        _mixed,
        8,
        1,
        64,
        16,
        page_dtype="float8_e4m3fn",
        sliding_window=9,
    )
    add("mixed-gqa4-d128-p16-bf16", _mixed, 8, 2, 128, 16, dtype="bfloat16")
    add("long-gqa2-d64-p32", _long, 4, 2, 64, 32)
    add(
        "long-mqa-d128-p16-int8-window", _long, 4, 1, 128, 16, page_dtype="int8", sliding_window=300
    )
    # Attention sinks (gpt-oss: GQA 8, head_dim 64, windowed and full layers), alone and
    # with every other option.
    add("decode-gqa8-d64-p16-sinks", _decode, 8, 1, 64, 16, sinks=True)
    add("prefill-gqa4-d64-p16-sinks-window", _prefill, 8, 2, 64, 16, sliding_window=13, sinks=True)
    add(
        "mixed-gqa2-d128-p8-int8-softcap-window-sinks",
        _mixed,
        4,
        2,
        128,
        8,
        page_dtype="int8",
        soft_cap=20.0,
        sliding_window=9,
        sinks=True,
    )
    add("mixed-gqa4-d64-p16-bf16-sinks", _mixed, 8, 2, 64, 16, dtype="bfloat16", sinks=True)
    add("long-gqa4-d64-p32-sinks-window", _long, 8, 2, 64, 32, sliding_window=128, sinks=True)
    return g


GRID = _grid()
