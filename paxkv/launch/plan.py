"""The KV capacity planner: how many sequences fit, paged against contiguous, per page size and cache dtype.

    paxkv-plan --setup=llama-3.1-8b --device=H200
    paxkv-plan --setup=tiny --kv_budget_gib=0.5 --workload=fixed --prompt_len=100 --output_len=28
    paxkv-plan --setup=llama-3.1-8b --device=v6e --mesh=model:4,data:2

The KV budget is `--kv_budget_gib`, or `--kv_fraction` of a `--device`'s memory left
after the weights. Lengths are `--workload=fixed` (`--prompt_len` + `--output_len`) or
`--workload=sharegpt` (log-normal with those medians and `--sigma`, capped at
max_model_len). Of the shared flags it reads --config, --model_dir (its config.json),
--dtype, --page_size, --max_model_len, --kv_cache_dtype, --seed and --mesh; it plans
every KV cache dtype. Prints a markdown report; `--json_out` writes it as JSON. The
arithmetic is `paxkv.planner.capacity` (with `parameters` and `kv_budget`), the report
`paxkv.planner.capacity_report`.

When the budget cannot hold one max_model_len sequence in the `--kv_cache_dtype` cache,
the report is still printed in full (the plans that fit and those that do not), then
one `error:` line says what does fit: the other cache dtypes, the longest
--max_model_len, and the smallest `--mesh=model:N` (the weights and KV heads split over
N devices); exit status 1. Bad input is an `error:` line and exit status 2.

With `--mesh` the budget is per device: `--kv_budget_gib` on each device, or
`--kv_fraction` of each device's memory left after its shard of the weights. The tables
are per replica, and the report adds the totals over the mesh. Planning needs no
devices: the mesh is not built.
"""

from __future__ import annotations

import json

from absl import flags

from paxkv.launch import exit_with_error, list_in_help, run_app
from paxkv.launch import flags as launch_flags
from paxkv.launch.setups import ServingSetup
from paxkv.models.decoder_config import DecoderConfig
from paxkv.planner import capacity, kv_budget, parameters
from paxkv.planner.capacity_report import CapacityReport, build_report, format_bytes
from paxkv.planner.workloads import WORKLOAD_KINDS, Workload
from paxkv.sharding.mesh_shape import ONE_DEVICE, MeshShape

