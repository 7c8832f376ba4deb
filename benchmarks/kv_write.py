"""Benchmark: the donated KV write costs the same whatever the cache size.

    python -m benchmarks.kv_write [--num_pages=256,1024,4096,16384] [--tokens=64]

For each cache size it times (median over --iters) one jitted write of --tokens new
tokens with the cache donated (in place), and the same write without donation, which
must copy the whole cache. The donated time should stay flat while the copy grows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.timing import median_seconds
from paxkv.kv_cache import PagedKVCache
from paxkv.measure.page_tables import page_table_from_host

_NUM_PAGES = flags.DEFINE_list(
    "num_pages", ["256", "1024", "4096", "16384"], "Cache sizes, in pages."
)
_TOKENS = flags.DEFINE_integer("tokens", 64, "New tokens written per call (one per sequence).")
_ITERS = flags.DEFINE_integer("iters", 30, "Timed calls per point.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 8, "KV heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dim.")
_DTYPE = flags.DEFINE_string(
    "dtype",
    "float32",
    "Page dtype. XLA:CPU has no native bf16 scatter and converts the whole cache to f32 and"
    " back around it, so on the CPU bf16 shows a copy that accelerators do not make.",
)


def measure(
    num_pages: int,
    *,
    tokens: int,
    iters: int,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
) -> dict:
    """Median seconds of a donated and of a copying write into a `num_pages` cache."""
    rng = np.random.default_rng(0)
    pages = rng.choice(np.arange(1, num_pages), size=tokens, replace=False)
    table = page_table_from_host(
        [[int(p)] for p in pages],
        [page_size] * tokens,
        [1] * tokens,
        page_size=page_size,
        max_num_seqs=tokens,
        pages_per_seq=1,
    )
    new = jnp.asarray(rng.standard_normal((tokens, kv_heads, head_dim)), dtype)
    write = lambda cache: cache.write(0, new, new, table)
    make = lambda: PagedKVCache.create(
        num_layers=1,
        num_pages=num_pages,
        num_kv_heads=kv_heads,
        page_size=page_size,
        head_dim=head_dim,
        dtype=dtype,
    )
    donating, copying = jax.jit(write, donate_argnums=0), jax.jit(write)
    cache = make()
    nbytes = cache.nbytes

    def donated_write() -> PagedKVCache:
        nonlocal cache
        cache = donating(cache)  # the old cache's buffers are the new one's
        return cache

    donated = median_seconds(donated_write, iters=iters)
    cache = make()  # a fresh cache for the copying write; the donated one is freed
    copied = median_seconds(lambda: copying(cache), iters=iters)
    return {
        "num_pages": num_pages,
        "cache_mib": nbytes / 2**20,
        "donated_s": donated,
        "copied_s": copied,
    }


def main(argv: list[str]) -> None:
    """Measures every --num_pages cache size and prints the table."""
    del argv
    rows = [
        measure(
            int(n),
            tokens=_TOKENS.value,
            iters=_ITERS.value,
            page_size=_PAGE_SIZE.value,
            kv_heads=_KV_HEADS.value,
            head_dim=_HEAD_DIM.value,
            dtype=_DTYPE.value,
        )
        for n in _NUM_PAGES.value
    ]
    base = rows[0]["donated_s"]
    print(
        f"device: {jax.devices()[0].device_kind}; {_DTYPE.value} pages; {_TOKENS.value} tokens per"
        f" write; medians of {_ITERS.value}"
    )
    print("| pages | cache MiB | donated write (us) | vs smallest | copying write (us) |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['num_pages']} | {r['cache_mib']:.0f} | {r['donated_s'] * 1e6:.0f} | "
            f"{r['donated_s'] / base:.2f}x | {r['copied_s'] * 1e6:.0f} |"
        )


def run() -> None:
    """The benchmark as a console script."""
    app.run(main)


if __name__ == "__main__":
    run()
