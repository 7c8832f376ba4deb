"""Compile time of one step bucket against model depth, and the step's temporary memory.

    python -m benchmarks.compile_depth                       # 2, 16, 32, 80 layers
    python -m benchmarks.compile_depth --layers=2,80 --setup=llama-3.1-8b
    python -m benchmarks.compile_depth --layers=2,80 --warmup --scan_layers=true

Each depth is compiled with the layers looped and scanned (`--scan_layers`, both by
default, side by side in one run). `--warmup` compiles every step shape of the
engine's default buckets (`EngineConfig(max_model_len=--max_model_len)`) and reports
their total: the time an engine's warm-up spends compiling.

Lowers and compiles the engine's one-step function (`paxkv.engine.device.step.FORWARD`) ahead
of time on abstract arguments (no weights, no cache allocated) for the preset's shapes
at several depths, on this machine's backend, and reports per depth: seconds to trace
and lower, seconds to compile, and the compiled step's temporary memory
(`compiled.memory_analysis()`) next to the KV cache's size, so a step that copies the
cache shows. One bucket: `--tokens` packed tokens, as many sequences, `--pages` pages
each. Wall-clock seconds of one run per depth; the machine's load is printed.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from paxkv.engine.config import EngineConfig
from paxkv.engine.device.step import FORWARD, Carried, abstract_step_batch
from paxkv.kv_cache import PagedKVCache
from paxkv.models import PRESETS

_SETUP = flags.DEFINE_string("setup", "llama-3.1-8b", "Model preset whose shapes to use.")
_LAYERS = flags.DEFINE_list("layers", ["2", "16", "32", "80"], "Depths to compile.")
_TOKENS = flags.DEFINE_integer("tokens", 256, "Packed tokens (and sequences) of the bucket.")
_PAGES = flags.DEFINE_integer("pages", 64, "Pages per sequence of the bucket.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", 4096, "Pages of the (abstract) KV cache.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
_DTYPE = flags.DEFINE_string(
    "dtype",
    None,
    "Parameter dtype (default: the preset's; the CPU converts bf16 weights "
    "to f32 for its dots, which shows as temporary memory).",
)
_SCAN = flags.DEFINE_list(
    "scan_layers", ["false", "true"], "Layer modes to compile: false (loop), true (scan)."
)
_WARMUP = flags.DEFINE_bool(
    "warmup", False, "Also compile every step shape of the default buckets; report the total."
)
_MAX_MODEL_LEN = flags.DEFINE_integer(
    "max_model_len", 2048, "The engine's max_model_len for --warmup's buckets."
)
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results as JSON here.")


def compile_step(
    config, *, tokens: int, pages: int, num_pages: int, page_size: int, seqs: int | None = None
) -> dict:
    """Traces, lowers and compiles one step of a model of `config` on abstract
    arguments (`seqs` sequences, default `tokens`); returns the seconds of each phase
    and the memory figures."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: _model(config)))
    cache = jax.eval_shape(lambda: PagedKVCache.for_model(config, num_pages, page_size))
    seqs = tokens if seqs is None else seqs
    batch, _ = abstract_step_batch(tokens, seqs, pages, page_size)
    prev = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    carried = Carried(prev, prev)
    t0 = time.perf_counter()
    lowered = FORWARD.trace(graphdef, params, cache, batch, carried, attention_backend="auto")
    lowered = lowered.lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    memory = compiled.memory_analysis()
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    return {
        "num_layers": config.num_layers,
        "scan_layers": config.scan_layers,
        "lower_s": t1 - t0,
        "compile_s": t2 - t1,
        "total_s": t2 - t0,
        "temp_bytes": None if memory is None else int(memory.temp_size_in_bytes),
        "cache_bytes": int(cache_bytes),
    }


def _model(config):
    from paxkv.models import init_model

    return init_model(config)


def compile_warmup(config, *, num_pages: int, page_size: int, max_model_len: int) -> dict:
    """Compiles the step for every shape of the default engine's buckets; the total
    seconds and the number of shapes."""
    engine = EngineConfig(page_size=page_size, max_model_len=max_model_len)
    shapes = engine.buckets().shapes()
    total = 0.0
    for t, s, p in shapes:
        one = compile_step(
            config, tokens=t, seqs=s, pages=p, num_pages=num_pages, page_size=page_size
        )
        total += one["total_s"]
    return {"warmup_shapes": len(shapes), "warmup_s": total}


def main(argv: list[str]) -> None:
    """The absl main: compiles each depth in each layer mode and prints a markdown table."""
    del argv
    base = PRESETS[_SETUP.value]
    if _DTYPE.value:
        base = base.replace(dtype=_DTYPE.value)
    modes = [m.lower() in ("true", "1", "scan") for m in _SCAN.value]
    rows = []
    for depth in (int(x) for x in _LAYERS.value):
        for scan in modes:  # side by side, so load changes hit both alike
            config = base.replace(num_layers=depth, scan_layers=scan)
            row = compile_step(
                config,
                tokens=_TOKENS.value,
                pages=_PAGES.value,
                num_pages=_NUM_PAGES.value,
                page_size=_PAGE_SIZE.value,
            )
            if _WARMUP.value:
                row |= compile_warmup(
                    config,
                    num_pages=_NUM_PAGES.value,
                    page_size=_PAGE_SIZE.value,
                    max_model_len=_MAX_MODEL_LEN.value,
                )
            rows.append(row)
    print(f"load average {os.getloadavg()[0]:.2f}, {jax.default_backend()}, {_SETUP.value}")
    warm = " warm-up (s) |" if _WARMUP.value else ""
    print(
        "| layers | layers run as | lower (s) | compile (s) | total (s) | vs 2 layers |"
        f"{warm} temp memory | KV cache |"
    )
    print("|---:|---|---:|---:|---:|---:|" + ("---:|" if warm else "") + "---:|---:|")
    first = {}
    for r in rows:
        base_total = first.setdefault(r["scan_layers"], r["total_s"])
        temp = "-" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.1f} MiB"
        w = f" {r['warmup_s']:.0f} ({r['warmup_shapes']} shapes) |" if warm else ""
        print(
            f"| {r['num_layers']} | {'scan' if r['scan_layers'] else 'loop'} "
            f"| {r['lower_s']:.1f} | {r['compile_s']:.1f} | {r['total_s']:.1f} "
            f"| {r['total_s'] / base_total:.2f}x |{w} {temp} "
            f"| {r['cache_bytes'] / 2**30:.1f} GiB |"
        )
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    app.run(main)
