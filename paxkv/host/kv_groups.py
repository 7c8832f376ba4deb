"""Which layers share a page table: KV-cache groups by attention type. No JAX.

A model whose layers all see the whole prefix needs one page table per sequence. A
hybrid model (Gemma 2 and 3: sliding-window layers between global ones) wastes most of
a uniform cache at long contexts, because a window layer never reads a token again once
it falls `W` positions behind. Following vLLM's hybrid KV-cache manager, layers are
grouped by attention type, each group has its own page table per sequence, and every
group draws its pages from the one pool of same-size pages. A window group frees the
pages that fall wholly behind its window as the sequence advances.

So that a page means the same bytes whatever group holds it, the groups have equal
numbers of layers (`group_size`, the fewest layers of any attention type): the cache is
`group_size` per-layer arrays ("slots") of `num_pages` pages each, and layer `l` keeps
its K/V in slot `layer_slot[l]` at the page ids of its group's table. A page id held by
a group is used by that group's layers only, so nothing is shared by accident. Gemma 3
1B (26 layers, 4 global) gets 7 groups of at most 4 layers over 4 slots: a page there
holds 4 layers' K/V, where a uniform cache's page holds 26.

With one group (a model without windows, or hybrid paging off), slot `l` is layer
`l` and the cache is laid out exactly as before groups existed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one page table per sequence.

    `window` W: each layer of the group lets a token see itself and the W - 1 tokens
    before it, so pages wholly behind the window can be freed; None: global attention.
    `layers` are the model's layer indices, in order; layer `layers[i]` uses slot i.
    """

    window: int | None
    layers: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class KVCacheGroups:
    """The KV-cache groups of a model and where each layer's K/V live (see module doc)."""

    groups: tuple[KVCacheGroup, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("KV-cache groups need at least one group")
        layers = sorted(i for g in self.groups for i in g.layers)
        if layers != list(range(len(layers))):
            raise ValueError(f"groups must cover layers 0..L-1 exactly once, got {layers}")
        for g in self.groups:
            if g.window is not None and g.window < 1:
                raise ValueError(f"window={g.window} must be positive or None")

    @classmethod
    def uniform(cls, num_layers: int, window: int | None = None) -> KVCacheGroups:
        """One group of every layer (one page table per sequence), slot l = layer l."""
        return cls((KVCacheGroup(window, tuple(range(num_layers))),))

    @classmethod
    def from_windows(cls, windows: Sequence[int | None], *, hybrid: bool = True) -> KVCacheGroups:
        """Groups for layers with the given windows (None: global), one entry per layer.

        Layers of one window size all alike: one group with that window. Mixed sizes:
        the layers of each size split, in order, into groups of `group_size` (the
        fewest layers of any size) layers, global groups first. Without `hybrid`: one
        global group, every page kept (uniform paging).
        """
        windows = tuple(windows)
        if not windows:
            raise ValueError("a model needs at least one layer")
        if not hybrid:
            return cls.uniform(len(windows), None)
        kinds = list(dict.fromkeys(windows))
        if len(kinds) == 1:
            return cls.uniform(len(windows), kinds[0])
        by_kind = {k: [i for i, w in enumerate(windows) if w == k] for k in kinds}
        size = min(len(v) for v in by_kind.values())
        order = sorted(kinds, key=lambda k: (k is not None, k or 0))  # global first
        groups = [
            KVCacheGroup(k, tuple(by_kind[k][i : i + size]))
            for k in order
            for i in range(0, len(by_kind[k]), size)
        ]
        return cls(tuple(groups))

    @classmethod
    def for_model(cls, model_config: Any, *, hybrid: bool = True) -> KVCacheGroups:
        """The layout of a model config with `layer_sliding_windows` (one window or None
        per layer), or else one `sliding_window` for its `num_layers` layers."""
        windows = getattr(model_config, "layer_sliding_windows", None)
        if windows is None:
            window = getattr(model_config, "sliding_window", None)
            windows = (window,) * model_config.num_layers
        return cls.from_windows(windows, hybrid=hybrid)

    @property
    def num_groups(self) -> int:
        """Page tables per sequence."""
        return len(self.groups)

    @property
    def num_layers(self) -> int:
        """Layers of the model."""
        return sum(len(g.layers) for g in self.groups)

    @property
    def num_slots(self) -> int:
        """Per-layer cache arrays: the most layers in any group."""
        return max(len(g.layers) for g in self.groups)

    @property
    def hybrid(self) -> bool:
        """Whether layers are split over several page tables."""
        return len(self.groups) > 1

    @property
    def has_windows(self) -> bool:
        """Whether some group frees pages behind a window."""
        return any(g.window is not None for g in self.groups)

    @property
    def layer_group(self) -> tuple[int, ...]:
        """The group of each layer."""
        out = [0] * self.num_layers
        for gi, g in enumerate(self.groups):
            for layer in g.layers:
                out[layer] = gi
        return tuple(out)

    @property
    def layer_slot(self) -> tuple[int, ...]:
        """The cache slot of each layer (its index in its group)."""
        out = [0] * self.num_layers
        for g in self.groups:
            for i, layer in enumerate(g.layers):
                out[layer] = i
        return tuple(out)

    def describe(self) -> str:
        """One line: the groups by window, their layer counts, and the slots."""
        by_window: dict[int | None, list[int]] = {}
        for g in self.groups:
            by_window.setdefault(g.window, []).append(len(g.layers))
        parts = []
        for window, sizes in by_window.items():
            kind = "global" if window is None else f"window {window}"
            n = len(sizes)
            parts.append(
                f"{kind}: {n} group{'s' if n > 1 else ''} of {'/'.join(map(str, sizes))} layers"
            )
        s = "s" if self.num_groups > 1 else ""
        return f"{self.num_groups} group{s} ({'; '.join(parts)}) over {self.num_slots} slots"


def first_page_read(window: int | None, start: int, page_size: int) -> int:
    """The first page a chunk from token `start` reads in a group with `window` (None:
    global attention reads from page 0)."""
    if window is None:
        return 0
    return max(0, start - window + 1) // page_size


def peak_pages(
    window: int | None, num_pages: int, num_tokens: int, max_chunk_tokens: int, page_size: int
) -> int:
    """Pages a group with `window` holds at most for a sequence of `num_tokens` tokens in
    `num_pages` table entries, computed in chunks of at most `max_chunk_tokens`: a global
    group holds them all, a window group the pages of one chunk and the window before it."""
    if window is None:
        return num_pages
    span = window - 1 + min(max_chunk_tokens, num_tokens)
    return min(num_pages, -(-span // page_size) + 1)
