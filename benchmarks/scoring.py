"""Benchmark: the device cost of prompt logprobs against plain prefill.

    python -m benchmarks.scoring [--model=tiny] [--tokens=256] [--k=5] [--runs=7]

One prefill step of `--tokens` prompt tokens (`--num_seqs` prompts), laid out by the
engine's own scheduler and batch layout, run through the compiled step twice over: as
plain prefill (logits at each sequence's last row only) and with
`prompt_logprobs=--k` (every prompt row scored on the device: its target's logprob,
rank and the top-k). Each variant's step is timed `--runs` times, alternated, and the
median per prompt token is reported, as wall time (the device's: each call waits for
its result) and the calling thread's CPU time. On the CPU the "device" is the CPU.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
from absl import app, flags

_MODEL = flags.DEFINE_string("model", "tiny", "A paxkv.models preset or checkpoint directory.")
_TOKENS = flags.DEFINE_integer("tokens", 256, "Prompt tokens in the prefill step.")
_NUM_SEQS = flags.DEFINE_integer("num_seqs", 4, "Prompts sharing the step.")
_K = flags.DEFINE_integer("k", 5, "prompt_logprobs (the top-k reported per position).")
_RUNS = flags.DEFINE_integer("runs", 7, "Timed runs per variant, alternated.")


def prefill_batches(model: Any, tokens: int, num_seqs: int, k: int) -> dict[str, Any]:
    """`{"plain": (engine, host batch), "prompt_logprobs": ...}`: the same prefill step of
    `num_seqs` prompts of `tokens // num_seqs` tokens, without and with prompt_logprobs=k."""
    from paxkv.engine import Engine, EngineConfig
    from paxkv.host.request import SamplingParams

    per_seq = tokens // num_seqs
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, per_seq).tolist() for _ in range(num_seqs)]
    out = {}
    for name, prompt_logprobs in (("plain", None), ("prompt_logprobs", k)):
        config = EngineConfig(
            num_pages=num_seqs * (per_seq // 16 + 2) + 1,
            page_size=16,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=tokens,
            max_model_len=per_seq + 16,
            token_buckets=(tokens,),
            max_logprobs=k,
            enable_prefix_caching=False,
            log_stats_interval_s=0,
        )
        engine = Engine(model, config)
        params = SamplingParams(max_tokens=1, prompt_logprobs=prompt_logprobs)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        plan, hb = engine.batch_builder.build_batch(engine.scheduler.schedule())
        assert plan.num_tokens == per_seq * num_seqs, "the prompts must fit one step"
        out[name] = (engine, hb)
    return out


def time_step(engine: Any, hb: Any) -> tuple[float, float]:
    """(wall seconds, thread CPU seconds) of one dispatched and fetched step of `hb`."""
    w0, c0 = time.perf_counter(), time.thread_time_ns()
    jax.block_until_ready(engine.runner.fetch(engine.runner.dispatch(hb)))
    return time.perf_counter() - w0, (time.thread_time_ns() - c0) / 1e9


def measure(model: Any, tokens: int, num_seqs: int, k: int, runs: int) -> dict[str, Any]:
    """Median wall and thread-CPU microseconds per prompt token of each variant, and the
    relative extra wall time of prompt_logprobs."""
    batches = prefill_batches(model, tokens, num_seqs, k)
    for engine, hb in batches.values():  # compiles each variant, untimed
        time_step(engine, hb)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in batches}
    for _ in range(runs):
        for name, (engine, hb) in batches.items():
            times[name].append(time_step(engine, hb))
    n = num_seqs * (tokens // num_seqs)
    result = {}
    for name, ts in times.items():
        wall, cpu = np.median(np.array(ts), axis=0)
        result[name] = {"wall_us_per_token": 1e6 * wall / n, "cpu_us_per_token": 1e6 * cpu / n}
    plain, scored = result["plain"]["wall_us_per_token"], result["prompt_logprobs"]
    result["extra_wall"] = scored["wall_us_per_token"] / plain - 1
    return result


def main(argv: list[str]) -> None:
    """Prints the two variants' costs per prompt token side by side."""
    del argv
    from paxkv.models import load_model

    _, model, _ = load_model(_MODEL.value, dtype="float32")
    r = measure(model, _TOKENS.value, _NUM_SEQS.value, _K.value, _RUNS.value)
    print(
        f"backend={jax.default_backend()} model={_MODEL.value} tokens={_TOKENS.value} k={_K.value}"
    )
    print(f"{'variant':<18}{'wall us/token':>15}{'cpu us/token':>15}")
    for name in ("plain", "prompt_logprobs"):
        print(
            f"{name:<18}{r[name]['wall_us_per_token']:>15.2f}{r[name]['cpu_us_per_token']:>15.2f}"
        )
    print(
        f"prompt_logprobs costs {100 * r['extra_wall']:+.1f}% device (wall) time per prompt token"
    )


if __name__ == "__main__":
    app.run(main)
