"""The one public entry point for ragged paged attention, over every backend."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Literal

import jax

from .contract import AttentionInputs, attention_op
from .reference import ragged_paged_attention_reference
from .xla import ragged_paged_attention_xla

Backend = Literal["auto", "reference", "xla", "tpu", "gpu"]
BACKENDS = ("auto", "reference", "xla", "tpu", "gpu")
# `backend + DETERMINISTIC` (e.g. "auto+deterministic") is `backend` with
# `deterministic=True`: the form a caller that passes only a backend name (a model's
# `attention_backend`) can ask for it in.
DETERMINISTIC = "+deterministic"

# Kernel modules load on first use, so the reference path never imports Pallas.
_KERNELS = {
    "tpu": (".tpu.ragged_paged_attention", "ragged_paged_attention_tpu"),
    "gpu": (".gpu.ragged_paged_attention", "ragged_paged_attention_gpu"),
}


def resolve_backend(backend: Backend, platform: str | None = None) -> str:
    """The concrete backend `backend` names on `platform` (default: JAX's default backend).

    "auto" is the TPU kernel on TPU, the GPU kernel on GPU, and the "xla" loop
    (`ragged_paged_attention_xla`, which skips padding) elsewhere.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if backend != "auto":
        return backend
    platform = platform or jax.default_backend()
    return {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(platform, "xla")


@attention_op
def ragged_paged_attention(
    inputs: AttentionInputs,
    *,
    backend: Backend = "auto",
    interpret: Any = False,
    block_sizes: Any = None,
    decode_only: bool = False,
    deterministic: bool = False,
) -> jax.Array:  # [T, Hq, D]
    """Ragged paged attention on the chosen backend; semantics of the reference.

    Called as `ragged_paged_attention(q, kv_pages, kv_lens, block_tables, cu_q_lens,
    num_seqs, *, sm_scale, soft_cap=None, sliding_window=None, kv_scales=None,
    sinks=None, backend="auto", interpret=False, block_sizes=None, decode_only=False)`.

    Every backend computes exactly what `ragged_paged_attention_reference` documents.
    `backend="auto"` picks the platform's kernel (the "xla" loop on the CPU);
    "reference" is the oracle, "xla" a pure-JAX loop that skips padding, "tpu" and
    "gpu" force a kernel, and with `interpret=` (True, or `pltpu.InterpretParams()` for
    the TPU kernel) run it in the Pallas interpreter on any platform. `block_sizes` is
    the kernel's `BlockSizes` (None: its defaults); the reference takes none.
    `decode_only` is a static promise that every live sequence has at most one query
    row: the GPU kernel then launches no prefill grid; the other backends ignore it.

    `deterministic` (static; or `backend` suffixed with `DETERMINISTIC`): each sequence's
    reduction order depends on its own lengths only, never on its batch-mates, so its
    rows are bitwise the same in any batch. Only the GPU kernel changes for it (its
    split plan from each sequence's own length, `BlockSizes.split_tokens`); "xla" and
    the TPU kernel already reduce each row over its own sequence's KV blocks in a fixed
    order, and "reference" reduces over the table's padded width (it changes with the
    page bucket: about 1e-7 at f32). See docs/python_api.md, "Reproducible sampling".
    """
    if backend.endswith(DETERMINISTIC):
        backend, deterministic = backend.removesuffix(DETERMINISTIC), True
    name = resolve_backend(backend)
    if name in ("reference", "xla"):
        if block_sizes is not None:
            loop = "the reference" if name == "reference" else "the xla loop"
            raise ValueError(f"block_sizes applies to the tpu and gpu kernels, not {loop}")
        op = ragged_paged_attention_reference if name == "reference" else ragged_paged_attention_xla
        return op.impl(inputs)
    module, fn = _KERNELS[name]
    kernel = getattr(importlib.import_module(module, __package__), fn)
    tunables = {} if block_sizes is None else {"block_sizes": block_sizes}
    if name == "gpu":
        tunables["decode_only"] = decode_only
        if deterministic:
            from .gpu.block_sizes import DETERMINISTIC_SPLIT_TOKENS, BlockSizes

            bs = block_sizes or BlockSizes()
            split_tokens = bs.split_tokens or DETERMINISTIC_SPLIT_TOKENS
            tunables["block_sizes"] = dataclasses.replace(bs, split_tokens=split_tokens)
    return kernel.impl(inputs, **tunables, interpret=interpret)
