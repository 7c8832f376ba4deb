"""KV capacity planning: how many sequences a memory budget holds, paged against contiguous.

Plain Python and NumPy, no JAX: every byte count comes from the model's config fields,
with the same layout as `paxkv.engine.state` (a test holds `page_bytes` here equal to
`paxkv.engine.state.page_bytes`). The accounting is per device, weights and KV cache only.

On a mesh (`paxkv.sharding.mesh_shape.MeshShape`, e.g. model:4,data:2) a budget is per device:
each device holds its shard of the weights and, of every page, its share of the KV
heads (all of them when they do not split over the model axis; see `paxkv.sharding`).
Pages, and so concurrencies, are per replica (each replica has its own page pool), and
the totals multiply them by the replicas.

A sequence of final length L (prompt plus output, capped at `max_model_len`) holds
  - paged: `ceil(L / ps)` pages, so it wastes `ceil(L / ps) * ps - L` token slots;
  - contiguous: `max_model_len` slots, reserved up front, so it wastes `max_model_len - L`.
Capacities count every sequence at its final length, as the scheduler's admission check
does (`prompt + max_tokens`). Page 0 is the null page and never holds a token, so a pool
of `num_pages` pages has `num_pages - 1` to give out.

    model = paxkv.models.config.PRESETS["llama-3.1-8b"]
    lengths = Workload("sharegpt", prompt_len=128, output_len=128).lengths(8192)
    plan = plan_capacity(model, kv_budget_bytes=40 * GIB, page_size=16, lengths=lengths,
                         max_model_len=8192)
    plan.paged_concurrency, plan.contiguous_concurrency
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import numpy as np

from paxkv.sharding.mesh_shape import ONE_DEVICE, MeshShape

GIB = 2**30
# Nominal memory per device, in GiB (the runtime keeps a little of it for itself).
DEVICE_HBM_GIB: dict[str, float] = {
    "v5e": 16,
    "v6e": 32,
    "v5p": 95,
    "A100": 80,
    "H100": 80,
    "H200": 141,
}
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
PAGE_SIZES = (8, 16, 32, 64, 128, 256)
BLOCK_TABLE_ENTRY_BYTES = 4  # block tables are int32
WORKLOADS = ("sharegpt", "fixed")

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8_e4m3fn": 1}
# kv_cache_dtype -> page dtype of a quantized cache (as `paxkv.engine.state.KV_CACHE_DTYPES`).
_QUANTIZED_PAGE_DTYPES = {"int8": "int8", "fp8": "float8_e4m3fn"}
_SCALE_BYTES = 4  # one float32 scale per token per head, for K and for V


class ModelShape(Protocol):
    """The config fields the planner reads; `paxkv.models.LlamaConfig` has them all."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: str


# Weights.


def num_parameters(model: ModelShape) -> int:
    """Parameters of a Llama-family decoder: embedding, layers, final norm, LM head."""
    h, d = model.hidden_size, model.head_dim
    q, kv = model.num_heads * d, model.num_kv_heads * d
    attention = h * q + 2 * h * kv + q * h
    if model.attention_bias:  # Qwen2: q/k/v biases, none on o_proj
        attention += q + 2 * kv
    mlp = 3 * h * model.intermediate_size
    layer = attention + mlp + 2 * h  # two RMSNorms
    embedding = model.vocab_size * h
    lm_head = 0 if model.tie_word_embeddings else model.vocab_size * h
    return embedding + model.num_layers * layer + h + lm_head


def num_parameters_per_device(model: ModelShape, mesh: MeshShape) -> int:
    """Parameters each device of `mesh` holds, by `paxkv.sharding`'s rules.

    Attention splits over the model axis by KV head, the MLP by intermediate feature,
    the embedding and LM head by vocabulary entry, each only when it divides; norms and
    o/down biases are replicated.
    """
    h, d, m = model.hidden_size, model.head_dim, mesh.model
    q, kv = model.num_heads * d, model.num_kv_heads * d
    attention = h * q + 2 * h * kv + q * h
    if model.attention_bias:
        attention += q + 2 * kv
    if mesh.splits(model.num_kv_heads):
        attention //= m  # every attention tensor has a head axis
    mlp = 3 * h * model.intermediate_size
    if mesh.splits(model.intermediate_size):
        mlp //= m
    vocab = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    if mesh.splits(model.vocab_size):
        vocab //= m
    return vocab + model.num_layers * (attention + mlp + 2 * h) + h


