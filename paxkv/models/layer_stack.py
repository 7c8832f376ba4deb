"""Layers held stacked and run as one `lax.scan`, so a step compiles one period, not L layers.

With `config.scan_layers`, a model's `layers` is a `LayerStack`: the layers repeat a
pattern of `p` kinds (`period`: 1 for the Llama family; Gemma 2 alternates sliding and
full attention, p = 2; Gemma 3 has five sliding layers to one full, p = 6), and
`blocks[j]` is one module of kind j whose every array has a leading axis of R = L // p
(layer `r * p + j` at index r), with the last `L % p` layers one by one in `tail`. The
forward pass scans over r, running the p kinds of each period in turn with their static
settings (a window, RoPE frequencies), then the tail, carrying the residual stream and
the KV cache; the cache is then stacked the same way (`PagedKVCache` with
`slot_pages`), and each layer reaches its pages by index, with no copy. Without
`scan_layers`, `layers` is an `nnx.List` run by a Python loop, which XLA compiles L
times over.

Checkpoints do not see the difference: `paxkv.models.weights` reads and writes layer
l's tensors under the same names either way (`layer_paths`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

LAYERS = "layers"  # the attribute (and the first path element) of the decoder's layers
# body(layer, index, kind, carry) -> carry: `index` the layer's number (an int, or a
# traced i32 scalar inside the scan), `kind` a static layer number of the same kind.
Body = Callable[[nnx.Module, "int | jax.Array", int, Any], Any]


def period(kinds: Sequence[Hashable]) -> int:
    """The shortest p with `kinds[i] == kinds[i % p]` for every layer i: the length of
    the pattern the layers repeat (a kind is whatever sets a layer apart, e.g. its
    attention window)."""
    n = len(kinds)
    return next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))


def stack(modules: Sequence[nnx.Module]) -> nnx.Module:
    """One module like `modules[0]` whose arrays are those of `modules` stacked on a new
    leading axis (NumPy arrays stay on the host, others become `jnp.stack`s). The
    modules must have one structure (the same graph, static fields included)."""
    graphdefs, states = zip(*(nnx.split(m) for m in modules), strict=True)
    if any(g != graphdefs[0] for g in graphdefs[1:]):
        raise ValueError("cannot stack layers of different structures")

    def join(*xs):
        return np.stack(xs) if isinstance(xs[0], np.ndarray) else jnp.stack(xs)

    return nnx.merge(graphdefs[0], jax.tree.map(join, *states))


def unstack(module: nnx.Module, num_layers: int) -> list[nnx.Module]:
    """The `num_layers` modules `stack` made `module` of (each array indexed on axis 0)."""
    graphdef, state = nnx.split(module)
    return [
        nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], state)) for i in range(num_layers)
    ]


class LayerStack(nnx.Module):
    """`layers` held for a scan with the given `period` (see the module's docstring):
    `blocks[j]` stacks layers `j, j + p, ...` of the first `R * p`, `tail` the rest."""

    def __init__(self, layers: Sequence[nnx.Module], period: int):
        repeats = len(layers) // period
        self.period, self.num_layers = period, len(layers)
        cut = repeats * period
        self.blocks = nnx.List(
            [stack(layers[j:cut:period]) for j in range(period)] if repeats else []
        )
        self.tail = nnx.List(list(layers[cut:]))

    @property
    def repeats(self) -> int:
        """R, the periods the scan runs."""
        return self.num_layers // self.period

    def run(self, carry: Any, body: Body) -> Any:
        """`carry` after `body` for every layer in order: one `lax.scan` over the R
        periods (the body traced once per kind), then the tail, looped."""
        if self.repeats:
            splits = [nnx.split(block) for block in self.blocks]
            p = self.period

            def step(carry, xs):
                r, states = xs
                for j, ((graphdef, _), state) in enumerate(zip(splits, states, strict=True)):
                    carry = body(nnx.merge(graphdef, state), r * p + j, j, carry)
                return carry, None

            rs = jnp.arange(self.repeats, dtype=jnp.int32)
            carry, _ = jax.lax.scan(step, carry, (rs, [state for _, state in splits]))
        for t, layer in enumerate(self.tail):
            index = self.repeats * self.period + t
            carry = body(layer, index, index, carry)
        return carry

    def unstacked(self) -> list[nnx.Module]:
        """The layers one module each, in order (new arrays)."""
        blocks = [unstack(block, self.repeats) for block in self.blocks]
        return [blocks[j][r] for r in range(self.repeats) for j in range(self.period)] + list(
            self.tail
        )


def run(layers: Any, carry: Any, body: Body, *, scanned: bool) -> Any:
    """`carry` after `body(layer, index, kind, carry)` for every layer: a `LayerStack`'s
    scan, or a Python loop (static indices, each layer its own kind) over an `nnx.List`."""
    if scanned:
        return layers.run(carry, body)
    for i, layer in enumerate(layers):
        carry = body(layer, i, i, carry)
    return carry


def kinds(config: Any) -> tuple[Hashable, ...]:
    """What sets each layer apart at run time: its attention window."""
    return tuple(config.layer_sliding_windows)


def layer_list(model: Any) -> list[nnx.Module]:
    """The model's layers one module each, whichever way it holds them (stacked ones
    are sliced: new arrays, for inspection and conversion, not for a step)."""
    layers = getattr(model, LAYERS)
    return layers.unstacked() if model.config.scan_layers else list(layers)


def layer_modules(model: Any) -> list[nnx.Module]:
    """The modules that hold the model's layer parameters as they are: the stacked
    blocks and the tail, or each layer (for in-place edits that keep leading axes)."""
    layers = getattr(model, LAYERS)
    return [*layers.blocks, *layers.tail] if model.config.scan_layers else list(layers)


def hold(layers: Sequence[nnx.Module], config: Any) -> nnx.Module:
    """`layers` as a model built from `config` holds them: a `LayerStack` when it
    scans its layers, else an `nnx.List`."""
    if config.scan_layers:
        return LayerStack(layers, period(kinds(config)))
    return nnx.List(list(layers))


def with_scan_layers(model: Any, scan_layers: bool) -> Any:
    """A model with the same parameters, its layers held stacked (`scan_layers=True`) or
    one module each; `model` itself is unchanged and returned when it already is so.

    Stacking copies the layers' arrays (the originals are freed with `model`): fine for
    a model that fits twice; a checkpoint is loaded stacked directly
    (`load_hf_checkpoint` with a `scan_layers` config).
    """
    if model.config.scan_layers == scan_layers:
        return model
    layers = layer_list(model)
    model = nnx.clone(model)
    model.config = model.config.replace(scan_layers=scan_layers)
    setattr(model, LAYERS, hold(layers, model.config))
    return model


def layer_paths(path: tuple[str, ...], config: Any) -> tuple[list[tuple[str, ...]], bool] | None:
    """The per-layer paths (`("layers", "7", "mlp", ...)`) a `LayerStack` parameter at
    `path` holds, and whether it is stacked over them (a block's, `[R, ...]`) or is one
    layer's (the tail's); None when `path` is not under a `LayerStack`."""
    if len(path) < 3 or path[0] != LAYERS or path[1] not in ("blocks", "tail"):
        return None
    p = period(kinds(config))
    repeats = config.num_layers // p
    i, rest = int(path[2]), path[3:]
    if path[1] == "tail":
        return [(LAYERS, str(repeats * p + i), *rest)], False
    return [(LAYERS, str(r * p + i), *rest) for r in range(repeats)], True
