"""Benchmark: the host KV tier's copy bandwidth, device to host and back.

    python -m benchmarks.page_copies [--layers=32] [--kv_heads=8] [--head_dim=128] [--pages=64]

A paged cache of Llama 3.1 8B's KV shape by default (32 layers, 8 KV heads, head_dim 128,
16-token bf16 pages: 2 MiB a page over every layer) on JAX's default device; `--pages`
pages (one copy bucket) are read out to host memory (`read_pages`, then `np.asarray`)
and written back (`write_pages` from NumPy, waited for), as the host tier does. Reported:
the median of `--repeats` timed rounds after one untimed round, in GB/s each way.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
from absl import app, flags

from paxkv.kv_cache import PagedKVCache, page_copies


def measure(
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    pages: int,
    repeats: int,
    cache_pages: int | None = None,
) -> dict:
    """Seconds and GB/s of reading `pages` pages to the host and writing them back, in a
    cache of `cache_pages` pages (None: just those and the null page)."""
    cache = PagedKVCache.create(
        num_layers=layers,
        num_pages=max(cache_pages or 0, pages + 1),
        num_kv_heads=kv_heads,
        page_size=page_size,
        head_dim=head_dim,
    )
    ids = np.arange(1, pages + 1, dtype=np.int32)
    rows = page_copies.page_rows(cache, ids)
    nbytes = page_copies.page_bytes(cache) * pages
    out_s, in_s = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        host = [np.asarray(a) for a in page_copies.read_pages(cache, rows)]
        t1 = time.perf_counter()
        cache = page_copies.write_pages(cache, rows, tuple(host))
        jax.block_until_ready(cache)
        t2 = time.perf_counter()
        if i:  # the first round compiles
            out_s.append(t1 - t0)
            in_s.append(t2 - t1)
    out, back = statistics.median(out_s), statistics.median(in_s)
    return {
        "device": str(jax.devices()[0]),
        "bytes": nbytes,
        "to_host_s": out,
        "to_device_s": back,
        "to_host_gb_s": nbytes / out / 1e9,
        "to_device_gb_s": nbytes / back / 1e9,
    }


def main(argv: list[str]) -> None:
    """Prints the two bandwidths."""
    del argv
    f = flags.FLAGS
    r = measure(
        layers=f.layers,
        kv_heads=f.kv_heads,
        head_dim=f.head_dim,
        page_size=f.page_size,
        pages=f.pages,
        repeats=f.repeats,
        cache_pages=f.cache_pages,
    )
    print(f"{r['device']}: {r['bytes'] / 2**20:.0f} MiB a round")
    print(f"device to host {r['to_host_gb_s']:.2f} GB/s ({1e3 * r['to_host_s']:.1f} ms)")
    print(f"host to device {r['to_device_gb_s']:.2f} GB/s ({1e3 * r['to_device_s']:.1f} ms)")


if __name__ == "__main__":
    # Defined here, not at import: tests import several benchmarks into one process.
    flags.DEFINE_integer("layers", 32, "Layers (cache arrays).")
    flags.DEFINE_integer("kv_heads", 8, "KV heads per layer.")
    flags.DEFINE_integer("head_dim", 128, "Head dimension.")
    flags.DEFINE_integer("page_size", 16, "Tokens per page.")
    flags.DEFINE_integer("pages", 64, "Pages per copy (the largest copy bucket).")
    flags.DEFINE_integer("repeats", 5, "Timed rounds.")
    flags.DEFINE_integer("cache_pages", None, "Pages in the cache; unset: pages + 1.")
    app.run(main)
