"""Benchmark: paxkv's ragged paged attention kernel against JAX's bundled kernel and XLA.

    python -m paxkv.benchmarks.kernels [--batch_sizes=1,8,32,128,256]
        [--contexts=512,2048,8192,32768] [--prefill_lens=512,2048,8192] [--json_out=F]
    python -m paxkv.benchmarks.kernels --tiny   # seconds on the CPU, kernels interpreted

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
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from paxkv.benchmarks.timing import median_seconds
from paxkv.pallas_kernels.kv_write import pack_kv_pages
from paxkv.pallas_kernels.layout import (
    KEY,
    VALUE,
    cdiv,
    is_quantized,
    kv_lanes,
    page_bytes,
    scale_lanes,
)
from paxkv.pallas_kernels.quantization import dequantize, quantize

IMPLS = ("paxkv", "paxkv-1-item", "jax-pallas", "xla-dense")

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


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a run depends on (the flags, after --tiny)."""

    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    prefill_batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    page_dtype: str
    iters: int
    warmup: int
    max_kv_gib: float
    copy_mib: int
    matmul_size: int
    impls: tuple[str, ...]

    @classmethod
    def tiny(cls, **overrides) -> Settings:
        """Sizes that run on the CPU in seconds (f32, so results compare tightly)."""
        base = dict(
            batch_sizes=(3,), contexts=(40,), prefill_lens=(24,), prefill_batch=2,
            num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32",
            page_dtype="float32", iters=2, warmup=1, max_kv_gib=1.0, copy_mib=8, matmul_size=128,
            impls=IMPLS,
        )  # fmt: skip
        return cls(**{**base, **overrides})


