"""The capacity planner's report: plans for every KV cache dtype, as markdown and as JSON.

The numbers are `paxkv.planner.capacity`'s (and `parameters`' and `kv_budget`'s); this module picks the plans a report shows
(each KV cache dtype at one page size, and across `PAGE_SIZES`) and lays them out.

    report = build_report(model, name="llama-3.1-8b", budget=budget, workload=workload,
                          page_size=16, max_model_len=8192)
    print(report.to_markdown())
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from paxkv.models.decoder_config import DecoderConfig
from paxkv.pallas_kernels.layout import KV_CACHE_DTYPES
from paxkv.planner.capacity import CapacityPlan, page_size_tradeoff, plan_capacity
from paxkv.planner.kv_budget import DEVICE_PLATFORM, GIB, KVBudget
from paxkv.planner.parameters import active_parameters, expert_parameters, num_parameters
from paxkv.planner.workloads import Workload
from paxkv.sharding.mesh_shape import ONE_DEVICE, MeshShape


@dataclasses.dataclass(frozen=True)
class CapacityReport:
    """Plans of one model, budget and workload, for each KV cache dtype.

    `plans[kv_cache_dtype]` is at the chosen page size and `tradeoffs[kv_cache_dtype]`
    at each of `PAGE_SIZES`.
    """

    name: str
    model: DecoderConfig
    dtype: str
    budget: KVBudget
    workload: Workload
    page_size: int
    max_model_len: int
    lengths: np.ndarray
    plans: dict[str, CapacityPlan]
    tradeoffs: dict[str, list[CapacityPlan]]
    mesh: MeshShape = ONE_DEVICE

    def length_stats(self) -> dict[str, float | int]:
        """Mean, percentiles and maximum of the sampled lengths, and how many were capped."""
        q = np.percentile(self.lengths, [50, 90, 99])
        return {
            "mean": float(self.lengths.mean()),
            "p50": float(q[0]),
            "p90": float(q[1]),
            "p99": float(q[2]),
            "max": int(self.lengths.max()),
            "num_capped": int((self.lengths == self.max_model_len).sum()),
        }

    def _experts_note(self) -> str:
        """For a mixture of experts: the experts' share of the parameters and bytes, and
        the parameters a token runs through."""
        m = self.model
        experts = expert_parameters(m)
        if not experts:
            return ""
        itemsize = np.dtype(self.dtype).itemsize
        return (
            f" ({_count(experts)} in {m.num_experts} experts a layer, "
            f"{format_bytes(experts * itemsize)} in all; {m.num_experts_per_tok} per token: "
            f"{_count(active_parameters(m))} active)"
        )

    def _mesh_lines(self) -> list[str]:
        mesh, m = self.mesh, self.model
        if mesh.num_devices == 1:
            return []
        per_device = mesh.kv_heads_per_device(m.num_kv_heads, m.num_heads)
        factor = mesh.kv_head_factor(m.num_kv_heads, m.num_heads)
        if factor > 1:
            heads = (
                f"{m.num_kv_heads} KV heads repeated {factor}x (model={mesh.model} outnumbers "
                f"them), {per_device} per device: the heads its query heads read"
            )
        elif per_device < m.num_kv_heads:
            heads = f"{m.num_kv_heads} KV heads split {per_device} per device"
        else:
            heads = (
                f"{m.num_kv_heads} KV heads on every device (model={mesh.model} does not "
                "split them and the query heads cannot be regrouped: replicated)"
            )
        p = self.plans.get("auto") or next(iter(self.plans.values()))
        return [
            f"- mesh: {mesh} = {mesh.num_devices} devices, {mesh.data} "
            f"replica{'s' if mesh.data > 1 else ''} of {mesh.model}; "
            f"{heads}; weights and KV budget above are per device",
            f"- in total ({_dtype_label(p)}): KV {format_bytes(p.total_kv_budget_bytes)} over "
            f"{mesh.num_devices} devices, {p.total_num_pages} pages, {p.total_paged_concurrency} "
            f"paged / {p.total_contiguous_concurrency} contiguous sequences; the tables below "
            "are per replica",
        ]

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data: the inputs, and every plan with its derived numbers."""
        return {
            "config": self.name,
            "model": {
                "num_layers": self.model.num_layers,
                "num_kv_heads": self.model.num_kv_heads,
                "head_dim": self.model.head_dim,
                "dtype": self.dtype,
                "num_parameters": num_parameters(self.model),
                "num_expert_parameters": expert_parameters(self.model),
                "num_active_parameters": active_parameters(self.model),
            },
            "mesh": dataclasses.asdict(self.mesh) | {"num_devices": self.mesh.num_devices},
            "budget": dataclasses.asdict(self.budget),
            "workload": dataclasses.asdict(self.workload) | {"lengths": self.length_stats()},
            "page_size": self.page_size,
            "max_model_len": self.max_model_len,
            "plans": {k: p.to_dict() for k, p in self.plans.items()},
            "page_size_tradeoff": {
                k: [p.to_dict() for p in plans] for k, plans in self.tradeoffs.items()
            },
        }

    def to_markdown(self) -> str:
        """The report as markdown: the inputs, then a table per question."""
        m, b = self.model, self.budget
        s = self.length_stats()
        lines = [
            f"# KV capacity plan: {self.name}" + (f" on {b.device}" if b.device else ""),
            "",
            f"- model: {m.num_layers} layers, {m.num_kv_heads} KV heads x {m.head_dim} head dim; "
            f"{_count(num_parameters(m))} parameters{self._experts_note()}, "
            f"{format_bytes(b.weights_bytes)} of {self.dtype} weights"
            + (f" ({m.quantization} projections)" if getattr(m, "quantization", None) else ""),
            f"- KV budget: {format_bytes(b.kv_budget_bytes)} ({b.kv_budget_bytes} bytes)"
            + (
                f" = {b.kv_fraction} x ({b.device} {format_bytes(b.device_bytes)} - weights "
                f"{format_bytes(b.weights_bytes)})"
                if b.device
                else ""
            ),
            *self._mesh_lines(),
            f"- workload: {self.workload.describe()}",
            f"- lengths (prompt + output): mean {s['mean']:.0f}, p50 {s['p50']:.0f}, p90 {s['p90']:.0f}, "
            f"p99 {s['p99']:.0f}, max {s['max']}; {s['num_capped']} of {self.lengths.size} capped at "
            f"max_model_len {self.max_model_len}",
            "",
            f"## Maximum concurrency at page_size {self.page_size}",
            "",
            "| KV cache | bytes/token | --num_pages | contiguous seqs | paged seqs | paged/contiguous "
            "| waste/seq contiguous | waste/seq paged | block table |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p in self.plans.values():
            lines.append(
                f"| {_dtype_label(p)} | {p.token_bytes:.0f} | {p.num_pages} | {p.contiguous_concurrency} "
                f"| {_seqs(p)} | {'-' if p.paged_gain is None else f'{p.paged_gain:.1f}x'} "
                f"| {p.contiguous_waste_tokens:.0f} tok ({p.contiguous_waste_fraction:.0%}) "
                f"| {p.paged_waste_tokens:.1f} tok ({p.paged_waste_fraction:.1%}) "
                f"| {format_bytes(p.block_table_bytes)} |"
            )
        if any(
            p.group_slots != p.num_layers or "window" in p.kv_groups for p in self.plans.values()
        ):
            first = next(iter(self.plans.values()))
            lines += [
                "",
                f"## Sliding-window layers: KV-cache groups ({first.kv_groups})",
                "",
                "A window group holds only the pages inside its window "
                "(`EngineConfig.hybrid_kv_cache`, on by default)"
                + (
                    f"; a page of the grouped pool holds {first.group_slots} layers' K/V "
                    f"where a uniform one holds {first.num_layers}."
                    if first.group_slots != first.num_layers
                    else "."
                ),
                "",
                "| KV cache | --num_pages grouped | pages/seq grouped | grouped seqs "
                "| uniform paged seqs | grouped/uniform | contiguous seqs |",
                "|---|---:|---:|---:|---:|---:|---:|",
            ]
            for p in self.plans.values():
                gain = "-" if p.group_gain is None else f"{p.group_gain:.1f}x"
                lines.append(
                    f"| {_dtype_label(p)} | {p.group_num_pages} | {p.group_pages_per_seq:.1f} "
                    f"| {p.group_concurrency} | {_seqs(p)} | {gain} | {p.contiguous_concurrency} |"
                )
        lines += [
            "",
            "Waste is the expected number of token slots a sequence holds but never fills "
            "(contiguous: max_model_len - L; paged: the unfilled tail of its last page). "
            "The block table is the int32 `[paged seqs, max_model_len / page_size]` table.",
        ]
        for plans in self.tradeoffs.values():
            lines += [
                "",
                f"## Page size trade-off: {_dtype_label(plans[0])}",
                "",
                "| page_size | pages/seq | waste/seq | waste | --num_pages | paged seqs | block table |",
                "|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for p in plans:
                mark = " *" if p.page_size == self.page_size else ""
                lines.append(
                    f"| {p.page_size}{mark} | {p.mean_pages_per_seq:.2f} | {p.paged_waste_tokens:.1f} tok "
                    f"| {p.paged_waste_fraction:.1%} | {p.num_pages} | {_seqs(p)} "
                    f"| {format_bytes(p.block_table_bytes)} |"
                )
        notes = [
            "",
            "Per-device accounting of weights and KV only: activations and the runtime live in "
            "the rest of the memory, and the scheduler's admission watermark (1% of pages) is not "
            "deducted.",
        ]
        return "\n".join(lines + notes) + "\n"


def build_report(
    model: DecoderConfig,
    *,
    name: str,
    budget: KVBudget,
    workload: Workload,
    page_size: int,
    max_model_len: int,
    dtype: str | None = None,
    kv_cache_dtypes: tuple[str, ...] = KV_CACHE_DTYPES,
    mesh: MeshShape = ONE_DEVICE,
) -> CapacityReport:
    """Plans `model` under `budget` (per device of `mesh`) for `workload`, at `page_size`
    and across `PAGE_SIZES`."""
    dtype = dtype or model.dtype
    lengths = workload.lengths(max_model_len)
    common = dict(
        kv_budget_bytes=budget.kv_budget_bytes,
        lengths=lengths,
        max_model_len=max_model_len,
        dtype=dtype,
        mesh=mesh,
        platform=DEVICE_PLATFORM.get(budget.device) if budget.device else None,
    )
    plans = {
        k: plan_capacity(model, page_size=page_size, kv_cache_dtype=k, **common)
        for k in kv_cache_dtypes
    }
    tradeoffs = {k: page_size_tradeoff(model, kv_cache_dtype=k, **common) for k in kv_cache_dtypes}
    return CapacityReport(
        name=name,
        model=model,
        dtype=dtype,
        budget=budget,
        workload=workload,
        page_size=page_size,
        max_model_len=max_model_len,
        lengths=lengths,
        plans=plans,
        tradeoffs=tradeoffs,
        mesh=mesh,
    )


def format_bytes(n: float) -> str:
    """`n` bytes in the largest binary unit that keeps it at least 1 (e.g. "14.96 GiB")."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _dtype_label(p: CapacityPlan) -> str:
    return f"{p.page_dtype} (auto)" if p.kv_cache_dtype == "auto" else p.kv_cache_dtype


def _seqs(p: CapacityPlan) -> str:
    return str(p.paged_concurrency) if p.fits_one_sequence else "does not fit"
