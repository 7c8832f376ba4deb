"""What a serving set-up is: a model's shapes and the engine limits it is served with."""

from __future__ import annotations

import dataclasses

from paxkv.engine import EngineConfig
from paxkv.models.config import ModelConfig


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
