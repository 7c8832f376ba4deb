"""Typed, frozen configuration of the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) and its presets."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from . import hf_fields
from .decoder_config import DecoderConfig
from .hf_fields import field as _field

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


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

    def __post_init__(self):
        try:
            hf_fields.check_positive(self, *(f.name for f in dataclasses.fields(self)))
        except ValueError as e:
            raise ValueError(f"rope_scaling.{e}") from None
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor} (the band between is interpolated)"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(DecoderConfig):
    """Shapes and numerics of one decoder-only Llama-family model: the shared fields
    (`DecoderConfig`) and these.

    `rope_scaling` is Llama 3.1's stretch of the RoPE frequencies (None: plain RoPE of
    `rope_theta`). `attention_bias` means Qwen2's layout: q/k/v projections with bias,
    o_proj without. `qk_norm` means Qwen3's: an RMSNorm over the head dim of every q
    and k head (one weight per projection, shared by its heads), after the projection
    and before RoPE. `sliding_window` is Mistral's, on every layer.
    """

    rope_scaling: Llama3RopeScaling | None = None
    attention_bias: bool = False
    qk_norm: bool = False

    @property
    def norm_params_per_layer(self) -> int:
        """Parameters of a layer's norms: two RMSNorms, and Qwen3's q/k norms."""
        return 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> LlamaConfig:
        """Parses a Hugging Face `config.json` of model_type llama, mistral, qwen2 or qwen3.

        Raises ValueError naming the field for a required field that is missing (or
        null), a field of the wrong type (integers must be ints, not floats, strings or
        bools; floats must be finite numbers), a size below 1, and for what this
        decoder does not implement: other model types, rope scalings other than
        llama3, activations other than SiLU, MLP bias, Llama's and Qwen3's attention
        bias, Qwen2's and Qwen3's per-layer sliding windows.
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
        if model_type in ("llama", "qwen3") and _field(hf, "attention_bias", bool, default=False):
            raise ValueError(f"{model_type} attention_bias=True (o_proj bias) is not supported")
        windowed = _field(hf, "use_sliding_window", bool, default=False)
        if model_type in ("qwen2", "qwen3") and windowed:
            raise ValueError(
                f"{model_type} use_sliding_window=True (per-layer windows) is not supported"
            )
        qk_norm = model_type == "qwen3"
        sliding_window = None
        if model_type == "mistral":
            sliding_window = _field(hf, "sliding_window", int, default=None)
        rope = hf_fields.rope_parameters(hf)
        return cls(
            # Qwen3's head_dim is its own (128), not hidden_size / heads; transformers'
            # class default stands in when the file omits it.
            **cls.shared_from_hf(
                hf,
                head_dim=128 if qk_norm else None,
                rms_norm_eps=1e-6,
                max_position_embeddings=4096,
            ),
            rope_theta=hf_fields.rope_theta(hf, rope, default=10000.0),
            rope_scaling=_parse_rope_scaling(rope),
            attention_bias=model_type == "qwen2",
            qk_norm=qk_norm,
            sliding_window=sliding_window,
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict; `from_hf(c.to_hf()) == c`.

        The model type is qwen2 with attention bias, qwen3 with q/k norms, mistral with
        a sliding window and llama otherwise; a config with two of these has no Hugging
        Face equivalent (ValueError).
        """
        features = {
            "attention_bias": self.attention_bias,
            "qk_norm": self.qk_norm,
            "sliding_window": self.sliding_window is not None,
        }
        if sum(features.values()) > 1:
            both = " with ".join(name for name, on in features.items() if on)
            raise ValueError(f"{both} has no Hugging Face model type")
        model_type = (
            "qwen2"
            if self.attention_bias
            else "qwen3"
            if self.qk_norm
            else "mistral"
            if self.sliding_window
            else "llama"
        )
        hf = {
            "model_type": model_type,
            "architectures": [
                {
                    "llama": "LlamaForCausalLM",
                    "mistral": "MistralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM",
                }[model_type]
            ],
            **super().to_hf(),
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if model_type in ("llama", "qwen3"):
            hf |= {"attention_bias": False, "mlp_bias": False}
        if model_type == "mistral":
            hf["sliding_window"] = self.sliding_window
        elif model_type in ("qwen2", "qwen3"):
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

QWEN3_0_6B = LlamaConfig(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    qk_norm=True,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_id=151645,
)

QWEN3_8B = QWEN3_0_6B.replace(
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    tie_word_embeddings=False,
)

TINY_QWEN3 = TINY.replace(qk_norm=True, rms_norm_eps=1e-6)

PRESETS: dict[str, LlamaConfig] = {
    "tiny": TINY,
    "llama-3.2-1b": LLAMA_3_2_1B,
    "llama-3.1-8b": LLAMA_3_1_8B,
    "mistral-7b": MISTRAL_7B,
    "qwen2.5-7b": QWEN2_5_7B,
    "qwen3-0.6b": QWEN3_0_6B,
    "qwen3-8b": QWEN3_8B,
    "tiny-qwen3": TINY_QWEN3,
}
# Presets whose ids are UTF-8 bytes: they come with the `ByteTokenizer`.
BYTE_LEVEL_PRESETS = ("tiny", "tiny-qwen3")
