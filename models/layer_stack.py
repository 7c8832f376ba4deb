"""Layers held stacked and run as one `lax.scan`, so a step compiles one layer, not L.

With `config.scan_layers`, a model's `layers` is one module of the layer's kind whose
every array has a leading axis of length L (layer l's parameters at index l), and the
forward pass scans over that axis (`scan`), carrying the residual stream and the
KV cache; the cache is then stacked the same way (`PagedKVCache` with `slot_pages`),
and each layer reaches its pages by index, with no copy. Without it, `layers` is an
`nnx.List` run by a Python loop, which XLA compiles L times over.

Checkpoints do not see the difference: `paxkv.models.weights` reads and writes layer
l's tensors under the same names either way (`layer_names`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

LAYERS = "layers"  # the attribute (and the first path element) of the decoder's layers


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


def scan(
    module: nnx.Module,
    carry: Any,
    body: Callable[[nnx.Module, jax.Array, Any], Any],
) -> Any:
    """`carry` after `body(layer, index, carry)` for every layer of the stacked `module`
    in order, as one `lax.scan`: `layer` is the module of one layer's parameters and
    `index` its number (a traced i32 scalar). The body is traced once."""
    graphdef, state = nnx.split(module)
    num_layers = jax.tree.leaves(state)[0].shape[0]

    def step(carry, xs):
        index, layer_state = xs
        return body(nnx.merge(graphdef, layer_state), index, carry), None

    carry, _ = jax.lax.scan(step, carry, (jnp.arange(num_layers, dtype=jnp.int32), state))
    return carry


def run(
    layers: Any,
    carry: Any,
    body: Callable[[nnx.Module, jax.Array | int, Any], Any],
    *,
    scanned: bool,
) -> Any:
    """`carry` after `body(layer, index, carry)` for every layer: a `scan` over stacked
    `layers`, or a Python loop (static int indices) over an `nnx.List` of them."""
    if scanned:
        return scan(layers, carry, body)
    for i, layer in enumerate(layers):
        carry = body(layer, i, carry)
    return carry


def layer_list(model: Any) -> list[nnx.Module]:
    """The model's layers one module each, whichever way it holds them (stacked ones
    are sliced: new arrays, for inspection and conversion, not for a step)."""
    layers = getattr(model, LAYERS)
    if model.config.scan_layers:
        return unstack(layers, model.config.num_layers)
    return list(layers)


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
    setattr(model, LAYERS, stack(layers) if scan_layers else nnx.List(layers))
    model.config = model.config.replace(scan_layers=scan_layers)
    return model


def layer_names(path: tuple[str, ...], num_layers: int) -> list[tuple[str, ...]] | None:
    """The per-layer paths of a stacked parameter's `path` (`("layers", "mlp", ...)` ->
    `("layers", "0", "mlp", ...)`, ...), or None when `path` is not a stacked layer's."""
    if not path or path[0] != LAYERS or (len(path) > 1 and path[1].isdigit()):
        return None
    return [(LAYERS, str(i), *path[1:]) for i in range(num_layers)]
