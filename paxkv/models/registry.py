"""The model registry: every family's entry (`Family`), one line each, and what follows
from them: the presets by name, the family of a config or a Hugging Face model type,
and models built from a config alone.

Adding a family is its own file(s) and one line in `FAMILIES` (see CONTRIBUTING.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from paxkv.sharding import shardings

from . import gemma, gpt_oss, llama, moe_decoder
from .decoder_config import DecoderConfig
from .family import Family, Model
from .hf_fields import field

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    gemma.FAMILY,
    moe_decoder.FAMILY,
    gpt_oss.FAMILY,
)


def _index(families: tuple[Family, ...]) -> tuple[dict[str, Family], dict[type, Family]]:
    """Families by model type and by config class; ValueError for a model type, a
    config class or a preset name that two families claim."""
    by_model_type: dict[str, Family] = {}
    by_config: dict[type, Family] = {}
    presets: set[str] = set()
    for family in families:
        if taken := sorted(set(family.model_types) & set(by_model_type)):
            raise ValueError(f"family {family.name}: model types {taken} are registered already")
        if family.config_class in by_config:
            raise ValueError(f"family {family.name}: {family.config_class.__name__} is taken")
        if taken := sorted(set(family.presets) & presets):
            raise ValueError(f"family {family.name}: presets {taken} are registered already")
        by_model_type |= dict.fromkeys(family.model_types, family)
        by_config[family.config_class] = family
        presets |= set(family.presets)
    return by_model_type, by_config


_BY_MODEL_TYPE, _BY_CONFIG = _index(FAMILIES)
for _family in FAMILIES:
    shardings.register_param_rules(_family.config_class, _family.sharding_rules)

# Every preset by name (random weights from `load_model`), and those with byte ids.
PRESETS: dict[str, DecoderConfig] = {n: c for f in FAMILIES for n, c in f.presets.items()}
BYTE_LEVEL_PRESETS: tuple[str, ...] = tuple(n for f in FAMILIES for n in f.byte_level_presets)


def family_of(config: DecoderConfig) -> Family:
    """The family whose config class `config` is; ValueError for an unregistered one."""
    family = _BY_CONFIG.get(type(config))
    if family is None:
        raise ValueError(f"{type(config).__name__} is the config of no registered family")
    return family


def model_class(config: DecoderConfig) -> type[Model]:
    """The NNX model class of `config`'s family."""
    return family_of(config).model_class


def config_from_hf(hf: Mapping[str, Any]) -> DecoderConfig:
    """The config of a Hugging Face `config.json` dict, by its `model_type`.

    ValueError naming the field, as each family's `from_hf` does, and for a model type
    of no registered family.
    """
    model_type = field(hf, "model_type", str)
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(
            f"model_type={model_type!r} is not supported; expected one of {tuple(_BY_MODEL_TYPE)}"
        )
    return _BY_MODEL_TYPE[model_type].config_class.from_hf(hf)


def init_model(config: DecoderConfig, seed: int = 0, *, mesh: Any = None) -> Model:
    """A randomly initialised model (normal(0.02) weights, identity norms, zero biases).

    With a `mesh` (`paxkv.sharding`), the weights are initialised under `jit` directly
    in their shardings, so no device ever holds more than its shard; the values are the
    same as without one.
    """
    cls = model_class(config)
    if mesh is None:
        return cls(config, rngs=nnx.Rngs(seed))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(seed))))
    out = shardings.param_shardings(abstract, config, mesh)
    state = jax.jit(lambda: nnx.split(cls(config, rngs=nnx.Rngs(seed)))[1], out_shardings=out)()
    return nnx.merge(graphdef, state)
