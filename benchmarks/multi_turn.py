"""Benchmark: multi-turn conversations over a device pool too small for them, host KV tier
off against on (`kv_host_cache_gib`), at equal device memory.

    python -m benchmarks.multi_turn [--conversations=8] [--num_pages=96] [--kv_host_cache_gib=0.05]

Each conversation has 8 to 16 turns; a turn's prompt is the whole history (every earlier
user message and reply) plus a new user message of 24 to 40 tokens, and the reply is 16
greedy tokens. Each round submits the next turn of every live conversation at once, so
the pool must hold all of their histories to keep them: it holds about a third. The
model is tiny-py (the trained byte-level model shipped in the package), in float32 on
this machine's default JAX device; everything is compiled before the timed run
(`warmup`). Reported per setting: prompt tokens, prefill tokens computed (prompt tokens
less those served from a cache), the device prefix cache's and the host tier's hits, the
preemptions with the tokens they dropped and, of those, the ones a resumed sequence took
back from a cache (device or host tier) instead of recomputing, the bytes copied each
way, the median and p90 time to first token, and the wall time; then whether every
reply was the same token for token.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import numpy as np
from absl import app, flags

from paxkv.engine import Engine, EngineConfig
from paxkv.host.request import SamplingParams
from paxkv.models import load_model

REPLY = 16


def conversations(
    num: int, vocab: int, seed: int, turns: tuple[int, int] = (8, 16)
) -> list[list[list[int]]]:
    """Per conversation, its user messages (`turns` inclusive, of 24 to 40 tokens)."""
    rng = np.random.default_rng(seed)
    return [
        [
            rng.integers(32, min(vocab, 127), int(rng.integers(24, 41))).tolist()
            for _ in range(int(rng.integers(turns[0], turns[1] + 1)))
        ]
        for _ in range(num)
    ]


def engine_config(num_pages: int, page_size: int, num_seqs: int) -> EngineConfig:
    """The benchmark's engine limits."""
    return EngineConfig(
        num_pages=num_pages,
        page_size=page_size,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=256,
        max_model_len=1024,
    )


def run(model, convs: list[list[list[int]]], gib: float, config: EngineConfig) -> dict:
    """Runs `convs` round by round on an engine of `config` with a host tier of `gib`
    GiB (0: none)."""
    config = dataclasses.replace(config, kv_host_cache_gib=gib)
    page_size = config.page_size
    engine = Engine(model, config)
    engine.warmup()
    compiled = engine.num_compilations
    params = SamplingParams(temperature=0.0, max_tokens=REPLY, ignore_eos=True)
    histories: list[list[int]] = [[] for _ in convs]
    replies: list[list[list[int]]] = [[] for _ in convs]
    prompt_tokens = computed = 0
    ttfts = []
    t0 = time.perf_counter()
    for turn in range(max(len(c) for c in convs)):
        live = [i for i, c in enumerate(convs) if turn < len(c)]
        for i in live:
            histories[i] = histories[i] + convs[i][turn]
            engine.add_request(f"{i}-{turn}", {"prompt_token_ids": histories[i]}, params)
        done = engine.run_until_done()
        for i in live:
            out = done[f"{i}-{turn}"]
            reply = list(out.outputs[0].token_ids)
            replies[i].append(reply)
            prompt_tokens += len(histories[i])
            computed += len(histories[i]) - out.num_cached_tokens
            ttfts.append(out.metrics.ttft)
            histories[i] = histories[i] + reply
    wall = time.perf_counter() - t0
    stats = engine.stats()
    assert engine.pool.num_in_use == 0, "pages leaked"
    return {
        "kv_host_cache_gib": gib,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": computed,
        "device_prefix_hits": stats["prefix_cache_hits"],
        "host_tier_hit_tokens": stats.get("kv_host_tier_hits", 0) * page_size,
        "preemptions": stats["num_preemptions"],
        "preempted_tokens": stats["num_recomputed_tokens"],
        "preempted_tokens_reused": stats["num_preempted_tokens_reused"],
        "bytes_to_host": stats.get("kv_offload_bytes_to_host", 0),
        "bytes_to_device": stats.get("kv_offload_bytes_to_device", 0),
        "ttft_median_ms": 1e3 * statistics.median(ttfts),
        "ttft_p90_ms": 1e3 * float(np.percentile(ttfts, 90)),
        "wall_s": wall,
        "compiled_after_warmup": engine.num_compilations - compiled,
        "replies": replies,
    }


def main(argv: list[str]) -> None:
    """Runs the conversations with the tier off, then on, and prints the table."""
    del argv
    f = flags.FLAGS
    config, model, _ = load_model("tiny-py", dtype="float32")
    convs = conversations(f.conversations, config.vocab_size, f.seed)
    config = engine_config(f.num_pages, f.page_size, len(convs))
    results = [run(model, convs, 0.0, config), run(model, convs, f.kv_host_cache_gib, config)]
    same = results[0]["replies"] == results[1]["replies"]
    keys = [k for k in results[0] if k not in ("replies", "kv_host_cache_gib")]
    print(f"{'':28}{'tier off':>14}{'tier on':>14}")
    for k in keys:
        a, b = results[0][k], results[1][k]
        fmt = "{:>14.1f}" if isinstance(a, float) else "{:>14d}"
        print(f"{k:28}" + fmt.format(a) + fmt.format(b))
    print(f"replies equal token for token: {same}")
    if f.results_json:
        with open(f.results_json, "w") as out:
            json.dump(
                {"runs": [{k: v for k, v in r.items() if k != "replies"} for r in results],
                 "replies_equal": same},
                out, indent=1,
            )  # fmt: skip


if __name__ == "__main__":
    # Defined here, not at import: tests import several benchmarks into one process.
    flags.DEFINE_integer("conversations", 8, "Conversations at once.")
    flags.DEFINE_integer("num_pages", 96, "Device KV pages (page 0 reserved).")
    flags.DEFINE_integer("page_size", 16, "Tokens per page.")
    flags.DEFINE_float("kv_host_cache_gib", 0.05, "The host tier's size in the 'on' run.")
    flags.DEFINE_integer("seed", 0, "Seed of the conversations.")
    flags.DEFINE_string("results_json", None, "Write the results as JSON here.")
    app.run(main)
