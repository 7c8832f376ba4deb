"""The host KV tier's bytes and copies: pages out to host memory and back, between steps.

`paxkv.host.host_tier.HostKVTier` decides which pages go where; `HostTierCopies` makes
the copies it records, in one `flush` before each step is dispatched:

1. the reads of the pages the step could overwrite (saves), dispatched first: the
   device runs calls in order, so they see the pages as the steps before left them,
   and are copied to the host asynchronously (`copy_to_host_async`); their bytes land
   in the host arrays at the next flush, or at once when a load of the same flush needs
   them;
2. the writes of restored pages (loads), from the host arrays.

Both run in batches padded to a few sizes (`COPY_BUCKETS`), compiled at warm-up, so no
new program appears later. Host memory is plain NumPy arrays, one per cache array,
`[slots, r, ...]` (r rows per page: a stacked cache's slots); a platform's pinned host
memory kind is not used yet.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from typing import Any

import numpy as np

from paxkv.host.kv_cache_manager import KVCacheManager
from paxkv.pallas_kernels.layout import NULL_PAGE

COPY_BUCKETS = (1, 4, 16, 64)  # pages per copy call; more go in several calls
# Device memory the reads of saves may hold before they land: past it, a flush lands
# them at once (waiting for them) rather than keep more.
MAX_IN_FLIGHT_BYTES = 256 * 2**20


class HostCopyError(RuntimeError):
    """A copy between the device cache and the host tier failed; the pages it was
    filling hold nothing trustworthy (the engine treats the KV cache as lost)."""


def host_slots(gib: float, page_bytes: int) -> int:
    """Host slots `gib` GiB holds, pages of `page_bytes` bytes each (at least 1)."""
    return max(1, int(gib * 2**30) // page_bytes)


class HostTierCopies:
    """The host arrays of `kv.host_tier` and the copies between them and `runner`'s caches.

    Args:
      kv: the KV-cache manager whose pool and host tier record the copies.
      runner: a `ModelRunner` (`read_pages`, `write_pages`, `rows_per_page`).
    """

    def __init__(self, kv: KVCacheManager, runner: Any) -> None:
        tier = kv.host_tier
        assert tier is not None
        self.kv, self.tier, self.runner = kv, tier, runner
        self._host: list[list[np.ndarray]] | None = None  # per cache, per array
        self._landing: list[tuple[list[tuple[Any, ...]], list[int], int]] = []
        self._failed = False  # a flush raised: its copies are lost (`take_failed`)
        # Metrics: bytes and host seconds each way.
        self.bytes_out = self.bytes_in = 0
        self.seconds_out = self.seconds_in = 0.0

    def _arrays(self, reads: list[tuple[Any, ...]]) -> list[list[np.ndarray]]:
        """The host arrays, made on the first save from its reads' shapes and dtypes
        (untouched memory is not committed by the OS until written)."""
        if self._host is None:
            n, rows = self.tier.num_slots, self.runner.rows_per_page()
            self._host = [
                [np.empty((n, r, *a.shape[1:]), a.dtype) for a in arrays]
                for arrays, r in zip(reads, rows, strict=True)
            ]
        return self._host

    def flush(self) -> None:
        """`_flush`; a failure (an interruption included) leaves copies half made, so
        the engine treats the KV cache as lost (`take_failed`); an `Exception` is
        raised as `HostCopyError`."""
        try:
            self._flush()
        except BaseException as e:
            self._failed = True
            if isinstance(e, Exception):
                raise HostCopyError(f"a host KV tier copy failed: {type(e).__name__}: {e}") from e
            raise

    def take_failed(self) -> bool:
        """Whether a flush failed since the last call."""
        failed, self._failed = self._failed, False
        return failed

    def _flush(self) -> None:
        """Makes the copies recorded since the last flush: the saves of the flush before
        land (they ran before the last step: no wait), this flush's saves are
        dispatched, then its loads (after the saves they read have landed). Call before
        dispatching a step."""
        self.kv.save_evicted()
        if self._landing:
            self.land()
        if not self.tier.pending:
            return
        saves, loads = self.tier.take_copies()
        t0 = time.perf_counter()
        for chunk in _chunks(saves):
            pages, slots = zip(*chunk, strict=True)
            padded = _padded(list(pages))
            reads = self.runner.read_pages(padded)
            for arrays in reads:
                for a in arrays:
                    a.copy_to_host_async()
            self._landing.append((reads, list(slots), len(padded)))
            self.bytes_out += len(chunk) * self.tier.page_bytes
            in_flight = sum(n for _, _, n in self._landing) * self.tier.page_bytes
            if in_flight > MAX_IN_FLIGHT_BYTES:
                self.land()
        self.seconds_out += time.perf_counter() - t0
        if not loads:
            return
        if {slot for _, slot in saves} & {slot for slot, _ in loads}:
            # A key evicted and wanted back in one plan: its save lands first (under
            # async scheduling this waits for the step in flight, dispatched before it).
            self.land()
        t1 = time.perf_counter()
        by_page = {page: slot for slot, page in loads}  # a page written twice: the last
        host = self._host
        assert host is not None, "a load before any save"
        for chunk in _chunks([(slot, page) for page, slot in by_page.items()]):
            slots, pages = zip(*chunk, strict=True)
            at = _padded(list(slots))
            data = [[a[at].reshape(-1, *a.shape[2:]) for a in arrays] for arrays in host]
            self.runner.write_pages(_padded(list(pages)), data)
            self.bytes_in += len(chunk) * self.tier.page_bytes
        self.seconds_in += time.perf_counter() - t1

    def land(self) -> None:
        """Waits for the saves dispatched so far and writes their bytes into the host
        arrays."""
        t0 = time.perf_counter()
        for reads, slots, padded in self._landing:
            host = self._arrays(reads)
            for arrays, out in zip(reads, host, strict=True):
                for a, h in zip(arrays, out, strict=True):
                    rows = np.asarray(a).reshape(padded, -1, *a.shape[1:])
                    h[slots] = rows[: len(slots)]
            self.tier.landed(slots)
        self._landing = []
        self.seconds_out += time.perf_counter() - t0

    def drop(self) -> None:
        """After the device cache was lost: the saves already read land (their reads
        are arrays of their own); the copies not made, and the keys of saves that
        cannot land, are forgotten."""
        with contextlib.suppress(Exception):  # unless their reads failed too
            self.land()
        self._landing = []
        self.kv.drop_copies()

    def stats(self) -> dict[str, Any]:
        """The tier's counters (`paxkv.engine.metrics.engine_stats` reports them)."""
        t = self.tier
        return {
            "kv_host_tier_slots": t.num_slots,
            "kv_host_tier_used": t.num_used,
            "kv_host_tier_usage": t.usage,
            "kv_host_tier_queries": t.queries,
            "kv_host_tier_hits": t.hits,
            "kv_host_tier_evictions": t.evictions,
            "kv_host_tier_skipped": t.skipped,
            "kv_offload_pages_to_host": t.saved,
            "kv_offload_pages_to_device": t.loaded,
            "kv_offload_bytes_to_host": self.bytes_out,
            "kv_offload_bytes_to_device": self.bytes_in,
            "kv_offload_seconds_to_host": self.seconds_out,
            "kv_offload_seconds_to_device": self.seconds_in,
        }


def _chunks(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    top = COPY_BUCKETS[-1]
    return [pairs[i : i + top] for i in range(0, len(pairs), top)]


def _padded(values: list[int]) -> np.ndarray:  # i32[bucket]
    """`values` padded to the next copy bucket by repeating the last (a repeated read or
    an equal write again: harmless)."""
    size = COPY_BUCKETS[bisect.bisect_left(COPY_BUCKETS, len(values))]
    return np.asarray(values + values[-1:] * (size - len(values)), np.int32)


def warm_copies(runner: Any) -> None:
    """Compiles the copy programs of every bucket: reads page `NULL_PAGE` and writes it
    back as it was."""
    for size in COPY_BUCKETS:
        pages = np.full(size, NULL_PAGE, np.int32)
        reads = runner.read_pages(pages)
        runner.write_pages(pages, [[np.asarray(a) for a in arrays] for arrays in reads])