def weights_bytes(
    model: ModelShape, dtype: str | None = None, *, mesh: MeshShape = ONE_DEVICE
) -> int:
    """Bytes of the parameters in `dtype` (None: the model's) on each device of `mesh`."""
    return num_parameters_per_device(model, mesh) * _itemsize(dtype or model.dtype)


def _itemsize(dtype: str) -> int:
    if dtype not in _ITEMSIZE:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(_ITEMSIZE)}")
    return _ITEMSIZE[dtype]


# KV cache layout.


def kv_page_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """The page dtype's name for `kv_cache_dtype` ("auto" stores pages in the model `dtype`)."""
    if kv_cache_dtype == "auto":
        _itemsize(dtype)
        return dtype
    if kv_cache_dtype not in _QUANTIZED_PAGE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}")
    return _QUANTIZED_PAGE_DTYPES[kv_cache_dtype]


def page_bytes(*, num_kv_heads: int, page_size: int, head_dim: int, page_dtype: str) -> int:
    """Bytes of one page of one layer, K and V together, scales included.

    The same count as `paxkv.engine.state.page_bytes`, with the dtype given by name.
    """
    entries = 2 * num_kv_heads * page_size * head_dim * _itemsize(page_dtype)
    quantized = page_dtype in _QUANTIZED_PAGE_DTYPES.values()
    scales = 2 * num_kv_heads * page_size * _SCALE_BYTES if quantized else 0
    return entries + scales


# Budget.


@dataclasses.dataclass(frozen=True)
class KVBudget:
    """Bytes for the KV cache, and where they come from.

    On a device: `kv_fraction` of the memory left after the weights, the rest kept for
    activations and the runtime. Given directly: `device` is None.
    """

    kv_budget_bytes: int
    weights_bytes: int
    device: str | None = None
    device_bytes: int | None = None
    kv_fraction: float | None = None

    @classmethod
    def on_device(cls, device: str, *, weights_bytes: int, kv_fraction: float) -> KVBudget:
        names = {name.lower(): name for name in DEVICE_HBM_GIB}
        if device.lower() not in names:
            raise ValueError(f"device={device!r} is not one of {sorted(DEVICE_HBM_GIB)}")
        if not 0 < kv_fraction <= 1:
            raise ValueError(f"kv_fraction={kv_fraction} must be in (0, 1]")
        device = names[device.lower()]
        device_bytes = int(DEVICE_HBM_GIB[device] * GIB)
        if weights_bytes >= device_bytes:
            raise ValueError(
                f"the weights need {weights_bytes} bytes ({weights_bytes / GIB:.2f} GiB), no less "
                f"than all of {device}'s {device_bytes / GIB:.0f} GiB: nothing is left for the KV cache"
            )
        return cls(
            kv_budget_bytes=int((device_bytes - weights_bytes) * kv_fraction),
            weights_bytes=weights_bytes,
            device=device,
            device_bytes=device_bytes,
            kv_fraction=kv_fraction,
        )

    @classmethod
    def given(cls, kv_budget_bytes: int, *, weights_bytes: int) -> KVBudget:
        if kv_budget_bytes <= 0:
            raise ValueError(f"kv_budget_bytes={kv_budget_bytes} must be positive")
        return cls(kv_budget_bytes=int(kv_budget_bytes), weights_bytes=weights_bytes)


# Workload.


