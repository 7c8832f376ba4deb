"""Model weights on disk: Hugging Face safetensors checkpoints and orbax parameter checkpoints.

Hugging Face names map onto the NNX parameter paths by one rule (`hf_name`): the
path joined with dots under `model.` (`lm_head` at the top level), `kernel` read as a
transposed `weight` (HF Linear weights are `[out, in]`) and `embedding` as `weight`.
Nothing here touches the network.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import LlamaConfig
from .llama import LlamaForCausalLM

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
ORBAX_PARAMS_DIR = "params"

# Buffers some older Llama checkpoints carry; derived from the config, so skipped.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def hf_name(path: tuple) -> tuple[str, bool]:
    """The Hugging Face tensor name of an NNX parameter path, and whether it is transposed."""
    *modules, leaf = (str(p) for p in path)
    transpose = leaf == "kernel"
    leaf = "weight" if leaf in ("kernel", "embedding") else leaf
    prefix = [] if modules[:1] == ["lm_head"] else ["model"]
    return ".".join([*prefix, *modules, leaf]), transpose


def _abstract_model(config: LlamaConfig):
    """`(graphdef, state)` of the model with ShapeDtypeStruct leaves; allocates nothing."""
    return nnx.split(nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0))))


def _hf_params(state) -> Iterator[tuple[str, bool, nnx.Variable]]:
    for path, var in nnx.to_flat_state(state):
        name, transpose = hf_name(path)
        yield name, transpose, var


def _tensor_files(path: str) -> dict[str, str]:
    """Maps each tensor name to the safetensors file (under `path`) that holds it."""
    index = os.path.join(path, SAFETENSORS_INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SAFETENSORS_FILE)
    if not os.path.exists(single):
        raise ValueError(f"{path} has neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX_FILE}")
    from safetensors import safe_open

    with safe_open(single, framework="numpy") as f:
        return dict.fromkeys(f.keys(), single)


def load_hf_checkpoint(
    path: str | os.PathLike, *, dtype: str | None = None
) -> tuple[LlamaConfig, LlamaForCausalLM]:
    """Loads a local Hugging Face checkpoint directory (single-file or sharded safetensors).

    The parameters are cast to `dtype` (default: the config's `torch_dtype`). Raises
    ValueError naming the tensor for a missing tensor, an unexpected one, or a shape
    that does not match the config.
    """
    from safetensors import safe_open

    path = os.fspath(path)
    with open(os.path.join(path, CONFIG_FILE)) as f:
        config = LlamaConfig.from_hf(json.load(f))
    if dtype is not None:
        config = config.replace(dtype=dtype)
    files = _tensor_files(path)
    found = {n for n in files if not n.endswith(_IGNORED_SUFFIXES)}
    graphdef, state = _abstract_model(config)
    params = list(_hf_params(state))
    expected = {name for name, _, _ in params}
    if missing := sorted(expected - found):
        raise ValueError(f"checkpoint {path} is missing tensors: {missing}")
    if unexpected := sorted(found - expected):
        hint = " (config has tie_word_embeddings=True)" if "lm_head.weight" in unexpected else ""
        raise ValueError(f"checkpoint {path} has unexpected tensors{hint}: {unexpected}")
    by_file: dict[str, list] = {}
    for param in params:
        by_file.setdefault(files[param[0]], []).append(param)
    for file, file_params in by_file.items():
        with safe_open(file, framework="numpy") as f:
            stored = set(f.keys())
            for name, transpose, var in file_params:
                if name not in stored:
                    raise ValueError(f"tensor {name} is indexed in {file} but not stored there")
                array = f.get_tensor(name)
                want = var.get_value().shape
                want_hf = want[::-1] if transpose else want
                if array.shape != want_hf:
                    raise ValueError(
                        f"tensor {name} has shape {array.shape}, expected {want_hf} from the config"
                    )
                var.set_value(jnp.asarray(array.T if transpose else array, config.dtype))
    return config, nnx.merge(graphdef, state)


def save_hf_checkpoint(
    model: LlamaForCausalLM, path: str | os.PathLike, *, max_shard_bytes: int | None = None
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
    for name, transpose, var in _hf_params(nnx.state(model, nnx.Param)):
        array = np.asarray(var.get_value())
        tensors[name] = np.ascontiguousarray(array.T if transpose else array)
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


def save_params(model: LlamaForCausalLM, path: str | os.PathLike) -> None:
    """Writes the parameters as an orbax checkpoint in `path/params`, and `path/config.json`.

    `path` must not hold a `params` checkpoint already.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(model.config.to_hf(), f, indent=2)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(path, ORBAX_PARAMS_DIR), nnx.state(model, nnx.Param))


def restore_params(config: LlamaConfig, path: str | os.PathLike) -> LlamaForCausalLM:
    """The model whose parameters `save_params` wrote under `path`, in `config.dtype`."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    graphdef, abstract = _abstract_model(config)
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(os.path.join(path, ORBAX_PARAMS_DIR), abstract)
    return nnx.merge(graphdef, state)
