"""Benchmark: vLLM's v1 scheduler replaying a `host_step` trace, for a side-by-side.

    PYTHONPATH=. /tmp/vllm-venv/bin/python -m benchmarks.vllm_scheduler \\
        --trace=FILE [--vocab=32000] [--repeat=1] [--json_out=FILE]

vLLM is not a paxkv dependency, and this module imports nothing of it until it runs
(the test suite imports it without vLLM). It needs vLLM 0.33 and absl-py in a venv of
their own (Python 3.11 or 3.12 both work; use paxkv's for a like-for-like comparison),
with paxkv's sources on `PYTHONPATH` (it imports nothing else of paxkv):

    python3.11 -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install vllm==0.33.0 absl-py

It drives `vllm.v1.core.sched.scheduler.Scheduler` itself, the class vLLM's engine
core steps, with a fake model: each step `schedule()`, then `update_from_output()`
with a `ModelRunnerOutput` that samples token 1 for every scheduled request whose
prompt is done (none for a partial prefill chunk, as vLLM's model runner discards
those). Requests are vLLM `Request`s built as its engine core builds them (the
prefix-caching block hasher, sha256 by default), with `max_tokens` from the trace,
`ignore_eos` and greedy sampling; each is added before step `arrival_step`, as
`host_step` submits them. The configuration matches `host_step`'s defaults: 16384
blocks of 16 tokens, 256 running at most, 8192 tokens per step, chunked prefill and
prefix caching on, one full-attention KV-cache group; the model is a one-layer Llama
config of `--vocab` tokens written to a temporary folder (no weights, nothing
downloaded), on the CPU device.

Each step's `schedule()` and `update_from_output()` are timed on the thread's CPU
clock (`time.thread_time_ns`) and the wall clock; the fake model's output and the
counting of the tokens out of vLLM's `EngineCoreOutputs` are not. What vLLM does
besides in a step (its model runner's input preparation, its front end's output
processing) is not counted. Reported in microseconds (p50 / mean / p99) over all
steps, over the steps with `max_num_seqs` running after the step, and over those of
them in which every scheduled request was given one token: the rows `host_step`
reports.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from absl import app, flags

from benchmarks.step_summary import summary, table

PARTS = ("schedule", "update")
SAMPLED_TOKEN = 1  # what the fake model samples, every time
INSTALL_HINT = (
    "this benchmark needs vLLM 0.33 and absl-py in a venv of their own: "
    "`python3.11 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm==0.33.0 "
    "absl-py`, then run it with `PYTHONPATH=. /tmp/vllm-venv/bin/python -m "
    "benchmarks.vllm_scheduler` from paxkv's checkout"
)


def define_flags() -> None:
    """Defines the command's flags; called only when run as a script, so that importing
    this module (the tests do) defines no global absl flags."""
    flags.DEFINE_string("trace", None, "Trace JSON to replay (host_step --make_trace).")
    flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
    flags.DEFINE_integer("num_pages", 16384, "KV blocks.")
    flags.DEFINE_integer("page_size", 16, "Tokens per block.")
    flags.DEFINE_integer("max_num_seqs", 256, "Sequences running at once.")
    flags.DEFINE_integer("max_num_batched_tokens", 8192, "Tokens per step.")
    flags.DEFINE_bool("enable_prefix_caching", True, "Prefix caching.")
    flags.DEFINE_integer("vocab", 32000, "The fake model's vocabulary.")
    flags.DEFINE_integer(
        "repeat", 1, "Replays of the trace, each on a new scheduler; steps pooled.", lower_bound=1
    )


def _fake_model_dir(vocab: int, max_model_len: int) -> str:
    """A folder holding a one-layer Llama `config.json` (no weights): what vLLM's
    `ModelConfig` reads to know the model."""
    folder = tempfile.mkdtemp(prefix="vllm-fake-model-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 1,
        "max_position_embeddings": max_model_len,
        "torch_dtype": "float32",
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def make_scheduler(
    *,
    num_pages: int,
    page_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    enable_prefix_caching: bool,
    vocab: int,
) -> tuple[Any, Any]:
    """vLLM's v1 `Scheduler` over `num_pages` blocks of `page_size` tokens, and the
    block hasher its engine core gives each `Request` (None without prefix caching)."""
    try:
        import torch
        from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError as e:
        raise SystemExit(f"{e}: {INSTALL_HINT}") from e

    model_config = ModelConfig(
        model=_fake_model_dir(vocab, max_model_len),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="float32",
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=page_size, enable_prefix_caching=enable_prefix_caching)
    cache_config.num_gpu_blocks = num_pages
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=DeviceConfig(device="cpu"),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_pages,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"],
                FullAttentionSpec(
                    block_size=page_size, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=page_size,
        log_stats=False,
    )
    hasher = None
    if enable_prefix_caching:
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(page_size, hash_fn)
    return scheduler, hasher


def _fake_model_output(scheduler: Any, scheduler_output: Any) -> Any:
    """The fake model's step: `SAMPLED_TOKEN` for each scheduled request whose prompt
    (and every token it has) is computed after this step; nothing for a partial prefill."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([SAMPLED_TOKEN] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def run(
    trace: dict[str, Any],
    schedulers: Iterable[tuple[Any, Any]],
    max_num_seqs: int,
) -> dict[str, Any]:
    """Replays `trace` through each of vLLM's `schedulers` ((scheduler, block hasher)
    pairs, `make_scheduler`'s) in turn with the fake model; returns the results
    (`host_step.run`'s shape, parts schedule and update), every replay's steps pooled
    (the counts: the last replay's)."""
    rows: list[dict[str, Any]] = []
    forced = {r["id"]: r["max_tokens"] for r in trace["requests"]}
    finished, replays = True, 0
    for scheduler, hasher in schedulers:
        finished = finished and _replay(trace, scheduler, hasher, rows) == forced
        replays += 1
    for row in rows:
        for clock in ("cpu", "wall"):
            row[f"{clock}_total"] = row[f"{clock}_schedule"] + row[f"{clock}_update"]
    pool = scheduler.kv_cache_manager.block_pool
    at_max = lambda r: r["running"] == max_num_seqs
    return {
        "steps": len(rows) // replays,
        "repeat": replays,
        "peak_running": max((r["running"] for r in rows), default=0),
        "all_finished": finished,
        # Every block but the null block is free again (cached ones are evictable).
        "blocks_in_use_at_end": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
        "per_step_us": {
            clock: {
                "all": _summary(rows, clock, lambda r: True),
                "at_max_num_seqs": _summary(rows, clock, at_max),
                "decode_only_at_max_num_seqs": _summary(
                    rows, clock, lambda r: at_max(r) and r["decode_only"]
                ),
            }
            for clock in ("cpu", "wall")
        },
    }


