"""Model weights on disk: Hugging Face safetensors checkpoints and orbax parameter checkpoints.

Hugging Face names map onto the NNX parameter paths by the family's rule
(`Family.hf_name`; `family.hf_name` for the families here). A parameter of stacked
layers (`scan_layers`, `[L, ...]`) is the L tensors of `model.layers.{l}....` stacked on
axis 0 (`layer_stack.layer_paths`), and one stacked over experts (`[E, ...]`, after the
layer axis if any) the E tensors of `...experts.{e}....` (`family.EXPERT_INDEX`); each
is read slice by slice into its sharding like any other, so a device of an
expert-parallel mesh reads only its own experts' tensors. Orbax checkpoints hold the
layers one by one either way. Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import sys
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paxkv.pallas_kernels.layout import QUANTIZED_KV_CACHE_DTYPES

from . import layer_stack
from .decoder_config import DecoderConfig
from .family import EXPERT_INDEX, SCALE, Model
from .registry import config_from_hf, family_of, model_class

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
ORBAX_PARAMS_DIR = "params"

# Buffers some older Llama checkpoints carry; derived from the config, so skipped.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# safetensors' names of the floating dtypes (F64, F32, F16, BF16, F8_E4M3, ...); an
# integer or bool tensor would be cast to float silently and give garbage.
_FLOAT_DTYPE_PREFIXES = ("F", "BF")


def _abstract_model(config: DecoderConfig):
    """`(graphdef, state)` of the model with ShapeDtypeStruct leaves (its weights
    quantized as `config.quantization` says); allocates nothing."""
    cls = model_class(config)
    mode = getattr(config, "quantization", None)

    def make() -> Model:
        model = cls(config.replace(quantization=None) if mode else config, rngs=nnx.Rngs(0))
        if mode:
            from .quantized_weights import quantize_model

            quantize_model(model, mode)
        return model

    return nnx.split(nnx.eval_shape(make))


class _Param(NamedTuple):
    # Its Hugging Face tensors, an object array over the parameter's leading axes that
    # stack tensors: layers (`[L, ...]`, scanned), then experts (`[E, ...]`); 0-d for one.
    names: np.ndarray
    transpose: bool  # each tensor is stored transposed in the file
    path: tuple  # the NNX path
    var: nnx.Variable


def _hf_params(state, config: DecoderConfig) -> Iterator[_Param]:
    """Every parameter of `state` (of a model of `config`) with the Hugging Face
    tensors it is made of."""
    hf_name = family_of(config).hf_name
    for path, var in nnx.to_flat_state(state):
        held = layer_stack.layer_paths(tuple(str(p) for p in path), config)
        paths, stacked = ([path], False) if held is None else held
        names = [hf_name(p)[0] for p in paths]  # each layer's, when stacked
        if EXPERT_INDEX in names[0]:  # the expert axis follows the layer axis, if any
            num_experts = var.get_value().shape[int(stacked)]
            names = [[n.replace(EXPERT_INDEX, str(e)) for e in range(num_experts)] for n in names]
        names = np.array(names, dtype=object)
        yield _Param(names if stacked else names[0, ...], hf_name(path)[1], path, var)


def read_json(file: str) -> dict[str, Any]:
    """The JSON object in `file`; ValueError naming the file if it is unreadable or not
    a JSON object (OSError, naming it, if it cannot be opened)."""
    try:
        with open(file, "rb") as f:
            value = json.loads(f.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def read_hf_config(path: str | os.PathLike) -> DecoderConfig:
    """The config (of the family registered for its model type) of checkpoint
    directory `path`'s `config.json`.

    ValueError naming the file and the field for invalid JSON, a missing field or a
    field of the wrong type (see `LlamaConfig.from_hf`); OSError without the file.
    """
    file = os.path.join(os.fspath(path), CONFIG_FILE)
    hf = read_json(file)
    try:
        return config_from_hf(hf)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from e


def _tensor_files(path: str) -> dict[str, str]:
    """Maps each tensor name to the safetensors file (under `path`) that holds it.

    ValueError naming the file for an index that is not valid JSON, has no weight map,
    or names a shard that does not exist, and for an unreadable single file.
    """
    index = os.path.join(path, SAFETENSORS_INDEX_FILE)
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(file, str) for file in weight_map.values()
        ):
            raise ValueError(f"{index}: expected a 'weight_map' of tensor names to file names")
        for file in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(path, file)):
                raise ValueError(f"{index}: names the shard {file}, which is not in {path}")
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SAFETENSORS_FILE)
    if not os.path.exists(single):
        raise ValueError(f"{path} has neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX_FILE}")
    with _open_safetensors(single) as f:
        return dict.fromkeys(f.keys(), single)


def _open_safetensors(file: str):
    """`safe_open(file)` for numpy; ValueError naming the file (and the tensors cut off,
    if it was truncated) when it is not a complete safetensors file, OSError naming it
    when it cannot be opened (a directory, say)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, framework="numpy")
    except OSError as e:  # a directory, a device, no permission: Rust's message omits the name
        raise OSError(f"{file}: cannot open as a safetensors file ({e})") from e
    except SafetensorError as e:
        cut = _tensors_past_end(file)
        detail = f"; tensors cut off at byte {os.path.getsize(file)}: {cut}" if cut else ""
        raise ValueError(f"{file}: not a complete safetensors file ({e}){detail}") from e


