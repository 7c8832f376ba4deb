"""Benchmark: paxkv's ragged paged attention kernel against JAX's bundled kernel and XLA.

    python -m benchmarks.kernels [--batch_sizes=1,8,32,128,256]
        [--contexts=512,2048,8192,32768] [--prefill_lens=512,2048,8192] [--json_out=F]
    python -m benchmarks.kernels --tiny   # seconds on the CPU, kernels interpreted

On one device and in one run it measures the device's copy bandwidth (a large
device-to-device copy) and matmul rate (a large matmul), then for every configuration
times, on the same inputs:

* `paxkv`: our kernel for the backend (`ragged_paged_attention_gpu` on GPU,
  `ragged_paged_attention_tpu` on TPU; on the CPU the GPU kernel in the Pallas
  interpreter);
* `jax-pallas`: JAX's bundled Pallas kernel (`jax.experimental.pallas.ops.gpu.
  paged_attention` on GPU, decode only; `...ops.tpu.ragged_paged_attention` on TPU), with
  the cache copied into its layout;
* `xla-dense`: attention over a contiguous (unpaged) copy of the cache in plain jnp.

Decode rows report the achieved bandwidth, the bytes of K/V (and scales) that must be
read divided by the median time, as a fraction of the copy bandwidth. Prefill rows (fresh
causal prefills) report useful FLOP/s (the causal triangle only) as a fraction of the
matmul rate. Times are medians over --iters calls after --warmup calls, each ended with
`block_until_ready`. The table goes to stdout as markdown; --json_out also writes JSON.

This module runs the sweep; the cases are `kernel_cases`', the implementations
`kernel_impls`' and the device rates and table `kernel_report`'s.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from benchmarks.kernel_cases import (
    IMPLS,
    Settings,
    causal_prefill_flops,
    kv_bytes,
    make_inputs,
)
from benchmarks.kernel_impls import dense_attention_fn, jax_pallas_fn, paxkv_fn
from benchmarks.kernel_report import add_rates, copy_bandwidth, markdown_table, matmul_rate
from benchmarks.timing import median_seconds
from paxkv.pallas_kernels.layout import page_bytes

_BATCH_SIZES = flags.DEFINE_list(
    "batch_sizes", ["1", "8", "32", "128", "256"], "Decode batch sizes."
)
_CONTEXTS = flags.DEFINE_list(
    "contexts", ["512", "2048", "8192", "32768"], "Decode context lengths."
)
_PREFILL_LENS = flags.DEFINE_list("prefill_lens", ["512", "2048", "8192"], "Fresh prefill lengths.")
_PREFILL_BATCH = flags.DEFINE_integer("prefill_batch", 1, "Sequences per prefill batch.")
_NUM_Q_HEADS = flags.DEFINE_integer("num_q_heads", 32, "Query heads.")
_NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dim.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Query (and unquantized page) dtype.")
_PAGE_DTYPE = flags.DEFINE_string(
    "page_dtype", None, "Page dtype (int8, float8_e4m3fn...); default: --dtype."
)
_ITERS = flags.DEFINE_integer("iters", 10, "Timed calls per measurement.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed calls (compile included) before timing.")
_MAX_KV_GIB = flags.DEFINE_float(
    "max_kv_gib", 24.0, "Skip configurations whose K/V (one layout) or dense logits exceed this."
)
_COPY_MIB = flags.DEFINE_integer("copy_mib", 4096, "Size of the copy that measures bandwidth.")
_MATMUL_SIZE = flags.DEFINE_integer(
    "matmul_size", 8192, "n of the n x n x n matmul that measures FLOP/s."
)
_IMPLS = flags.DEFINE_list("impls", list(IMPLS), "Implementations to time.")
_TINY = flags.DEFINE_bool(
    "tiny",
    False,
    "Tiny sizes (overriding the size flags): runs on the CPU in seconds, kernels interpreted.",
)
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the results here as JSON.")


def run_config(settings: Settings, kind: str, batch: int, context: int) -> list[dict]:
    """Times every implementation on one configuration; one result row per implementation."""
    decode = kind == "decode"
    q_len = 1 if decode else context
    row = dict(kind=kind, batch=batch, context=context, q_tokens=batch * q_len)
    token_bytes = page_bytes(
        num_kv_heads=settings.num_kv_heads,
        page_size=1,
        head_dim=settings.head_dim,
        page_dtype=settings.page_dtype,
    )
    cache_bytes = batch * context * token_bytes
    logits_bytes = 4 * batch * settings.num_q_heads * q_len * context
    if max(cache_bytes, logits_bytes) > settings.max_kv_gib * 2**30:
        return [
            dict(row, impl=impl, error=f"skipped: over --max_kv_gib={settings.max_kv_gib}")
            for impl in settings.impls
        ]
    inputs = make_inputs(settings, batch, context, q_len)
    work = dict(
        kv_bytes=kv_bytes(inputs, batch, context),
        flops=causal_prefill_flops(batch, context, settings.num_q_heads, settings.head_dim)
        if not decode
        else 4 * batch * settings.num_q_heads * settings.head_dim * context,
    )
    builders = {
        "paxkv": lambda x: paxkv_fn(x, decode=decode),
        # The TPU kernel with one work item per grid step (the default decode runs 8):
        # the fixed cost of a grid step, side by side.
        "paxkv-1-item": lambda x: paxkv_fn(x, decode=decode, items_per_step=1),
        "jax-pallas": lambda x: jax_pallas_fn(x, decode=decode),
        "xla-dense": lambda x: dense_attention_fn(x, batch, context, q_len),
    }
    results, outputs = [], {}
    for impl in settings.impls:
        result = dict(row, impl=impl, **work)
        try:
            fn = builders[impl](inputs)
            if isinstance(fn, str):
                result["error"] = fn
            else:
                result["median_s"] = median_seconds(
                    fn, iters=settings.iters, warmup=settings.warmup
                )
                outputs[impl] = np.asarray(fn().astype(jnp.float32))
        except Exception as e:  # one failing implementation must not end the sweep
            logging.exception("%s %s batch=%d context=%d failed", impl, kind, batch, context)
            result["error"] = (
                f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            )
        results.append(result)
    if "xla-dense" in outputs:  # a fast wrong kernel is not a result
        for result in results:
            if result["impl"] in outputs and result["impl"] != "xla-dense":
                diff = np.abs(outputs[result["impl"]] - outputs["xla-dense"])
                result["max_abs_diff_vs_dense"] = float(diff.max(initial=0.0))
    return results


def run(settings: Settings) -> dict:
    """The whole benchmark; returns the report (device rates, settings, result rows)."""
    unknown = set(settings.impls) - set(IMPLS)
    if unknown:
        raise ValueError(f"impls={sorted(unknown)} must be among {IMPLS}")
    copy = copy_bandwidth(settings)
    flops = matmul_rate(settings)
    logging.info("copy %.1f GB/s, matmul %.2f TFLOP/s", copy / 1e9, flops / 1e12)
    results = []
    for batch in settings.batch_sizes:
        for context in settings.contexts:
            logging.info("decode batch=%d context=%d", batch, context)
            results += run_config(settings, "decode", batch, context)
    for length in settings.prefill_lens:
        logging.info("prefill batch=%d length=%d", settings.prefill_batch, length)
        results += run_config(settings, "prefill", settings.prefill_batch, length)
    device = jax.devices()[0]
    return dict(
        device=device.device_kind,
        backend=jax.default_backend(),
        jax_version=jax.__version__,
        copy_bytes_per_s=copy,
        matmul_flops_per_s=flops,
        settings=dataclasses.asdict(settings),
        results=add_rates(results, copy, flops),
    )


def settings_from_flags() -> Settings:
    """The run's settings from the flags (`--tiny` overrides the sizes)."""
    if _TINY.value:
        return Settings.tiny(impls=tuple(_IMPLS.value))
    ints = lambda values: tuple(int(v) for v in values)
    return Settings(
        batch_sizes=ints(_BATCH_SIZES.value),
        contexts=ints(_CONTEXTS.value),
        prefill_lens=ints(_PREFILL_LENS.value),
        prefill_batch=_PREFILL_BATCH.value,
        num_q_heads=_NUM_Q_HEADS.value,
        num_kv_heads=_NUM_KV_HEADS.value,
        head_dim=_HEAD_DIM.value,
        page_size=_PAGE_SIZE.value,
        dtype=_DTYPE.value,
        page_dtype=_PAGE_DTYPE.value or _DTYPE.value,
        iters=_ITERS.value,
        warmup=_WARMUP.value,
        max_kv_gib=_MAX_KV_GIB.value,
        copy_mib=_COPY_MIB.value,
        matmul_size=_MATMUL_SIZE.value,
        impls=tuple(_IMPLS.value),
    )


def main(argv: list[str]) -> None:
    """Runs the benchmark with the flags' settings; prints the table, writes the JSON."""
    del argv
    report = run(settings_from_flags())
    print(markdown_table(report))
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    app.run(main)
