"""The config base (`DecoderConfig`): every family's config derives from it, declares
only its own fields, and reads and writes the shared ones through it."""

import dataclasses

import pytest

from paxkv.models import FAMILIES, PRESETS, DecoderConfig, ModelConfig
from paxkv.models.decoder_config import HF_KEYS
from paxkv.models.llama_config import TINY

SHARED = {f.name for f in dataclasses.fields(DecoderConfig)}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_extends_the_base(family):
    cls = family.config_class
    assert issubclass(cls, DecoderConfig) and ModelConfig is DecoderConfig
    own = set(cls.__dataclass_fields__) - SHARED
    # A shared field a family declares again changes only its default.
    for name in set(cls.__annotations__) & SHARED:
        assert (
            cls.__dataclass_fields__[name].default
            != DecoderConfig.__dataclass_fields__[name].default
        ), f"{cls.__name__}.{name} repeats the base's default"
    assert own, f"{cls.__name__} adds no field of its own"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_shared_entries_round_trip(name):
    config = PRESETS[name]
    hf = config.to_hf()
    assert set(HF_KEYS.values()) <= set(hf)
    assert type(config).from_hf(hf) == config


def test_shared_parse_defaults_and_errors():
    hf = {k: v for k, v in TINY.to_hf().items() if k not in ("num_key_value_heads", "head_dim")}
    shared = DecoderConfig.shared_from_hf(hf, rms_norm_eps=1e-6, max_position_embeddings=64)
    assert (shared["num_kv_heads"], shared["head_dim"]) == (TINY.num_heads, 128 // 4)
    assert DecoderConfig(**shared).layer_sliding_windows == (None, None)
    with pytest.raises(ValueError, match="missing field 'max_position_embeddings'"):
        DecoderConfig.shared_from_hf({**hf, "max_position_embeddings": None}, rms_norm_eps=1e-6)
    with pytest.raises(TypeError, match="no default to give for \\['rms_norm_epsilon'\\]"):
        DecoderConfig.shared_from_hf(hf, rms_norm_epsilon=1e-6, max_position_embeddings=64)
    with pytest.raises(ValueError, match="'hidden_size'=128 is not a multiple"):
        DecoderConfig.shared_from_hf(
            {**hf, "num_attention_heads": 3}, rms_norm_eps=1e-6, max_position_embeddings=64
        )


def test_shared_checks_show_the_value():
    with pytest.raises(ValueError, match="num_heads=4 must be a multiple of num_kv_heads=3"):
        TINY.replace(num_kv_heads=3)
    with pytest.raises(ValueError, match="sliding_window=0 must be positive or None"):
        TINY.replace(sliding_window=0)
    assert TINY.replace(eos_token_id=[1, 2]).eos_token_ids == (1, 2)