def _tensors_past_end(file: str) -> list[str]:
    """Names of the tensors whose bytes, by `file`'s own header, lie past its end
    (a truncated file); empty when the header itself cannot be read."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8 or (n := struct.unpack("<Q", head)[0]) > size - 8:
            return []
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return []
    ends = {
        name: entry["data_offsets"][1]
        for name, entry in header.items()
        if isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list)
    }
    return sorted((name for name, end in ends.items() if 8 + n + end > size), key=ends.get)


def _read_tensor(f, file: str, name: str) -> np.ndarray:
    """Tensor `name` of the open safetensors `f`; ValueError naming it and `file`."""
    from safetensors import SafetensorError

    try:
        return f.get_tensor(name)
    except (SafetensorError, TypeError, ValueError) as e:
        raise ValueError(f"{file}: cannot read tensor {name} ({e})") from e


def _nonfinite_error(bad: dict[str, list[str]]) -> ValueError:
    """The error for parameters holding NaN or inf: `bad` maps each file to their names."""
    where = "; ".join(f"{file}: {names}" for file, names in bad.items())
    return ValueError(f"non-finite values (NaN or inf) in {where}")


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    mesh: Any = None,
    stats: dict[str, int] | None = None,
    scan_layers: bool | None = None,
    quantization: str | None = None,
) -> tuple[DecoderConfig, Model]:
    """Loads a local Hugging Face checkpoint directory (single-file or sharded safetensors).

    `quantization` ("int8", "fp8"; `paxkv.models.quantized_weights`) quantizes a float
    checkpoint's projections and experts as they load: each weight is read whole to the
    host, quantized on the CPU and placed (values and scale) into its sharding, so no
    device holds it in float. A pre-quantized checkpoint (`quantization_config`) loads
    as it is quantized.

    The parameters are cast to `dtype` (default: the config's `torch_dtype`);
    `scan_layers=True` loads the layers stacked (`[L, ...]` per parameter, each layer's
    tensor read into its place: nothing is loaded twice). With a
    `mesh` (`paxkv.sharding`), every parameter is created in its sharding from the
    start: each device's slice is read from the file on its own (safetensors'
    `get_slice`), checked and cast, so no device holds more than its shard, the host
    about one tensor's slices at a time, and a process of a multi-host job reads only
    the slices of its own devices. `stats`, if given, counts the tensor bytes read: in all
    (`"bytes_read"`) and per tensor (by its name). Raises
    ValueError naming the file, and the field or tensor, for a `config.json` that is
    invalid or lacks a field (`read_hf_config`), an index or safetensors file that is
    unreadable or truncated, a missing tensor, an unexpected one, a shape that does not
    match the config, a tensor of integers or bools, and tensors holding NaN or inf
    (checked as each is read); OSError naming the file for one that cannot be opened.
    """
    path = os.fspath(path)
    config = read_hf_config(path)
    on_load = None  # the quantization to apply as float weights load
    if quantization is not None and config.quantization is None:
        from .quantized_weights import check_mode

        on_load = check_mode(quantization)
        config = config.replace(quantization=on_load)
    elif quantization is not None and quantization != config.quantization:
        raise ValueError(
            f"quantization={quantization!r}: checkpoint {path} is quantized already "
            f"({config.quantization})"
        )
    if dtype is not None:
        config = config.replace(dtype=dtype)
    if scan_layers is not None:
        config = config.replace(scan_layers=scan_layers)
    files = _tensor_files(path)
    # MXFP4 tensors (gpt-oss's experts): `<name>_blocks` and `<name>_scales` stand for
    # `<name>`, dequantized as it is read.
    mxfp4 = _mxfp4_pairs(files)
    for name, (blocks, _) in mxfp4.items():
        files[name] = files[blocks]
    mxfp4_parts = {blocks for blocks, _ in mxfp4.values()} | {s for _, s in mxfp4.values()}
    # A W8A8 checkpoint's static activation scales: its activations run unquantized here.
    ignored = _IGNORED_SUFFIXES + ((".input_scale",) if config.quantization else ())
    found = {n for n in files if not n.endswith(ignored) and n not in mxfp4_parts}
    graphdef, state = _abstract_model(config)
    params = list(_hf_params(state, config))
    if on_load:  # the scales are made here, not read
        params = [p for p in params if not str(p.path[-1]).endswith(SCALE)]
    scales = {  # the scale variables, by path (a quantized weight's is beside it)
        tuple(str(p) for p in path): var
        for path, var in nnx.to_flat_state(state)
        if str(path[-1]).endswith(SCALE)
    }
    expected = {name for param in params for name in param.names.flat}
    if missing := sorted(expected - found):
        raise ValueError(f"checkpoint {path} is missing tensors: {missing}")
    if unexpected := sorted(found - expected):
        hint = " (config has tie_word_embeddings=True)" if "lm_head.weight" in unexpected else ""
        raise ValueError(f"checkpoint {path} has unexpected tensors{hint}: {unexpected}")
    nonfinite: dict[str, list[str]] = {}
    stats = {} if stats is None else stats
    stats.setdefault("bytes_read", 0)
    with contextlib.ExitStack() as stack:
        opened: dict[str, tuple[Any, set[str]]] = {}

        dequantized: dict[str, np.ndarray] = {}  # an MXFP4 tensor's, while it is read

        def handle(name: str) -> tuple[Any, str]:
            # The open file holding tensor `name` (a stacked parameter's layers may
            # lie in several shards), checked to store it.
            if name in mxfp4:
                name = mxfp4[name][0]
            file = files[name]
            if file not in opened:
                f = stack.enter_context(_open_safetensors(file))
                opened[file] = f, set(f.keys())
            f, stored = opened[file]
            if name not in stored:
                raise ValueError(f"tensor {name} is indexed in {file} but not stored there")
            return f, file

        def read(
            name: str, transpose: bool, dtype: Any, hf_shape: tuple, index: tuple = ()
        ) -> np.ndarray:
            # Slice `index` (of the model's layout) of tensor `name`, counted and checked,
            # in `dtype`. A per-tensor scale (one value) is read whole and broadcast to
            # the per-channel scale's `hf_shape`.
            f, file = handle(name)
            hf_index = index[::-1] if transpose else index
            if name in mxfp4:
                if name not in dequantized:
                    blocks, scales = (_read_slice(*handle(n), n)[:] for n in mxfp4[name])
                    dequantized.clear()  # one at a time
                    dequantized[name] = dequantize_mxfp4(np.asarray(blocks), np.asarray(scales))
                part = dequantized[name][hf_index]
                stats["bytes_read"] += part.nbytes
                if not np.isfinite(part).all():  # a scale of 255 (NaN in e8m0)
                    nonfinite.setdefault(file, []).append(name)
                return (part.T if transpose else part).astype(dtype, copy=False)
            stored = _read_slice(f, file, name)
            if name.endswith("weight_scale") and np.prod(stored.get_shape()) == 1:
                value = np.asarray(stored[:]).reshape(())
                part = np.broadcast_to(value, np.empty(hf_shape, bool)[hf_index].shape)
            elif stored.get_dtype() in _FLOAT8:  # NumPy has no float8: mapped from the file
                part = np.asarray(_float8_tensor(file, name)[hf_index])
            else:
                part = np.asarray(stored[hf_index])
            stats["bytes_read"] += part.nbytes
            stats[name] = stats.get(name, 0) + part.nbytes
            if not np.isfinite(part).all():  # on the host, before the cast
                nonfinite.setdefault(file, []).append(name)
            return (part.T if transpose else part).astype(dtype, copy=False)

        for names, transpose, var_path, var in params:
            want, dtype = var.get_value().shape, var.get_value().dtype
            tensor_shape = want[names.ndim :]
            want_hf = tensor_shape[::-1] if transpose else tensor_shape
            scale_path = (*(str(p) for p in var_path[:-1]), str(var_path[-1]) + SCALE)
            quantizing = on_load is not None and scale_path in scales
            if quantizing:  # read in float, quantized below
                dtype = np.dtype(config.dtype)
            # a compressed-tensors int8 weight
            quantized = np.dtype(dtype) == np.int8
            for name in names.flat:
                if name in mxfp4:
                    pair = (_read_slice(*handle(n), n) for n in mxfp4[name])
                    _check_mxfp4(*pair, name, want_hf)
                    continue
                f, file = handle(name)
                stored = _read_slice(f, file, name)
                stored_dtype = stored.get_dtype()
                if not (stored_dtype.startswith(_FLOAT_DTYPE_PREFIXES) or quantized):
                    raise ValueError(
                        f"{file}: tensor {name} is stored as {stored_dtype}; weights "
                        "must be floating point (F32, F16, BF16, ...), not integers or bools"
                    )
                if quantized and stored_dtype != "I8":
                    raise ValueError(f"{file}: tensor {name} is stored as {stored_dtype}, not I8")
                shape = tuple(stored.get_shape())
                per_tensor = name.endswith("weight_scale") and np.prod(shape) == 1
                if shape != want_hf and not per_tensor:
                    raise ValueError(
                        f"{file}: tensor {name} has shape {shape}, expected {want_hf} "
                        "from the config"
                    )

            def part(index, names=names, transpose=transpose, dtype=dtype, hf_shape=want_hf):
                # Device slice `index` of the parameter: its leading indices pick the
                # stacked tensors (layers, experts), the rest is read of each in turn.
                picked, rest = names[tuple(index[: names.ndim])], tuple(index[names.ndim :])
                picked_names = list(picked.flat) if names.ndim else [picked]
                parts = [read(str(n), transpose, dtype, hf_shape, rest) for n in picked_names]
                if not names.ndim:
                    return parts[0]
                return np.stack(parts).reshape(*picked.shape, *parts[0].shape)

            if quantizing:
                values, scale = _quantized_on_host(part((slice(None),) * len(want)), on_load)
                scale_var = scales[scale_path]
                for v, p, x in ((var, var_path, values), (scale_var, scale_path, scale)):
                    where = None if mesh is None else _sharding_of(v, p, config, mesh)
                    v.set_value(jax.device_put(x, where) if where else jnp.asarray(x))
                continue
            if mesh is None:
                var.set_value(jnp.asarray(part((slice(None),) * len(want))))
                continue
            sharding = _sharding_of(var, var_path, config, mesh)
            var.set_value(jax.make_array_from_callback(want, sharding, part))
    if nonfinite:
        raise _nonfinite_error({f: sorted(set(n)) for f, n in nonfinite.items()})
    return config, nnx.merge(graphdef, state)


# safetensors' float8 dtypes (fp8 checkpoints' weights): the fp8 KV pages' dtypes.
_FLOAT8 = {
    "F8_E4M3": QUANTIZED_KV_CACHE_DTYPES["fp8"],
    "F8_E5M2": QUANTIZED_KV_CACHE_DTYPES["fp8_e5m2"],
}


def _float8_tensor(file: str, name: str) -> np.ndarray:
    """Tensor `name` of safetensors `file`, stored as float8, as a read-only ml_dtypes
    array mapped from the file (safetensors' NumPy reader has no float8 type)."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(size))[name]
    start, end = info["data_offsets"]
    raw = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + size + start, shape=(end - start,))
    return raw.view(_FLOAT8[info["dtype"]]).reshape(info["shape"])


