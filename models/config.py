"""Typed, frozen configuration of the Llama family (Llama 2/3, Mistral, Qwen2) and its presets."""

from __future__ import annotations

import dataclasses
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

        Raises ValueError for other model types, rope scalings other than llama3,
        activations other than SiLU, and features this decoder does not implement
        (MLP bias, Llama's o_proj bias, Qwen2's per-layer sliding window).
        """
        model_type = hf.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r} is not supported; expected one of {HF_MODEL_TYPES}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; only 'silu' (SwiGLU)")
        if hf.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        if model_type == "llama":
            if hf.get("attention_bias", False):
                raise ValueError("llama attention_bias=True (o_proj bias) is not supported")
            attention_bias, sliding_window = False, None
        elif model_type == "mistral":
            attention_bias, sliding_window = False, hf.get("sliding_window")
        else:
            if hf.get("use_sliding_window", False):
                raise ValueError(
                    "qwen2 use_sliding_window=True (per-layer windows) is not supported"
                )
            attention_bias, sliding_window = True, None
        # transformers >= 5 folds rope_theta and the scaling into `rope_parameters`.
        rope = dict(hf.get("rope_parameters") or {})
        rope.update(hf.get("rope_scaling") or {})
        num_heads = hf["num_attention_heads"]
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        if dtype not in DTYPES:
            raise ValueError(f"torch_dtype={dtype!r} is not supported; expected one of {DTYPES}")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=_parse_rope_scaling(rope),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            sliding_window=sliding_window,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            dtype=dtype,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
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


def _parse_rope_scaling(rope: Mapping[str, Any]) -> Llama3RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(
            f"rope_type={rope_type!r} is not supported; expected 'default' or 'llama3'"
        )
    return Llama3RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
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