@dataclasses.dataclass(frozen=True)
class Workload:
    """A distribution of prompt and output lengths, in tokens.

    "fixed": every request has `prompt_len` prompt and `output_len` output tokens.
    "sharegpt": chat-like, both log-normal with those medians and log-space standard
    deviation `sigma` (a long tail), each at least 1, the total capped at max_model_len;
    `num_samples` draws with `seed` estimate the expectations.
    """

    kind: str
    prompt_len: int
    output_len: int
    sigma: float = 1.0
    num_samples: int = 100_000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload={self.kind!r} must be one of {WORKLOADS}")
        for name in ("prompt_len", "output_len", "num_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.sigma < 0:
            raise ValueError(f"sigma={self.sigma} must be >= 0")

    def lengths(self, max_model_len: int) -> np.ndarray:
        """Final sequence lengths (prompt + output), i64[N] in [1, max_model_len]."""
        if max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len} must be at least 2")
        if self.kind == "fixed":
            total = self.prompt_len + self.output_len
            if total > max_model_len:
                raise ValueError(
                    f"prompt_len={self.prompt_len} + output_len={self.output_len} = {total} "
                    f"exceeds max_model_len={max_model_len}"
                )
            return np.array([total], np.int64)
        rng = np.random.default_rng(self.seed)
        draw = lambda median: np.maximum(
            1, np.rint(rng.lognormal(math.log(median), self.sigma, self.num_samples))
        ).astype(np.int64)
        return np.minimum(draw(self.prompt_len) + draw(self.output_len), max_model_len)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed: {self.prompt_len} prompt + {self.output_len} output tokens"
        return (
            f"sharegpt: log-normal prompt (median {self.prompt_len}) + output (median "
            f"{self.output_len}) tokens, sigma {self.sigma}; {self.num_samples} samples, seed {self.seed}"
        )


# Capacity.