# MXFP4's 4-bit values (e2m1), by code: the low nibble of a byte is the even element.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)


def _mxfp4_pairs(files: dict[str, str]) -> dict[str, tuple[str, str]]:
    """`name -> (name_blocks, name_scales)` of every MXFP4 tensor in `files`."""
    return {
        n.removesuffix("_blocks"): (n, n.removesuffix("_blocks") + "_scales")
        for n in files
        if n.endswith("_blocks") and n.removesuffix("_blocks") + "_scales" in files
    }


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (OCP microscaling, gpt-oss's experts) as float32: `blocks u8[E, R, G, 16]`
    (two e2m1 values a byte, low nibble first) times `2 ** (scales u8[E, R, G] - 127)`,
    a scale per 32 values; returned `[E, G * 32, R]` (the rows R are the outputs: the
    NNX layout, `[E, in, out]`)."""
    values = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    e, r, g, b = values.shape
    return values.reshape(e, r, g * b).transpose(0, 2, 1)


def _check_mxfp4(blocks: Any, scales: Any, name: str, want: tuple) -> None:
    """ValueError naming the tensor unless `name`'s MXFP4 blocks and scales are bytes of
    shapes that dequantize to `want` (`[E, in, out]`)."""
    b, s = tuple(blocks.get_shape()), tuple(scales.get_shape())
    if blocks.get_dtype() != "U8" or scales.get_dtype() != "U8":
        raise ValueError(f"MXFP4 tensor {name}: blocks and scales must be U8")
    if len(b) != 4 or b[:3] != s or (b[0], b[2] * b[3] * 2, b[1]) != tuple(want):
        raise ValueError(
            f"MXFP4 tensor {name}: blocks {b} and scales {s} do not make {tuple(want)} "
            "(blocks [E, out, in / 32, 16], scales [E, out, in / 32])"
        )


def _quantized_on_host(weight: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """`weight` (`[..., in, out]`) quantized on the CPU (`quantize_weight`): host arrays
    of its values and scale, which never touch an accelerator in float."""
    from .quantized_weights import quantize_weight

    with jax.default_device(jax.devices("cpu")[0]):
        values, scale = quantize_weight(jnp.asarray(weight), mode=mode)
    return np.asarray(values), np.asarray(scale)


def _read_slice(f, file: str, name: str):
    """The lazy slice handle of tensor `name` of the open safetensors `f`."""
    from safetensors import SafetensorError

    try:
        return f.get_slice(name)
    except (SafetensorError, TypeError, ValueError) as e:
        raise ValueError(f"{file}: cannot read tensor {name} ({e})") from e


def _sharding_of(var: nnx.Variable, path: tuple, config: DecoderConfig, mesh: Any):
    """The NamedSharding of the parameter `var` at NNX `path` on `mesh`."""
    from jax.sharding import NamedSharding

    from paxkv.sharding import shardings

    names = tuple(str(p) for p in path if p != "value")
    return NamedSharding(mesh, shardings.param_spec(names, var.get_value().shape, config, mesh))


def save_hf_checkpoint(
    model: Model, path: str | os.PathLike, *, max_shard_bytes: int | None = None
) -> None:
    """Writes `config.json` and the weights in Hugging Face's safetensors layout.

    With `max_shard_bytes`, tensors are split into `model-0000i-of-0000n.safetensors`
    shards of at most that size (a larger tensor gets a shard of its own) with a
    `model.safetensors.index.json`; otherwise one `model.safetensors`.
    """
    from safetensors.numpy import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(model.config.to_hf(), f, indent=2)
    tensors = {}
    for names, transpose, _, var in _hf_params(nnx.state(model, nnx.Param), model.config):
        array = np.asarray(var.get_value())
        stacked = array.reshape(-1, *array.shape[names.ndim :])
        for name, tensor in zip(names.flat, stacked, strict=True):
            tensors[name] = np.ascontiguousarray(tensor.T if transpose else tensor)
    if max_shard_bytes is None:
        save_file(tensors, os.path.join(path, SAFETENSORS_FILE), metadata={"format": "pt"})
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    index = {
        "metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
        "weight_map": weight_map,
    }
    with open(os.path.join(path, SAFETENSORS_INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)


def save_params(model: Model, path: str | os.PathLike) -> None:
    """Writes the parameters as an orbax checkpoint in `path/params`, and `path/config.json`.

    `path` must not hold a `params` checkpoint already.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(model.config.to_hf(), f, indent=2)
    # One layout on disk: the layers one by one, however the model holds them.
    state = nnx.state(layer_stack.with_scan_layers(model, False), nnx.Param)
    with _quiet_info_logs(), ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(path, ORBAX_PARAMS_DIR), state)


