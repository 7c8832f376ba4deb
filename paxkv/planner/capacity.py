"""KV capacity arithmetic: how many sequences a memory budget holds, paged against contiguous.

Plain Python and NumPy, no JAX: every byte count comes from the model's config fields
and the page layout of `paxkv.pallas_kernels.layout`, the one the engine allocates. The accounting
is per device, weights (`paxkv.planner.parameters`) and KV cache only, out of a budget
(`paxkv.planner.kv_budget`). The report built from these numbers is
`paxkv.planner.capacity_report`.

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

    model = paxkv.models.PRESETS["llama-3.1-8b"]
    lengths = paxkv.planner.workloads.Workload("sharegpt", 128, 128).lengths(8192)
    plan = plan_capacity(model, kv_budget_bytes=40 * 2**30, page_size=16, lengths=lengths,
                         max_model_len=8192)
    plan.paged_concurrency, plan.contiguous_concurrency
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from paxkv.host.kv_groups import KVCacheGroups
from paxkv.models.decoder_config import DecoderConfig
from paxkv.pallas_kernels.layout import cdiv, kv_page_bytes, page_bytes, resolve_kv_cache_dtype
from paxkv.sharding.mesh_shape import ONE_DEVICE, MeshShape

PAGE_SIZES = (8, 16, 32, 64, 128, 256)
BLOCK_TABLE_ENTRY_BYTES = 4  # block tables are int32


def num_pages_for_budget(
    model: DecoderConfig,
    *,
    kv_budget_bytes: int,
    page_size: int,
    mesh: MeshShape = ONE_DEVICE,
    kv_cache_dtype: str = "auto",
    dtype: str | None = None,
    platform: str | None = None,
) -> int:
    """The page pool (`EngineConfig.num_pages`, the null page included) of one replica of
    `mesh` whose every device spends `kv_budget_bytes` on KV pages of all layers, with
    the cache laid out for `platform` ("tpu" pads quantized pages' scales).

    Each device stores its share of every page's KV heads, so with the heads split the
    pool grows with the model axis at a fixed per-device budget.
    """
    one_page = kv_page_bytes(
        num_layers=model.num_layers,
        num_kv_heads=mesh.kv_heads_per_device(model.num_kv_heads, model.num_heads),
        page_size=page_size,
        head_dim=model.head_dim,
        page_dtype=resolve_kv_cache_dtype(kv_cache_dtype, dtype or model.dtype),
        platform=platform,
    )
    return int(kv_budget_bytes // one_page)


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
    # With the engine's KV-cache groups (`paxkv.host.kv_groups`) for a model with
    # sliding windows: the pool (pages of `group_slots` layers each), the pages a
    # sequence holds at its final length over every group (a window group only those
    # inside its window), and the concurrency; equal to the paged figures otherwise.
    kv_groups: str = "1 group"
    group_slots: int = 0
    group_num_pages: int = 0
    group_pages_per_seq: float = 0.0
    group_concurrency: int = 0

    @property
    def num_devices(self) -> int:
        """Devices of the mesh."""
        return self.model_parallel * self.data_parallel

    @property
    def total_kv_budget_bytes(self) -> int:
        """KV budget of every device together."""
        return self.kv_budget_bytes * self.num_devices

    @property
    def total_num_pages(self) -> int:
        """Pages of every replica's pool."""
        return self.num_pages * self.data_parallel

    @property
    def total_paged_concurrency(self) -> int:
        """Paged sequences of every replica."""
        return self.paged_concurrency * self.data_parallel

    @property
    def total_contiguous_concurrency(self) -> int:
        """Contiguous sequences of every replica."""
        return self.contiguous_concurrency * self.data_parallel

    @property
    def token_bytes(self) -> float:
        """Bytes of one token slot across all layers on one device, scales included."""
        return self.page_bytes * self.num_layers / self.page_size

    @property
    def pages_per_seq(self) -> int:
        """Block-table width: pages of a `max_model_len` sequence."""
        return cdiv(self.max_model_len, self.page_size)

    @property
    def min_kv_budget_bytes(self) -> int:
        """The least budget that serves one `max_model_len` sequence: its pages and the null page."""
        return (1 + self.pages_per_seq) * self.page_bytes * self.num_layers

    @property
    def fits_one_sequence(self) -> bool:
        """Whether the budget serves one `max_model_len` sequence (see `min_kv_budget_bytes`)."""
        return self.kv_budget_bytes >= self.min_kv_budget_bytes

    @property
    def block_table_bytes(self) -> int:
        """Bytes of the int32 block table `[paged_concurrency, pages_per_seq]`."""
        return self.paged_concurrency * self.pages_per_seq * BLOCK_TABLE_ENTRY_BYTES

    @property
    def paged_gain(self) -> float | None:
        """Paged over contiguous concurrency; None when contiguous allocation holds none."""
        if not self.contiguous_concurrency:
            return None
        return self.paged_concurrency / self.contiguous_concurrency

    @property
    def group_gain(self) -> float | None:
        """Concurrency with KV-cache groups over uniform paging; None when paging holds none."""
        if not self.paged_concurrency:
            return None
        return self.group_concurrency / self.paged_concurrency

    @property
    def paged_waste_fraction(self) -> float:
        """Expected share of a sequence's allocated slots that hold no token."""
        return self.paged_waste_tokens / (self.mean_pages_per_seq * self.page_size)

    @property
    def contiguous_waste_fraction(self) -> float:
        """Expected share of a sequence's `max_model_len` reserved slots that hold no token."""
        return self.contiguous_waste_tokens / self.max_model_len

    def to_dict(self) -> dict[str, Any]:
        """The fields and the derived properties, JSON-ready."""
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
            "group_gain",
            "paged_waste_fraction",
            "contiguous_waste_fraction",
        )
        return dataclasses.asdict(self) | {name: getattr(self, name) for name in derived}


