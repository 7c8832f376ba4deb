"""Serving metrics: counters, latency summaries, and an optional Prometheus exposition.

Names follow vLLM's metrics where one exists (`kv_cache_usage_perc`,
`prefix_cache_queries` / `prefix_cache_hits` in tokens, `num_preemptions`,
`time_to_first_token_seconds`, `inter_token_latency_seconds`, ...). Plain Python; the
Prometheus part needs the optional `prometheus-client` package.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from absl import logging

from paxkv.host.kv_usage import group_usage
from paxkv.host.speculative import spec_rates

if TYPE_CHECKING:
    from paxkv.host.scheduler import Scheduler
    from paxkv.host.sequence import SequenceState

_WINDOW = 20_000  # latency samples kept per summary


class LatencySummary:
    """The most recent latency samples of one kind (the last `_WINDOW`, in a ring of
    floats), summarised as percentiles; and the count and sum of all of them."""

    def __init__(self) -> None:
        self._ring = np.zeros(_WINDOW, np.float64)
        self.count = 0  # samples ever; the newest sits at ring[(count - 1) % _WINDOW]
        self.total = 0.0

    def add(self, seconds: float) -> None:
        """Records one latency sample, in seconds."""
        self._ring[self.count % _WINDOW] = seconds
        self.count += 1
        self.total += seconds

    def extend(self, samples: Iterable[float]) -> None:
        """Records several latency samples, in seconds (a list or an array: one write
        of the ring, not one call per sample)."""
        x = np.asarray(samples if isinstance(samples, (list, np.ndarray)) else list(samples), float)
        n = len(x)
        if not n:
            return
        self.total += float(x.sum())
        at = self.count % _WINDOW
        self.count += n
        if n >= _WINDOW:  # only the newest fit, in order from where the next would go
            x = np.roll(x[-_WINDOW:], self.count % _WINDOW)
            self._ring[:] = x
            return
        head = min(n, _WINDOW - at)
        self._ring[at : at + head] = x[:head]
        self._ring[: n - head] = x[head:]

    def summary(self) -> dict[str, float | None]:
        """p50 / p90 / p99 / mean of the samples (None each when there are none)."""
        if not self.count:
            return {"p50": None, "p90": None, "p99": None, "mean": None}
        p50, p90, p99 = np.percentile(self._ring[: min(self.count, _WINDOW)], [50, 90, 99])
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
        self._last_log = time.monotonic()

    def on_arrival(self, now: float) -> None:
        """Records a request's arrival (the throughput clock starts at the first)."""
        if self.start_time is None:
            self.start_time = now

    def on_token(self, itl: float | None) -> None:
        """Records one generated token and its inter-token latency (None for a first token)."""
        self.generation_tokens += 1
        if itl is not None:
            self.latency["inter_token_latency_seconds"].add(itl)

    def on_tokens(self, itls: list[float | None] | np.ndarray) -> None:
        """`on_token` for each of one step's tokens: a list (None for a first token) or
        an f64 array (NaN for one)."""
        self.generation_tokens += len(itls)
        if isinstance(itls, np.ndarray):
            if np.isnan(itls).any():
                itls = itls[~np.isnan(itls)]
        elif None in itls:
            itls = [t for t in itls if t is not None]
        self.latency["inter_token_latency_seconds"].extend(itls)

    def on_finish(self, seq: SequenceState) -> None:
        """Records a sequence that ended: its finish reason and latencies."""
        self.finished[seq.finish_reason.value] += 1
        arrival = seq.arrival_time
        for name, t in (
            ("request_queue_time_seconds", seq.first_scheduled_time),
            ("time_to_first_token_seconds", seq.first_token_time),
            ("e2e_request_latency_seconds", seq.finished_time),
        ):
            if t is not None:
                self.latency[name].add(t - arrival)
        num_tokens = len(seq.output_token_ids)
        if seq.first_token_time is not None and num_tokens > 1:
            self.latency["time_per_output_token_seconds"].add(
                (seq.last_token_time - seq.first_token_time) / (num_tokens - 1)
            )

    def account_step(self, t0: float, t_sched: float, t1: float, t2: float) -> None:
        """Records one step's times (perf_counter): started, scheduled, laid out (ready
        to dispatch), and done waiting for the device; the host's share is everything but
        the dispatch and the wait (on the CPU, dispatching may run the step itself)."""
        self.num_steps += 1
        self.schedule_time_s += t_sched - t0
        self.host_time_s += (t1 - t0) + (time.perf_counter() - t2)
        # Waiting for the device: with async scheduling, for step k while k+1 is queued.
        self.device_time_s += t2 - t1

    def maybe_log(self, stats: Callable[[], dict[str, Any]], interval_s: float) -> None:
        """Logs a line of `stats()` (absl, INFO) if `interval_s` > 0 has passed since the last."""
        now = time.monotonic()
        if interval_s > 0 and now - self._last_log >= interval_s:
            self._last_log = now
            logging.info(format_log_line(stats()))

    def throughput(self) -> dict[str, float]:
        """Requests and tokens per second since the first arrival."""
        elapsed = time.monotonic() - self.start_time if self.start_time is not None else 0.0
        if elapsed <= 0:
            return {"output_tok_per_s": 0.0, "req_per_s": 0.0, "elapsed_s": 0.0}
        done = sum(self.finished.values())
        return {
            "output_tok_per_s": self.generation_tokens / elapsed,
            "req_per_s": done / elapsed,
            "elapsed_s": elapsed,
        }