@dataclasses.dataclass
class Inputs:
    """One batch in paxkv's layout, on the device."""

    q: jax.Array  # [T, Hq, D]
    kv_pages: jax.Array  # [P, Hkv, ps, 2 * D]
    kv_scales: jax.Array | None  # bf16[P, Hkv, 2, L]
    kv_lens: jax.Array  # i32[S]
    block_tables: jax.Array  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array  # i32[S + 1]
    num_seqs: jax.Array  # i32[1]
    sm_scale: float

    def args(self) -> tuple[jax.Array, ...]:
        """The kernels' positional arguments: q, the pages, lengths and tables."""
        return (
            self.q,
            self.kv_pages,
            self.kv_lens,
            self.block_tables,
            self.cu_q_lens,
            self.num_seqs,
        )

    def scales(self) -> dict:
        """The kernels' scale keyword arguments: none for unquantized pages."""
        return {} if self.kv_scales is None else {"kv_scales": self.kv_scales}

    def split(self, part: int) -> tuple[jax.Array, jax.Array | None]:
        """K (`part=KEY`) or V pages `[P, Hkv, ps, D]` and their scales, apart, for the
        implementations that take them so (a copy)."""
        _, _, page_size, lanes = self.kv_pages.shape
        scales = None if self.kv_scales is None else self.kv_scales[:, :, part, :page_size]
        return self.kv_pages[..., kv_lanes(part, lanes // 2)], scales


def make_inputs(settings: Settings, batch: int, context: int, q_len: int, seed: int = 0) -> Inputs:
    """`batch` sequences with `context` cached tokens each, the last `q_len` of them new,
    on scattered pages (page 0 is left unused as the null page)."""
    ps = settings.page_size
    pages_per_seq = cdiv(context, ps)
    num_pages = 1 + batch * pages_per_seq
    keys = jax.random.split(jax.random.key(seed), 4)
    perm = 1 + jax.random.permutation(keys[0], num_pages - 1).astype(jnp.int32)
    shape = (num_pages, settings.num_kv_heads, ps, settings.head_dim)

    @jax.jit
    def pages(key):
        return jax.random.normal(key, shape, jnp.float32)

    k, v = pages(keys[1]), pages(keys[2])
    k_scales = v_scales = None
    if is_quantized(settings.page_dtype):
        (k, k_scales), (v, v_scales) = (
            quantize(k, settings.page_dtype),
            quantize(v, settings.page_dtype),
        )
    kv, kv_scales = pack_kv_pages(
        k.astype(settings.page_dtype),
        v.astype(settings.page_dtype),
        k_scales,
        v_scales,
        scale_lanes=scale_lanes(ps, jax.default_backend()),  # as the engine's cache
    )
    q = jax.random.normal(
        keys[3], (batch * q_len, settings.num_q_heads, settings.head_dim), settings.dtype
    )
    return Inputs(
        q=q, kv_pages=kv, kv_scales=kv_scales,
        kv_lens=jnp.full((batch,), context, jnp.int32),
        block_tables=perm.reshape(batch, pages_per_seq),
        cu_q_lens=jnp.arange(0, batch * q_len + 1, q_len, dtype=jnp.int32),
        num_seqs=jnp.asarray([batch], jnp.int32),
        sm_scale=1.0 / math.sqrt(settings.head_dim),
    )  # fmt: skip


def kv_bytes(inputs: Inputs, batch: int, context: int) -> int:
    """Bytes of K/V (and scales) that attention over `context` tokens per sequence must read."""
    _, num_kv_heads, _, head_dim = inputs.kv_pages.shape
    per_token = page_bytes(
        num_kv_heads=num_kv_heads, page_size=1, head_dim=head_dim, page_dtype=inputs.kv_pages.dtype
    )
    return batch * context * per_token


def causal_prefill_flops(batch: int, length: int, num_q_heads: int, head_dim: int) -> int:
    """Useful FLOPs of fresh causal prefills: query i sees i + 1 keys; QK^T and PV."""
    return 2 * 2 * batch * num_q_heads * head_dim * length * (length + 1) // 2


def copy_bandwidth(settings: Settings) -> float:
    """Device-to-device bandwidth in bytes/s: read and write of a `copy_mib` buffer."""
    x = jnp.zeros((settings.copy_mib * 2**20 // 4,), jnp.float32)
    fn = jax.jit(lambda a: a + 1.0)  # one read and one write of every element
    seconds = median_seconds(lambda: fn(x), iters=max(3, settings.iters), warmup=settings.warmup)
    return 2 * x.nbytes / seconds


def matmul_rate(settings: Settings) -> float:
    """FLOP/s of an n x n x n matmul in the run's dtype (f32 accumulation)."""
    n = settings.matmul_size
    a = jax.random.normal(jax.random.key(1), (n, n), settings.dtype)
    fn = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    seconds = median_seconds(lambda: fn(a, a), iters=max(3, settings.iters), warmup=settings.warmup)
    return 2 * n**3 / seconds


def _dequantized(inputs: Inputs) -> tuple[jax.Array, jax.Array]:
    (k, k_scales), (v, v_scales) = inputs.split(KEY), inputs.split(VALUE)
    if k_scales is None:
        return k, v
    return (
        dequantize(k, k_scales).astype(inputs.q.dtype),
        dequantize(v, v_scales).astype(inputs.q.dtype),
    )


def dense_attention_fn(
    inputs: Inputs, batch: int, context: int, q_len: int
) -> Callable[[], jax.Array]:
    """XLA attention over a contiguous copy of the cache (`[S, Hkv, L, D]`), causal."""
    k, v = _dequantized(inputs)
    _, num_kv_heads, _, head_dim = k.shape

    def contiguous(pages):  # [P, Hkv, ps, D] -> [S, Hkv, L, D]
        x = pages[inputs.block_tables]  # [S, pages_per_seq, Hkv, ps, D]
        x = x.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, -1, head_dim)
        return x[:, :, :context]

    k, v = jax.block_until_ready((contiguous(k), contiguous(v)))
    q = inputs.q.reshape(batch, q_len, num_kv_heads, -1, head_dim)  # [S, q, Hkv, G, D]
    q_pos = context - q_len + jnp.arange(q_len)

    @jax.jit
    def attend(q, k, v):
        s = (
            jnp.einsum("sqhgd,shld->shgql", q, k, preferred_element_type=jnp.float32)
            * inputs.sm_scale
        )
        s = jnp.where(jnp.arange(context)[None, :] <= q_pos[:, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        o = jnp.einsum("shgql,shld->sqhgd", p, v, preferred_element_type=jnp.float32)
        return o.reshape(batch * q_len, -1, head_dim).astype(q.dtype)

    return lambda: attend(q, k, v)


def paxkv_fn(
    inputs: Inputs, *, decode: bool, items_per_step: int | None = None
) -> Callable[[], jax.Array] | str:
    """Our kernel for the default backend (the GPU kernel, interpreted, on the CPU). On
    TPU, decode rows use the decode block sizes; `items_per_step` (TPU only) sets how
    many work items a grid step runs (`tpu.BlockSizes`)."""
    backend = jax.default_backend()
    if items_per_step is not None and backend != "tpu":
        return "n/a: TPU only (work items per grid step)"
    if items_per_step is not None and not decode:
        return "n/a: prefill runs one item per grid step by default"
    if backend == "tpu":
        module = importlib.import_module("paxkv.pallas_kernels.tpu.ragged_paged_attention")
        tpu = importlib.import_module("paxkv.pallas_kernels.tpu")
        block_sizes = tpu.BlockSizes(decode=decode, items_per_step=items_per_step)
        kernel, extra = module.ragged_paged_attention_tpu, {"block_sizes": block_sizes}
    else:
        module = importlib.import_module("paxkv.pallas_kernels.gpu.ragged_paged_attention")
        kernel, extra = module.ragged_paged_attention_gpu, {"decode_only": decode}
        extra["interpret"] = backend != "gpu"
    kwargs = dict(sm_scale=inputs.sm_scale, **inputs.scales(), **extra)
    fn = jax.jit(lambda *args: kernel(*args, **kwargs))
    args = inputs.args()
    return lambda: fn(*args)


def jax_pallas_fn(inputs: Inputs, *, decode: bool) -> Callable[[], jax.Array] | str:
    """JAX's bundled Pallas paged attention on the same inputs (its layout is a copy made
    here, outside the timing), or a string saying why it cannot run."""
    backend = jax.default_backend()
    if inputs.kv_scales is not None:
        return "n/a: quantized pages"
    if backend == "tpu":
        return _jax_tpu_ragged_fn(inputs)
    if not decode:
        return "n/a: the bundled GPU kernel is decode only"
    with warnings.catch_warnings():  # deprecated from JAX 0.11
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module("jax.experimental.pallas.ops.gpu.paged_attention")
    pages_per_seq = inputs.block_tables.shape[1]
    # Its constraints: pages_per_seq divisible by k_splits, and the split by the block.
    k_splits = math.gcd(16, pages_per_seq)
    per_block = math.gcd(8, pages_per_seq // k_splits)
    k = jnp.swapaxes(inputs.split(KEY)[0], 0, 1)  # [Hkv, P, ps, D]
    v = jnp.swapaxes(inputs.split(VALUE)[0], 0, 1)
    q = inputs.q * jnp.asarray(inputs.sm_scale, inputs.q.dtype)  # it applies no sm_scale
    fn = jax.jit(
        lambda q, k, v, tables, lens: module.paged_attention(
            q, k, v, tables, lens, k_splits=k_splits, pages_per_compute_block=per_block,
            interpret=backend != "gpu",
        )
    )  # fmt: skip
    k, v = jax.block_until_ready((k, v))
    return lambda: fn(q, k, v, inputs.block_tables, inputs.kv_lens)


def _jax_tpu_ragged_fn(inputs: Inputs) -> Callable[[], jax.Array]:
    module = importlib.import_module("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
    # Its cache is [P, ps, 2 * Hkv, D] with K and V interleaved along the heads.
    k = jnp.swapaxes(inputs.split(KEY)[0], 1, 2)
    v = jnp.swapaxes(inputs.split(VALUE)[0], 1, 2)
    kv = jnp.stack([k, v], axis=3).reshape(*k.shape[:2], -1, k.shape[3])
    kv = jax.block_until_ready(kv)
    fn = jax.jit(lambda *a: module.ragged_paged_attention(*a, sm_scale=inputs.sm_scale))
    args = (inputs.q, kv, inputs.kv_lens, inputs.block_tables, inputs.cu_q_lens, inputs.num_seqs)
    return lambda: fn(*args)


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


def add_rates(
    results: list[dict], copy_bytes_per_s: float, matmul_flops_per_s: float
) -> list[dict]:
    """Adds bandwidth (decode) or FLOP/s (prefill) and their fractions of the device's."""
    for r in results:
        if "median_s" not in r:
            continue
        r["bandwidth_bytes_per_s"] = r["kv_bytes"] / r["median_s"]
        r["bandwidth_fraction"] = r["bandwidth_bytes_per_s"] / copy_bytes_per_s
        r["flops_per_s"] = r["flops"] / r["median_s"]
        r["matmul_fraction"] = r["flops_per_s"] / matmul_flops_per_s
    return results


def markdown_table(report: dict) -> str:
    """The results as a markdown table, with the device's measured rates in a header line."""
    lines = [
        f"device: {report['device']} ({report['backend']}); copy bandwidth "
        f"{report['copy_bytes_per_s'] / 1e9:.1f} GB/s; matmul {report['matmul_flops_per_s'] / 1e12:.2f} "
        f"TFLOP/s ({report['settings']['dtype']}); pages {report['settings']['page_dtype']}, "
        f"Hq={report['settings']['num_q_heads']} Hkv={report['settings']['num_kv_heads']} "
        f"D={report['settings']['head_dim']} page_size={report['settings']['page_size']}; "
        f"medians of {report['settings']['iters']}",
        "",
        "| kind | batch | context | impl | median (us) | GB/s | % copy BW | TFLOP/s | % matmul | max |diff| vs dense | note |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["results"]:
        cells = ["-"] * 5
        if "median_s" in r:  # decode is bandwidth-bound, prefill compute-bound: show that rate
            cells[0] = f"{r['median_s'] * 1e6:.1f}"
            if r["kind"] == "decode":
                cells[1] = f"{r['bandwidth_bytes_per_s'] / 1e9:.1f}"
                cells[2] = f"{100 * r['bandwidth_fraction']:.1f}"
            else:
                cells[3] = f"{r['flops_per_s'] / 1e12:.3f}"
                cells[4] = f"{100 * r['matmul_fraction']:.1f}"
        diff = f"{r['max_abs_diff_vs_dense']:.2e}" if "max_abs_diff_vs_dense" in r else "-"
        lines.append(
            f"| {r['kind']} | {r['batch']} | {r['context']} | {r['impl']} | "
            + " | ".join(cells)
            + f" | {diff} | {r.get('error', '')} |"
        )
    return "\n".join(lines)


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
