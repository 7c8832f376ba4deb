"""Models over the paged KV cache: the registered families (`registry.FAMILIES`: Llama,
Gemma, the mixtures of experts: Mixtral, Qwen3-MoE, gpt-oss), their configs, presets, weights and tokenizers.

Names load lazily, so the configs (`decoder_config.DecoderConfig` and each family's)
import without JAX, for the capacity planner. Any other name imports the registry
first, as importing the package did: every family's sharding rules are registered.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .decoder_config import DecoderConfig
    from .family import Model
    from .tokenizer import Tokenizer

# Names by the module that defines them; those of `_WITHOUT_JAX` import no JAX.
_LAZY = {
    "DecoderConfig": "decoder_config",
    "DTYPES": "hf_fields",
    "GemmaConfig": "gemma_config",
    "GptOssConfig": "gpt_oss_config",
    "Llama3RopeScaling": "llama_config",
    "LlamaConfig": "llama_config",
    "MoeConfig": "moe_config",
    "Family": "family",
    "Model": "family",
    "ModelConfig": "family",
    "GemmaForCausalLM": "gemma",
    "dense_causal_attention": "layers",
    "LlamaForCausalLM": "llama",
    "MoeForCausalLM": "moe_decoder",
    "BYTE_LEVEL_PRESETS": "registry",
    "FAMILIES": "registry",
    "PRESETS": "registry",
    "config_from_hf": "registry",
    "init_model": "registry",
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "CONFIG_FILE": "weights",
    "ORBAX_PARAMS_DIR": "weights",
    "load_hf_checkpoint": "weights",
    "read_hf_config": "weights",
    "restore_params": "weights",
    "save_hf_checkpoint": "weights",
    "save_params": "weights",
}
_WITHOUT_JAX = (
    "decoder_config",
    "hf_fields",
    "gemma_config",
    "gpt_oss_config",
    "llama_config",
    "moe_config",
)

# Trained checkpoints shipped inside the package, by name: `paxkv-train` writes tiny-py,
# the tiny architecture as a byte-level LM of the Python standard library.
CHECKPOINTS = {"tiny-py": os.path.join(os.path.dirname(__file__), "checkpoints", "tiny_py")}
# A checkpoint directory declares paxkv's byte-level tokenizer here, as
# {"paxkv_tokenizer": "bytes"} (beside a tokenizer.json of the same tokens, for other
# programs: `byte_tokenizer_json`) or, without a tokenizer.json, {"tokenizer_class":
# "ByteTokenizer"} (the key of Hugging Face's file of this name).
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

__all__ = sorted([*_LAZY, "CHECKPOINTS", "TOKENIZER_CONFIG_FILE", "load_model"])


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module not in _WITHOUT_JAX:
        importlib.import_module(f"{__name__}.registry")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | None = None,
    seed: int = 0,
    mesh: Any = None,
    scan_layers: bool | None = None,
    quantization: str | None = None,
) -> tuple[DecoderConfig, Model, Tokenizer | None]:
    """`(config, model, tokenizer or None)` from a preset name or a local directory.

    A preset name gives a random model (`seed`); the byte-level ones (`BYTE_LEVEL_PRESETS`:
    "tiny", "tiny-qwen3", "tiny-mixtral", ...) come with the `ByteTokenizer`.
    A name of `CHECKPOINTS` ("tiny-py") gives that trained model and the `ByteTokenizer`.
    A directory is a Hugging Face checkpoint, or an orbax checkpoint from `save_params`
    (`config.json` and `params/`); its tokenizer is its `tokenizer.json`, if any, or the
    `ByteTokenizer` its `tokenizer_config.json` declares.
    `dtype` overrides the parameter dtype, `scan_layers` how the layers are held and
    run (`paxkv.models.layer_stack`; None: the config's, off). With a `mesh` (`paxkv.sharding`) the weights
    are created in their shardings from the start (no device holds more than its shard).

    A damaged checkpoint raises ValueError naming the file and the field or tensor: an
    invalid or incomplete `config.json`, an unreadable or truncated weights file, an
    unreadable tokenizer file, parameters holding NaN or inf; OSError for a file that
    cannot be opened.

    `quantization` ("int8", "fp8") quantizes the projections' and experts' weights once
    loaded (`paxkv.models.quantized_weights`), a scale per output channel.
    """
    if quantization is not None and not _is_hf_checkpoint(name_or_path):
        from .quantized_weights import check_mode, quantize_model

        check_mode(quantization)
        config, model, tokenizer = load_model(
            name_or_path, dtype=dtype, seed=seed, mesh=mesh, scan_layers=scan_layers
        )
        quantize_model(model, quantization)
        return model.config, model, tokenizer
    from .registry import BYTE_LEVEL_PRESETS, PRESETS, init_model
    from .tokenizer import ByteTokenizer, load_tokenizer
    from .weights import ORBAX_PARAMS_DIR, load_hf_checkpoint, read_hf_config, restore_params

    name = os.fspath(name_or_path)
    overrides = {k: v for k, v in (("dtype", dtype), ("scan_layers", scan_layers)) if v is not None}
    if name in PRESETS:
        config = PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
        tokenizer = ByteTokenizer() if name in BYTE_LEVEL_PRESETS else None
        return config, init_model(config, seed, mesh=mesh), tokenizer
    if name in CHECKPOINTS:
        path = CHECKPOINTS[name]
        if not os.path.isdir(os.path.join(path, ORBAX_PARAMS_DIR)):
            raise FileNotFoundError(
                f"the {name} checkpoint is missing from {path}: train it with `paxkv-train` "
                "(a few minutes on a CPU)"
            )
        return load_model(path, dtype=dtype, mesh=mesh, scan_layers=scan_layers)
    if not os.path.isdir(name):
        raise ValueError(
            f"{name!r} is neither a preset ({', '.join(PRESETS)}), a trained checkpoint "
            f"({', '.join(CHECKPOINTS)}) nor an existing directory"
        )
    if os.path.isdir(os.path.join(name, ORBAX_PARAMS_DIR)):
        config = read_hf_config(name).replace(**overrides)
        model = restore_params(config, name, mesh=mesh)
    else:  # quantized as it loads (no device holds the float weights)
        config, model = load_hf_checkpoint(
            name, dtype=dtype, mesh=mesh, scan_layers=scan_layers, quantization=quantization
        )
    declared = _declared_tokenizer(name)
    if declared.get("paxkv_tokenizer") == "bytes":  # beside a tokenizer.json for others
        return config, model, ByteTokenizer()
    tokenizer = load_tokenizer(name)
    if tokenizer is None and declared.get("tokenizer_class") == "ByteTokenizer":
        tokenizer = ByteTokenizer()
    return config, model, tokenizer


def _is_hf_checkpoint(name: str | os.PathLike) -> bool:
    """Whether `load_model` reads `name` as a Hugging Face checkpoint directory."""
    from .weights import ORBAX_PARAMS_DIR

    path = os.fspath(name)
    return os.path.isdir(path) and not os.path.isdir(os.path.join(path, ORBAX_PARAMS_DIR))


def _declared_tokenizer(path: str) -> dict:
    """The checkpoint's `tokenizer_config.json` ({} without one)."""
    file = os.path.join(path, TOKENIZER_CONFIG_FILE)
    if not os.path.isfile(file):
        return {}
    from .weights import read_json

    return read_json(file)
