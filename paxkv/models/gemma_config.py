"""Typed, frozen configuration of Gemma 2 and Gemma 3 (text) and their presets."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from . import hf_fields
from .decoder_config import DecoderConfig
from .hf_fields import field as _field
from .hf_fields import positive_or_null

HF_MODEL_TYPES = ("gemma2", "gemma3_text")
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer type names
ACTIVATION = "gelu_pytorch_tanh"  # GeGLU with the tanh-approximate gelu


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaConfig(DecoderConfig):
    """Shapes and numerics of one Gemma 2 or Gemma 3 text decoder: the shared fields
    (`DecoderConfig`, some with Gemma's defaults) and these.

    What sets them apart from the Llama family: GeGLU MLPs; RMSNorms that scale by
    `1 + weight`; a norm before and after both attention and the MLP; embeddings
    multiplied by `sqrt(hidden_size)` (rounded to `dtype`, as Hugging Face does);
    attention scaled by `query_pre_attn_scalar ** -0.5` instead of `head_dim ** -0.5`;
    layers of two kinds (`layer_types`, one per layer): "sliding_attention" sees
    itself and the `sliding_window - 1` tokens before it, "full_attention" the whole
    prefix. `attn_logit_softcapping` (Gemma 2) caps attention logits, and
    `final_logit_softcapping` the output logits, at `cap * tanh(x / cap)`; None is
    off. `qk_norm` (Gemma 3) normalises every q and k head over the head dim (with
    `1 + weight` too) before RoPE. RoPE: full layers use `rope_theta` with its
    inverse frequencies divided by `rope_scaling_factor` (linear scaling; None is
    1), sliding layers `rope_local_theta` unscaled (Gemma 2: both the same).
    `scan_layers` scans over the period of `layer_types`.
    """

    layer_types: tuple[str, ...]
    # Required: a bare annotation would inherit the base's default (None).
    sliding_window: int = dataclasses.field()
    query_pre_attn_scalar: int
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    qk_norm: bool = False
    rope_scaling_factor: float | None = None
    rope_local_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192

    def __post_init__(self):
        super().__post_init__()
        hf_fields.check_positive(self, "rope_local_theta", "query_pre_attn_scalar")
        check_layer_types(self)
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "rope_scaling_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value} must be positive or None")

    @property
    def layer_sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window W (None: the whole prefix)."""
        return windows_by_layer_type(self)

    @property
    def norm_params_per_layer(self) -> int:
        """Parameters of a layer's norms: four RMSNorms, and Gemma 3's q/k norms."""
        return 4 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def model_type(self) -> str:
        """The Hugging Face model type: gemma3_text with q/k norms, gemma2 otherwise."""
        return "gemma3_text" if self.qk_norm else "gemma2"

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> GemmaConfig:
        """Parses a Hugging Face `config.json` of model_type gemma2 or gemma3_text.

        Both transformers 4's spellings (`rope_theta`, `rope_local_base_freq`,
        `rope_scaling`, `sliding_window_pattern`, or no layer kinds: Gemma 2's even
        layers slide) and transformers 5's (`rope_parameters`, per layer type for
        Gemma 3; `layer_types`) are read. A field missing takes transformers' class
        default; an explicit null soft-cap is off. Raises ValueError naming the field
        as `LlamaConfig.from_hf` does, and for what this decoder does not implement:
        other model types (a multimodal "gemma3" checkpoint among them), activations
        other than gelu_pytorch_tanh, attention biases, bidirectional attention, rope
        types other than default and linear (and linear on sliding layers), and an
        attention soft-cap on Gemma 3, which transformers does not apply.
        """
        model_type = _field(hf, "model_type", str)
        if model_type not in HF_MODEL_TYPES:
            hint = (
                " (the multimodal checkpoint; only text ones load)"
                if model_type == "gemma3"
                else ""
            )
            raise ValueError(
                f"model_type={model_type!r} is not supported{hint}; expected one of "
                f"{HF_MODEL_TYPES}"
            )
        gemma3 = model_type == "gemma3_text"
        act = _field(hf, "hidden_activation", str, default=None) or _field(
            hf, "hidden_act", str, default=ACTIVATION
        )
        if act != ACTIVATION:
            raise ValueError(f"hidden_activation={act!r} is not supported; only {ACTIVATION!r}")
        if _field(hf, "attention_bias", bool, default=False):
            raise ValueError("attention_bias=True is not supported")
        if _field(hf, "use_bidirectional_attention", bool, default=False):
            raise ValueError("use_bidirectional_attention=True is not supported (causal only)")
        shared = cls.shared_from_hf(
            hf,
            num_kv_heads=hf_fields.REQUIRED,
            head_dim=256,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            max_position_embeddings=131072 if gemma3 else 8192,
        )
        attn_cap = positive_or_null(hf, "attn_logit_softcapping", None if gemma3 else 50.0)
        if gemma3 and attn_cap is not None:
            raise ValueError(
                f"gemma3_text attn_logit_softcapping={attn_cap} is not supported: transformers' "
                "Gemma 3 does not apply it"
            )
        theta, factor, local_theta = (_gemma3_rope if gemma3 else _gemma2_rope)(hf)
        return cls(
            **shared,
            layer_types=_layer_types(hf, shared["num_layers"], gemma3),
            sliding_window=_field(hf, "sliding_window", int, default=4096),
            query_pre_attn_scalar=_field(hf, "query_pre_attn_scalar", int, default=256),
            attn_logit_softcapping=attn_cap,
            final_logit_softcapping=positive_or_null(
                hf, "final_logit_softcapping", None if gemma3 else 30.0
            ),
            qk_norm=gemma3,
            rope_theta=theta,
            rope_scaling_factor=factor,
            rope_local_theta=local_theta,
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict; `from_hf(c.to_hf()) == c`.

        Written in the spelling transformers 4.5x and 5 both read (`rope_theta`,
        `rope_local_base_freq`, `rope_scaling`, and `layer_types`). A Gemma 2 config
        (no q/k norms) with separate local RoPE or RoPE scaling, or a Gemma 3 one with
        an attention soft-cap, has no Hugging Face equivalent (ValueError).
        """
        gemma3 = self.qk_norm
        if not gemma3 and (
            self.rope_scaling_factor is not None or self.rope_local_theta != self.rope_theta
        ):
            raise ValueError("gemma2 has a single RoPE: no rope_scaling_factor or rope_local_theta")
        if gemma3 and self.attn_logit_softcapping is not None:
            raise ValueError("gemma3_text has no attention soft-cap")
        hf = {
            "model_type": self.model_type,
            "architectures": ["Gemma3ForCausalLM" if gemma3 else "Gemma2ForCausalLM"],
            **super().to_hf(),
            "hidden_activation": ACTIVATION,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "attn_logit_softcapping": self.attn_logit_softcapping,
            "final_logit_softcapping": self.final_logit_softcapping,
            "attention_bias": False,
            "rope_theta": self.rope_theta,
        }
        if gemma3:
            hf["rope_local_base_freq"] = self.rope_local_theta
            hf["rope_scaling"] = (
                None
                if self.rope_scaling_factor is None
                else {"rope_type": "linear", "factor": self.rope_scaling_factor}
            )
        return hf


def _layer_types(hf: Mapping[str, Any], num_layers: int, gemma3: bool) -> tuple[str, ...]:
    """`layer_types`, or the pattern of older files: every `sliding_window_pattern`-th
    layer full (Gemma 3, 6 by default), every second one (Gemma 2)."""
    types = _field(hf, "layer_types", list, default=None)
    if types is not None:
        if len(types) != num_layers or not all(t in (SLIDING, FULL) for t in types):
            raise ValueError(
                f"field 'layer_types' must list {num_layers} of {SLIDING!r} and {FULL!r}, "
                f"got {types!r}"
            )
        return tuple(types)
    if not gemma3:
        return every_nth_full(num_layers, 2)
    # Some files spell the pattern `_sliding_window_pattern`.
    key = "_sliding_window_pattern" if "_sliding_window_pattern" in hf else "sliding_window_pattern"
    return every_nth_full(num_layers, _field(hf, key, int, default=6))


def _gemma2_rope(hf: Mapping[str, Any]) -> tuple[float, None, float]:
    """`(theta, None, theta)`: Gemma 2 has one unscaled RoPE for every layer."""
    rope = hf_fields.rope_parameters(hf)
    theta, factor = _rope_of(rope, "rope_parameters", _field(hf, "rope_theta", float, default=None))
    if factor is not None:
        raise ValueError("gemma2 rope_type='linear' is not supported")
    theta = 10000.0 if theta is None else theta
    return theta, None, theta


def _gemma3_rope(hf: Mapping[str, Any]) -> tuple[float, float | None, float]:
    """`(global theta, global linear factor or None, local theta)` of Gemma 3, from
    `rope_parameters[layer type]` (transformers 5) or `rope_theta`, `rope_scaling` and
    `rope_local_base_freq` (4), with transformers' defaults 1e6 and 1e4."""
    params = _field(hf, "rope_parameters", dict, default={})
    unknown = sorted(set(params) - {SLIDING, FULL})
    if unknown:
        raise ValueError(
            f"field 'rope_parameters' must map {SLIDING!r} and {FULL!r} to RoPE "
            f"parameters, got keys {unknown}"
        )
    full = dict(_field(params, FULL, dict, default={}, parent="rope_parameters"))
    full.update(_field(hf, "rope_scaling", dict, default={}))
    sliding = _field(params, SLIDING, dict, default={}, parent="rope_parameters")
    theta, factor = _rope_of(
        full, f"rope_parameters.{FULL}", _field(hf, "rope_theta", float, default=1e6)
    )
    local_theta, local_factor = _rope_of(
        sliding,
        f"rope_parameters.{SLIDING}",
        _field(hf, "rope_local_base_freq", float, default=1e4),
    )
    if local_factor is not None:
        raise ValueError(f"rope_type='linear' on {SLIDING} layers is not supported")
    return theta, factor, local_theta


def _rope_of(
    rope: Mapping[str, Any], parent: str, theta: float | None
) -> tuple[float | None, float | None]:
    """`(theta, linear factor or None)` of one RoPE parameter dict; `theta` is the
    value to use when the dict gives none."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise ValueError(
            f"rope_type={rope_type!r} is not supported; expected 'default' or 'linear'"
        )
    theta = _field(rope, "rope_theta", float, default=theta, parent=parent)
    if rope_type == "default":
        return theta, None
    return theta, _field(rope, "factor", float, parent=parent)


def check_layer_types(config: Any) -> None:
    """ValueError showing the value unless `config.layer_types` gives each of its
    `num_layers` layers `SLIDING` or `FULL` and its sliding layers have a window (Gemma
    2/3, gpt-oss); a list becomes a tuple."""
    if config.sliding_window is None:
        raise ValueError(f"sliding_window={config.sliding_window} must be positive")
    if isinstance(config.layer_types, list):
        object.__setattr__(config, "layer_types", tuple(config.layer_types))
    kinds_ok = set(config.layer_types) <= {SLIDING, FULL}
    if len(config.layer_types) != config.num_layers or not kinds_ok:
        raise ValueError(
            f"layer_types={config.layer_types!r} must give {config.num_layers} layers, each "
            f"{SLIDING!r} or {FULL!r}"
        )


def windows_by_layer_type(config: Any) -> tuple[int | None, ...]:
    """Each layer's attention window: `sliding_window` on `SLIDING` layers, None (the
    whole prefix) on `FULL` ones."""
    return tuple(config.sliding_window if t == SLIDING else None for t in config.layer_types)


def every_nth_full(num_layers: int, n: int) -> tuple[str, ...]:
    """Layer types with every `n`-th layer full and the rest sliding: Gemma 2's
    alternation is n = 2, Gemma 3's 5:1 pattern n = 6."""
    return tuple(FULL if (i + 1) % n == 0 else SLIDING for i in range(num_layers))


GEMMA_2_2B = GemmaConfig(
    vocab_size=256000,
    hidden_size=2304,
    intermediate_size=9216,
    num_layers=26,
    num_heads=8,
    num_kv_heads=4,
    head_dim=256,
    layer_types=every_nth_full(26, 2),
    sliding_window=4096,
    query_pre_attn_scalar=256,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    rope_theta=10000.0,
    max_position_embeddings=8192,
    bos_token_id=2,
    eos_token_id=1,
)

GEMMA_2_9B = GEMMA_2_2B.replace(
    hidden_size=3584,
    intermediate_size=14336,
    num_layers=42,
    num_heads=16,
    num_kv_heads=8,
    layer_types=every_nth_full(42, 2),
)

# The instruction-tuned release's ends: <eos> and <end_of_turn>.
_GEMMA3_EOS = (1, 106)

GEMMA_3_1B = GemmaConfig(
    vocab_size=262144,
    hidden_size=1152,
    intermediate_size=6912,
    num_layers=26,
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    layer_types=every_nth_full(26, 6),
    sliding_window=512,
    query_pre_attn_scalar=256,
    qk_norm=True,
    rope_theta=1e6,
    rope_local_theta=1e4,
    max_position_embeddings=32768,
    bos_token_id=2,
    eos_token_id=_GEMMA3_EOS,
)

# The text decoder of Gemma 3 4B (its `text_config`); 128K context by 8x linear RoPE.
GEMMA_3_4B = GEMMA_3_1B.replace(
    vocab_size=262208,
    hidden_size=2560,
    intermediate_size=10240,
    num_layers=34,
    num_heads=8,
    num_kv_heads=4,
    layer_types=every_nth_full(34, 6),
    sliding_window=1024,
    rope_scaling_factor=8.0,
    max_position_embeddings=131072,
)

# Byte-level toys (vocab 256, `ByteTokenizer`) of each architecture, for tests and
# benchmarks. tiny-gemma3 is Gemma-3-shaped: a 5:1 local/global pattern, window 128.
TINY_GEMMA2 = GemmaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    layer_types=every_nth_full(2, 2),
    sliding_window=128,
    query_pre_attn_scalar=64,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    max_position_embeddings=4096,
    dtype="float32",
)

TINY_GEMMA3 = TINY_GEMMA2.replace(
    num_layers=6,
    layer_types=every_nth_full(6, 6),
    attn_logit_softcapping=None,
    final_logit_softcapping=None,
    qk_norm=True,
    rope_theta=1e6,
    rope_scaling_factor=8.0,
    rope_local_theta=1e4,
)

PRESETS: dict[str, GemmaConfig] = {
    "gemma-2-2b": GEMMA_2_2B,
    "gemma-2-9b": GEMMA_2_9B,
    "gemma-3-1b": GEMMA_3_1B,
    "gemma-3-4b": GEMMA_3_4B,
    "tiny-gemma2": TINY_GEMMA2,
    "tiny-gemma3": TINY_GEMMA3,
}
# Presets whose ids are UTF-8 bytes: they come with the `ByteTokenizer`.
BYTE_LEVEL_PRESETS = ("tiny-gemma2", "tiny-gemma3")