def num_pages_for_budget(
    model: ModelShape,
    *,
    kv_budget_bytes: int,
    page_size: int,
    mesh: MeshShape = ONE_DEVICE,
    kv_cache_dtype: str = "auto",
    dtype: str | None = None,
) -> int:
    """The page pool (`EngineConfig.num_pages`, the null page included) of one replica of
    `mesh` whose every device spends `kv_budget_bytes` on KV pages of all layers.

    Each device stores its share of every page's KV heads, so with the heads split the
    pool grows with the model axis at a fixed per-device budget.
    """
    page_dtype = kv_page_dtype(kv_cache_dtype, dtype or model.dtype)
    one_page = page_bytes(
        num_kv_heads=mesh.kv_heads_per_device(model.num_kv_heads),
        page_size=page_size,
        head_dim=model.head_dim,
        page_dtype=page_dtype,
    )
    return int(kv_budget_bytes // (one_page * model.num_layers))


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    """How many sequences of a length distribution fit `kv_budget_bytes`, one page size, one cache dtype.

    Concurrencies are floors. Wastes are expectations per sequence in token slots.
    `block_table_bytes` is the int32 block table `[paged_concurrency, pages_per_seq]`.
    On a mesh, `kv_budget_bytes` and `page_bytes` are per device, pages and
    concurrencies per replica, and the `total_` properties are over the whole mesh.
    """

    kv_cache_dtype: str
    page_dtype: str
    page_size: int
    max_model_len: int
    kv_budget_bytes: int  # per device
    num_layers: int
    page_bytes: int  # one layer, one device's KV heads
    num_pages: int  # pages of all layers in the budget, the null page included; per replica
    mean_len: float
    mean_pages_per_seq: float
    paged_concurrency: int
    contiguous_concurrency: int
    paged_waste_tokens: float
    contiguous_waste_tokens: float
    model_parallel: int = 1
    data_parallel: int = 1
    kv_heads_per_device: int | None = None

    @property
    def num_devices(self) -> int:
        return self.model_parallel * self.data_parallel

    @property
    def total_kv_budget_bytes(self) -> int:
        return self.kv_budget_bytes * self.num_devices

    @property
    def total_num_pages(self) -> int:
        """Pages of every replica's pool."""
        return self.num_pages * self.data_parallel

    @property
    def total_paged_concurrency(self) -> int:
        return self.paged_concurrency * self.data_parallel

    @property
    def total_contiguous_concurrency(self) -> int:
        return self.contiguous_concurrency * self.data_parallel

    @property
    def token_bytes(self) -> float:
        """Bytes of one token slot across all layers on one device, scales included."""
        return self.page_bytes * self.num_layers / self.page_size

    @property
    def pages_per_seq(self) -> int:
        """Block-table width: pages of a `max_model_len` sequence."""
        return -(-self.max_model_len // self.page_size)

    @property
    def min_kv_budget_bytes(self) -> int:
        """The least budget that serves one `max_model_len` sequence: its pages and the null page."""
        return (1 + self.pages_per_seq) * self.page_bytes * self.num_layers

    @property
    def fits_one_sequence(self) -> bool:
        return self.kv_budget_bytes >= self.min_kv_budget_bytes

    @property
    def block_table_bytes(self) -> int:
        return self.paged_concurrency * self.pages_per_seq * BLOCK_TABLE_ENTRY_BYTES

    @property
    def paged_gain(self) -> float | None:
        """Paged over contiguous concurrency; None when contiguous allocation holds none."""
        if not self.contiguous_concurrency:
            return None
        return self.paged_concurrency / self.contiguous_concurrency

    @property
    def paged_waste_fraction(self) -> float:
        """Expected share of a sequence's allocated slots that hold no token."""
        return self.paged_waste_tokens / (self.mean_pages_per_seq * self.page_size)

    @property
    def contiguous_waste_fraction(self) -> float:
        return self.contiguous_waste_tokens / self.max_model_len

    def to_dict(self) -> dict[str, Any]:
        derived = (
            "num_devices",
            "total_kv_budget_bytes",
            "total_num_pages",
            "total_paged_concurrency",
            "total_contiguous_concurrency",
            "token_bytes",
            "pages_per_seq",
            "min_kv_budget_bytes",
            "fits_one_sequence",
            "block_table_bytes",
            "paged_gain",
            "paged_waste_fraction",
            "contiguous_waste_fraction",
        )
        return dataclasses.asdict(self) | {name: getattr(self, name) for name in derived}


def plan_capacity(
    model: ModelShape,
    *,
    kv_budget_bytes: int,
    page_size: int,
    lengths: np.ndarray,
    max_model_len: int,
    kv_cache_dtype: str = "auto",
    dtype: str | None = None,
    mesh: MeshShape = ONE_DEVICE,
) -> CapacityPlan:
    """The capacity of `kv_budget_bytes` for sequences of final lengths `lengths` (i64[N]).

    The expectations are means over `lengths`: pass samples of a distribution, or one
    entry for a fixed length. `dtype` is the model dtype "auto" pages use (None: the
    model's). A budget below `min_kv_budget_bytes` is not an error: the plan says so
    (`fits_one_sequence`), and its concurrencies may be 0. On a `mesh` the budget is
    per device and the plan per replica (see `CapacityPlan`).
    """
    for name, value in (
        ("kv_budget_bytes", kv_budget_bytes),
        ("page_size", page_size),
        ("max_model_len", max_model_len),
    ):
        if value < 1:
            raise ValueError(f"{name}={value} must be positive")
    lengths = np.asarray(lengths, np.int64)
    if lengths.ndim != 1 or not lengths.size:
        raise ValueError(f"lengths must be a non-empty 1-D array, got shape {lengths.shape}")
    if lengths.min() < 1 or lengths.max() > max_model_len:
        raise ValueError(
            f"lengths must lie in [1, max_model_len={max_model_len}], got [{lengths.min()}, {lengths.max()}]"
        )
    page_dtype = kv_page_dtype(kv_cache_dtype, dtype or model.dtype)
    kv_heads = mesh.kv_heads_per_device(model.num_kv_heads)
    one_page = page_bytes(
        num_kv_heads=kv_heads,
        page_size=page_size,
        head_dim=model.head_dim,
        page_dtype=page_dtype,
    )
    num_pages = num_pages_for_budget(
        model,
        kv_budget_bytes=kv_budget_bytes,
        page_size=page_size,
        mesh=mesh,
        kv_cache_dtype=kv_cache_dtype,
        dtype=dtype,
    )
    usable = max(num_pages - 1, 0)
    pages = -(-lengths // page_size)
    contiguous_bytes = max_model_len * one_page * model.num_layers // page_size
    return CapacityPlan(
        kv_cache_dtype=kv_cache_dtype,
        page_dtype=page_dtype,
        page_size=page_size,
        max_model_len=max_model_len,
        kv_budget_bytes=int(kv_budget_bytes),
        num_layers=model.num_layers,
        page_bytes=one_page,
        num_pages=int(num_pages),
        mean_len=float(lengths.mean()),
        mean_pages_per_seq=float(pages.mean()),
        # usable / mean(pages), in integers so fixed lengths come out exact.
        paged_concurrency=int(usable * lengths.size // int(pages.sum())),
        contiguous_concurrency=int(kv_budget_bytes // contiguous_bytes),
        paged_waste_tokens=float((pages * page_size - lengths).mean()),
        contiguous_waste_tokens=float((max_model_len - lengths).mean()),
        model_parallel=mesh.model,
        data_parallel=mesh.data,
        kv_heads_per_device=kv_heads,
    )


def page_size_tradeoff(
    model: ModelShape, *, page_sizes: tuple[int, ...] = PAGE_SIZES, **kwargs: Any
) -> list[CapacityPlan]:
    """`plan_capacity` at each of `page_sizes` (the other arguments as `plan_capacity`'s)."""
    return [plan_capacity(model, page_size=ps, **kwargs) for ps in page_sizes]


# The report.


@dataclasses.dataclass(frozen=True)
class CapacityReport:
    """Plans of one model, budget and workload, for each KV cache dtype.

    `plans[kv_cache_dtype]` is at the chosen page size and `tradeoffs[kv_cache_dtype]`
    at each of `PAGE_SIZES`.
    """

    name: str
    model: ModelShape
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
        q = np.percentile(self.lengths, [50, 90, 99])
        return {
            "mean": float(self.lengths.mean()),
            "p50": float(q[0]),
            "p90": float(q[1]),
            "p99": float(q[2]),
            "max": int(self.lengths.max()),
            "num_capped": int((self.lengths == self.max_model_len).sum()),
        }

    def _mesh_lines(self) -> list[str]:
        mesh, m = self.mesh, self.model
        if mesh.num_devices == 1:
            return []
        per_device = mesh.kv_heads_per_device(m.num_kv_heads)
        heads = (
            f"{m.num_kv_heads} KV heads split {per_device} per device"
            if per_device < m.num_kv_heads
            else f"{m.num_kv_heads} KV heads on every device (fewer than model={mesh.model}: replicated)"
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
        return {
            "config": self.name,
            "model": {
                "num_layers": self.model.num_layers,
                "num_kv_heads": self.model.num_kv_heads,
                "head_dim": self.model.head_dim,
                "dtype": self.dtype,
                "num_parameters": num_parameters(self.model),
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
        m, b = self.model, self.budget
        s = self.length_stats()
        lines = [
            f"# KV capacity plan: {self.name}" + (f" on {b.device}" if b.device else ""),
            "",
            f"- model: {m.num_layers} layers, {m.num_kv_heads} KV heads x {m.head_dim} head dim; "
            f"{_count(num_parameters(m))} parameters, {format_bytes(b.weights_bytes)} of {self.dtype} weights",
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
        if getattr(m, "sliding_window", None):
            notes.append(
                f"The model's {m.sliding_window}-token sliding window is not used to free pages: "
                "every token stays resident."
            )
        return "\n".join(lines + notes) + "\n"


def build_report(
    model: ModelShape,
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
