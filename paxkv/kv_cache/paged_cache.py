"""The paged KV cache of every layer, on the device, and its layer-slot arithmetic.

The cache and its `PageTable` are immutable pytrees (`flax.struct.dataclass`, the one
pytree mechanism in paxkv): an update returns a new value, e.g. `table.replace(kv_lens=table.kv_lens + 1)`.
Under `jit` with the cache donated, the functional write updates the pages in place.

Page layout (per layer): one array `[P, Hkv, ps, 2 * D]`, each token's key then its
value in one row (`paxkv.kv_layout`), so one page is one contiguous block covering
K and V of every KV head; moving it between HBM and on-chip memory is a single DMA, and
the per-head `[ps, D]` tiles are what the matrix unit consumes. Layers are separate
arrays (a tuple), so a layer's pages are handed to a kernel without a copy. Quantized
caches (int8, fp8) hold `bf16[P, Hkv, 2, L]` scales per layer beside the pages
(`[p, h, KEY, j]` token j's key scale; L = ps, or on TPU ps padded to 128 lanes).

With KV-cache groups (`paxkv.host.kv_groups`, hybrid models), the arrays are slots
shared by one layer of each group: layer l reads and writes slot `layer_slots[l]` at the
page ids of its group's table, `table.for_group(layer_groups[l])`.

Stacked (`slot_pages=P`, for a model whose layers run as one scan): the slots are one
array `[num_slots * P, Hkv, ps, 2 * D]`, slot i's pages at rows `i * P .. (i + 1) * P - 1`.
A layer, even one known only by a traced index, reaches its pages by adding `i * P` to
its page table: the kernels and the write see one larger page pool, and nothing is
sliced or copied (a slice of a scan's carry would be).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from flax import struct

from paxkv.host.kv_groups import KVCacheGroups
from paxkv.kv_cache.page_table import PageTable
from paxkv.kv_layout import SCALE_DTYPE, TPU_LANES, resolve_kv_cache_dtype, scale_lanes
from paxkv.pallas_kernels import write_kv_pages


@struct.dataclass
class PagedKVCache:
    """The paged K/V of every layer: `kv[l]` is `[P, Hkv, ps, 2 * D]` (key, then value).

    `kv_scales[l]` (`bf16[P, Hkv, 2, L]`, `SCALE_DTYPE`) is present exactly when the
    pages are quantized. Page `NULL_PAGE` is never allocated by the host pool. Stacked
    (`slot_pages=P`): `kv` (and the scales) is one array, `[num_slots * P, Hkv, ps, 2 * D]`
    (see the module's docstring).
    """

    kv: tuple[jax.Array, ...]
    kv_scales: tuple[jax.Array, ...] | None = None
    # KV-cache groups: each layer's slot and group; None: slot l is layer l, one group.
    layer_slots: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)
    layer_groups: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)
    # Stacked: the pages per slot P, the slots being row blocks of one array; None: a tuple.
    slot_pages: int | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        num_pages: int,
        num_kv_heads: int,
        page_size: int,
        head_dim: int,
        dtype=jnp.bfloat16,
        kv_cache_dtype: str = "auto",
        kv_groups: KVCacheGroups | None = None,
        stacked: bool = False,
        platform: str | None = None,
    ) -> PagedKVCache:
        """A zero-filled cache; `kv_cache_dtype` "int8"/"fp8" stores pages quantized.
        With `kv_groups` of several groups, `kv_groups.num_slots` arrays shared by groups.
        `stacked`: the slots as one array (`slot_pages`), for scanned layers. `platform`
        (None: JAX's default backend) sets the scales' lanes (`scale_lanes`)."""
        page_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        static = {}
        num_arrays = num_layers
        if kv_groups is not None and kv_groups.hybrid:
            if kv_groups.num_layers != num_layers:
                raise ValueError(f"{kv_groups.num_layers=} != {num_layers=}")
            static = {"layer_slots": kv_groups.layer_slot, "layer_groups": kv_groups.layer_group}
            num_arrays = kv_groups.num_slots
        rows = num_pages
        if stacked:
            static["slot_pages"] = num_pages
            rows, num_arrays = num_arrays * num_pages, 1
        shape = (rows, num_kv_heads, page_size, 2 * head_dim)
        kv = tuple(jnp.zeros(shape, page_dtype) for _ in range(num_arrays))
        if kv_cache_dtype == "auto":
            return cls(kv=kv, **static)
        platform = platform or jax.default_backend()
        lanes = scale_lanes(page_size, platform)
        if platform == "tpu" and lanes < TPU_LANES:
            logging.warning(
                "kv_cache_dtype=%r with page_size=%d on TPU: the scales' %d lanes are relaid "
                "out before every attention call (padding them to 128 would cost more of the "
                "pool); page_size >= 64 avoids the copy",
                kv_cache_dtype, page_size, lanes,
            )  # fmt: skip
        scale_shape = (rows, num_kv_heads, 2, lanes)
        scales = tuple(jnp.ones(scale_shape, SCALE_DTYPE) for _ in range(num_arrays))
        return cls(kv=kv, kv_scales=scales, **static)

    @classmethod
    def for_model(
        cls,
        model_config: Any,
        num_pages: int,
        page_size: int,
        kv_cache_dtype: str = "auto",
        kv_groups: KVCacheGroups | None = None,
    ) -> PagedKVCache:
        """A zero-filled cache for a model with `model_config`'s num_layers, num_kv_heads,
        head_dim and dtype, laid out for the KV-cache groups `kv_groups` (None: one), and
        stacked when the model's layers are (`scan_layers`)."""
        mc = model_config
        return cls.create(
            num_layers=mc.num_layers,
            num_pages=num_pages,
            num_kv_heads=mc.num_kv_heads,
            page_size=page_size,
            head_dim=mc.head_dim,
            dtype=mc.dtype,
            kv_cache_dtype=kv_cache_dtype,
            kv_groups=kv_groups,
            stacked=getattr(mc, "scan_layers", False),
        )

    @property
    def num_layers(self) -> int:
        """Layers the cache serves."""
        return self.num_slots if self.layer_slots is None else len(self.layer_slots)

    @property
    def num_slots(self) -> int:
        """Per-layer page pools (layers, or slots shared by the groups' layers)."""
        if self.slot_pages is not None:
            return self.kv[0].shape[0] // self.slot_pages
        return len(self.kv)

    @property
    def stacked(self) -> bool:
        """Whether the slots are row blocks of one array (scanned layers)."""
        return self.slot_pages is not None

    def slot(self, layer: int | jax.Array) -> int | jax.Array:
        """The page pool that holds `layer`'s pages (traced for a traced `layer`)."""
        if self.layer_slots is None:
            return layer
        if isinstance(layer, int):
            return self.layer_slots[layer]
        return jnp.asarray(self.layer_slots, jnp.int32)[layer]

    def group(self, layer: int | jax.Array) -> int | jax.Array:
        """The KV-cache group (page table) of `layer` (traced for a traced `layer`)."""
        if self.layer_groups is None:
            return 0
        if isinstance(layer, int):
            return self.layer_groups[layer]
        return jnp.asarray(self.layer_groups, jnp.int32)[layer]

    @property
    def num_pages(self) -> int:
        """P, pages per layer (page 0 included)."""
        return self.slot_pages if self.stacked else self.kv[0].shape[0]

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.kv[0].shape[2]

    @property
    def quantized(self) -> bool:
        """Whether pages are stored quantized, with scales."""
        return self.kv_scales is not None

    @property
    def nbytes(self) -> int:
        """Device bytes the cache occupies, scales included."""
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))

    def layer(self, layer: int) -> dict[str, jax.Array]:
        """Keyword arguments of the attention call for `layer`: pages and, if quantized,
        scales. Not for a stacked cache, whose layers share arrays: `attention_kwargs`."""
        if self.stacked:
            raise ValueError("a stacked cache's layers share arrays: use attention_kwargs")
        return self._pools(self.slot(layer))

    def _pools(self, i: int) -> dict[str, jax.Array]:
        args = {"kv_pages": self.kv[i]}
        if self.quantized:
            args["kv_scales"] = self.kv_scales[i]
        return args

    def layer_table(self, layer: int | jax.Array, table: PageTable) -> PageTable:
        """`table` as `layer` uses it: its group's table, with page ids made row ids of
        the stacked array when the cache is stacked. `layer` may be traced (stacked)."""
        group = self.group(layer)
        if not self.stacked:
            return table.for_group(group)
        tables = table.block_tables
        if tables.ndim == 3:
            tables = tables[group]
        offset = self.slot(layer) * self.slot_pages  # the first row of the layer's slot
        return table.replace(block_tables=tables + jnp.asarray(offset, jnp.int32))

    def attention_kwargs(self, layer: int | jax.Array, table: PageTable) -> dict[str, jax.Array]:
        """Keyword arguments of the attention call for `layer`: its pages (and scales)
        and its group's page table (`layer_table`)."""
        pools = self._pools(0) if self.stacked else self.layer(layer)
        return pools | self.layer_table(layer, table).kernel_kwargs()

    def write(
        self,
        layer: int | jax.Array,
        new_k: jax.Array,  # [T, Hkv, D]
        new_v: jax.Array,  # [T, Hkv, D]
        table: PageTable,
    ) -> PagedKVCache:
        """Returns the cache with this step's new K/V of `layer` written into their slots
        (of its group's pages). `layer` may be traced when the cache is stacked."""
        if table.page_size != self.page_size:
            raise ValueError(
                f"table.page_size={table.page_size} != cache page_size={self.page_size}"
            )
        if not self.stacked and not isinstance(layer, int):
            raise ValueError("a traced layer index needs a stacked cache (slot_pages)")
        i = 0 if self.stacked else self.slot(layer)
        kv, scales = write_kv_pages(
            self.kv[i],
            new_k,
            new_v,
            *self.layer_table(layer, table).kernel_args(),
            kv_scales=self.kv_scales[i] if self.quantized else None,
        )
        put = lambda xs, x: (*xs[:i], x, *xs[i + 1 :])
        if not self.quantized:
            return self.replace(kv=put(self.kv, kv))
        return self.replace(kv=put(self.kv, kv), kv_scales=put(self.kv_scales, scales))
