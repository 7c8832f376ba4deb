"""LoRA adapters in device slots, applied per token inside the base model's projections.

A model given slots (`add_lora_slots`) holds, on each projection LoRA may target
(`TARGETS`), `lora_a [..., N, in, r]` and `lora_b [..., N, r, out]`: N = max_loras + 1
slots of rank r = max_lora_rank, slot 0 all zeros (no adapter), the leading axes those
of the kernel (stacked layers). An adapter of lower rank is zero-padded, and its
scaling (alpha / r, or alpha / sqrt(r) for rsLoRA) is folded into `lora_b`, so every
slot computes `x @ A @ B` whatever its rank and scale: a slot's contents are data,
never shapes, and loading or evicting an adapter compiles nothing.

A step gives each packed row its slot (i32[T], `lora=` of the model's call); a projection adds
`(x @ A[slot]) @ B[slot]` row by row (`project`). The slot arrays are `LoRAWeight`
variables, not `nnx.Param`s, so `update_weights` of the base model leaves them as they are.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import layer_stack

# The projections an adapter may target, by Hugging Face name, and the module of the
# layer that holds each. The MoE families' expert MLPs are not among them.
TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# How a step applies the adapters: "gather" gathers each row's A and B (FLOPs and bytes
# in proportion to the rows and the rank, whatever the number of slots); "ragged" sorts
# the rows by slot and runs `jax.lax.ragged_dot` (a grouped matmul kernel on TPU; XLA's
# CPU lowering computes every slot for every row, and reads each slot's A and B once);
# "auto" gathers in steps of at most `GATHER_MAX_ROWS` rows (decodes) and runs ragged
# above, where the gathered copies outgrow the slots (measured: docs/lora.md).
METHODS = ("auto", "gather", "ragged")
GATHER_MAX_ROWS = 64


class LoRAWeight(nnx.Variable):
    """A LoRA slot array (`lora_a` or `lora_b`): engine state, not a model parameter."""


def target_projections(layer: nnx.Module) -> dict[str, nnx.Module]:
    """The projections of `layer` (one layer, or a stacked block) LoRA may target."""
    out = {}
    for name, holder in TARGETS.items():
        module = getattr(layer, holder, None)
        proj = getattr(module, name, None) if module is not None else None
        if proj is not None and hasattr(proj, "kernel"):
            out[name] = proj
    return out


def supported_targets(model: Any) -> tuple[str, ...]:
    """The target names the model's layers have (its MoE experts are not targets)."""
    return tuple(target_projections(layer_stack.layer_modules(model)[0]))


def add_lora_slots(model: nnx.Module, max_loras: int, max_rank: int, method: str = "auto") -> None:
    """Gives every target projection of `model` (in place) `max_loras + 1` zero slots
    of rank `max_rank`, in the model dtype, applied by `method` (`METHODS`); sets
    `model.lora_slots` (N)."""
    if method not in METHODS:
        raise ValueError(f"lora_method={method!r} must be one of {METHODS}")
    n = max_loras + 1
    for layer in layer_stack.layer_modules(model):
        for proj in target_projections(layer).values():
            kernel = proj.kernel.get_value()  # [..., in, out]
            *lead, d_in, d_out = kernel.shape
            # The model dtype: a quantized kernel's is its scale's (`quantized_weights`).
            scale = getattr(proj, "kernel_scale", None)
            dtype = kernel.dtype if scale is None else scale.get_value().dtype
            proj.lora_a = LoRAWeight(jnp.zeros((*lead, n, d_in, max_rank), dtype))
            proj.lora_b = LoRAWeight(jnp.zeros((*lead, n, max_rank, d_out), dtype))
            proj.lora_method = method
    model.lora_slots = n


