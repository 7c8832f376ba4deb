"""Models over the paged KV cache: the Llama family, its configs, weights and tokenizers."""

from __future__ import annotations

import json
import os

from .config import PRESETS, Llama3RopeScaling, LlamaConfig
from .llama import LlamaForCausalLM, dense_causal_attention, init_cache, init_model
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from .weights import (
    CONFIG_FILE,
    ORBAX_PARAMS_DIR,
    load_hf_checkpoint,
    restore_params,
    save_hf_checkpoint,
    save_params,
)

__all__ = [
    "PRESETS",
    "ByteTokenizer",
    "HFTokenizer",
    "Llama3RopeScaling",
    "LlamaConfig",
    "LlamaForCausalLM",
    "Tokenizer",
    "dense_causal_attention",
    "init_cache",
    "init_model",
    "load_hf_checkpoint",
    "load_model",
    "load_tokenizer",
    "restore_params",
    "save_hf_checkpoint",
    "save_params",
]


def load_model(
    name_or_path: str | os.PathLike, *, dtype: str | None = None, seed: int = 0
) -> tuple[LlamaConfig, LlamaForCausalLM, Tokenizer | None]:
    """`(config, model, tokenizer or None)` from a preset name or a local directory.

    A preset name gives a random model (`seed`); "tiny" comes with the `ByteTokenizer`.
    A directory is a Hugging Face checkpoint, or an orbax checkpoint from `save_params`
    (`config.json` and `params/`); its tokenizer is its `tokenizer.json`, if any.
    `dtype` overrides the parameter dtype.
    """
    name = os.fspath(name_or_path)
    if name in PRESETS:
        config = PRESETS[name] if dtype is None else PRESETS[name].replace(dtype=dtype)
        tokenizer = ByteTokenizer() if name == "tiny" else None
        return config, init_model(config, seed), tokenizer
    if not os.path.isdir(name):
        raise ValueError(
            f"{name!r} is neither a preset ({', '.join(PRESETS)}) nor an existing directory"
        )
    if os.path.isdir(os.path.join(name, ORBAX_PARAMS_DIR)):
        with open(os.path.join(name, CONFIG_FILE)) as f:
            config = LlamaConfig.from_hf(json.load(f))
        if dtype is not None:
            config = config.replace(dtype=dtype)
        model = restore_params(config, name)
    else:
        config, model = load_hf_checkpoint(name, dtype=dtype)
    return config, model, load_tokenizer(name)