def _replay(
    trace: dict[str, Any], scheduler: Any, hasher: Any, rows: list[dict[str, Any]]
) -> dict[str, int]:
    """One replay of `trace` through `scheduler`, appending a row per step to `rows`;
    returns each request's token count."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    requests = sorted(trace["requests"], key=lambda r: r["arrival_step"])
    produced: dict[str, int] = {}
    step, nxt = 0, 0
    while nxt < len(requests) or scheduler.has_unfinished_requests():
        while nxt < len(requests) and requests[nxt]["arrival_step"] <= step:
            r = requests[nxt]
            params = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
            scheduler.add_request(Request(r["id"], r["prompt"], params, None, block_hasher=hasher))
            nxt += 1
        step += 1
        if not scheduler.has_unfinished_requests():
            continue
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        scheduler_output = scheduler.schedule()
        c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
        model_output = _fake_model_output(scheduler, scheduler_output)
        c2, w2 = time.thread_time_ns(), time.perf_counter_ns()
        engine_outputs = scheduler.update_from_output(scheduler_output, model_output)
        c3, w3 = time.thread_time_ns(), time.perf_counter_ns()
        for outs in engine_outputs.values():
            for out in outs.outputs:
                produced[out.request_id] = produced.get(out.request_id, 0) + len(out.new_token_ids)
        rows.append(
            {
                "running": len(scheduler.running),
                "decode_only": all(n == 1 for n in scheduler_output.num_scheduled_tokens.values()),
                "cpu_schedule": (c1 - c0) / 1e3,
                "cpu_update": (c3 - c2) / 1e3,
                "wall_schedule": (w1 - w0) / 1e3,
                "wall_update": (w3 - w2) / 1e3,
            }
        )
    return produced


def _summary(rows, clock: str, keep) -> dict[str, Any]:
    return summary(rows, clock, keep, PARTS)


def _table(result: dict[str, Any]) -> str:
    return table(result, "schedule + update", PARTS)


def main(argv: list[str]) -> None:
    """Replays `--trace` through vLLM's scheduler and prints (and optionally writes) the
    results."""
    del argv
    if flags.FLAGS.trace is None:
        raise app.UsageError("--trace is required (write one with host_step --make_trace)")
    with open(flags.FLAGS.trace) as f:
        trace = json.load(f)
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in trace["requests"])
    schedulers = (
        make_scheduler(
            num_pages=flags.FLAGS.num_pages,
            page_size=flags.FLAGS.page_size,
            max_num_seqs=flags.FLAGS.max_num_seqs,
            max_num_batched_tokens=flags.FLAGS.max_num_batched_tokens,
            max_model_len=max(longest, flags.FLAGS.page_size),
            enable_prefix_caching=flags.FLAGS.enable_prefix_caching,
            vocab=flags.FLAGS.vocab,
        )
        for _ in range(flags.FLAGS.repeat)
    )
    result = run(trace, schedulers, flags.FLAGS.max_num_seqs)
    print(
        f"vLLM scheduler: steps {result['steps']}, peak running {result['peak_running']}, "
        f"all finished {result['all_finished']}"
    )
    print(_table(result))
    if flags.FLAGS.json_out is not None:
        with open(flags.FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    define_flags()
    app.run(main)
