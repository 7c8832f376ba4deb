"""The reference of quantized weights: the same model with each quantized weight
replaced by `values * scale` in float32, run by plain (unquantized) matmuls."""

import jax.numpy as jnp
from flax import nnx


def dequantized_reference(original, quantized):
    """`original` (unquantized) with each weight `quantized` quantized replaced by its
    `values * scale`, in f32: the reference of the quantized matmuls."""
    reference = nnx.clone(original)
    flat = dict(nnx.to_flat_state(nnx.state(quantized, nnx.Param)))
    updates = []
    for path, scale in flat.items():
        if path[-1].endswith("_scale"):
            weight = (*path[:-1], path[-1].removesuffix("_scale"))
            values = flat[weight].get_value().astype(jnp.float32)
            updates.append((weight, nnx.Param(values * scale.get_value().astype(jnp.float32))))
    assert updates
    nnx.update(reference, nnx.from_flat_state(updates))
    return reference
