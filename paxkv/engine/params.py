"""The runner's parameters from a caller's tree: checked, placed, ready to swap in.

The runner passes its parameters to the jitted step as an argument, so new arrays of
the same shapes, dtypes and shardings replace them without a recompilation.
`prepare_params` turns a caller's parameter tree into the runner's: checked whole
before anything changes, per-layer trees stacked for a scanned model, KV heads
duplicated as the runner duplicated them for its mesh (`ParamSource`), every array put
into the sharding of the leaf it replaces, NaN and inf refused.

Dtypes are strict: a leaf of another dtype is an error, never a silent cast (a cast
trainer state is the caller's decision to make).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paxkv.sharding.shardings import SCALE  # a quantized weight's scale suffix

Path = tuple[str, ...]  # a parameter's path in the state, every key as a str
_STACKED, _TAIL = ("layers", "blocks"), ("layers", "tail")  # `models.layer_stack`'s names


@dataclasses.dataclass(frozen=True)
class ParamSource:
    """The parameters as the caller's model holds them, before the runner's own changes
    (its KV heads repeated `kv_head_factor` times for a mesh): the layout
    `update_weights` takes, and how the runner makes its own from it."""

    graphdef: Any  # of the caller's model, split as (Param, the rest)
    rest: nnx.State  # its other variables (the model's own arrays, no copy)
    params: nnx.State  # its Param leaves as ShapeDtypeStructs
    kv_head_factor: int
    # For a model with quantized weights (`config.quantization`): `w -> (values, scale)`,
    # how a float weight given for a quantized one is quantized (`quantize_weight`).
    quantize: Any = None

    @classmethod
    def of(cls, model: nnx.Module, kv_head_factor: int = 1) -> ParamSource:
        """`model`'s layout (before `duplicate_kv_heads(kv_head_factor)`, if > 1)."""
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
        quantize = None
        if getattr(model.config, "quantization", None):
            quantize = model.quantize_weight
        return cls(graphdef, rest, abstract, kv_head_factor, quantize)

    def to_runner(self, params: nnx.State) -> nnx.State:
        """The runner's Param state of `params` (a state of this layout)."""
        if self.kv_head_factor == 1:
            return params
        model = nnx.merge(self.graphdef, params, self.rest)
        model.duplicate_kv_heads(self.kv_head_factor)
        return nnx.state(model, nnx.Param)


def _key(path: tuple) -> Path:
    return tuple(str(k) for k in path)


def _name(path: Path) -> str:
    return ".".join(path)


def _natural(path: Path) -> tuple:
    """Sort key: layer numbers in numeric order."""
    return tuple((0, int(k), "") if k.isdigit() else (1, 0, k) for k in path)


def flatten(tree: Any) -> dict[Path, Any]:
    """The leaves of a parameter tree by path: an `nnx.State`, or the same nesting of
    dicts (and lists) of arrays or `nnx.Variable`s. Keys become strs (layer 0 is "0")."""
    out: dict[Path, Any] = {}

    def walk(node: Any, path: Path) -> None:
        if isinstance(node, nnx.Variable):
            node = node.get_value()
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, (*path, str(k)))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, (*path, str(i)))
        else:
            out[path] = node

    walk(tree, ())
    return out


def _spec(state: nnx.State) -> dict[Path, Any]:
    """The Param leaves of `state` by path (values: arrays or ShapeDtypeStructs)."""
    return {
        _key(path): var.get_value()
        for path, var in nnx.to_flat_state(state)
        if isinstance(var, nnx.Param)
    }


def _is_per_layer(given: dict[Path, Any], spec: dict[Path, Any]) -> bool:
    """Whether `given` holds the layers one by one while `spec` holds them stacked."""
    stacked = any(p[:2] in (_STACKED, _TAIL) for p in spec)
    return stacked and any(
        len(p) > 2 and p[0] == "layers" and p[1].isdigit() and p[:2] not in spec for p in given
    )


def _per_layer(spec: dict[Path, Any]) -> tuple[dict[Path, Any], dict[Path, tuple[Path, int]]]:
    """`spec` of a scanned model as per-layer leaves (`layers.{l}...`), and where each
    comes from: `(stacked path, index on its leading axis)`, index -1 for a leaf held
    as is (the tail, and everything outside the layers)."""
    blocks = sorted({int(p[2]) for p in spec if p[:2] == _STACKED})
    period = len(blocks)
    repeats = next((x.shape[0] for p, x in spec.items() if p[:2] == _STACKED), 0)
    layer_spec: dict[Path, Any] = {}
    origin: dict[Path, tuple[Path, int]] = {}
    for path, x in spec.items():
        if path[:2] == _STACKED:
            j, rest = int(path[2]), path[3:]
            for r in range(repeats):
                lp = ("layers", str(r * period + j), *rest)
                layer_spec[lp] = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
                origin[lp] = (path, r)
        elif path[:2] == _TAIL:
            lp = ("layers", str(repeats * period + int(path[2])), *path[3:])
            layer_spec[lp], origin[lp] = x, (path, -1)
        else:
            layer_spec[path], origin[path] = x, (path, -1)
    return layer_spec, origin


