"""Models over the paged KV cache: the registered families (`registry.FAMILIES`: Llama,
Gemma, the mixtures of experts: Mixtral, Qwen3-MoE, gpt-oss), their configs, presets, weights and tokenizers."""

from __future__ import annotations

import os
from typing import Any

from .family import Family, Model, ModelConfig
from .gemma import GemmaForCausalLM
from .gemma_config import GemmaConfig
from .gpt_oss_config import GptOssConfig
from .hf_fields import DTYPES
from .layers import dense_causal_attention
from .llama import LlamaForCausalLM
from .llama_config import Llama3RopeScaling, LlamaConfig
from .moe_config import MoeConfig
from .moe_decoder import MoeForCausalLM
from .registry import BYTE_LEVEL_PRESETS, FAMILIES, PRESETS, config_from_hf, init_model
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from .weights import (
    CONFIG_FILE,
    ORBAX_PARAMS_DIR,
    load_hf_checkpoint,
    read_hf_config,
    read_json,
    restore_params,
    save_hf_checkpoint,
    save_params,
)

# Trained checkpoints shipped inside the package, by name: `paxkv-train` writes tiny-py,
# the tiny architecture as a byte-level LM of the Python standard library.
CHECKPOINTS = {"tiny-py": os.path.join(os.path.dirname(__file__), "checkpoints", "tiny_py")}
# A checkpoint directory without a tokenizer.json declares a byte-level tokenizer here,
# as {"tokenizer_class": "ByteTokenizer"} (the key of Hugging Face's file of this name).
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

__all__ = [
    "BYTE_LEVEL_PRESETS",
    "CHECKPOINTS",
    "CONFIG_FILE",
    "DTYPES",
    "FAMILIES",
    "ORBAX_PARAMS_DIR",
    "PRESETS",
    "TOKENIZER_CONFIG_FILE",
    "ByteTokenizer",
    "Family",
    "GemmaConfig",
    "GemmaForCausalLM",
    "GptOssConfig",
    "HFTokenizer",
    "Llama3RopeScaling",
    "LlamaConfig",
    "LlamaForCausalLM",
    "Model",
    "ModelConfig",
    "MoeConfig",
    "MoeForCausalLM",
    "Tokenizer",
    "config_from_hf",
    "dense_causal_attention",
    "init_model",
    "load_hf_checkpoint",
    "load_model",
    "load_tokenizer",
    "read_hf_config",
    "restore_params",
    "save_hf_checkpoint",
    "save_params",
]


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | None = None,
    seed: int = 0,
    mesh: Any = None,
    scan_layers: bool | None = None,
) -> tuple[ModelConfig, Model, Tokenizer | None]:
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
    """
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
    else:
        config, model = load_hf_checkpoint(name, dtype=dtype, mesh=mesh, scan_layers=scan_layers)
    tokenizer = load_tokenizer(name)
    if tokenizer is None and _declares_byte_tokenizer(name):
        tokenizer = ByteTokenizer()
    return config, model, tokenizer


def _declares_byte_tokenizer(path: str) -> bool:
    file = os.path.join(path, TOKENIZER_CONFIG_FILE)
    if not os.path.isfile(file):
        return False
    return read_json(file).get("tokenizer_class") == "ByteTokenizer"
