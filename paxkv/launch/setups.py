"""Serving set-ups by name: a model's shapes and the engine limits it is served with.

One for every preset and shipped checkpoint of `paxkv.models`: `get_setup("llama-3.1-8b")`
gives it by name, and the launch apps' `--setup` takes the same names as
`paxkv.LLM(model=...)`. `TUNED` holds the set-ups tuned for a device; a preset without
one is served as `paxkv.LLM` serves it (`preset_setup`). The set-ups of real models are
shapes and serving limits only: their weights come from a local Hugging Face checkpoint
(`--model_dir`). A set-up with `random_weights=True` (the byte-level toys) also runs with
random weights, and one with a `checkpoint` (tiny-py, the tiny toy trained) with the
weights shipped in the package.
"""

from __future__ import annotations

import dataclasses
import warnings

from paxkv.engine import EngineConfig
from paxkv.models import BYTE_LEVEL_PRESETS, CHECKPOINTS, PRESETS
from paxkv.models.family import ModelConfig
from paxkv.models.gemma_config import GEMMA_2_9B, GEMMA_3_4B, TINY_GEMMA3
from paxkv.models.llama_config import (
    LLAMA_3_1_8B,
    LLAMA_3_2_1B,
    MISTRAL_7B,
    QWEN2_5_7B,
    QWEN3_8B,
    TINY,
)
from paxkv.offline.llm import default_engine_config


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


def _limits(
    num_pages: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
) -> EngineConfig:
    return EngineConfig(
        num_pages=num_pages,
        page_size=16,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
    )


# One 80 GiB accelerator (an H100) serving up to 256 sequences of 8192 tokens.
def _h100(pages: int, max_model_len: int = 8192) -> EngineConfig:
    return _limits(pages, 256, 8192, max_model_len)


# The byte-level toys on the CPU. tiny's max_model_len is below EngineConfig's default
# (LLM's): tiny-py, this model trained, saw 256-byte windows, and shorter sequences need
# fewer step shapes, so a quick warm-up on the CPU.
_TINY = ServingSetup("tiny", TINY, _limits(256, 8, 128, 512), random_weights=True)

# The page arithmetic behind each num_pages is in the comment beside it. Real models
# compile one layer (or one period of Gemma's window pattern) per shape: scan_layers.
TUNED: dict[str, ServingSetup] = {
    s.name: s
    for s in (
        _TINY,
        _TINY.replace(name="tiny-py", random_weights=False, checkpoint="tiny-py"),
        # 5 window-128 layers and 1 global over 1 slot: a page holds one layer.
        ServingSetup("tiny-gemma3", TINY_GEMMA3, _limits(1536, 8, 128, 4096), random_weights=True),
        # A 16 GiB TPU v5e, 2.3 GiB of weights; 32 KiB of KV a token: 8 GiB of pages
        # (`paxkv-plan --setup=llama-3.2-1b --device=v5e` gives the pages that fit).
        ServingSetup(
            "llama-3.2-1b", LLAMA_3_2_1B.replace(scan_layers=True), _limits(16384, 128, 4096, 8192)
        ),
        # 15 GiB of weights; 128 KiB of KV a token: 48 GiB of pages.
        ServingSetup("llama-3.1-8b", LLAMA_3_1_8B.replace(scan_layers=True), _h100(24576)),
        # 13.5 GiB; 128 KiB a token: 48 GiB. Every layer has the 4096-token window, so a
        # sequence holds at most about 4096 tokens' pages (`paxkv.host.kv_groups`).
        ServingSetup("mistral-7b", MISTRAL_7B.replace(scan_layers=True), _h100(24576)),
        # 14.2 GiB; 4 KV heads, 28 layers: 56 KiB a token, 42 GiB.
        ServingSetup("qwen2.5-7b", QWEN2_5_7B.replace(scan_layers=True), _h100(49152)),
        # 15.3 GiB; 36 layers x 8 KV heads x 128 x 2 x 2 bytes = 144 KiB a token: 54 GiB.
        ServingSetup("qwen3-8b", QWEN3_8B.replace(scan_layers=True), _h100(24576)),
        # 17.2 GiB. Window (4096) and global layers alternate: with the hybrid page
        # allocator a page holds 21 layers (one of each group) instead of 42;
        # 21 x 8 KV heads x 256 x 2 x 2 bytes x 16 tokens = 2.6 MiB a page, 52.5 GiB.
        ServingSetup("gemma-2-9b", GEMMA_2_9B.replace(scan_layers=True), _h100(20480)),
        # 7.2 GiB. Five 1024-token window layers for every global one: a page holds 5
        # layers instead of 34; 5 x 4 x 256 x 2 x 2 x 16 = 320 KiB a page, 60 GiB.
        ServingSetup("gemma-3-4b", GEMMA_3_4B.replace(scan_layers=True), _h100(196608, 32768)),
    )
}


def preset_setup(name: str) -> ServingSetup:
    """The set-up of a preset of `paxkv.models` that has none in `TUNED`: the engine
    limits `paxkv.LLM(model=name)` serves it with (`default_engine_config`), random
    weights for the byte-level presets, `--model_dir`'s for the others."""
    model = PRESETS[name]
    return ServingSetup(
        name=name,
        model=model,
        engine=default_engine_config(model),
        random_weights=name in BYTE_LEVEL_PRESETS,
    )


if unknown := sorted(set(TUNED) - set(PRESETS) - set(CHECKPOINTS)):
    raise ValueError(f"set-ups {unknown} name no preset or checkpoint of paxkv.models")
if untuned := sorted(set(CHECKPOINTS) - set(TUNED)):
    raise ValueError(f"checkpoints {untuned} have no tuned set-up")
SETUPS: dict[str, ServingSetup] = TUNED | {
    name: preset_setup(name) for name in PRESETS if name not in TUNED
}
NAMES = tuple(SETUPS)


def get_setup(name: str) -> ServingSetup:
    """The set-up called `name`; ValueError naming the known ones for any other."""
    if name not in SETUPS:
        raise ValueError(f"unknown set-up {name!r}; known set-ups: {', '.join(NAMES)}")
    return SETUPS[name]


# The names of `paxkv.configs`, which this module replaced (listed in docs/moved.md).
_DEPRECATED = {"get_config": "get_setup", "CONFIGS": "SETUPS"}


def __getattr__(name: str):
    if name in _DEPRECATED:
        new = _DEPRECATED[name]
        warnings.warn(
            f"paxkv.configs.{name} is deprecated: use paxkv.launch.setups.{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["NAMES", "SETUPS", "TUNED", "ServingSetup", "get_setup", "preset_setup"]
