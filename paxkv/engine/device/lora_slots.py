"""Writing one LoRA adapter slot of a model's slot arrays, on the device, in place.

The slot arrays (`lora_a [..., N, in, r]`, `lora_b [..., N, r, out]`: the projections'
LoRA weights, `paxkv.models.lora`) are donated and updated at one slot, a traced index:
one program however many adapters come and go.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _write_slot(
    arrays: list[jax.Array],  # each [..., N, x, y]
    slot: jax.Array,  # i32[]
    values: list[jax.Array],  # each [..., x, y]: the slot's new contents
) -> list[jax.Array]:
    out = []
    for a, v in zip(arrays, values, strict=True):
        lead = a.ndim - 3
        index = (*(slice(None),) * lead, slot)
        out.append(a.at[index].set(v.astype(a.dtype)))
    return out


write_slot = jax.jit(_write_slot, donate_argnums=0)
write_slot.__doc__ = """`arrays` with slot `slot` (on the axis before their last two)
set to `values`; the arrays are donated."""

COMPILED_FUNCTIONS = ("_write_slot",)


def zero_slot(arrays: list[jax.Array]) -> list[jax.Array]:
    """Zero contents of one slot of each array (what slot 0 always holds)."""
    return [jnp.zeros((*a.shape[:-3], *a.shape[-2:]), a.dtype) for a in arrays]
