"""Serving set-ups: one file per model, each a `MODEL` (a `LlamaConfig`) and a `SERVING` (an `EngineConfig`).

Installed as `paxkv.configs`. `get_config("llama-3.1-8b")` gives the set-up by name.
The configs of real models are shapes and serving limits only: their weights come
from a local Hugging Face checkpoint (`--model_dir`). A set-up with
`RANDOM_WEIGHTS = True` (the tiny toy) also runs with random weights.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

from paxkv.configs import llama_3_1_8b, llama_3_2_1b, mistral_7b, qwen2_5_7b, tiny
from paxkv.engine import EngineConfig
from paxkv.models.config import LlamaConfig


@dataclasses.dataclass(frozen=True)
class ServingSetup:
    """A model's shapes and the engine limits it is served with.

    `random_weights`: the model may run without a checkpoint, randomly initialised
    (its `name` is then a preset of `paxkv.models`).
    """

    name: str
    model: LlamaConfig
    engine: EngineConfig
    random_weights: bool = False

    def replace(self, **changes) -> ServingSetup:
        return dataclasses.replace(self, **changes)


_MODULES: dict[str, ModuleType] = {
    "tiny": tiny,
    "llama-3.2-1b": llama_3_2_1b,
    "llama-3.1-8b": llama_3_1_8b,
    "mistral-7b": mistral_7b,
    "qwen2.5-7b": qwen2_5_7b,
}
NAMES = tuple(_MODULES)


def get_config(name: str) -> ServingSetup:
    """The set-up called `name`; ValueError naming the known ones for any other."""
    if name not in _MODULES:
        raise ValueError(f"unknown config {name!r}; known configs: {', '.join(NAMES)}")
    module = _MODULES[name]
    return ServingSetup(
        name=name,
        model=module.MODEL,
        engine=module.SERVING,
        random_weights=module.RANDOM_WEIGHTS,
    )
