"""Serving set-ups, one file per model, each a `ServingSetup` value named `SETUP`.

Installed as `paxkv.configs`. `get_config("llama-3.1-8b")` gives the set-up by name.
The configs of real models are shapes and serving limits only: their weights come
from a local Hugging Face checkpoint (`--model_dir`). A set-up with
`random_weights=True` (the tiny toy) also runs with random weights, and one with a
`checkpoint` (tiny-py, the tiny toy trained) with the weights shipped in the package.
"""

from __future__ import annotations

from paxkv.configs import (
    gemma_2_9b,
    gemma_3_4b,
    llama_3_1_8b,
    llama_3_2_1b,
    mistral_7b,
    qwen2_5_7b,
    qwen3_8b,
    tiny,
    tiny_gemma3,
    tiny_py,
)
from paxkv.configs.setup import ServingSetup

CONFIGS: dict[str, ServingSetup] = {
    m.SETUP.name: m.SETUP
    for m in (
        tiny,
        tiny_py,
        tiny_gemma3,
        llama_3_2_1b,
        llama_3_1_8b,
        mistral_7b,
        qwen2_5_7b,
        qwen3_8b,
        gemma_2_9b,
        gemma_3_4b,
    )
}
NAMES = tuple(CONFIGS)


def get_config(name: str) -> ServingSetup:
    """The set-up called `name`; ValueError naming the known ones for any other."""
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; known configs: {', '.join(NAMES)}")
    return CONFIGS[name]


__all__ = ["CONFIGS", "NAMES", "ServingSetup", "get_config"]