def restore_params(config: DecoderConfig, path: str | os.PathLike, *, mesh: Any = None) -> Model:
    """The model whose parameters `save_params` wrote under `path`, in `config.dtype`.

    With a `mesh`, each parameter goes from the host straight to its sharding (each
    device receives only its shard); the host holds the restored arrays meanwhile.

    Raises ValueError naming `path/params` when orbax cannot restore it (a missing,
    truncated or corrupt file, or shapes that do not match `config`), and naming the
    parameters that hold NaN or inf.
    """
    import orbax.checkpoint as ocp

    params_dir = os.path.join(os.path.abspath(os.fspath(path)), ORBAX_PARAMS_DIR)
    graphdef, abstract = _abstract_model(config.replace(scan_layers=False))  # as saved
    # Restored to the host (NumPy targets), checked there, then put on the device.
    on_host = jax.tree.map(lambda leaf: np.empty(leaf.shape, leaf.dtype), abstract)
    try:
        with _quiet_info_logs(), ocp.StandardCheckpointer() as checkpointer:
            state = checkpointer.restore(params_dir, on_host)
    # Orbax and tensorstore raise many types for a damaged checkpoint: all mean this one.
    except Exception as e:
        _ignore_closed_loop_callbacks()
        raise ValueError(
            f"{params_dir}: cannot restore the parameters ({type(e).__name__}: {_brief(e)})"
        ) from e
    bad = [
        ".".join(map(str, p))
        for p, var in nnx.to_flat_state(state)
        if not np.isfinite(var.get_value()).all()
    ]
    if bad:
        raise _nonfinite_error({params_dir: bad})
    if config.scan_layers:  # stacked on the host, then placed
        stacked = layer_stack.with_scan_layers(nnx.merge(graphdef, state), True)
        graphdef, state = nnx.split(stacked)
    if mesh is None:
        return nnx.merge(graphdef, jax.device_put(state))
    from paxkv.sharding import shardings

    return nnx.merge(
        graphdef, jax.device_put(state, shardings.param_shardings(state, config, mesh))
    )