def engine_stats(
    metrics: EngineMetrics,
    scheduler: Scheduler,
    *,
    num_compilations: int,
    compile_time_s: float,
    num_model_compilations: int = 0,
    compiling: bool = False,
) -> dict[str, Any]:
    """The run's metrics so far, with vLLM-compatible names where one exists.

    Counters (tokens, preemptions, prefix-cache queries and hits in tokens,
    compilations), gauges (running and waiting requests, KV usage in pages and in token
    slots), latency summaries (p50/p90/p99/mean of queue time, TTFT, TPOT, inter-token
    latency, end-to-end latency), throughput, and the host's scheduling and
    batch-building time against the device step time.
    """
    m, sch, kvm = metrics, scheduler, scheduler.kv_cache_manager
    prefix = kvm.prefix_cache
    kv = sch.kv_usage()
    running = len(sch.running)
    host, device = m.host_time_s, m.device_time_s
    return {
        "num_requests_running": running,
        "num_requests_waiting": len(sch.waiting),
        "peak_num_requests_running": sch.peak_running,
        "kv_cache_usage_perc": kv["page_usage"],
        "kv_pages_in_use": kv["pages_in_use"],
        "kv_pages_total": kv["pages_total"],
        "kv_token_slots_used": kv["token_slots_used"],
        "kv_token_slots_reserved": kv["token_slots_reserved"],
        "kv_token_utilization": kv["kv_utilization"],
        "kv_wasted_slots_per_seq": kv["wasted_slots"] / running if running else 0.0,
        # Per KV-cache group (`paxkv.host.kv_groups`): window, layers, pages held.
        "kv_groups": group_usage(kvm, sch.running),
        "prefix_cache_queries": prefix.queries,
        "prefix_cache_hits": prefix.hits,
        "prefix_cache_hit_rate": prefix.hits / prefix.queries if prefix.queries else 0.0,
        "prefix_cache_short_prefix_misses": prefix.short_prefix_misses,
        "num_preemptions": sch.num_preemptions,
        "num_recomputed_tokens": sch.num_recomputed_tokens,
        # Tokens resumed (preempted) sequences took from a cache, the device's or the
        # host tier's (up to what they had computed, and beyond where a cache had more).
        "num_preempted_tokens_reused": prefix.resumed_hits,
        **lora_stats(getattr(sch, "lora_slots", None)),
        "prompt_tokens": m.prompt_tokens,
        "generation_tokens": m.generation_tokens,
        "requests_finished": dict(m.finished),
        **{name: summary.summary() for name, summary in m.latency.items()},
        **m.throughput(),
        "num_steps": m.num_steps,
        "num_decode_loops": m.num_decode_loops,
        "num_compilations": num_compilations,
        # Of them, the model's programs (not its samplers); and whether a background
        # warm-up is still compiling.
        "num_model_compilations": num_model_compilations,
        "compiling": int(compiling),
        "compile_time_s": compile_time_s,
        "schedule_time_per_step_s": m.schedule_time_s / m.num_steps if m.num_steps else 0.0,
        "host_time_s": host,
        "device_time_s": device,
        "host_overhead_fraction": host / (host + device) if host + device else 0.0,
    }


