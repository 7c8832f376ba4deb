"""paxkv-bench: the load benchmark, paged against contiguous allocation at equal KV memory.

    paxkv-bench                                  # tiny model, ShareGPT-like, on the CPU
    paxkv-bench --workload=shared_prefix --request_rate=4 --json_out=out.json --plot_out=out.png

The same requests run through the same engine, with the same KV memory
(`--kv_budget_mib`, or the memory of `--num_pages` uniform pages), once per set-up:
paged, paged with uniform allocation (models with sliding-window layers only: every
layer keeps every page), contiguous max-length reservation, and contiguous
guessed-length reservation (see `paxkv.measure.load_bench`). A page of the grouped
cache holds fewer layers (`paxkv.host.kv_groups`), so "paged" gets more pages there.
"""

from __future__ import annotations

import dataclasses
import json

import jax
from absl import flags

from paxkv.host.kv_groups import KVCacheGroups
from paxkv.launch import exit_with_error, list_in_help, platform, run_app
from paxkv.launch import flags as launch_flags
from paxkv.measure.load_bench import (
    SETUPS,
    WORKLOADS,
    format_table,
    make_workload,
    progress_bar,
    run_setup,
)
from paxkv.pallas_kernels.layout import cdiv, kv_page_bytes, resolve_kv_cache_dtype

_WORKLOAD = flags.DEFINE_enum("workload", "sharegpt", list(WORKLOADS), "Request lengths.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 32, "Requests in the workload.", lower_bound=1)
_RATE = flags.DEFINE_float(
    "request_rate", float("inf"), "Mean arrivals per second (inf: all at once)."
)
_BURSTINESS = flags.DEFINE_float(
    "burstiness", 1.0, "Gamma shape of the inter-arrival times (1: Poisson)."
)
_KV_BUDGET_MIB = flags.DEFINE_float(
    "kv_budget_mib", 32.0, "KV memory of every set-up, in MiB (ignored with --num_pages)."
)
_GUESS = flags.DEFINE_integer(
    "guess_tokens", 128, "Output tokens contiguous_guess reserves per request.", lower_bound=1
)
_FIXED_PROMPT = flags.DEFINE_list(
    "fixed_prompt_len", ["64", "512"], "--workload=fixed: prompt lengths lo,hi."
)
_FIXED_OUTPUT = flags.DEFINE_list(
    "fixed_output_len", ["32", "256"], "--workload=fixed: output lengths lo,hi."
)
_SETUPS = flags.DEFINE_list("setups", list(SETUPS), f"Set-ups to run, of {', '.join(SETUPS)}.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
_PLOT_OUT = flags.DEFINE_string("plot_out", None, "Write a PNG plot here (needs matplotlib).")


def main(argv: list[str]) -> None:
    """The absl main: runs the load benchmark from flags."""
    if len(argv) > 1:
        exit_with_error(f"unexpected arguments {argv[1:]}")
    try:
        launch_flags.init_runtime()
        results = _run()
        print(format_table(results))
        if _JSON_OUT.value:
            with open(_JSON_OUT.value, "w") as f:
                json.dump(results, f, indent=2)
        if _PLOT_OUT.value:
            from paxkv.measure.bench_plot import plot

            plot(results, _PLOT_OUT.value)
    except (ValueError, OSError) as e:
        exit_with_error(str(e))


def _run() -> dict:
    setup = launch_flags.serving_setup()
    platform.announce("paxkv-bench", setup.engine.attention_backend)
    unknown = sorted(set(_SETUPS.value) - set(SETUPS))
    if unknown:
        raise ValueError(f"--setups has {unknown}; choose from {list(SETUPS)}")
    if not _RATE.value > 0:
        raise ValueError(f"--request_rate={_RATE.value} must be > 0 (inf: all at once)")
    model_cfg, engine_cfg = setup.model, setup.engine
    page_dtype = resolve_kv_cache_dtype(engine_cfg.kv_cache_dtype, model_cfg.dtype)
    per_page = kv_page_bytes(
        num_layers=model_cfg.num_layers,
        num_kv_heads=model_cfg.num_kv_heads,
        page_size=engine_cfg.page_size,
        head_dim=model_cfg.head_dim,
        page_dtype=page_dtype,
        platform=jax.default_backend(),
    )
    if launch_flags.NUM_PAGES.value is not None:
        num_pages = engine_cfg.num_pages
    else:
        num_pages = int(_KV_BUDGET_MIB.value * 2**20) // per_page
    one_seq = cdiv(engine_cfg.max_model_len, engine_cfg.page_size) + 1
    if num_pages < one_seq:
        raise ValueError(
            f"a KV budget of {num_pages * per_page / 2**20:.2f} MiB ({num_pages} pages) cannot hold one "
            f"sequence of max_model_len={engine_cfg.max_model_len}: that needs {one_seq} pages, "
            f"{one_seq * per_page / 2**20:.2f} MiB"
        )
    workload = make_workload(
        _WORKLOAD.value,
        num_requests=_NUM_REQUESTS.value,
        vocab_size=model_cfg.vocab_size,
        max_model_len=engine_cfg.max_model_len,
        seed=launch_flags.SEED.value,
        request_rate=_RATE.value,
        burstiness=_BURSTINESS.value,
        fixed_prompt_len=_range(_FIXED_PROMPT),
        fixed_output_len=_range(_FIXED_OUTPUT),
    )
    layout = KVCacheGroups.for_model(model_cfg, hybrid=engine_cfg.hybrid_kv_cache)
    # A page of the grouped cache holds `num_slots` layers: more of them fit the budget.
    grouped_pages = num_pages * model_cfg.num_layers // layout.num_slots
    names = [s for s in SETUPS if s in _SETUPS.value]
    if not layout.has_windows and "paged_uniform" in names:
        names.remove("paged_uniform")  # the same as "paged" without windows
    model = launch_flags.build_model(setup)
    results = {
        "workload": {
            **workload.describe(),
            "request_rate": _RATE.value,
            "burstiness": _BURSTINESS.value,
        },
        "model": setup.name,
        "kv_budget_bytes": num_pages * per_page,
        "num_pages": num_pages,
        "page_size": engine_cfg.page_size,
        "max_model_len": engine_cfg.max_model_len,
        "kv_cache_dtype": engine_cfg.kv_cache_dtype,
        "setups": {},
    }
    results["kv_groups"] = layout.describe()
    for name in names:
        pages = grouped_pages if name == "paged" else num_pages
        results["setups"][name] = run_setup(
            name,
            model,
            workload,
            dataclasses.replace(engine_cfg, num_pages=pages),
            guess_tokens=_GUESS.value,
            progress=progress_bar(name),
        )
    return results


# The benchmark's own defaults for the shared engine flags: long contexts and enough
# sequence slots that KV memory, not the sequence cap, bounds concurrency.
BENCH_DEFAULTS = {"max_model_len": 4096, "max_num_seqs": 64, "max_num_batched_tokens": 512}


def _range(flag) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in flag.value)
    except ValueError:
        raise ValueError(
            f"--{flag.name}={','.join(flag.value)} must be two integers lo,hi"
        ) from None
    if not 1 <= lo <= hi:
        raise ValueError(f"--{flag.name}={lo},{hi} must satisfy 1 <= lo <= hi")
    return lo, hi


def run() -> None:
    """Console-script entry point (`paxkv-bench`)."""
    for name, value in BENCH_DEFAULTS.items():
        flags.FLAGS.set_default(name, value)
    list_in_help(__name__, __doc__, launch_flags.__name__)
    run_app(main)


if __name__ == "__main__":
    run()
