"""Serving limits and step shapes of an engine, as one frozen dataclass."""

from __future__ import annotations

import dataclasses

from paxkv.host.batch import Buckets
from paxkv.pallas_kernels.layout import cdiv


def _geometric(lo: int, hi: int, growth: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= growth
    return (*out, hi)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Serving limits and step shapes (see `buckets`)."""

    num_pages: int = 1024
    page_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    log_stats_interval_s: float = 10.0  # a periodic absl log line; 0 turns it off
    # Decode steps per compiled call when every scheduled sequence is decoding
    # (`paxkv.engine.step.decode_loop`); 1 runs one step per call. None: 8 on an
    # accelerator, where it hides the host's time, and 1 on the CPU, where host and
    # "device" share cores.
    num_decode_steps: int | None = None
    # Schedule and dispatch step k+1 before reading step k's tokens (`paxkv.engine.pipeline`).
    async_scheduling: bool = False
    token_buckets: tuple[int, ...] | None = None
    seq_buckets: tuple[int, ...] | None = None
    page_buckets: tuple[int, ...] | None = None
    bucket_growth: int = 4

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs}, so every running sequence can decode each step"
            )
        if self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be at least 2 (page 0 is reserved)")
        if self.num_decode_steps is not None and self.num_decode_steps < 1:
            raise ValueError(f"num_decode_steps={self.num_decode_steps} must be at least 1")
        if self.async_scheduling and (self.num_decode_steps or 1) > 1:
            raise ValueError(
                f"async_scheduling runs one decode step per call: set num_decode_steps=1, "
                f"not {self.num_decode_steps}"
            )

    @property
    def pages_per_seq(self) -> int:
        """Block-table entries of the longest sequence."""
        return cdiv(self.max_model_len, self.page_size)

    def buckets(self) -> Buckets:
        """The step shapes: each list grows by `bucket_growth` and ends at its limit.

        `seq_buckets=None` ties the sequence count to the token bucket.
        """
        g = self.bucket_growth
        tokens = self.token_buckets or _geometric(
            min(16, self.max_num_batched_tokens), self.max_num_batched_tokens, g
        )
        pages = self.page_buckets or _geometric(min(8, self.pages_per_seq), self.pages_per_seq, g)
        return Buckets(
            tuple(tokens), tuple(self.seq_buckets or ()), tuple(pages), self.max_num_seqs
        )