def _ignore_closed_loop_callbacks() -> None:
    """Silences the stray tracebacks of a failed orbax restore, once per process.

    When one read fails, orbax closes its event loop while tensorstore's threads still
    have reads in flight; each then reports "RuntimeError: Event loop is closed" through
    `sys.unraisablehook`. This hook drops exactly those (raised off the main thread) and
    passes everything else to the hook it replaces.
    """
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop_callbacks", False):
        return

    def hook(unraisable) -> None:
        if (
            unraisable.exc_type is RuntimeError
            and str(unraisable.exc_value) == "Event loop is closed"
            and threading.current_thread() is not threading.main_thread()
        ):
            return
        previous(unraisable)

    hook.drops_closed_loop_callbacks = True
    sys.unraisablehook = hook


def _brief(error: Exception, limit: int = 300) -> str:
    """The first line of `error`'s message, cut at `limit` characters (tensorstore's
    run to kilobytes of spec)."""
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[:limit] + "..."


@contextlib.contextmanager
def _quiet_info_logs() -> Iterator[None]:
    """Hides absl's INFO lines (orbax's many) in the block, unless DEBUG was asked for.

    Raises the level of absl's logger from INFO to WARNING and restores it after, so
    warnings and errors still show and `--verbosity=1` still shows everything.
    """
    from absl import logging as absl_logging

    logger = absl_logging.get_absl_logger()
    level = logger.level
    if logger.getEffectiveLevel() == logging.INFO:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
