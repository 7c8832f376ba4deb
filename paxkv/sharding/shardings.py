"""Serving over a device mesh: the mesh, where weights and KV pages live, per-shard attention.

The mesh has the axes `("data", "model")` (see `paxkv.sharding.mesh_shape`). One engine serves
one replica, a mesh whose `data` axis has size 1; `replica_meshes` cuts a full mesh into
those. Within a replica, under `jit`, XLA's SPMD partitioner runs the model:

- weights, Megatron-style: q/k/v, gate and up are column-parallel (their output
  features split over `model`), o and down row-parallel (their input features split,
  the partial sums all-reduced); the embedding and the LM head are split over the
  vocabulary (a lookup is a masked local gather plus an all-reduce; logits come out
  vocab-sharded). Norms are replicated.
- KV pages `[P, Hkv, ps, 2 * D]` and their scales `[P, Hkv, 2, L]` are split over KV heads
  (axis 1), so each device holds every page, and in it its own heads' tokens.
- the paged write and the attention kernel run per shard under `shard_map`, on the
  shard's q heads and KV heads, with the page table replicated: a page id means the
  same page on every device, and no collective is needed inside attention.

A dimension that does not divide by the `model` size is replicated instead. For
attention the unit is the KV head: with `num_kv_heads % model != 0` (e.g. 2 KV heads on
8 devices) q/k/v/o and the pages are replicated, every device computes all heads, and
the cache holds no more pages than on one device; the MLP and the vocabulary still split.

Models opt in through a static `mesh` attribute that their `__call__` honours (as
`paxkv.models.LlamaForCausalLM` does). The weight rules are data (`SplitRule`s by
parameter names) that each model family's registry entry provides
(`paxkv.models.registry`), registered here by config class (`register_param_rules`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from paxkv.sharding.mesh_shape import AXES, DATA_AXIS, MODEL_AXIS, MeshShape

REPLICATED = P()
_DEFAULT_MESH: list[Mesh | None] = [None]


def make_mesh(shape: MeshShape, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `("data", "model")` mesh of `shape` over `devices` (default: every process's).

    The order follows the interconnect topology (`jax.make_mesh`). Over several
    processes, when one process's devices hold whole replicas, each replica is made of
    one process's devices, so replicas on different hosts run independently.
    """
    devices = jax.devices() if devices is None else list(devices)
    if shape.num_devices > len(devices):
        raise ValueError(
            f"mesh {shape} needs {shape.num_devices} devices, and {len(devices)} are visible"
        )
    processes = sorted({d.process_index for d in devices})
    local = len(devices) // len(processes)
    if len(processes) > 1 and shape.model <= local and local % shape.model == 0:
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))[: shape.num_devices]
        return Mesh(
            np.array(ordered, dtype=object).reshape(shape.data, shape.model),
            AXES,
            axis_types=(AxisType.Auto,) * len(AXES),
        )
    return jax.make_mesh(
        (shape.data, shape.model),
        AXES,
        axis_types=(AxisType.Auto,) * len(AXES),
        devices=devices[: shape.num_devices],
    )


def mesh_shape(mesh: Mesh | AbstractMesh) -> MeshShape:
    """The `MeshShape` of a (possibly abstract) mesh."""
    sizes = dict(mesh.shape)
    unknown = sorted(set(sizes) - set(AXES))
    if unknown or MODEL_AXIS not in sizes:
        raise ValueError(
            f"mesh axes {tuple(sizes)} must be {MODEL_AXIS!r} and optionally {DATA_AXIS!r}"
        )
    return MeshShape(model=sizes[MODEL_AXIS], data=sizes.get(DATA_AXIS, 1))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """The replicas of `mesh`, one per `data` index: each a mesh with a `data` axis of size 1."""
    shape = mesh_shape(mesh)
    devices = np.asarray(mesh.devices)
    if DATA_AXIS in mesh.axis_names:
        devices = np.moveaxis(devices, mesh.axis_names.index(DATA_AXIS), 0)
    devices = devices.reshape(shape.data, shape.model)
    return [Mesh(row[None], AXES, axis_types=(AxisType.Auto,) * len(AXES)) for row in devices]


def process_replica(mesh: Mesh) -> Mesh:
    """The replica of `mesh` that holds this process's devices.

    Raises ValueError when this process holds devices of several replicas (an app
    drives one engine) or of none.
    """
    me = jax.process_index()
    mine = [r for r in replica_meshes(mesh) if any(d.process_index == me for d in r.devices.flat)]
    if len(mine) != 1:
        raise ValueError(
            f"mesh {mesh_shape(mesh)}: process {me} holds devices of {len(mine)} replicas, and "
            "a launch app serves exactly one; use data:1 here, run one process per replica, "
            "or build one Engine per paxkv.sharding.replica_meshes(mesh) in Python"
        )
    return mine[0]


