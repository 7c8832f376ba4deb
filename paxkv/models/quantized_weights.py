"""Quantization of a model's projections and experts: int8 or fp8 weights, a scale per
output channel, and for the W8A8 modes the projections' input activations too, a scale
per row, with qwix (the quantization library tpu-inference and MaxText use).

`quantize_model(model, "int8")` replaces, in place, the kernel of every projection the
layers hold (attention q/k/v/o, the MLP's gate/up/down) and every expert weight of the
MoE families by its quantized values (`int8`, or `float8_e4m3fn` for "fp8") and adds
`kernel_scale` (`{name}_scale` for experts): `kernel ~= qvalue * scale`, one scale per
output column of each layer (and expert), absmax-calibrated. The embedding, the LM head,
norms, biases and routers stay in the model dtype: they are a small share of the bytes
(the head reads only the rows' logits) and the most sensitive.

A quantized projection runs `qwix.dot_general` on the stored values and scales
(`project`). In the W8A8 modes ("w8a8-int8", "w8a8-fp8") its input rows are quantized
too, each with its absmax scale, so the matmul itself runs on int8 or fp8 operands: the
MXU's int8 path on TPU, fp8 tensor cores on H100 and later. An expert weight is
dequantized where its grouped matmul reads it (weight-only in every mode). The
scales are `nnx.Param`s, so they shard with their kernels' output channels (as biases
do: `paxkv.sharding.shardings.param_spec`) and `update_weights` checks them like any
parameter.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from paxkv.pallas_kernels.layout import QUANTIZED_KV_CACHE_DTYPES
from paxkv.sharding.shardings import SCALE

from . import layer_stack

# Modes by name, and the dtype their weights' values are stored in; the "w8a8-" modes
# quantize the projections' input activations to the same dtype.
# The values' dtypes are the quantized KV pages' of the same names (one copy: layout).
QTYPES = {
    mode: QUANTIZED_KV_CACHE_DTYPES[mode.removeprefix("w8a8-")]
    for mode in ("int8", "fp8", "w8a8-int8", "w8a8-fp8")
}
W8A8 = "w8a8-"


def _qwix() -> Any:
    try:
        import qwix
    except ImportError:
        raise ImportError("quantized weights need qwix: pip install -e '.[quantization]'") from None
    return qwix


def check_mode(mode: str) -> str:
    """`mode` if it is one of `QTYPES`; ValueError naming the field otherwise."""
    if mode not in QTYPES:
        raise ValueError(f"quantization={mode!r} must be one of {sorted(QTYPES)} (or None)")
    return mode


def _quantize_weight(w: jax.Array, mode: str) -> tuple[jax.Array, jax.Array]:
    """`w [..., in, out]` as (values in `QTYPES[mode]`, scale `[..., 1, out]` in w's
    dtype): one absmax scale per output channel of each leading index (layer, expert)."""
    q = _qwix().quantize(
        w, QTYPES[check_mode(mode)], channelwise_axes=[a for a in range(w.ndim) if a != w.ndim - 2]
    )
    return q.qvalue, q.scale


def dequantize(values: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """`values * scale` in `dtype` (the reference of a quantized matmul)."""
    return (values.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


quantize_weight = jax.jit(_quantize_weight, static_argnames="mode")


def _projections(layer: nnx.Module) -> list[nnx.Module]:
    """The projections (`nnx.Linear`s) of a layer's attention and dense MLP."""
    out = []
    for holder in ("self_attn", "mlp"):
        module = getattr(layer, holder, None)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            proj = getattr(module, name, None) if module is not None else None
            if proj is not None and hasattr(proj, "kernel"):
                out.append(proj)
    return out


def _experts(layer: nnx.Module) -> list[tuple[nnx.Module, str]]:
    """`(experts module, weight name)` of each expert weight stack of a MoE layer."""
    moe = getattr(layer, getattr(layer, "moe_attribute", ""), None)
    experts = getattr(moe, "experts", None)
    if experts is None:
        return []
    form = experts.form
    return [(experts, name) for name in (*form.inputs, form.output)]


def quantize_model(model: nnx.Module, mode: str) -> None:
    """Quantizes `model`'s projections and experts in place (see the module docstring);
    sets `config.quantization`. ValueError for an unknown mode or a model quantized already."""
    check_mode(mode)
    if getattr(model.config, "quantization", None):
        raise ValueError(f"the model is quantized already ({model.config.quantization})")
    for layer in layer_stack.layer_modules(model):
        for proj in _projections(layer):
            values, scale = quantize_weight(proj.kernel.get_value(), mode=mode)
            proj.kernel = nnx.Param(values)
            proj.kernel_scale = nnx.Param(scale)
            # Static: the dtype the input rows are quantized to (W8A8), or None.
            proj.input_qtype = QTYPES[mode] if mode.startswith(W8A8) else None
        for experts, name in _experts(layer):
            values, scale = quantize_weight(getattr(experts, name).get_value(), mode=mode)
            setattr(experts, name, nnx.Param(values))
            setattr(experts, name + SCALE, nnx.Param(scale))
    model.config = model.config.replace(quantization=mode)


def quantized_matmul(proj: nnx.Module, x: jax.Array) -> jax.Array:
    """`x [T, in] @ kernel` of a quantized projection (`[T, out]`, x's dtype), with
    its bias: qwix's dot_general of x with the stored values and scales."""
    qwix = _qwix()
    values, scale = proj.kernel[...], proj.kernel_scale[...]
    w = qwix.QArray(qvalue=values, scale=scale, qtype=values.dtype)
    lhs = x.astype(scale.dtype)
    qtype = getattr(proj, "input_qtype", None)
    if qtype is not None:  # W8A8: each row quantized with its own absmax scale
        lhs = qwix.quantize(lhs, qtype, channelwise_axes=list(range(x.ndim - 1)))
    y = qwix.dot_general(lhs, w, (((x.ndim - 1,), (0,)), ((), ())), precision=proj.precision)
    if proj.bias is not None:
        y = y + proj.bias[...]
    return y.astype(x.dtype)
