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


def rope_parameters(hf: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE's parameters as one dict: transformers 5's `rope_parameters`, with
    transformers 4's `rope_scaling` over them."""
    rope = dict(field(hf, "rope_parameters", dict, default={}))
    rope.update(field(hf, "rope_scaling", dict, default={}))
    return rope


def rope_theta(hf: Mapping[str, Any], rope: Mapping[str, Any], default: float) -> float:
    """The RoPE base: `rope_theta` (transformers 4), else that of `rope`
    (`rope_parameters`, transformers 5), else `default`."""
    theta = field(hf, "rope_theta", float, default=None)
    if theta is None:
        theta = field(rope, "rope_theta", float, default=default, parent="rope_parameters")
    return theta


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


# compressed-tensors (llm-compressor) formats read, by their weights' `type`: 8-bit
# symmetric per-channel or per-tensor weights, stored as `weight` and `weight_scale`.
COMPRESSED_TENSORS_FORMATS = {
    "int-quantized": "int",
    "float-quantized": "float",
    "naive-quantized": None,
}
_WEIGHT_TYPES = {"int": "int8", "float": "fp8"}


def quantization(hf: Mapping[str, Any]) -> str | None:
    """The quantization of a pre-quantized checkpoint ("int8", "fp8", or "w8a8-int8",
    "w8a8-fp8" when its input activations are quantized too), from its
    `quantization_config`; None without one. compressed-tensors checkpoints of 8-bit
    symmetric weights with a scale per output channel or per tensor, every Linear but
    `lm_head` quantized alike, are read; 8-bit symmetric input activations of the
    weights' type make them W8A8 (each row then gets its scale at run time: a static
    `input_scale` is not used). ValueError naming the field and showing the value for
    every other method, format or scheme."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    q = field(hf, "quantization_config", dict)
    method = q.get("quant_method")
    hint = (
        "load the bfloat16 checkpoint and quantize it at load (quantization='int8' or 'fp8', "
        "--quantization)"
    )
    if method != "compressed-tensors":
        raise ValueError(
            f"field 'quantization_config' (quant_method={method!r}): this pre-quantized format "
            f"is not read (only compressed-tensors int8 and fp8 weights); {hint}"
        )
    fmt = q.get("format")
    groups = q.get("config_groups") or {}
    ignored = [i for i in q.get("ignore") or [] if i != "lm_head"]
    where = "quantization_config"
    if fmt not in COMPRESSED_TENSORS_FORMATS:
        raise ValueError(
            f"field '{where}.format'={fmt!r}: compressed-tensors formats read: "
            f"{sorted(COMPRESSED_TENSORS_FORMATS)}; {hint}"
        )
    if ignored:
        raise ValueError(
            f"field '{where}.ignore'={q.get('ignore')!r}: only lm_head may stay unquantized"
        )
    if len(groups) != 1:
        raise ValueError(f"field '{where}.config_groups' has {len(groups)} groups; one is read")
    ((name, group),) = groups.items()
    weights = group.get("weights") or {}
    prefix = f"{where}.config_groups.{name}.weights"
    expected = {"num_bits": 8, "symmetric": True, "group_size": None, "dynamic": False}
    for key, want in expected.items():
        if weights.get(key, want) != want:
            raise ValueError(f"field '{prefix}.{key}'={weights.get(key)!r}: only {want!r} is read")
    if weights.get("strategy") not in ("channel", "tensor"):
        raise ValueError(
            f"field '{prefix}.strategy'={weights.get('strategy')!r}: 'channel' and 'tensor' are read"
        )
    kind = weights.get("type")
    if kind not in _WEIGHT_TYPES or (COMPRESSED_TENSORS_FORMATS[fmt] not in (None, kind)):
        raise ValueError(f"field '{prefix}.type'={kind!r} in format {fmt!r}: int or float 8-bit")
    if group.get("targets") != ["Linear"]:
        raise ValueError(
            f"field '{where}.config_groups.{name}.targets'={group.get('targets')!r}: "
            "only ['Linear'] is read"
        )
    inputs = group.get("input_activations")
    if inputs is None:
        return _WEIGHT_TYPES[kind]
    prefix = f"{where}.config_groups.{name}.input_activations"
    for key, want in (("num_bits", 8), ("symmetric", True), ("type", kind)):
        if inputs.get(key, want) != want:
            raise ValueError(
                f"field '{prefix}.{key}'={inputs.get(key)!r}: W8A8 is read with {want!r} "
                "(8-bit symmetric activations of the weights' type)"
            )
    return "w8a8-" + _WEIGHT_TYPES[kind]