def lora_delta(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [N, in, r]
    b: jax.Array,  # [N, r, out]
    slots: jax.Array,  # i32[T]
    method: str = "gather",
    precision: Any = None,
) -> jax.Array:  # f32[T, out]
    """Row t's `(x[t] @ a[s]) @ b[s]` for its slot `s = slots[t]`, in float32."""
    x = x.astype(a.dtype)
    if method == "ragged":
        order = jnp.argsort(slots, stable=True)
        sizes = jnp.bincount(slots, length=a.shape[0]).astype(jnp.int32)
        h = jax.lax.ragged_dot(
            x[order], a, sizes, precision=precision, preferred_element_type=jnp.float32
        )
        d = jax.lax.ragged_dot(
            h.astype(b.dtype), b, sizes, precision=precision, preferred_element_type=jnp.float32
        )
        out = jnp.zeros_like(d).at[order].set(d)
    else:
        h = jnp.einsum(
            "ti,tir->tr", x, a[slots], precision=precision, preferred_element_type=jnp.float32
        )
        out = jnp.einsum(
            "tr,tro->to",
            h.astype(b.dtype),
            b[slots],
            precision=precision,
            preferred_element_type=jnp.float32,
        )
    return out


def stacked_layers(model: nnx.Module) -> list[list[int]]:
    """For each module of `layer_stack.layer_modules`, the model layers it holds, in the
    order of its leading axis (one layer for an unstacked module)."""
    config = model.config
    if not config.scan_layers:
        return [[i] for i in range(config.num_layers)]
    stack = getattr(model, layer_stack.LAYERS)
    p, r = stack.period, stack.repeats
    out = [[k * p + j for k in range(r)] for j in range(len(stack.blocks))]
    return out + [[r * p + t] for t in range(len(stack.tail))]


def base_config(model: nnx.Module) -> Any:
    """The model's config as its checkpoint has it: KV heads before the runner repeated
    them for a mesh (`duplicate_kv_heads`), the shapes an adapter of it has."""
    repeats = getattr(model, "kv_head_repeats", 1)
    c = model.config
    return c if repeats == 1 else c.replace(num_kv_heads=c.num_kv_heads // repeats)


def slot_contents(model: nnx.Module, weights: Any) -> dict[tuple, np.ndarray]:
    """One slot's contents of every slot array of `model`, by state path (`[..., x, y]`:
    the array's shape without its slot axis): `weights` (`(layer, projection) -> (a [in,
    r], b [r, out])`, scaled, `paxkv.models.lora_checkpoint.LoRAAdapter.weights`) zero-
    padded to the slot rank, zeros for the projections it leaves; B's KV heads repeated
    as the model repeated its own (`kv_head_repeats`)."""
    paths = {id(node): path for path, node in nnx.iter_graph(model) if isinstance(node, LoRAWeight)}
    repeats = getattr(model, "kv_head_repeats", 1)
    head_dim = model.config.head_dim
    out: dict[tuple, np.ndarray] = {}
    modules = layer_stack.layer_modules(model)
    for layer, layers in zip(modules, stacked_layers(model), strict=True):
        for name, proj in target_projections(layer).items():
            a_var, b_var = proj.lora_a, proj.lora_b
            a_shape, b_shape = a_var.get_value().shape, b_var.get_value().shape
            dtype = a_var.get_value().dtype
            a = np.zeros((len(layers), *a_shape[-2:]), np.float32)
            b = np.zeros((len(layers), *b_shape[-2:]), np.float32)
            for k, index in enumerate(layers):
                pair = weights.get((index, name))
                if pair is None:
                    continue
                wa, wb = pair
                if repeats > 1 and name in ("k_proj", "v_proj"):
                    heads = wb.reshape(wb.shape[0], -1, head_dim)
                    wb = np.repeat(heads, repeats, axis=1).reshape(wb.shape[0], -1)
                a[k, :, : wa.shape[1]] = wa
                b[k, : wb.shape[0], :] = wb
            if len(a_shape) == 3:  # one layer, no stacked axis
                a, b = a[0], b[0]
            out[paths[id(a_var)]] = a.astype(dtype)
            out[paths[id(b_var)]] = b.astype(dtype)
    return out
