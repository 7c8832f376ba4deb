"""The load benchmark: one workload, one model, one KV memory budget, three allocators.

It runs the same requests through the same engine with the same KV memory, changing
only what a sequence reserves:

* `paged`: the pages its tokens need (with prefix caching), a window layer group only
  those inside its window (`paxkv.host.kv_groups`);
* `paged_uniform`: the same, but every layer keeps every page (for models with
  sliding-window layers: what `paged` gains by its groups);
* `contiguous_max`: max_model_len slots at admission, the classic contiguous cache;
* `contiguous_guess`: prompt + a guessed output length at admission; a sequence that
  outgrows its guess is preempted and recomputed with a doubled guess.

and reports throughput, latency percentiles, peak concurrency, KV utilisation (token
slots used over slots reserved, averaged over steps), preemptions and prefix hits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from paxkv.engine import Engine, EngineConfig
from paxkv.engine.metrics import LatencySummary
from paxkv.host.request import SamplingParams
from paxkv.measure.reservations import ContiguousGuess, ContiguousMax
from paxkv.planner.workloads import SHAREGPT_OUTPUT_LENS, SHAREGPT_PROMPT_LENS

# "paged" serves with the engine's KV-cache groups (a window group holds only the pages
# in its window, `paxkv.host.kv_groups`); "paged_uniform" keeps every layer's pages, and
# differs from "paged" only for models with sliding-window layers.
SETUPS = ("paged", "paged_uniform", "contiguous_max", "contiguous_guess")
WORKLOADS = ("sharegpt", "fixed", "shared_prefix")


@dataclasses.dataclass(frozen=True)
class RequestTrace:
    """Requests to replay: prompts, output lengths and arrival offsets in seconds."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]

    def describe(self) -> dict[str, Any]:
        """Its name, size, and the mean and longest prompt and output."""
        p = np.array([len(x) for x in self.prompts])
        o = np.array(self.output_lens)
        return {
            "name": self.name,
            "num_requests": len(p),
            "prompt_len_mean": float(p.mean()),
            "prompt_len_max": int(p.max()),
            "output_len_mean": float(o.mean()),
            "output_len_max": int(o.max()),
            "last_arrival_s": float(max(self.arrivals)),
        }


