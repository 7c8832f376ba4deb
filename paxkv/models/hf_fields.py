"""Typed reads of Hugging Face `config.json` fields, with errors that name the field.

Every model family's `from_hf` reads its fields through `field`, so a bad checkpoint
gets the same message whatever the family: the field's name and the value found.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")

REQUIRED = object()
_KIND_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "a bool",
    str: "a string",
    dict: "an object",
    list: "a list",
}


def field(
    hf: Mapping[str, Any],
    key: str,
    kind: type,
    *,
    default: Any = REQUIRED,
    minimum: int = 1,
    parent: str | None = None,
) -> Any:
    """`hf[key]` checked to be of `kind`, or `default` when the key is missing or null.

    ValueError naming the field (as `parent.key` under a nested object) and showing the
    value: a required field missing, a value of another JSON type (a bool is not an
    int, an int is a float), a float that is not finite, an int below `minimum`.
    """
    name = f"{parent}.{key}" if parent else key
    value = hf.get(key)
    if value is None:
        if default is REQUIRED:
            raise ValueError(f"missing field {name!r}")
        return default
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ValueError(
            f"field {name!r} must be {_KIND_NAMES[kind]}, got {value!r} ({type(value).__name__})"
        )
    if kind is int and value < minimum:
        raise ValueError(f"field {name!r} must be >= {minimum}, got {value}")
    return float(value) if kind is float else value


def positive_or_null(hf: Mapping[str, Any], key: str, default: float | None) -> float | None:
    """A positive number, where an explicit null means None (off) and a missing key
    `default` (Hugging Face's class default); ValueError naming the field otherwise."""
    if key not in hf:
        return default
    value = field(hf, key, float, default=None)
    if value is not None and value <= 0:
        raise ValueError(f"field {key!r} must be positive or null, got {value}")
    return value


def eos_token_id(hf: Mapping[str, Any]) -> int | tuple[int, ...] | None:
    """`eos_token_id`: null, a token id, or a list of token ids (ValueError otherwise)."""
    value = hf.get("eos_token_id")
    if isinstance(value, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            raise ValueError(f"field 'eos_token_id' must be token ids (ints >= 0), got {value!r}")
        return tuple(value)
    return field(hf, "eos_token_id", int, default=None, minimum=0)


def dtype(hf: Mapping[str, Any]) -> str:
    """The parameter dtype: `torch_dtype` (transformers 4) or `dtype` (5), else float32."""
    value = (
        field(hf, "torch_dtype", str, default=None)
        or field(hf, "dtype", str, default=None)
        or "float32"
    )
    if value not in DTYPES:
        raise ValueError(f"torch_dtype={value!r} is not supported; expected one of {DTYPES}")
    return value


# The sizes every family's config has, each at least 1.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position_embeddings",
)


def check_positive(config: Any, *names: str) -> None:
    """ValueError showing the value unless each field of `config` named is a finite
    number > 0 (a norm epsilon of 0 or below, or a RoPE base of 0, make every output
    NaN or zero without any other error)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name}={value!r} must be a number")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value} must be a finite number > 0")


def check_shared_fields(config: Any) -> None:
    """The checks every family's frozen config makes on the fields they share (dtype,
    sizes, heads, head dim, norm epsilon, RoPE base); a list `eos_token_id` becomes a
    tuple. ValueError showing the value."""
    if config.dtype not in DTYPES:
        raise ValueError(f"dtype={config.dtype!r} must be one of {DTYPES}")
    for name in SIZE_FIELDS:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    check_positive(config, "rms_norm_eps", "rope_theta")
    if config.num_kv_heads < 1 or config.num_heads % config.num_kv_heads:
        raise ValueError(
            f"num_heads={config.num_heads} must be a multiple of num_kv_heads={config.num_kv_heads}"
        )
    if config.head_dim % 2:
        raise ValueError(f"head_dim={config.head_dim} must be even for RoPE")
    if isinstance(config.eos_token_id, list):
        object.__setattr__(config, "eos_token_id", tuple(config.eos_token_id))


def eos_to_hf(eos: int | tuple[int, ...] | None) -> int | list[int] | None:
    """`eos_token_id` as `config.json` writes it (a tuple becomes a list)."""
    return list(eos) if isinstance(eos, tuple) else eos


def eos_token_ids(eos: int | tuple[int, ...] | None) -> tuple[int, ...]:
    """The end-of-sequence ids of a config's `eos_token_id`, as a tuple (empty for None)."""
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(eos)


def shared_to_hf(config: Any) -> dict[str, Any]:
    """The `config.json` entries of the fields every family writes alike: sizes, heads,
    norm epsilon, tied embeddings, dtype and the special tokens (`from_hf` reads them
    back)."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "torch_dtype": config.dtype,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos_to_hf(config.eos_token_id),
    }
