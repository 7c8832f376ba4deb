"""What a serving set-up is: a model's shapes and the engine limits it is served with."""

from __future__ import annotations

import dataclasses

from paxkv.engine import EngineConfig
from paxkv.llm import default_engine_config
from paxkv.models import BYTE_LEVEL_PRESETS, PRESETS
from paxkv.models.family import ModelConfig


@dataclasses.dataclass(frozen=True)
class ServingSetup:
    """A model's shapes and the engine limits it is served with.

    `random_weights`: the model may run without a checkpoint, randomly initialised
    (its `name` is then a preset of `paxkv.models`). `checkpoint`: the name of the
    trained checkpoint shipped with the package (`paxkv.models.CHECKPOINTS`) that holds
    the weights; None when they come from a local Hugging Face checkpoint, or are random.
    """

    name: str
    model: ModelConfig
    engine: EngineConfig
    random_weights: bool = False
    checkpoint: str | None = None

    def replace(self, **changes) -> ServingSetup:
        """A copy with `changes` applied (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)


def preset_setup(name: str) -> ServingSetup:
    """The set-up of a preset of `paxkv.models` that has no file of its own: the engine
    limits `paxkv.LLM(model=name)` serves it with (`default_engine_config`), random
    weights for the byte-level presets, `--model_dir`'s for the others."""
    model = PRESETS[name]
    return ServingSetup(
        name=name,
        model=model,
        engine=default_engine_config(model),
        random_weights=name in BYTE_LEVEL_PRESETS,
    )