def lora_stats(slots: Any) -> dict[str, int]:
    """The LoRA slots' counters (`paxkv.host.lora_slots`); empty without adapters."""
    if slots is None:
        return {}
    return {
        "lora_loads": slots.loads,
        "lora_evictions": slots.evictions,
        "lora_resident": len(slots.resident),
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
        "num_model_compilations",
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
        "compiling",
    )

    def __init__(self, stats_fn: Callable[[], dict[str, Any]], *, prefix: str = "paxkv") -> None:
        self._stats_fn = stats_fn
        self._prefix = prefix

    def collect(self) -> Iterable[Any]:
        """The current stats as Prometheus metric families (prometheus-client's collector API)."""
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
        groups = GaugeMetricFamily(
            f"{self._prefix}:kv_group_pages_held",
            "pages held by running requests per KV-cache group",
            labels=["group", "window"],
        )
        for i, g in enumerate(stats["kv_groups"]):
            groups.add_metric([str(i), str(g["window"] or "global")], g["pages_held"])
        yield groups
        yield from self._speculation(stats)
        yield from self._offload(stats)
        yield from self._lora(stats)
        yield from self._replicas(stats)

    def _lora(self, stats: dict[str, Any]) -> Iterable[Any]:
        """The LoRA slots' counters (`lora_stats`), with adapters on: adapters written to
        a slot and evicted from one, and the adapters resident."""
        if "lora_loads" not in stats:
            return
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, help in (
            ("loads", "adapters written to a slot"),
            ("evictions", "adapters evicted"),
        ):
            yield CounterMetricFamily(
                f"{self._prefix}:lora_{name}", help, value=stats[f"lora_{name}"]
            )
        yield GaugeMetricFamily(
            f"{self._prefix}:lora_resident",
            "adapters in device slots",
            value=stats["lora_resident"],
        )

    def _offload(self, stats: dict[str, Any]) -> Iterable[Any]:
        """The host KV tier's metrics, when it is on, under vLLM's `kv_offload` names:
        bytes and host seconds per direction (`transfer_type` "GPU_to_CPU" is device to
        host, whatever the device), the tier's usage, and its lookups and hits in pages."""
        if "kv_offload_bytes_to_host" not in stats:
            return
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for what, help in (("bytes", "bytes copied"), ("seconds", "host seconds copying")):
            name = "total_bytes" if what == "bytes" else "total_time"
            family = CounterMetricFamily(
                f"{self._prefix}:kv_offload_{name}", help, labels=["transfer_type"]
            )
            family.add_metric(["GPU_to_CPU"], stats[f"kv_offload_{what}_to_host"])
            family.add_metric(["CPU_to_GPU"], stats[f"kv_offload_{what}_to_device"])
            yield family
        yield GaugeMetricFamily(
            f"{self._prefix}:kv_offload_cpu_cache_usage_perc",
            "fraction of the host tier's slots in use",
            value=stats["kv_host_tier_usage"],
        )
        for name, key in (("lookup", "queries"), ("hit", "hits")):
            yield CounterMetricFamily(
                f"{self._prefix}:kv_offload_cpu_block_{name}",
                f"host-tier page {name}s",
                value=stats[f"kv_host_tier_{key}"],
            )

    SPEC_COUNTERS = (
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
    )

    def _speculation(self, stats: dict[str, Any]) -> Iterable[Any]:
        """Speculative decoding's counters (vLLM's names), when the engine speculates,
        and the acceptance rate per proposal position."""
        if "spec_decode_num_drafts" not in stats:
            return
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name in self.SPEC_COUNTERS:
            yield CounterMetricFamily(
                f"{self._prefix}:{name}", name.replace("_", " "), value=stats[name]
            )
        for name in ("spec_decode_acceptance_rate", "spec_decode_mean_accepted_length"):
            yield GaugeMetricFamily(
                f"{self._prefix}:{name}", name.replace("_", " "), value=stats[name]
            )
        per_pos = GaugeMetricFamily(
            f"{self._prefix}:spec_decode_acceptance_per_position",
            "fraction of drafts whose proposal at a position was accepted",
            labels=["position"],
        )
        for i, rate in enumerate(stats["spec_decode_acceptance_per_position"]):
            per_pos.add_metric([str(i)], rate)
        yield per_pos

    def _replicas(self, stats: dict[str, Any]) -> Iterable[Any]:
        """Data-parallel servers' families (`paxkv.serve.replicas.ReplicaSet.stats`):
        whether each replica is up, the router's counts, and with "replicas" each
        replica's counters and gauges, labelled `replica`."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if "replicas_up" in stats:
            up = GaugeMetricFamily(
                f"{self._prefix}:replica_up", "whether a replica serves", labels=["replica"]
            )
            for i, alive in enumerate(stats["replicas_up"]):
                up.add_metric([str(i)], float(alive))
            yield up
        for name, value in stats.get("router", {}).items():
            if name != "name":
                yield CounterMetricFamily(
                    f"{self._prefix}:router_{name}", name.replace("_", " "), value=value
                )
        replicas = stats.get("replicas", ())
        for kind, names in ((CounterMetricFamily, self.COUNTERS), (GaugeMetricFamily, self.GAUGES)):
            for name in names:
                family = kind(
                    f"{self._prefix}:replica_{name}",
                    f"{name.replace('_', ' ')} per replica",
                    labels=["replica"],
                )
                for i, r in enumerate(replicas):
                    if name in r:
                        family.add_metric([str(i)], r[name])
                yield family
        if replicas:
            routed = CounterMetricFamily(
                f"{self._prefix}:replica_routed_requests",
                "prompts routed to a replica, by the rule that chose it",
                labels=["replica", "rule"],
            )
            for i, r in enumerate(replicas):
                for rule, count in r.get("routed", {}).items():
                    routed.add_metric([str(i), rule], count)
            yield routed


# `merge_stats`: ratios recomputed from the summed parts, and what is not a sum.
_RATIOS = {
    "kv_cache_usage_perc": ("kv_pages_in_use", "kv_pages_total", 0.0),
    "kv_token_utilization": ("kv_token_slots_used", "kv_token_slots_reserved", 1.0),
    "prefix_cache_hit_rate": ("prefix_cache_hits", "prefix_cache_queries", 0.0),
    "kv_host_tier_usage": ("kv_host_tier_used", "kv_host_tier_slots", 0.0),
}
_MAXIMA = ("elapsed_s",)


def merge_stats(replicas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The stats of several engines (`engine_stats`, one per data-parallel replica) as
    one server's: counts, gauges and rates summed, ratios recomputed from the sums,
    finish reasons and KV-group pages added up; a latency percentile is the largest of
    the replicas' (an upper bound of the whole server's: at most 1% of the union's
    samples lie above the largest p99), and so is the mean. One engine's stats come
    back unchanged."""
    if not replicas:
        return {}
    if len(replicas) == 1:
        return dict(replicas[0])
    out: dict[str, Any] = {}
    for key, first in replicas[0].items():
        values = [r[key] for r in replicas]
        if key in LATENCIES:
            out[key] = {
                q: max((v[q] for v in values if v[q] is not None), default=None) for q in first
            }
        elif key == "requests_finished":
            out[key] = dict(sum((collections.Counter(v) for v in values), collections.Counter()))
        elif key == "kv_groups":
            out[key] = [
                {**g, "pages_held": sum(v[i]["pages_held"] for v in values)}
                for i, g in enumerate(first)
            ]
        elif key in _MAXIMA:
            out[key] = max(values)
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            out[key] = sum(values)
        elif isinstance(first, list) and key.endswith("_per_pos"):  # counts per position
            out[key] = [sum(col) for col in zip(*values, strict=True)]
    for key, (num, den, empty) in _RATIOS.items():
        if key in out:
            out[key] = out[num] / out[den] if out[den] else empty
    if "spec_decode_num_drafts" in out:  # speculation's rates from the summed counts
        out.update(spec_rates(out))
    running = out.get("num_requests_running", 0)
    if "kv_wasted_slots_per_seq" in out:
        wasted = out["kv_token_slots_reserved"] - out["kv_token_slots_used"]
        out["kv_wasted_slots_per_seq"] = wasted / running if running else 0.0
    steps = out.get("num_steps", 0)
    if "schedule_time_per_step_s" in out:
        total = sum(r["schedule_time_per_step_s"] * r["num_steps"] for r in replicas)
        out["schedule_time_per_step_s"] = total / steps if steps else 0.0
    if "host_overhead_fraction" in out:
        busy = out["host_time_s"] + out["device_time_s"]
        out["host_overhead_fraction"] = out["host_time_s"] / busy if busy else 0.0
    return out