def make_workload(
    name: str,
    *,
    num_requests: int,
    vocab_size: int,
    max_model_len: int,
    seed: int = 0,
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    fixed_prompt_len: tuple[int, int] = (64, 512),
    fixed_output_len: tuple[int, int] = (32, 256),
    prefix_len: int = 512,
    group_size: int = 8,
) -> RequestTrace:
    """Builds the requests of a named workload.

    * "sharegpt": log-normal prompt and output lengths with a long tail
      (`paxkv.planner.workloads.SHAREGPT_PROMPT_LENS` and `SHAREGPT_OUTPUT_LENS`), the
      prompt capped at max_model_len / 2 and prompt + output at max_model_len;
    * "fixed": lengths uniform in the given ranges;
    * "shared_prefix": groups of `group_size` requests sharing a `prefix_len` system prompt.

    Arrivals: all at t=0 when `request_rate` is infinite, else a gamma process with
    mean rate `request_rate` and shape `burstiness` (1 is Poisson).
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload={name!r} must be one of {WORKLOADS}")
    if not request_rate > 0:
        raise ValueError(f"request_rate={request_rate} must be > 0 (inf: all at once)")
    rng = np.random.default_rng(seed)
    if name == "sharegpt":
        capped = dataclasses.replace(SHAREGPT_PROMPT_LENS, hi=max_model_len // 2)
        prompt_lens = capped.sample(rng, num_requests)
        output_lens = SHAREGPT_OUTPUT_LENS.sample(rng, num_requests)
        output_lens = np.minimum(output_lens, max_model_len - prompt_lens)
    elif name == "fixed":
        prompt_lens = rng.integers(fixed_prompt_len[0], fixed_prompt_len[1] + 1, num_requests)
        output_lens = rng.integers(fixed_output_len[0], fixed_output_len[1] + 1, num_requests)
    else:
        prompt_lens = prefix_len + rng.integers(8, 128, num_requests)
        output_lens = rng.integers(16, 128, num_requests)
    if np.any(prompt_lens + output_lens > max_model_len):
        raise ValueError(
            f"workload {name!r} has requests longer than max_model_len={max_model_len}"
        )
    prompts = [rng.integers(0, vocab_size, int(n)).tolist() for n in prompt_lens]
    if name == "shared_prefix":
        for g in range(0, num_requests, group_size):
            prefix = rng.integers(0, vocab_size, prefix_len).tolist()
            for i in range(g, min(g + group_size, num_requests)):
                prompts[i][:prefix_len] = prefix
    if np.isinf(request_rate):
        arrivals = np.zeros(num_requests)
    else:
        gaps = rng.gamma(burstiness, 1.0 / (request_rate * burstiness), num_requests)
        arrivals = np.cumsum(gaps) - gaps[0]
    return RequestTrace(name, prompts, [int(x) for x in output_lens], arrivals.tolist())


def run_setup(
    setup: str,
    model: Any,
    workload: RequestTrace,
    config: EngineConfig,
    *,
    guess_tokens: int = 128,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Replays `workload` through one setup and returns its measurements.

    Every setup serves on `config`'s pool and limits; "paged" holds the pages its tokens
    need (with prefix caching), the contiguous ones reserve as
    `paxkv.measure.reservations` describes (`guess_tokens` for "contiguous_guess").
    """
    if setup not in SETUPS:
        raise ValueError(f"setup={setup!r} must be one of {SETUPS}")
    reservation = {
        "paged": None,
        "paged_uniform": None,
        "contiguous_max": ContiguousMax(),
        "contiguous_guess": ContiguousGuess(guess_tokens),
    }[setup]
    paged = setup.startswith("paged")
    config = dataclasses.replace(
        config,
        enable_prefix_caching=paged,
        hybrid_kv_cache=setup == "paged",
        watermark=0.0,
        log_stats_interval_s=0,
        warmup_scoring=False,  # the workload scores no prompt
    )
    engine = Engine(model, config, reservation=reservation)
    engine.warmup()
    compiled = engine.num_compilations
    order = np.argsort(workload.arrivals, kind="stable")
    next_req = 0
    done: dict[str, Any] = {}
    util_used = util_reserved = 0
    running_time = busy_time = 0.0  # sequences running x step seconds, step seconds
    start = time.monotonic()
    n = len(order)
    while len(done) < n:
        now = time.monotonic() - start
        while next_req < n and workload.arrivals[order[next_req]] <= now:
            i = int(order[next_req])
            params = SamplingParams(
                temperature=0.0, max_tokens=workload.output_lens[i], ignore_eos=True
            )
            engine.add_request(
                str(i),
                {"prompt_token_ids": workload.prompts[i]},
                params,
                arrival_time=start + workload.arrivals[i],
            )
            next_req += 1
        if not engine.has_unfinished():
            time.sleep(min(0.01, max(0.0, workload.arrivals[order[next_req]] - now)))
            continue
        step_start = time.monotonic()
        step_outputs = engine.step()
        step_time = time.monotonic() - step_start
        for out in step_outputs:
            if out.finished:
                done[out.request_id] = out
                if progress is not None:
                    progress(len(done), n)
        kv = engine.scheduler.kv_usage()
        running_time += len(engine.scheduler.running) * step_time
        busy_time += step_time
        util_used += kv["token_slots_used"]
        util_reserved += kv["token_slots_reserved"]
    elapsed = time.monotonic() - start
    stats = engine.stats()
    outs = list(done.values())
    ttft, tpot = LatencySummary(), LatencySummary()
    for o in outs:
        ttft.add(o.metrics.ttft)
        if len(o.outputs[0].token_ids) > 1:
            m = o.metrics
            tpot.add((m.last_token_time - m.first_token_time) / (len(o.outputs[0].token_ids) - 1))
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tokens = {o.request_id: list(o.outputs[0].token_ids) for o in outs}
    digest = hashlib.sha256(json.dumps(sorted(tokens.items())).encode()).hexdigest()
    return {
        "setup": setup,
        "num_pages": config.num_pages,
        "output_digest": digest[:16],
        "num_requests": n,
        "elapsed_s": elapsed,
        "req_per_s": n / elapsed,
        "output_tok_per_s": out_tokens / elapsed,
        "ttft_s": ttft.summary(),
        "tpot_s": tpot.summary(),
        "ttft_p50_s": ttft.summary()["p50"],
        "peak_concurrency": stats["peak_num_requests_running"],
        "mean_concurrency": running_time / busy_time if busy_time else 0.0,
        "kv_utilization": util_used / util_reserved if util_reserved else 0.0,
        "preemptions": stats["num_preemptions"],
        "recomputed_tokens": stats["num_recomputed_tokens"],
        "prefix_hit_rate": stats["prefix_cache_hit_rate"],
        "num_steps": stats["num_steps"],
        "recompilations_after_warmup": engine.num_compilations - compiled,
        "host_overhead_fraction": stats["host_overhead_fraction"],
    }


def progress_bar(label: str) -> Callable[[int, int], None]:
    """A one-line progress bar on stderr."""

    def show(done: int, total: int) -> None:
        width = 30
        filled = width * done // total
        sys.stderr.write(f"\r{label:>17} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def format_table(results: dict[str, Any]) -> str:
    """A markdown table of the setups side by side."""
    rows = [
        ("peak concurrent sequences", "peak_concurrency", "{:d}"),
        ("mean concurrent sequences (over step time)", "mean_concurrency", "{:.1f}"),
        ("output tok/s", "output_tok_per_s", "{:.1f}"),
        ("req/s", "req_per_s", "{:.2f}"),
        ("TTFT p50 / p90 / p99 (s)", "ttft_s", None),
        ("TPOT p50 / p90 / p99 (ms)", "tpot_s", None),
        ("KV utilisation (used / reserved)", "kv_utilization", "{:.1%}"),
        ("preemptions", "preemptions", "{:d}"),
        ("prefix hit rate", "prefix_hit_rate", "{:.1%}"),
        ("KV pages (equal memory)", "num_pages", "{:d}"),
    ]
    setups = results["setups"]
    names = [s for s in SETUPS if s in setups]
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, key, fmt in rows:
        cells = []
        for s in names:
            v = setups[s][key]
            if fmt is None:
                scale = 1000 if key == "tpot_s" else 1
                cells.append(
                    " / ".join(
                        "-" if v[q] is None else f"{v[q] * scale:.3g}"
                        for q in ("p50", "p90", "p99")
                    )
                )
            else:
                cells.append(fmt.format(v))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    first = setups[names[0]]["output_digest"] if names else None
    same = ["yes" if setups[s]["output_digest"] == first else "NO" for s in names]
    lines.append(f"| greedy outputs equal {names[0]}'s | " + " | ".join(same) + " |")
    return "\n".join(lines)
