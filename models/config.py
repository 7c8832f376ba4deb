"""Typed, frozen configuration of the Llama family (Llama 2/3, Mistral, Qwen2) and its presets."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
HF_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent stretch of the RoPE inverse frequencies.

    Wavelengths longer than `original_max_position_embeddings / low_freq_factor` are
    divided by `factor`, those shorter than `original_max_position_embeddings /
    high_freq_factor` are kept, and the band between is interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and numerics of one decoder-only Llama-family model.

    `attention_bias` means Qwen2's layout: q/k/v projections with bias, o_proj
    without. `sliding_window=W` lets each token see itself and the W - 1 tokens
    before it (Mistral); None attends to the whole prefix. `dtype` is the parameter
    and activation dtype. `eos_token_id` is an int or a tuple of ints (Llama 3 has
    several); `eos_token_ids` always gives the tuple.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {DTYPES}")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
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

    def replace(self, **changes) -> LlamaConfig:
        """A copy with `changes` applied (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> LlamaConfig:
        """Parses a Hugging Face `config.json` of model_type llama, mistral or qwen2.

        Raises ValueError naming the field for a required field that is missing (or
        null), a field of the wrong type (integers must be ints, not floats, strings or
        bools; floats must be finite numbers), a size below 1, and for what this
        decoder does not implement: other model types, rope scalings other than
        llama3, activations other than SiLU, MLP bias, Llama's o_proj bias, Qwen2's
        per-layer sliding window.
        """
        model_type = _field(hf, "model_type", str)
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r} is not supported; expected one of {HF_MODEL_TYPES}"
            )
        act = _field(hf, "hidden_act", str, default="silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; only 'silu' (SwiGLU)")
        if _field(hf, "mlp_bias", bool, default=False):
            raise ValueError("mlp_bias=True is not supported")
        if model_type == "llama":
            if _field(hf, "attention_bias", bool, default=False):
                raise ValueError("llama attention_bias=True (o_proj bias) is not supported")
            attention_bias, sliding_window = False, None
        elif model_type == "mistral":
            attention_bias, sliding_window = False, _field(hf, "sliding_window", int, default=None)
        else:
            if _field(hf, "use_sliding_window", bool, default=False):
                raise ValueError(
                    "qwen2 use_sliding_window=True (per-layer windows) is not supported"
                )
            attention_bias, sliding_window = True, None
        # transformers >= 5 folds rope_theta and the scaling into `rope_parameters`.
        rope = dict(_field(hf, "rope_parameters", dict, default={}))
        rope.update(_field(hf, "rope_scaling", dict, default={}))
        num_heads = _field(hf, "num_attention_heads", int)
        hidden_size = _field(hf, "hidden_size", int)
        dtype = (
            _field(hf, "torch_dtype", str, default=None)
            or _field(hf, "dtype", str, default=None)
            or "float32"
        )
        if dtype not in DTYPES:
            raise ValueError(f"torch_dtype={dtype!r} is not supported; expected one of {DTYPES}")
        rope_theta = _field(hf, "rope_theta", float, default=None)
        if rope_theta is None:
            rope_theta = _field(rope, "rope_theta", float, default=10000.0, parent="rope_scaling")
        return cls(
            vocab_size=_field(hf, "vocab_size", int),
            hidden_size=hidden_size,
            intermediate_size=_field(hf, "intermediate_size", int),
            num_layers=_field(hf, "num_hidden_layers", int),
            num_heads=num_heads,
            num_kv_heads=_field(hf, "num_key_value_heads", int, default=num_heads),
            head_dim=_field(hf, "head_dim", int, default=hidden_size // num_heads),
            rope_theta=rope_theta,
            rope_scaling=_parse_rope_scaling(rope),
            rms_norm_eps=_field(hf, "rms_norm_eps", float, default=1e-6),
            tie_word_embeddings=_field(hf, "tie_word_embeddings", bool, default=False),
            attention_bias=attention_bias,
            sliding_window=sliding_window,
            max_position_embeddings=_field(hf, "max_position_embeddings", int, default=4096),
            dtype=dtype,
            bos_token_id=_field(hf, "bos_token_id", int, default=None, minimum=0),
            eos_token_id=_eos_token_id(hf),
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict; `from_hf(c.to_hf()) == c`.

        The model type is qwen2 with attention bias, mistral with a sliding window and
        llama otherwise; a config with both has no Hugging Face equivalent (ValueError).
        """
        if self.attention_bias and self.sliding_window is not None:
            raise ValueError("attention_bias with sliding_window has no Hugging Face model type")
        model_type = (
            "qwen2" if self.attention_bias else "mistral" if self.sliding_window else "llama"
        )
        eos = self.eos_token_id
        hf = {
            "model_type": model_type,
            "architectures": [
                {
                    "llama": "LlamaForCausalLM",
                    "mistral": "MistralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM",
                }[model_type]
            ],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if model_type == "llama":
            hf |= {"attention_bias": False, "mlp_bias": False}
        elif model_type == "mistral":
            hf["sliding_window"] = self.sliding_window
        else:
            hf |= {"use_sliding_window": False, "sliding_window": None}
        return hf


_REQUIRED = object()
_KIND_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "a bool",
    str: "a string",
    dict: "an object",
}


def _field(
    hf: Mapping[str, Any],
    key: str,
    kind: type,
    *,
    default: Any = _REQUIRED,
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
        if default is _REQUIRED:
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


def _eos_token_id(hf: Mapping[str, Any]) -> int | tuple[int, ...] | None:
    """`eos_token_id`: null, a token id, or a list of token ids (ValueError otherwise)."""
    value = hf.get("eos_token_id")
    if isinstance(value, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            raise ValueError(f"field 'eos_token_id' must be token ids (ints >= 0), got {value!r}")
        return tuple(value)
    return _field(hf, "eos_token_id", int, default=None, minimum=0)


def _parse_rope_scaling(rope: Mapping[str, Any]) -> Llama3RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(
            f"rope_type={rope_type!r} is not supported; expected 'default' or 'llama3'"
        )
    get = lambda key, kind: _field(rope, key, kind, parent="rope_scaling")
    return Llama3RopeScaling(
        factor=get("factor", float),
        low_freq_factor=get("low_freq_factor", float),
        high_freq_factor=get("high_freq_factor", float),
        original_max_position_embeddings=get("original_max_position_embeddings", int),
    )


# Byte-level toy model: ids are UTF-8 bytes (see `ByteTokenizer`). The heads are wider
# than the residual stream (4 x 64 > 128) so o_proj maps Hq * D back to hidden_size.
TINY = LlamaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
    dtype="float32",
)

_LLAMA3_EOS = (128001, 128008, 128009)

LLAMA_3_2_1B = LlamaConfig(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192),
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=131072,
    bos_token_id=128000,
    eos_token_id=_LLAMA3_EOS,
)

LLAMA_3_1_8B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192),
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    bos_token_id=128000,
    eos_token_id=_LLAMA3_EOS,
)

# Mistral 7B v0.1, the release with the 4096-token sliding window.
MISTRAL_7B = LlamaConfig(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    sliding_window=4096,
    max_position_embeddings=32768,
    bos_token_id=1,
    eos_token_id=2,
)

QWEN2_5_7B = LlamaConfig(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    attention_bias=True,
    max_position_embeddings=131072,
    bos_token_id=151643,
    eos_token_id=151643,
)

PRESETS: dict[str, LlamaConfig] = {
    "tiny": TINY,
    "llama-3.2-1b": LLAMA_3_2_1B,
    "llama-3.1-8b": LLAMA_3_1_8B,
    "mistral-7b": MISTRAL_7B,
    "qwen2.5-7b": QWEN2_5_7B,
}
