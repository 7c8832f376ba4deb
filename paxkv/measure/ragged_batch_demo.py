"""The CPU demo: a ragged batch in a paged cache, attention over it, and the memory it saves.

`run_demo` draws ShareGPT-like prompt lengths, gives each sequence exactly the pages
its tokens need from the host page pool, writes the prompts' K/V through the
functional write, runs one decode step of ragged paged attention (the platform's
kernel; the "xla" loop on the CPU), checks it against dense attention over contiguous
K/V, and measures the KV memory used against contiguous max-length allocation;
`format_result` says it in words and a table. The app is `paxkv.launch.demo`.

    result = run_demo(num_seqs=32, max_model_len=4096, page_size=16)
    text = format_result(result, max_model_len=4096, page_size=16)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paxkv.host.page_pool import PagePool
from paxkv.kv_cache import PagedKVCache
from paxkv.measure.page_tables import page_table_from_host
from paxkv.pallas_kernels.dispatch import ragged_paged_attention, resolve_backend
from paxkv.pallas_kernels.layout import cdiv, page_bytes
from paxkv.planner.workloads import DEMO_PROMPT_LENS


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """What the demo measured: the batch's lengths, its KV bytes both ways, and the error."""

    kv_lens: list[int]
    pages_used: int
    paged_bytes: int
    contiguous_bytes: int
    tokens_stored: int
    max_abs_error: float
    backend: str

    @property
    def saving(self) -> float:
        """Contiguous over paged KV bytes: how many times less memory paging uses."""
        return self.contiguous_bytes / self.paged_bytes


def run_demo(
    *,
    num_seqs: int = 32,
    max_model_len: int = 4096,
    page_size: int = 16,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    seed: int = 0,
    backend: str = "auto",
) -> DemoResult:
    """Builds the paged batch, runs one decode step, and measures memory and error.

    `backend` is a name of `paxkv.pallas_kernels.dispatch.BACKENDS`; ValueError, before any work,
    for "tpu" or "gpu" on a platform without that device.
    """
    platform = jax.default_backend()
    if backend in ("tpu", "gpu") and backend != resolve_backend("auto", platform):
        raise ValueError(
            f"backend={backend!r} needs a {backend.upper()}; this platform is {platform!r} "
            f"(auto runs {resolve_backend('auto', platform)!r} here)"
        )
    rng = np.random.default_rng(seed)
    # max_model_len - 1 so that the decode token still fits.
    prompt_dist = dataclasses.replace(DEMO_PROMPT_LENS, hi=max_model_len - 1)
    prompt_lens = prompt_dist.sample(rng, num_seqs)
    kv_lens = prompt_lens + 1
    pages_per_seq = cdiv(max_model_len, page_size)
    needed = cdiv(kv_lens, page_size)
    pool = PagePool(int(needed.sum()) + 1)
    pages = [pool.allocate(int(n)) for n in needed]
    pool.check_invariants()

    cache = PagedKVCache.create(
        num_layers=1,
        num_pages=pool.num_pages,
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        head_dim=head_dim,
        dtype=jnp.float32,
    )
    k_all = rng.standard_normal((int(kv_lens.sum()), num_kv_heads, head_dim), np.float32)
    v_all = rng.standard_normal(k_all.shape, np.float32)
    q = jnp.asarray(rng.standard_normal((num_seqs, num_q_heads, head_dim)), jnp.float32)
    starts = np.concatenate([[0], np.cumsum(kv_lens)])
    write = jax.jit(lambda c, k, v, t: c.write(0, k, v, t), donate_argnums=0)
    # Prefill every prompt, then write each sequence's decode token.
    prompt_rows = np.concatenate(
        [np.arange(starts[s], starts[s] + prompt_lens[s]) for s in range(num_seqs)]
    )
    table = page_table_from_host(
        pages,
        prompt_lens.tolist(),
        prompt_lens.tolist(),
        page_size=page_size,
        max_num_seqs=num_seqs,
        pages_per_seq=pages_per_seq,
    )
    cache = write(cache, jnp.asarray(k_all[prompt_rows]), jnp.asarray(v_all[prompt_rows]), table)
    table = page_table_from_host(
        pages,
        kv_lens.tolist(),
        [1] * num_seqs,
        page_size=page_size,
        max_num_seqs=num_seqs,
        pages_per_seq=pages_per_seq,
    )
    last = starts[1:] - 1
    cache = write(cache, jnp.asarray(k_all[last]), jnp.asarray(v_all[last]), table)

    sm_scale = 1.0 / float(np.sqrt(head_dim))
    out = ragged_paged_attention(
        q, **cache.layer(0), **table.kernel_kwargs(), sm_scale=sm_scale, backend=backend
    )

    # Dense attention over each sequence's contiguous K/V.
    group = num_q_heads // num_kv_heads
    err = 0.0
    for s in range(num_seqs):
        k = np.repeat(k_all[starts[s] : starts[s + 1]], group, axis=1).astype(np.float64)
        v = np.repeat(v_all[starts[s] : starts[s + 1]], group, axis=1).astype(np.float64)
        logits = np.einsum("hd,lhd->hl", np.asarray(q[s], np.float64), k) * sm_scale
        w = np.exp(logits - logits.max(-1, keepdims=True))
        dense = np.einsum("hl,lhd->hd", w / w.sum(-1, keepdims=True), v)
        err = max(err, float(np.abs(np.asarray(out[s]) - dense).max()))

    per_page = page_bytes(
        num_kv_heads=num_kv_heads, page_size=page_size, head_dim=head_dim, page_dtype=jnp.float32
    )
    per_token = per_page // page_size
    return DemoResult(
        kv_lens=kv_lens.tolist(),
        pages_used=pool.num_in_use,
        paged_bytes=pool.num_in_use * per_page,
        contiguous_bytes=num_seqs * max_model_len * per_token,
        tokens_stored=int(kv_lens.sum()),
        max_abs_error=err,
        backend=resolve_backend(backend),
    )


def format_result(r: DemoResult, *, max_model_len: int, page_size: int) -> str:
    """The demo's report: the batch, the error against dense attention, and the memory table."""
    mib = lambda b: b / 2**20
    lens = np.asarray(r.kv_lens)
    return "\n".join(
        [
            f"ragged batch: {len(lens)} sequences, kv lengths min {lens.min()} / median {int(np.median(lens))} "
            f"/ max {lens.max()} (max_model_len {max_model_len}, page_size {page_size})",
            f"decode step of ragged paged attention on '{r.backend}': max |error| vs dense attention "
            f"{r.max_abs_error:.2e}",
            "",
            "| allocation | KV memory (MiB) | token slots | slots used |",
            "|---|---:|---:|---:|",
            f"| contiguous, max_model_len per sequence | {mib(r.contiguous_bytes):.2f} | "
            f"{len(lens) * max_model_len} | {r.tokens_stored / (len(lens) * max_model_len):.1%} |",
            f"| paged ({r.pages_used} pages) | {mib(r.paged_bytes):.2f} | {r.pages_used * page_size} | "
            f"{r.tokens_stored / (r.pages_used * page_size):.1%} |",
            "",
            f"paging uses {r.saving:.1f}x less KV memory for this batch: in the same memory, "
            f"contiguous allocation holds {len(lens)} such sequences and paging about "
            f"{int(len(lens) * r.saving)}.",
        ]
    )
