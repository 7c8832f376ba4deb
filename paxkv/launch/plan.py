"""The KV capacity planner: how many sequences fit, paged against contiguous, per page size and cache dtype.

    paxkv-plan --config=llama-3.1-8b --device=H200
    paxkv-plan --config=tiny --kv_budget_gib=0.5 --workload=fixed --prompt_len=100 --output_len=28
    paxkv-plan --config=llama-3.1-8b --device=v6e --mesh=model:4,data:2

The KV budget is `--kv_budget_gib`, or `--kv_fraction` of a `--device`'s memory left
after the weights. Lengths are `--workload=fixed` (`--prompt_len` + `--output_len`) or
`--workload=sharegpt` (log-normal with those medians and `--sigma`, capped at
max_model_len). Of the shared flags it reads --config, --model_dir (its config.json),
--dtype, --page_size, --max_model_len, --seed and --mesh; it plans every KV cache dtype.
Prints a markdown report; `--json_out` writes it as JSON. The arithmetic is
`paxkv.tools.capacity`, the report `paxkv.tools.capacity_report`.

With `--mesh` the budget is per device: `--kv_budget_gib` on each device, or
`--kv_fraction` of each device's memory left after its shard of the weights. The tables
are per replica, and the report adds the totals over the mesh. Planning needs no
devices: the mesh is not built.
"""

from __future__ import annotations

import json

from absl import app, flags

from paxkv.launch import exit_with_error, list_in_help
from paxkv.launch import flags as launch_flags
from paxkv.sharding.mesh_shape import ONE_DEVICE, MeshShape
from paxkv.tools import capacity
from paxkv.tools.capacity_report import CapacityReport, build_report, format_bytes
from paxkv.tools.workloads import WORKLOAD_KINDS, Workload

_KV_BUDGET_GIB = flags.DEFINE_float(
    "kv_budget_gib", None, "Bytes for the KV cache, in GiB (instead of --device)."
)
_DEVICE = flags.DEFINE_enum(
    "device",
    None,
    list(capacity.DEVICE_HBM_GIB),
    "Accelerator whose memory, less the weights, holds the KV cache (instead of --kv_budget_gib).",
    case_sensitive=False,
)
_KV_FRACTION = flags.DEFINE_float(
    "kv_fraction", 0.9, "With --device: the share of the memory left after the weights for KV."
)
_WORKLOAD = flags.DEFINE_enum("workload", "sharegpt", list(WORKLOAD_KINDS), "Length distribution.")
_PROMPT_LEN = flags.DEFINE_integer(
    "prompt_len", 128, "Prompt tokens: fixed, or the log-normal median (sharegpt)."
)
_OUTPUT_LEN = flags.DEFINE_integer(
    "output_len", 128, "Output tokens: fixed, or the log-normal median (sharegpt)."
)
_SIGMA = flags.DEFINE_float("sigma", 1.0, "sharegpt: standard deviation of the log lengths.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 100_000, "sharegpt: lengths drawn.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the report as JSON to this path.")


def main(argv: list[str]) -> None:
    """Plans the flags' model and budget; prints the report, or exits with the error."""
    if len(argv) > 1:
        exit_with_error(f"unexpected arguments {argv[1:]}")
    try:
        setup = launch_flags.serving_setup()
        mesh = launch_flags.mesh_shape() or ONE_DEVICE
        report = build_report(
            setup.model,
            name=setup.name,
            budget=_budget(setup.model, mesh),
            workload=Workload(
                _WORKLOAD.value,
                prompt_len=_PROMPT_LEN.value,
                output_len=_OUTPUT_LEN.value,
                sigma=_SIGMA.value,
                num_samples=_NUM_SAMPLES.value,
                seed=launch_flags.SEED.value,
            ),
            page_size=setup.engine.page_size,
            max_model_len=setup.engine.max_model_len,
            mesh=mesh,
        )
        _check_fits(report)
        if _JSON_OUT.value is not None:
            with open(_JSON_OUT.value, "w") as f:
                json.dump(report.to_dict(), f, indent=2)
    except (ValueError, OSError) as e:
        exit_with_error(str(e))
    print(report.to_markdown(), end="")


def _budget(model: capacity.ModelShape, mesh: MeshShape) -> capacity.KVBudget:
    weights = capacity.weights_bytes(model, mesh=mesh)  # on each device
    if (_KV_BUDGET_GIB.value is None) == (_DEVICE.value is None):
        raise ValueError(
            f"pass exactly one of --kv_budget_gib=<GiB> or --device=<{'|'.join(capacity.DEVICE_HBM_GIB)}>"
        )
    if _DEVICE.value is not None:
        return capacity.KVBudget.on_device(
            _DEVICE.value, weights_bytes=weights, kv_fraction=_KV_FRACTION.value
        )
    if not _KV_BUDGET_GIB.value > 0:
        raise ValueError(f"--kv_budget_gib={_KV_BUDGET_GIB.value} must be positive")
    return capacity.KVBudget.given(int(_KV_BUDGET_GIB.value * capacity.GIB), weights_bytes=weights)


def _check_fits(report: CapacityReport) -> None:
    p = report.plans["auto"]
    if p.fits_one_sequence:
        return
    quantized = report.plans["int8"]
    raise ValueError(
        f"a KV budget of {p.kv_budget_bytes} bytes ({format_bytes(p.kv_budget_bytes)}) is too "
        f"small for one sequence of max_model_len={p.max_model_len}: at page_size={p.page_size} a "
        f"{p.page_dtype} cache needs at least {p.min_kv_budget_bytes} bytes "
        f"({format_bytes(p.min_kv_budget_bytes)}: {1 + p.pages_per_seq} pages of "
        f"{p.page_bytes * p.num_layers} bytes, the null page included), an int8 cache "
        f"{quantized.min_kv_budget_bytes} bytes"
    )


def run() -> None:
    """The `paxkv-plan` console script."""
    list_in_help(__name__, __doc__, launch_flags.__name__)
    app.run(main)


if __name__ == "__main__":
    run()
