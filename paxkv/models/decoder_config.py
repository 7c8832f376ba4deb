"""`DecoderConfig`: the fields every model family's config shares, their checks and
their Hugging Face `config.json` spelling. Plain Python, no JAX.

Each family's config (`LlamaConfig`, `GemmaConfig`, `MoeConfig`, `GptOssConfig`) is a
frozen dataclass deriving from it that adds only its own fields. The capacity planner
(`paxkv.planner`, which never imports JAX) counts bytes from a `DecoderConfig`; this
module and `hf_fields` import nothing else of paxkv, and `paxkv.models` imports its
submodules lazily, so importing it costs no JAX. `paxkv.sharding` sits below the
models, so it reads a config's fields by name (`SplitRule.divisor`) and keeps no
description of its own.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any, Self

from . import hf_fields

# Each shared field's key in `config.json`, which every family reads and writes alike.
# The RoPE base and the sliding window are shared fields too, but spelled the family's
# own way (per layer type, in `rope_parameters`, only for some model types).
HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
    "max_position_embeddings": "max_position_embeddings",
    "dtype": "torch_dtype",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
}

# The sizes every config has, each at least 1.
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Shapes and numerics every decoder-only family has: what the engine, the loaders
    and the capacity planner read from any family's config.

    `intermediate_size` is the MLP's hidden width (a mixture of experts': each
    expert's). `sliding_window=W` lets a windowed layer see itself and the W - 1 tokens
    before it (None: every layer sees the whole prefix); every layer is windowed unless
    the family says which are (`layer_sliding_windows`). `dtype` is the parameter and
    activation dtype. `eos_token_id` is None, an int or a tuple of ints (Llama 3 has
    several); `eos_token_ids` always gives the tuple. `scan_layers` is how the layers are
    held and run, not what they compute (not in config.json): True stacks each
    parameter over the layers (`[L, ...]`) and runs them as one `lax.scan` over a cache
    stacked the same way, so a step compiles one layer, not L
    (`paxkv.models.layer_stack`).

    A family overrides a field here only to change its default. A family whose layers
    hold more than the shared layers' says so with attributes the capacity planner
    reads where present (`paxkv.planner.parameters`).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    scan_layers: bool = False
    # Weight-only quantization of the projections and experts ("int8", "fp8"; None:
    # the model dtype), set by `paxkv.models.quantized_weights.quantize_model`.
    quantization: str | None = None

    def __post_init__(self):
        """ValueError showing the value for a dtype, size, head count, head dim, norm
        epsilon, RoPE base or window out of range; a list `eos_token_id` becomes a tuple."""
        if self.dtype not in hf_fields.DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {hf_fields.DTYPES}")
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        hf_fields.check_positive(self, "rms_norm_eps", "rope_theta")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive or None")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence ids as a tuple (empty when the model has none)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def layer_sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window W (None: the whole prefix); one for all here."""
        return (self.sliding_window,) * self.num_layers

    @property
    def norm_params_per_layer(self) -> int:
        """Parameters of one layer's norms (the planner counts them): two RMSNorms here."""
        return 2 * self.hidden_size

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes` applied (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def shared_from_hf(
        cls,
        hf: Mapping[str, Any],
        *,
        head_dim: int | None = None,
        intermediate_size_key: str = "intermediate_size",
        **defaults: Any,
    ) -> dict[str, Any]:
        """The shared fields of a Hugging Face `config.json` (`hf`) read at their keys
        (`HF_KEYS`), for a family's `from_hf` to complete: `cls(**shared, ...)`.

        `defaults`, by field name, are the values the file may omit (transformers' class
        defaults for the family; `hf_fields.REQUIRED`: it must not). Without one a size,
        `rms_norm_eps` and `max_position_embeddings` are required, `num_kv_heads` is
        `num_heads`, `tie_word_embeddings` False, the dtype float32 and the special
        tokens None. `head_dim` is the heads' width when the file omits it (None:
        `hidden_size // num_heads`). `intermediate_size_key` is where the MLP width is
        (Qwen3-MoE: `moe_intermediate_size`). The RoPE base and the sliding window are
        left to the family. ValueError naming the field, as `hf_fields.field` says, and
        for a pre-quantized checkpoint of a format not read (`hf_fields.quantization`).
        """
        if unknown := sorted(set(defaults) - (set(HF_KEYS) - {"dtype", "eos_token_id"})):
            raise TypeError(f"no default to give for {unknown}")

        def read(name: str, kind: type, default: Any = hf_fields.REQUIRED, **kw: Any) -> Any:
            key = intermediate_size_key if name == "intermediate_size" else HF_KEYS[name]
            return hf_fields.field(hf, key, kind, default=defaults.get(name, default), **kw)

        num_heads = read("num_heads", int)
        hidden_size = read("hidden_size", int)
        if head_dim is None:
            if hf.get("head_dim") is None and hidden_size % num_heads:
                raise ValueError(
                    f"field 'hidden_size'={hidden_size} is not a multiple of "
                    f"num_attention_heads={num_heads}, and there is no head_dim to say the "
                    "heads' width"
                )
            head_dim = hidden_size // num_heads
        return {
            "vocab_size": read("vocab_size", int),
            "hidden_size": hidden_size,
            "intermediate_size": read("intermediate_size", int),
            "num_layers": read("num_layers", int),
            "num_heads": num_heads,
            "num_kv_heads": read("num_kv_heads", int, num_heads),
            "head_dim": read("head_dim", int, head_dim),
            "rms_norm_eps": read("rms_norm_eps", float),
            "tie_word_embeddings": read("tie_word_embeddings", bool, False),
            "max_position_embeddings": read("max_position_embeddings", int),
            "dtype": hf_fields.dtype(hf),
            "bos_token_id": read("bos_token_id", int, None, minimum=0),
            "eos_token_id": hf_fields.eos_token_id(hf),
            "quantization": hf_fields.quantization(hf),
        }

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` entries of the shared fields that `shared_from_hf` reads; a
        family's `to_hf` adds its model type and its own fields around them."""
        hf = {key: getattr(self, name) for name, key in HF_KEYS.items()}
        if isinstance(self.eos_token_id, tuple):
            hf["eos_token_id"] = list(self.eos_token_id)
        return hf