def _stacked(given: dict[Path, Any], origin: dict[Path, tuple[Path, int]]) -> dict[Path, Any]:
    """Per-layer leaves (checked) stacked into the scanned model's layout."""
    out: dict[Path, Any] = {}
    parts: dict[Path, dict[int, Any]] = {}
    for lp, (path, r) in origin.items():
        if r < 0:
            out[path] = given[lp]
        else:
            parts.setdefault(path, {})[r] = given[lp]
    for path, layers in parts.items():
        xs = [layers[r] for r in range(len(layers))]
        out[path] = np.stack(xs) if all(isinstance(x, np.ndarray) for x in xs) else jnp.stack(xs)
    return out


def quantize_given(given: dict[Path, Any], spec: dict[Path, Any], quantize: Any) -> dict[Path, Any]:
    """`given` with each float weight given for a quantized one of `spec` (one with a
    `<name>_scale` beside it, which `given` lacks) quantized by `quantize` into its
    values and scale: a float tree updates a quantized model (RL with a quantized
    rollout model). The float weight must be in the scale's dtype (the model's)."""
    if quantize is None:
        return given
    out = dict(given)
    for path, want in spec.items():
        scale_path = (*path[:-1], path[-1] + SCALE)
        got = given.get(path)
        if scale_path not in spec or scale_path in given or not hasattr(got, "dtype"):
            continue
        if np.dtype(got.dtype) == np.dtype(want.dtype):
            continue  # quantized values without their scale: `check_tree` names it
        float_dtype = np.dtype(spec[scale_path].dtype)
        if np.dtype(got.dtype) != float_dtype:
            raise ValueError(
                f"parameter {_name(path)}: a {np.dtype(got.dtype).name} weight for a "
                f"quantized one; give it in {float_dtype.name} (the model's dtype) to be "
                f"quantized, or as {np.dtype(want.dtype).name} with its {_name(scale_path)}"
            )
        out[path], out[scale_path] = quantize(got)
    return out


def check_tree(given: dict[Path, Any], spec: dict[Path, Any]) -> None:
    """Raises ValueError naming the first leaf of `given` that does not match `spec`
    (missing, extra, not an array, another shape or dtype); nothing otherwise."""
    missing = sorted(set(spec) - set(given), key=_natural)
    if missing:
        raise ValueError(
            f"the new weights lack {len(missing)} parameter(s) of the model, first "
            f"{_name(missing[0])} (expected {_shape_dtype(spec[missing[0]])}); missing: "
            f"{[_name(p) for p in missing[:8]]}{' ...' if len(missing) > 8 else ''}"
        )
    extra = sorted(set(given) - set(spec), key=_natural)
    if extra:
        raise ValueError(
            f"the new weights have {len(extra)} parameter(s) the model does not, first "
            f"{_name(extra[0])}; extra: {[_name(p) for p in extra[:8]]}"
            f"{' ...' if len(extra) > 8 else ''}"
        )
    for path in sorted(spec, key=_natural):
        want, got = spec[path], given[path]
        if not hasattr(got, "shape") or not hasattr(got, "dtype"):
            raise ValueError(
                f"parameter {_name(path)}: expected an array {_shape_dtype(want)}, "
                f"got a {type(got).__name__}"
            )
        if tuple(got.shape) != tuple(want.shape) or np.dtype(got.dtype) != np.dtype(want.dtype):
            raise ValueError(
                f"parameter {_name(path)}: expected {_shape_dtype(want)}, got "
                f"{_shape_dtype(got)} (dtypes are not cast: convert the tree first)"
            )


def _shape_dtype(x: Any) -> str:
    return f"shape {tuple(x.shape)} {np.dtype(x.dtype).name}"


def _finite(x: jax.Array) -> jax.Array:  # bool[]
    """Whether `x` holds no NaN or inf: x * 0 is NaN exactly where x is not finite, and a
    sum keeps it. A reduction XLA fuses with the product (`isfinite(x).all()` makes a
    boolean array of x's size first on the CPU: twice the time, and that much memory)."""
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.bool_(True)
    return jnp.isfinite(jnp.sum(x * 0, dtype=jnp.float32))


