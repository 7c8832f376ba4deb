"""LoRA adapters from PEFT checkpoints, checked against the base model. No JAX.

A PEFT LoRA checkpoint is a directory of `adapter_config.json` (rank `r`, `lora_alpha`,
`use_rslora`, `target_modules`, `rank_pattern` / `alpha_pattern`, ...) and
`adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight` (`[r, in]`)
and `...lora_B.weight` (`[out, r]`). `read_adapter` turns it into `LoRAAdapter`: per
(layer, projection) `a [in, r]` and `b [r, out]` with the scaling (alpha / r, or alpha
/ sqrt(r) for rsLoRA) folded into `b`, so `x @ a @ b` is the adapter's whole delta.
`adapter_from_state_dict` does the same for a tree already in memory (a trainer's).

Every check names the file (or "state dict") and the field, and shows the value.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from .lora import TARGETS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (the adapter name,
# e.g. ".default", appears only in trees taken from a live PEFT model).
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.\w+)?\.weight$"
)


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights, scaled, by `(layer, projection name)`."""

    source: str  # the directory, or "state dict"
    rank: int  # the largest rank of its projections
    weights: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray]]  # a [in, r], b [r, out]

    @property
    def targets(self) -> tuple[str, ...]:
        """The projection names it changes."""
        return tuple(sorted({name for _, name in self.weights}))


def _pattern_value(pattern: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override: the value of the first key that ends `module`'s name."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _check_config(config: Mapping[str, Any], where: str) -> None:
    """Refuses what paxkv does not serve, naming the field."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type={peft_type!r}: only LoRA adapters are served")
    for field, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if bool(config.get(field, ok)) != ok:
            raise ValueError(f"{where}: {field}={config.get(field)!r} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"{where}: bias={config.get('bias')!r}: adapters with biases are not served"
        )
    if config.get("modules_to_save"):
        raise ValueError(
            f"{where}: modules_to_save={config['modules_to_save']!r}: adapters that replace "
            "whole modules are not served"
        )
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{where}: {field}={value!r} must be a positive number")


def adapter_from_state_dict(
    state_dict: Mapping[str, Any],
    config: Mapping[str, Any],
    model_config: Any,
    *,
    max_rank: int,
    source: str = "state dict",
) -> LoRAAdapter:
    """`state_dict` (PEFT's tensor names -> arrays) with `config` (adapter_config.json's
    fields) as a `LoRAAdapter` for a model of `model_config`; ValueError naming the
    source and the field for anything the model or the slots cannot take."""
    _check_config(config, source)
    where = f"{source}: {WEIGHTS_FILE if source != 'state dict' else 'tensor'}"
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in state_dict.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(
                f"{where} {key!r}: not a LoRA weight of a layer's projection (expected "
                "...layers.{i}.self_attn|mlp.{proj}.lora_A|lora_B.weight)"
            )
        layer, holder, name, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if TARGETS.get(name) != holder:
            raise ValueError(
                f"{where} {key!r}: target module {holder}.{name} is not one paxkv serves "
                f"(targets: {sorted(TARGETS)})"
            )
        if not 0 <= layer < model_config.num_layers:
            raise ValueError(
                f"{where} {key!r}: layer {layer} is not among the base model's "
                f"{model_config.num_layers} layers (an adapter of another base model?)"
            )
        pairs.setdefault((layer, name), {})[ab] = np.asarray(value, np.float32)
    if not pairs:
        raise ValueError(f"{where}: no LoRA weights")
    alpha, rank, rslora = config["lora_alpha"], config["r"], bool(config.get("use_rslora"))
    weights = {}
    largest = 0
    for (layer, name), ab in sorted(pairs.items()):
        module = f"model.layers.{layer}.{TARGETS[name]}.{name}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: {module} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        d_in, d_out = _dims(model_config, name)
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != r:
            raise ValueError(
                f"{where}: {module}: lora_A {a.shape} and lora_B {b.shape} are not "
                "[r, in] and [out, r]"
            )
        if a.shape[1] != d_in or b.shape[0] != d_out:
            raise ValueError(
                f"{where}: {module}: shape [in={a.shape[1]}, out={b.shape[0]}] does not match "
                f"the base model's [in={d_in}, out={d_out}] (an adapter of another base model?)"
            )
        if r > max_rank:
            raise ValueError(
                f"{where}: {module}: rank r={r} exceeds max_lora_rank={max_rank} "
                "(raise max_lora_rank)"
            )
        module_rank = _pattern_value(config.get("rank_pattern") or {}, module, rank)
        if module_rank != r:
            raise ValueError(
                f"{where}: {module}: its tensors have rank {r} but the config says "
                f"r={module_rank} (rank_pattern={config.get('rank_pattern')!r})"
            )
        module_alpha = _pattern_value(config.get("alpha_pattern") or {}, module, alpha)
        scale = module_alpha / (math.sqrt(r) if rslora else r)
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise ValueError(f"{where}: {module} holds NaN or inf")
        weights[(layer, name)] = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T * scale))
        largest = max(largest, r)
    return LoRAAdapter(source, largest, weights)


def _dims(model_config: Any, name: str) -> tuple[int, int]:
    """(in, out) of projection `name` in the base model."""
    c = model_config
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    m = getattr(c, "intermediate_size", None)
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, m),
        "up_proj": (h, m),
        "down_proj": (m, h),
    }[name]


def read_adapter(path: str, model_config: Any, *, max_rank: int) -> LoRAAdapter:
    """The PEFT LoRA checkpoint in directory `path` (see the module docstring) for a
    model of `model_config`; ValueError naming the file and field otherwise."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a directory")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path}: no {CONFIG_FILE} (not a PEFT adapter directory)")
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise ValueError(f"{path}: no {WEIGHTS_FILE} (adapters are read from safetensors)")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    from safetensors.numpy import load_file

    try:
        tensors = load_file(weights_path)
    except Exception as e:  # bf16 tensors: read through the flax loader's dtype support
        tensors = _load_with_ml_dtypes(weights_path, e)
    return adapter_from_state_dict(
        tensors, config, model_config, max_rank=max_rank, source=os.path.join(path, "")
    )


def _load_with_ml_dtypes(path: str, error: Exception) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file NumPy cannot read alone (bfloat16), or the error."""
    try:
        from safetensors.flax import load_file

        return {k: np.asarray(v, np.float32) for k, v in load_file(path).items()}
    except Exception:  # not a safetensors file (or cut off): the first reader's error
        raise ValueError(f"{path}: cannot read ({error})") from None
