"""Serving set-ups by name: one for every preset and shipped checkpoint of `paxkv.models`.

Installed as `paxkv.configs`. `get_config("llama-3.1-8b")` gives the set-up by name; the
names are those `paxkv.LLM(model=...)` takes (`paxkv.models.PRESETS` and `CHECKPOINTS`),
so the launch apps' `--config` and the Python API know the same list. A file here (a
`ServingSetup` value named `SETUP`) tunes a model's limits for a device; a preset
without one is served as `paxkv.LLM` serves it (`setup.preset_setup`). The set-ups of
real models are shapes and serving limits only: their weights come from a local Hugging
Face checkpoint (`--model_dir`). A set-up with `random_weights=True` (the byte-level
toys) also runs with random weights, and one with a `checkpoint` (tiny-py, the tiny toy
trained) with the weights shipped in the package.
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
from paxkv.configs.setup import ServingSetup, preset_setup
from paxkv.models import CHECKPOINTS, PRESETS

_TUNED: dict[str, ServingSetup] = {
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
if unknown := sorted(set(_TUNED) - set(PRESETS) - set(CHECKPOINTS)):
    raise ValueError(f"set-ups {unknown} name no preset or checkpoint of paxkv.models")
if untuned := sorted(set(CHECKPOINTS) - set(_TUNED)):
    raise ValueError(f"checkpoints {untuned} have no set-up file")
CONFIGS: dict[str, ServingSetup] = _TUNED | {
    name: preset_setup(name) for name in PRESETS if name not in _TUNED
}
NAMES = tuple(CONFIGS)


def get_config(name: str) -> ServingSetup:
    """The set-up called `name`; ValueError naming the known ones for any other."""
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; known configs: {', '.join(NAMES)}")
    return CONFIGS[name]


__all__ = ["CONFIGS", "NAMES", "ServingSetup", "get_config"]
