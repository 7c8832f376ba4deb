"""What a model family is: the model contract every family meets (its config's is
`DecoderConfig`, in `decoder_config`), and `Family`, the one registry entry
(`paxkv.models.registry`) that names its parts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax

from paxkv.sharding.shardings import SCALE, SplitRule

from .decoder_config import DecoderConfig

# The name the engine and the apps have known a family's config by.
ModelConfig = DecoderConfig


class Model(Protocol):
    """A family's NNX model over the paged KV cache (`LlamaForCausalLM`, `GemmaForCausalLM`).

    `__call__(tokens, positions, kv_cache, table, *, attention_backend, decode_only)`
    is the paged step (final-norm hidden states and the new cache), `logits` the LM
    head, `dense_logits` the dense oracle; `mesh` (static) runs attention per shard.
    """

    config: DecoderConfig
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
        if leaf.endswith(SCALE):  # a quantized weight's scale, `[out, 1]` in the file
            weight = leaf.removesuffix(SCALE)
            return ".".join([*prefix, *modules, EXPERT_INDEX, weight, "weight_scale"]), True
        return ".".join([*prefix, *modules, EXPERT_INDEX, leaf, "weight"]), True
    if leaf == "kernel" + SCALE:  # compressed-tensors' `weight_scale`, `[out, 1]`
        return ".".join([*prefix, *modules, "weight_scale"]), True
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
    presets: Mapping[str, DecoderConfig]
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
