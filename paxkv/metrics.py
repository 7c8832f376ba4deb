"""Serving metrics: counters, latency summaries, and an optional Prometheus exposition.

Names follow vLLM's metrics where one exists (`kv_cache_usage_perc`,
`prefix_cache_queries` / `prefix_cache_hits` in tokens, `num_preemptions`,
`time_to_first_token_seconds`, `inter_token_latency_seconds`, ...). Plain Python; the
Prometheus part needs the optional `prometheus-client` package.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

_WINDOW = 20_000  # latency samples kept per summary


class LatencySummary:
    """The most recent latency samples of one kind, summarised as percentiles."""

    def __init__(self) -> None:
        self._samples: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self.count = 0
        self.total = 0.0

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)
        self.count += 1
        self.total += seconds

    def summary(self) -> dict[str, float | None]:
        if not self._samples:
            return {"p50": None, "p90": None, "p99": None, "mean": None}
        p50, p90, p99 = np.percentile(np.fromiter(self._samples, float), [50, 90, 99])
        return {
            "p50": float(p50),
            "p90": float(p90),
            "p99": float(p99),
            "mean": self.total / self.count,
        }


LATENCIES = (
    "request_queue_time_seconds",
    "time_to_first_token_seconds",
    "time_per_output_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
)


class EngineMetrics:
    """What the engine records as it runs; `Engine.stats()` reads it."""

    def __init__(self) -> None:
        self.latency = {name: LatencySummary() for name in LATENCIES}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = collections.Counter()  # finish reason -> requests
        self.start_time: float | None = None
        self.schedule_time_s = 0.0
        self.host_time_s = 0.0
        self.device_time_s = 0.0
        self.num_steps = 0
        self.num_decode_loops = 0  # steps that ran several decode iterations in one call

    def on_arrival(self, now: float) -> None:
        if self.start_time is None:
            self.start_time = now

    def on_token(self, itl: float | None) -> None:
        self.generation_tokens += 1
        if itl is not None:
            self.latency["inter_token_latency_seconds"].add(itl)

    def on_finish(
        self, reason: str, *, queue, ttft, e2e, first_token, last_token, num_tokens: int
    ) -> None:
        self.finished[reason] += 1
        for name, value in (
            ("request_queue_time_seconds", queue),
            ("time_to_first_token_seconds", ttft),
            ("e2e_request_latency_seconds", e2e),
        ):
            if value is not None:
                self.latency[name].add(value)
        if first_token is not None and num_tokens > 1:
            self.latency["time_per_output_token_seconds"].add(
                (last_token - first_token) / (num_tokens - 1)
            )

    def throughput(self) -> dict[str, float]:
        elapsed = time.monotonic() - self.start_time if self.start_time is not None else 0.0
        if elapsed <= 0:
            return {"output_tok_per_s": 0.0, "req_per_s": 0.0, "elapsed_s": 0.0}
        done = sum(self.finished.values())
        return {
            "output_tok_per_s": self.generation_tokens / elapsed,
            "req_per_s": done / elapsed,
            "elapsed_s": elapsed,
        }


def format_log_line(stats: dict[str, Any]) -> str:
    """The periodic one-line status of a running engine."""
    hit = stats["prefix_cache_hit_rate"]
    return (
        f"paxkv: running={stats['num_requests_running']} waiting={stats['num_requests_waiting']} "
        f"kv={stats['kv_cache_usage_perc']:.1%} prefix_hit={hit:.1%} "
        f"preemptions={stats['num_preemptions']} gen_tok/s={stats['output_tok_per_s']:.1f} "
        f"host_overhead={stats['host_overhead_fraction']:.1%} compiles={stats['num_compilations']}"
    )


class PrometheusCollector:
    """A prometheus-client collector that reads `stats_fn()` at every scrape.

    from prometheus_client import CollectorRegistry, generate_latest
    registry = CollectorRegistry()
    registry.register(PrometheusCollector(llm.stats))
    text = generate_latest(registry)
    """

    COUNTERS = (
        "prompt_tokens",
        "generation_tokens",
        "num_preemptions",
        "num_recomputed_tokens",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_compilations",
        "num_steps",
    )
    GAUGES = (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "kv_pages_in_use",
        "kv_token_slots_used",
        "kv_token_slots_reserved",
        "kv_token_utilization",
        "host_overhead_fraction",
        "output_tok_per_s",
    )

    def __init__(self, stats_fn: Callable[[], dict[str, Any]], *, prefix: str = "paxkv") -> None:
        self._stats_fn = stats_fn
        self._prefix = prefix

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self._stats_fn()
        for name in self.COUNTERS:
            yield CounterMetricFamily(
                f"{self._prefix}:{name}", name.replace("_", " "), value=stats[name]
            )
        for name in self.GAUGES:
            yield GaugeMetricFamily(
                f"{self._prefix}:{name}", name.replace("_", " "), value=stats[name]
            )
        for name in LATENCIES:
            g = GaugeMetricFamily(
                f"{self._prefix}:{name}", f"{name} percentiles", labels=["quantile"]
            )
            for q, v in stats[name].items():
                if v is not None and q != "mean":
                    g.add_metric([{"p50": "0.5", "p90": "0.9", "p99": "0.99"}[q]], v)
            yield g
        finished = CounterMetricFamily(
            f"{self._prefix}:request_success", "finished requests", labels=["finished_reason"]
        )
        for reason, count in stats["requests_finished"].items():
            finished.add_metric([reason], count)
        yield finished