@jax.jit
def _copied_and_checked(
    to_copy: list[jax.Array], to_check: list[jax.Array]
) -> tuple[list[jax.Array], jax.Array]:
    """New buffers of `to_copy` (in their shardings) and whether each leaf of
    `to_copy + to_check` is finite (bool[n]): one program, each leaf read once."""
    flags = [_finite(x) for x in [*to_copy, *to_check]]
    return [jnp.copy(x) for x in to_copy], jnp.stack(flags) if flags else jnp.ones(0, bool)


def place_checked(
    values: dict[Path, Any], shardings: dict[Path, Any], *, copy: bool
) -> dict[Path, jax.Array]:
    """`values` placed in `shardings`, each in a buffer of its own unless `copy` is False
    and it is a device array already in place (held as is); ValueError naming the first
    leaf holding NaN or inf. Leaves already in place are copied and checked in one
    program (one read of each), the others transferred and then checked."""
    keys = sorted(values, key=_natural)
    in_place = [
        k
        for k in keys
        if isinstance(values[k], jax.Array)
        and not values[k].is_deleted()
        and values[k].sharding == shardings[k]
    ]
    placed = set(in_place)
    moved = [k for k in keys if k not in placed]
    out = dict(
        zip(
            moved,
            jax.device_put([values[k] for k in moved], [shardings[k] for k in moved]),
            strict=True,
        )
    )
    kept = [values[k] for k in in_place]
    copies, finite = _copied_and_checked(
        kept if copy else [], [*([] if copy else kept), *(out[k] for k in moved)]
    )
    if copy:  # labelled with the target shardings (a no-op: the program kept them)
        copies = jax.device_put(copies, [shardings[k] for k in in_place], may_alias=True)
    out |= dict(zip(in_place, copies if copy else kept, strict=True))
    order = [*in_place, *moved]
    bad = [k for k, ok in zip(order, jax.device_get(finite), strict=True) if not ok]
    if bad:
        bad.sort(key=_natural)
        raise ValueError(
            f"parameter {_name(bad[0])} holds non-finite values (NaN or inf); refused, the "
            f"engine keeps its weights (non-finite: {[_name(p) for p in bad[:8]]})"
        )
    return out


def with_params_of(current: nnx.State, new: nnx.State) -> nnx.State:
    """`current` with its `nnx.Param` leaves taken from `new` (a state of the same
    layout, from `prepare_params`), its other variables (LoRA slots) kept as they are."""
    taken = {_key(path): var for path, var in nnx.to_flat_state(new) if isinstance(var, nnx.Param)}
    return nnx.from_flat_state(
        [
            (path, taken[_key(path)] if isinstance(var, nnx.Param) else var)
            for path, var in nnx.to_flat_state(current)
        ]
    )


def prepare_params(
    current: nnx.State, source: ParamSource, weights: Any, *, copy: bool = True
) -> nnx.State:
    """The runner state `current` with its Param leaves replaced by `weights` (a tree of
    `source`'s layout, or per-layer for a scanned model), each put into the sharding of
    the leaf it replaces, so the step does not recompile. Changes nothing: raises
    ValueError for a tree that does not match (see `check_tree`) or holds NaN or inf.

    `copy=False` lets a given device array already in its place be held as is (the
    caller must not donate or delete it afterwards); otherwise every leaf is a new buffer.
    """
    given = flatten(weights)
    spec = _spec(source.params)
    if _is_per_layer(given, spec):
        layer_spec, origin = _per_layer(spec)
        given = quantize_given(given, layer_spec, source.quantize)
        check_tree(given, layer_spec)
        given = _stacked(given, origin)
    given = quantize_given(given, spec, source.quantize)
    check_tree(given, spec)
    params = nnx.from_flat_state(
        [(p, var.replace(given[_key(p)])) for p, var in nnx.to_flat_state(source.params)]
    )
    runner_params = _spec(source.to_runner(params))
    flat = nnx.to_flat_state(current)
    targets = [(path, var) for path, var in flat if isinstance(var, nnx.Param)]
    keys = [_key(path) for path, _ in targets]
    shardings = {k: var.get_value().sharding for k, (_, var) in zip(keys, targets, strict=True)}
    new = place_checked({k: runner_params[k] for k in keys}, shardings, copy=copy)
    return nnx.from_flat_state(
        [
            (path, var.replace(new[_key(path)]) if isinstance(var, nnx.Param) else var)
            for path, var in flat
        ]
    )