def process_replicas(mesh: Mesh) -> list[Mesh]:
    """The replicas of `mesh` that hold this process's devices, in replica order: those
    a server in this process drives (one engine each).

    Raises ValueError when there are none, or several of which one also holds another
    process's devices (such a replica is served by all its processes together, alone).
    """
    me = jax.process_index()
    mine = [r for r in replica_meshes(mesh) if any(d.process_index == me for d in r.devices.flat)]
    shared = [r for r in mine if any(d.process_index != me for d in r.devices.flat)]
    if not mine or (shared and len(mine) > 1):
        raise ValueError(
            f"mesh {mesh_shape(mesh)}: process {me} holds devices of {len(mine)} replicas, "
            f"{len(shared)} of them shared with other processes; a process serves whole "
            "replicas of its own devices, or one replica it shares"
        )
    return mine


def serving_mesh(mesh: Mesh | AbstractMesh) -> MeshShape:
    """The shape of `mesh`, checked to be one replica (what one engine serves)."""
    shape = mesh_shape(mesh)
    if shape.data != 1:
        raise ValueError(
            f"mesh {shape} holds {shape.data} replicas, and an engine serves one: build one "
            "Engine per paxkv.sharding.replica_meshes(mesh)"
        )
    return shape


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of an array every device of `mesh` holds whole."""
    return NamedSharding(mesh, P())


def set_default_mesh(mesh: Mesh | None) -> None:
    """The mesh of engines built without one (the launch apps set it from `--mesh`)."""
    _DEFAULT_MESH[0] = mesh


def default_mesh() -> Mesh | None:
    """The mesh every `Engine` serves on when given none (None: one device)."""
    return _DEFAULT_MESH[0]


def shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
    """`f` run per shard of `mesh`: JAX's `shard_map` in every supported version.

    Replication is not checked (`check_vma`/`check_rep` off): the Pallas kernels do
    not declare it.
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as experimental_shard_map

    return experimental_shard_map(
        f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False
    )


# Where things live.


def kv_head_spec(num_kv_heads: int, mesh: Mesh | AbstractMesh) -> P:
    """The spec of arrays whose axis 1 is heads: pages, scales, and q/k/v `[T, H, D]`."""
    return P(None, MODEL_AXIS) if serving_mesh(mesh).splits(num_kv_heads) else P()


def head_vector_spec(num_kv_heads: int, mesh: Mesh | AbstractMesh) -> P:
    """The spec of per-query-head vectors `[Hq]` (attention sinks): their heads split as
    `kv_head_spec` splits the heads axis of q, so each device holds its own heads'."""
    return P(*kv_head_spec(num_kv_heads, mesh)[1:])


def kv_head_factor(num_kv_heads: int, num_heads: int, mesh: Mesh | AbstractMesh) -> int:
    """How many times to repeat each KV head so that the model axis splits them: 1 when
    it already does, or when no repetition can (the query heads must still divide
    evenly among the repeated KV heads); then the KV heads are replicated instead."""
    return serving_mesh(mesh).kv_head_factor(num_kv_heads, num_heads)


def cache_shardings(cache: Any, num_kv_heads: int, mesh: Mesh) -> Any:
    """NamedShardings for every leaf of a `PagedKVCache`: split over KV heads, or replicated."""
    sharding = NamedSharding(mesh, kv_head_spec(num_kv_heads, mesh))
    return jax.tree.map(lambda _: sharding, cache)


def sharded_cache(create: Callable[[], Any], num_kv_heads: int, mesh: Mesh | None) -> Any:
    """The cache `create()` makes, created directly in its shardings on `mesh` (zeros
    computed under `jit` with `out_shardings`), so no device holds more than its share;
    on one device (mesh None) just `create()`."""
    if mesh is None:
        return create()
    abstract = jax.eval_shape(create)
    return jax.jit(create, out_shardings=cache_shardings(abstract, num_kv_heads, mesh))()


# Kernels are `[..., in, out]`: column-parallel ones split their outputs, row-parallel
# their inputs; expert-parallel ones (`[E, in, out]`, stacked over experts) the experts.
COLUMN, ROW, EXPERT = "column", "row", "expert"
# A LoRA slot array of a projection (`paxkv.models.lora`): split as its kernel's inputs
# (A) or outputs (B), never along its slot or rank axes.
LORA_ARRAYS = ("lora_a", "lora_b")
# A quantized weight's per-output-channel scale is named as the weight plus this
# (`kernel_scale`, `w1_scale`: `paxkv.models.quantized_weights`); split as a bias.
SCALE = "_scale"
_SPLIT_AXIS = {COLUMN: -1, ROW: -2, EXPERT: 0}  # of a kernel; a bias drops its `in` axis


def kernel_spec(parallel: str, ndim: int, *, bias: bool = False) -> P:
    """The spec of a kernel (or, with `bias`, its bias) of `ndim` dims split as `parallel`."""
    axis = _SPLIT_AXIS[parallel]
    if bias:  # `[..., out]`: a ROW bias is replicated (added after the all-reduce)
        if parallel == ROW:
            return P()
        axis = -1 if parallel == COLUMN else 0
    spec = [None] * ndim
    spec[axis] = MODEL_AXIS
    return P(*spec)