_KV_BUDGET_GIB = flags.DEFINE_float(
    "kv_budget_gib", None, "Bytes for the KV cache, in GiB (instead of --device)."
)
_DEVICE = flags.DEFINE_string(
    "device",
    None,
    f"Accelerator whose memory, less the weights, holds the KV cache (instead of "
    f"--kv_budget_gib): one of {', '.join(kv_budget.DEVICE_HBM_GIB)}, any case; a TPU "
    "slice name (v5e-8) names its chip, whose memory each device has.",
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
    """Plans the flags' model and budget and prints the report; exits 1, after the
    report, when the requested cache does not fit one sequence, and 2 on bad input."""
    if len(argv) > 1:
        exit_with_error(f"unexpected arguments {argv[1:]}")
    try:
        setup = launch_flags.serving_setup()
        mesh = launch_flags.mesh_shape() or ONE_DEVICE
        try:
            budget = _budget(setup.model, mesh)
        except ValueError as e:  # the weights fill the device: quantized, or split, may not
            remedies = [_quantization_remedy(setup, mesh), _mesh_remedy(setup, mesh)]
            remedy = " or ".join(r for r in remedies if r is not None)
            raise ValueError(f"{e}; fits with {remedy}" if remedy else str(e)) from None
        report = build_report(
            setup.model,
            name=setup.name,
            budget=budget,
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
        if _JSON_OUT.value is not None:
            with open(_JSON_OUT.value, "w") as f:
                json.dump(report.to_dict(), f, indent=2)
    except (ValueError, OSError) as e:
        exit_with_error(str(e))
    print(report.to_markdown(), end="", flush=True)
    print(_weights_section(setup, mesh), end="", flush=True)
    problem = _fit_problem(report, setup, mesh)
    if problem is not None:
        exit_with_error(problem, status=1)


def _budget(model: DecoderConfig, mesh: MeshShape) -> kv_budget.KVBudget:
    weights = parameters.weights_bytes(model, mesh=mesh)  # on each device
    if (_KV_BUDGET_GIB.value is None) == (_DEVICE.value is None):
        raise ValueError(
            f"pass exactly one of --kv_budget_gib=<GiB> or --device=<{'|'.join(kv_budget.DEVICE_HBM_GIB)}>"
        )
    if _DEVICE.value is not None:
        try:
            return kv_budget.KVBudget.on_device(
                _DEVICE.value, weights_bytes=weights, kv_fraction=_KV_FRACTION.value
            )
        except ValueError as e:
            raise ValueError(f"--device={_DEVICE.value}: {e}") from None
    if not _KV_BUDGET_GIB.value > 0:
        raise ValueError(f"--kv_budget_gib={_KV_BUDGET_GIB.value} must be positive")
    return kv_budget.KVBudget.given(
        int(_KV_BUDGET_GIB.value * kv_budget.GIB), weights_bytes=weights
    )


def _fit_problem(report: CapacityReport, setup: ServingSetup, mesh: MeshShape) -> str | None:
    """None when the requested cache (`--kv_cache_dtype`) holds one sequence of
    max_model_len; else why not, and what would: the cache dtypes that fit, the longest
    max_model_len that does, and the model axis (`--mesh`) that does."""
    requested = setup.engine.kv_cache_dtype
    p = report.plans[requested]
    if p.fits_one_sequence:
        return None
    layer_pages = p.page_bytes * p.num_layers
    fit = [k for k, q in report.plans.items() if q.fits_one_sequence]
    remedies = [f"--kv_cache_dtype={k}" for k in fit]
    longest = (p.kv_budget_bytes // layer_pages - 1) * p.page_size
    if longest > 0:
        remedies.append(f"--max_model_len={longest}")
    quantization_remedy = _quantization_remedy(setup, mesh)
    if quantization_remedy is not None:
        remedies.append(quantization_remedy)
    mesh_remedy = _mesh_remedy(setup, mesh)
    if mesh_remedy is not None:
        remedies.append(mesh_remedy)
    return (
        f"a KV budget of {p.kv_budget_bytes} bytes ({format_bytes(p.kv_budget_bytes)}) is too "
        f"small for one sequence of max_model_len={p.max_model_len}: at page_size={p.page_size} a "
        f"{p.page_dtype} cache (--kv_cache_dtype={requested}) needs at least "
        f"{p.min_kv_budget_bytes} bytes ({format_bytes(p.min_kv_budget_bytes)}: "
        f"{1 + p.pages_per_seq} pages of {layer_pages} bytes, the null page included)"
        + (f"; fits with {' or '.join(remedies)}" if remedies else "")
    )


WEIGHT_OPTIONS = (None, "int8", "fp8")  # the model dtype, then quantized weights


def _fit(model: DecoderConfig, setup: ServingSetup, mesh: MeshShape) -> capacity.CapacityPlan:
    """The plan of one max_model_len sequence in the requested cache, with `model`'s
    weights; ValueError when the weights leave no KV budget."""
    engine = setup.engine
    budget = _budget(model, mesh)
    return capacity.plan_capacity(
        model,
        kv_budget_bytes=budget.kv_budget_bytes,
        page_size=engine.page_size,
        lengths=[engine.max_model_len],
        max_model_len=engine.max_model_len,
        kv_cache_dtype=engine.kv_cache_dtype,
        mesh=mesh,
        platform=kv_budget.DEVICE_PLATFORM.get(budget.device) if budget.device else None,
    )


def _weights_section(setup: ServingSetup, mesh: MeshShape) -> str:
    """A markdown table of the model's weights in its dtype and quantized (int8, fp8:
    `--quantization`), each with the KV pages it leaves in the requested cache and the
    max_model_len sequences they hold; and which fit one."""
    engine = setup.engine
    lines = [
        "",
        f"## Weights: what each leaves the {engine.kv_cache_dtype} KV cache",
        "",
        "| weights | bytes per device | --num_pages | sequences of max_model_len |",
        "|---|---:|---:|---:|",
    ]
    fits = []
    for mode in WEIGHT_OPTIONS:
        model = setup.model.replace(quantization=mode)
        label = f"{model.dtype}" if mode is None else f"{mode} (--quantization={mode})"
        weights = parameters.weights_bytes(model, mesh=mesh)
        try:
            plan = _fit(model, setup, mesh)
        except ValueError:
            lines.append(f"| {label} | {format_bytes(weights)} | does not fit | 0 |")
            continue
        seqs = plan.num_pages // plan.pages_per_seq if plan.pages_per_seq else 0
        lines.append(f"| {label} | {format_bytes(weights)} | {plan.num_pages} | {seqs} |")
        if plan.fits_one_sequence:
            fits.append(label)
    lines += ["", f"One max_model_len sequence fits with: {', '.join(fits) or 'none'}.", ""]
    return "\n".join(lines)


def _quantization_remedy(setup: ServingSetup, mesh: MeshShape) -> str | None:
    """`--quantization=int8 (...)` when the model's weights do not fit one sequence
    unquantized but do quantized; None otherwise (or when already quantized)."""
    if setup.model.quantization:
        return None
    for mode in WEIGHT_OPTIONS[1:]:
        try:
            plan = _fit(setup.model.replace(quantization=mode), setup, mesh)
        except ValueError:
            continue
        if plan.fits_one_sequence:
            return f"--quantization={mode} ({plan.num_pages} pages)"
    return None


# Model-axis sizes `_mesh_remedy` tries, beyond the requested one.
MESH_MODEL_SIZES = (2, 4, 8, 16, 32, 64)


def _mesh_remedy(setup: ServingSetup, mesh: MeshShape) -> str | None:
    """`--mesh=model:N,data:D (...)` for the smallest model axis above `mesh`'s over
    which the requested cache holds one sequence (each device holding its shard of the
    weights and KV heads), or None when none of `MESH_MODEL_SIZES` does."""
    for n in (n for n in MESH_MODEL_SIZES if n > mesh.model):
        larger = MeshShape(model=n, data=mesh.data)
        try:
            plan = _fit(setup.model, setup, larger)
        except ValueError:
            continue
        if plan.fits_one_sequence:
            return (
                f"--mesh={larger} ({n} devices a replica, each holding its shard of "
                f"the weights and KV heads: {plan.num_pages} pages)"
            )
    return None


def run() -> None:
    """The `paxkv-plan` console script."""
    list_in_help(__name__, __doc__, launch_flags.__name__)
    run_app(main)


if __name__ == "__main__":
    run()
