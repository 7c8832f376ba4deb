"""A serving benchmark client: replays a request trace against an OpenAI-compatible
server over HTTP and reports latency percentiles, as `vllm bench serve` does.

Each request is a streamed `/v1/completions` call with token-id prompts (from
`paxkv.measure.load_bench.make_workload`: Poisson or gamma arrivals, ShareGPT-like or fixed
lengths), `ignore_eos` so that it writes exactly its output length. Measured per
request on the client's clock: TTFT (send to first token), the inter-token latencies
(between chunks, each divided among its tokens), TPOT ((end - first token) / (tokens -
1)) and end-to-end latency.

    results = asyncio.run(run_trace("http://127.0.0.1:8000/v1", trace, model="tiny-py"))
    summarize(results)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import httpx
import numpy as np

from paxkv.measure.load_bench import RequestTrace

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass
class RequestResult:
    """One request as the client saw it; times in seconds."""

    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    latency: float | None = None
    itls: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def send_request(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, model: str | None
) -> RequestResult:
    """Streams one completion of `prompt` from `url` (the API root, …/v1)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,  # each chunk's token count is its logprobs' length
        "return_tokens_as_token_ids": True,
    }
    if model is not None:
        body["model"] = model
    result = RequestResult(ok=False, prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                n = sum(len(c["logprobs"]["tokens"]) for c in chunk["choices"])
                if n == 0:
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itls += [(now - last) / n] * n
                result.output_tokens += n
                last = now
        result.latency = time.perf_counter() - start
        result.ok = True
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_trace(
    url: str,
    trace: RequestTrace,
    *,
    model: str | None = None,
    max_concurrency: int | None = None,
    timeout_s: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """Sends `trace`'s requests at their arrival offsets (at most `max_concurrency` in
    flight); returns their results in trace order and the run's duration in seconds."""
    limit = asyncio.Semaphore(max_concurrency or len(trace.prompts))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, trace.arrivals[i] - (time.perf_counter() - start)))
            async with limit:
                return await send_request(
                    client, url, trace.prompts[i], trace.output_lens[i], model
                )

        results = await asyncio.gather(*(one(i) for i in range(len(trace.prompts))))
        return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    """Completed and failed requests, throughput, and TTFT / TPOT / ITL / E2E latency
    percentiles (p50/p90/p99) and means in milliseconds, over the completed requests."""
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)

    def stats(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"mean_ms": None, **{f"p{p}_ms": None for p in PERCENTILES}}
        ms = np.asarray(values) * 1e3
        return {
            "mean_ms": float(ms.mean()),
            **{
                f"p{p}_ms": float(v)
                for p, v in zip(PERCENTILES, np.percentile(ms, PERCENTILES), strict=True)
            },
        }

    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output / duration_s if duration_s > 0 else 0.0,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": output,
        "ttft": stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot": stats([t for r in ok if (t := r.tpot) is not None]),
        "itl": stats([t for r in ok for t in r.itls]),
        "e2e_latency": stats([r.latency for r in ok if r.latency is not None]),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a table, as `vllm bench serve` prints it."""
    lines = [
        f"{'Successful requests:':<40}{summary['completed']}",
        f"{'Failed requests:':<40}{summary['failed']}",
        f"{'Benchmark duration (s):':<40}{summary['duration_s']:.2f}",
        f"{'Total input tokens:':<40}{summary['total_input_tokens']}",
        f"{'Total generated tokens:':<40}{summary['total_output_tokens']}",
        f"{'Request throughput (req/s):':<40}{summary['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:.2f}",
    ]
    for key, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e_latency", "E2E")):
        for stat, value in summary[key].items():
            shown = "-" if value is None else f"{value:.2f}"
            name = stat.replace("_ms", "").replace("p", "P", 1) if stat != "mean_ms" else "Mean"
            lines.append(f"{f'{name} {title} (ms):':<40}{shown}")
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
