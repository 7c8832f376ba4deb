"""The one public entry point for ragged paged attention, over every backend."""

from __future__ import annotations

import importlib
from typing import Any, Literal

import jax

from .reference import ragged_paged_attention_reference
from .xla import ragged_paged_attention_scan

Backend = Literal["auto", "reference", "xla", "tpu", "gpu"]
BACKENDS = ("auto", "reference", "xla", "tpu", "gpu")

# Kernel modules load on first use, so the reference path never imports Pallas.
_KERNELS = {
    "tpu": ("paxkv.pallas_kernels.tpu.ragged_paged_attention", "ragged_paged_attention_tpu"),
    "gpu": ("paxkv.pallas_kernels.gpu.ragged_paged_attention", "ragged_paged_attention_gpu"),
}


def resolve_backend(backend: Backend, platform: str | None = None) -> str:
    """The concrete backend `backend` names on `platform` (default: JAX's default backend).

    "auto" is the TPU kernel on TPU, the GPU kernel on GPU, and the "xla" loop
    (`scan_attention`, which skips padding) elsewhere.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if backend != "auto":
        return backend
    platform = platform or jax.default_backend()
    return {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(platform, "xla")


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, Hkv, ps, D]
    v_pages: jax.Array,  # [P, Hkv, ps, D]
    kv_lens: jax.Array,  # i32[S]
    block_tables: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scales: jax.Array | None = None,  # f32[P, Hkv, ps]
    v_scales: jax.Array | None = None,  # f32[P, Hkv, ps]
    backend: Backend = "auto",
    interpret: Any = False,
    block_sizes: Any = None,
) -> jax.Array:  # [T, Hq, D]
    """Ragged paged attention on the chosen backend; semantics of the reference.

    Every backend computes exactly what `ragged_paged_attention_reference` documents.
    `backend="auto"` picks the platform's kernel (the "xla" loop on the CPU);
    "reference" is the oracle, "xla" a pure-JAX loop that skips padding, "tpu" and
    "gpu" force a kernel, and with `interpret=` (True, or `pltpu.InterpretParams()` for
    the TPU kernel) run it in the Pallas interpreter on any platform. `block_sizes` is
    the kernel's `BlockSizes` (None: its defaults); the reference takes none.
    """
    kwargs = dict(
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        k_scales=k_scales,
        v_scales=v_scales,
    )
    args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    name = resolve_backend(backend)
    if name == "reference":
        if block_sizes is not None:
            raise ValueError("block_sizes applies to the tpu and gpu kernels, not the reference")
        return ragged_paged_attention_reference(*args, **kwargs)
    if name == "xla":
        if block_sizes is not None:
            raise ValueError("block_sizes applies to the tpu and gpu kernels, not the xla loop")
        return ragged_paged_attention_scan(*args, **kwargs)
    module, fn = _KERNELS[name]
    kernel = getattr(importlib.import_module(module), fn)
    return kernel(*args, **kwargs, block_sizes=block_sizes, interpret=interpret)