@dataclasses.dataclass(frozen=True)
class SplitRule:
    """The parameters whose path holds every name in `modules` are split over the
    `model` axis as `parallel`, when the mesh splits the config's `divisor` field.

    COLUMN splits a `[..., in, out]` kernel's outputs and its bias, ROW a kernel's
    inputs (an embedding `[V, h]` counts as one) and replicates its bias, EXPERT a
    kernel stacked over experts (`[E, in, out]`) and its bias (`[E, out]`) by expert.
    """

    modules: tuple[str, ...]
    parallel: str
    divisor: str

    def __post_init__(self):
        if self.parallel not in _SPLIT_AXIS:
            raise ValueError(
                f"parallel={self.parallel!r} must be {COLUMN!r}, {ROW!r} or {EXPERT!r}"
            )


_PARAM_RULES: dict[type, tuple[SplitRule, ...]] = {}


def register_param_rules(config_class: type, rules: Sequence[SplitRule]) -> None:
    """Makes `rules` the sharding rules of models whose config is a `config_class`
    (`paxkv.models.registry` registers every family's)."""
    _PARAM_RULES[config_class] = tuple(rules)


def param_rules(config: Any) -> tuple[SplitRule, ...]:
    """The sharding rules of `config`'s family; ValueError for an unregistered family."""
    rules = _PARAM_RULES.get(type(config))
    if rules is None:
        raise ValueError(
            f"no sharding rules for {type(config).__name__}: register its family in "
            "paxkv.models.registry"
        )
    return rules


def param_spec(
    path: tuple[str, ...], shape: tuple[int, ...], config: Any, mesh: Mesh | AbstractMesh
) -> P:
    """The spec of the parameter at `path` (names as in `nnx.split`'s state), by the
    first of its family's rules (`param_rules`) that names it and whose divisor the mesh
    splits; replicated when the rules name it but none splits, and for unnamed ones of
    at most two dims. Scanned layers (`paxkv.models.layer_stack.LayerStack`): a
    parameter of a stacked block (`layers.blocks.j...`, `[R, ...]`) has its layer's spec
    after an unsplit layer axis, one of the tail (`layers.tail.t...`) its layer's spec."""
    if len(path) > 2 and path[0] == "layers" and path[1] in ("blocks", "tail"):
        layer = (path[0], "0", *path[3:])  # as one layer's parameter
        if path[1] == "tail":
            return param_spec(layer, shape, config, mesh)
        return P(None, *param_spec(layer, shape[1:], config, mesh))
    if path[-1] in LORA_ARRAYS:  # as its kernel splits (`paxkv.models.lora`)
        kernel = tuple(param_spec((*path[:-1], "kernel"), (1, 1), config, mesh))
        kernel_in, kernel_out = (*kernel, None, None)[:2]  # P() when the kernel is whole
        spec = [None] * len(shape)
        if path[-1] == "lora_a":  # [N, in, r]: split where a row-parallel kernel's inputs are
            spec[-2] = kernel_in
        else:  # [N, r, out]: where a column-parallel kernel's outputs are
            spec[-1] = kernel_out
        return P(*spec)
    m = serving_mesh(mesh)
    names = set(path)
    named = False
    for rule in param_rules(config):
        if names.issuperset(rule.modules):
            named = True
            if m.splits(getattr(config, rule.divisor)):
                # A bias, or a quantized kernel's scale (`[..., 1, out]`): split as the outputs.
                bias = path[-1].endswith(("bias", SCALE))
                return kernel_spec(rule.parallel, len(shape), bias=bias)
    if not named and len(shape) > 2:
        raise ValueError(f"no sharding rule for the parameter {'.'.join(path)} of shape {shape}")
    return P()


def param_specs(params: nnx.State, config: Any, mesh: Mesh | AbstractMesh) -> Any:
    """The `PartitionSpec` of every array of `params` (an `nnx.split` state), by `param_spec`."""

    def one(path, x):
        names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        names = tuple(n for n in names if n != "value")
        return param_spec(names, np.shape(x), config, mesh)

    return jax.tree_util.tree_map_with_path(one, params)


def param_shardings(params: nnx.State, config: Any, mesh: Mesh) -> Any:
    """`param_specs` as NamedShardings on `mesh`."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        param_specs(params, config, mesh),
        is_leaf=lambda x: isinstance(x, P),
    )


def shard_engine_state(
    graphdef: Any, params: nnx.State, kv_cache: Any, mesh: Mesh
) -> tuple[Any, nnx.State, Any]:
    """`(graphdef, params, kv_cache)` placed on `mesh`, the model told to attend per shard.

    The graphdef comes back with the model's static `mesh` set; the caller's module is
    not changed. Raises ValueError for a mesh of more than one replica, or a model with
    no `mesh` attribute.
    """
    serving_mesh(mesh)
    model = nnx.merge(graphdef, params)  # a new module over the same arrays
    if not hasattr(model, "mesh"):
        raise ValueError(
            f"{type(model).__name__} has no `mesh` attribute, so it cannot run on a mesh"
        )
    model.mesh = mesh
    graphdef, params = nnx.split(model)
    config = model.config
    params = jax.device_put(params, param_shardings(params, config, mesh))
    kv_cache = jax.device_put(kv_cache, cache_shardings(kv_cache, config.num_kv_heads, mesh))
    return graphdef, params, kv_cache
