"""What a model family is: the config and model contracts every family meets, and
`Family`, the one registry entry (`paxkv.models.registry`) that names its parts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, Self

import jax

from paxkv.sharding.model_shape import ModelShape
from paxkv.sharding.shardings import SplitRule

from . import hf_fields


class ModelConfig(ModelShape, Protocol):
    """A family's typed, frozen config: what the engine, the loaders and the planner read.

    Every family's config is a frozen dataclass with these fields, those of `ModelShape`
    (the dimensions and dtype the planner reads), and its own; `from_hf(c.to_hf()) == c`.
    """

    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | tuple[int, ...] | None
    scan_layers: bool

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence ids as a tuple (empty when the model has none)."""

    @property
    def layer_sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window W (None: the whole prefix)."""

    @property
    def norm_params_per_layer(self) -> int:
        """Parameters of one layer's norms (the planner counts them)."""

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with `changes` applied (`dataclasses.replace`)."""

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict (`from_hf` reads it back)."""


class ConfigBase:
    """What every family's frozen config derives alike from the fields they share
    (`ModelConfig`): the EOS ids as a tuple, and `replace`."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence ids as a tuple (empty when the model has none)."""
        return hf_fields.eos_token_ids(self.eos_token_id)

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes` applied (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)


class Model(Protocol):
    """A family's NNX model over the paged KV cache (`LlamaForCausalLM`, `GemmaForCausalLM`).

    `__call__(tokens, positions, kv_cache, table, *, attention_backend, decode_only)`
    is the paged step (final-norm hidden states and the new cache), `logits` the LM
    head, `dense_logits` the dense oracle; `mesh` (static) runs attention per shard.
    """

    config: ModelConfig
    mesh: Any

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[jax.Array, Any]:
        """The paged step: `(hidden [T, hidden], new kv_cache)`."""

    def logits(self, hidden: jax.Array) -> jax.Array:
        """`hidden [N, hidden]` -> `f32[N, vocab]`."""

    def dense_logits(self, tokens: jax.Array) -> jax.Array:
        """`i32[L]` -> `f32[L, vocab]` by dense causal attention (the oracle)."""

    def duplicate_kv_heads(self, factor: int) -> None:
        """Repeats every KV head `factor` times, in place (`layers.duplicate_kv_heads`)."""


# In a Hugging Face tensor name, where the expert's number goes: a parameter stacked over
# experts (`[E, ...]`) is the E tensors of the name with 0 .. E - 1 in its place.
EXPERT_INDEX = "{expert}"


def hf_name(path: tuple) -> tuple[str, bool]:
    """The Hugging Face tensor name of an NNX parameter path, and whether it is transposed.

    The rule of the families whose modules carry Hugging Face's names: the path joined
    with dots under `model.` (`lm_head` at the top level), `kernel` read as a transposed
    `weight` (HF Linear weights are `[out, in]`) and `embedding` as `weight`. A
    parameter of an `experts` module (`moe.Experts`, `[E, in, out]`) is its experts'
    transposed Linear weights, `...experts.{expert}.<name>.weight` (`EXPERT_INDEX`).
    """
    *modules, leaf = (str(p) for p in path)
    prefix = [] if modules[:1] == ["lm_head"] else ["model"]
    if modules[-1:] == ["experts"]:
        return ".".join([*prefix, *modules, EXPERT_INDEX, leaf, "weight"]), True
    transpose = leaf == "kernel"
    leaf = "weight" if leaf in ("kernel", "embedding") else leaf
    return ".".join([*prefix, *modules, leaf]), transpose


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family's registry entry.

    `model_types`: the Hugging Face `config.json` model types `config_class.from_hf`
    parses (each belongs to one family). `presets`: configs by name, known to
    `paxkv.models.load_model`, `paxkv.LLM` and every launch app's `--setup`;
    `byte_level_presets` of them come with the `ByteTokenizer`. `sharding_rules`: how
    its parameters split over a mesh (`paxkv.sharding.shardings.param_spec`). `hf_name`:
    an NNX parameter path -> (Hugging Face tensor name, transposed).
    """

    name: str
    model_types: tuple[str, ...]
    config_class: type
    model_class: type
    presets: Mapping[str, ModelConfig]
    byte_level_presets: tuple[str, ...]
    sharding_rules: tuple[SplitRule, ...]
    hf_name: Callable[[tuple], tuple[str, bool]] = hf_name

    def __post_init__(self):
        if unknown := sorted(set(self.byte_level_presets) - set(self.presets)):
            raise ValueError(f"family {self.name}: byte-level presets {unknown} are not presets")
        for preset, config in self.presets.items():
            if type(config) is not self.config_class:
                raise ValueError(
                    f"family {self.name}: preset {preset!r} is a {type(config).__name__}, "
                    f"not a {self.config_class.__name__}"
                )