def plan_capacity(
    model: DecoderConfig,
    *,
    kv_budget_bytes: int,
    page_size: int,
    lengths: np.ndarray,
    max_model_len: int,
    kv_cache_dtype: str = "auto",
    dtype: str | None = None,
    mesh: MeshShape = ONE_DEVICE,
    platform: str | None = None,
) -> CapacityPlan:
    """The capacity of `kv_budget_bytes` for sequences of final lengths `lengths` (i64[N]).

    The expectations are means over `lengths`: pass samples of a distribution, or one
    entry for a fixed length. `dtype` is the model dtype "auto" pages use (None: the
    model's). `platform` ("tpu", "gpu"; None: not TPU) is the layout the pages are
    counted in: on TPU quantized pages' scales are padded to 128 lanes. A budget below `min_kv_budget_bytes` is not an error: the plan says so
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
    page_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype or model.dtype).name
    kv_heads = mesh.kv_heads_per_device(model.num_kv_heads, model.num_heads)
    one_page = page_bytes(
        num_kv_heads=kv_heads,
        page_size=page_size,
        head_dim=model.head_dim,
        page_dtype=page_dtype,
        platform=platform,
    )
    num_pages = num_pages_for_budget(
        model,
        kv_budget_bytes=kv_budget_bytes,
        page_size=page_size,
        mesh=mesh,
        kv_cache_dtype=kv_cache_dtype,
        dtype=dtype,
        platform=platform,
    )
    usable = max(num_pages - 1, 0)
    pages = cdiv(lengths, page_size)
    contiguous_bytes = max_model_len * one_page * model.num_layers // page_size
    layout = KVCacheGroups.for_model(model)
    group_pages = group_pages_held(layout, lengths, page_size)
    group_num_pages = int(kv_budget_bytes // (one_page * layout.num_slots))
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
        kv_groups=layout.describe(),
        group_slots=layout.num_slots,
        group_num_pages=group_num_pages,
        group_pages_per_seq=float(group_pages.mean()),
        group_concurrency=int(max(group_num_pages - 1, 0) * lengths.size // int(group_pages.sum())),
    )


def group_pages_held(
    layout: KVCacheGroups, lengths: np.ndarray, page_size: int
) -> np.ndarray:  # i64[N]
    """Pages a sequence of each final length holds over every group of `layout` while
    it decodes its last token: a global group all of its pages, a window group of W the
    pages from token `L - W` (the first its last query reads) to its last."""
    last = lengths - 1
    held = np.zeros_like(lengths)
    for g in layout.groups:
        first = 0 if g.window is None else np.maximum(0, last - g.window + 1) // page_size
        held += last // page_size - first + 1
    return held


def page_size_tradeoff(
    model: DecoderConfig, *, page_sizes: tuple[int, ...] = PAGE_SIZES, **kwargs: Any
) -> list[CapacityPlan]:
    """`plan_capacity` at each of `page_sizes` (the other arguments as `plan_capacity`'s)."""
    return [plan_capacity(model, page_size=ps, **kwargs) for ps in page_sizes]
