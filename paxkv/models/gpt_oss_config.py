"""Typed, frozen configuration of gpt-oss (`GptOssForCausalLM`) and its presets."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from . import hf_fields
from .decoder_config import DecoderConfig
from .gemma_config import FULL, SLIDING, check_layer_types, windows_by_layer_type
from .hf_fields import field as _field
from .moe_config import check_experts

HF_MODEL_TYPES = ("gpt_oss",)


@dataclasses.dataclass(frozen=True)
class YarnRope:
    """YaRN's stretch of the RoPE frequencies (`layers.yarn_inv_freq`): by `factor`
    beyond `original_max_position_embeddings`, with the ramp between `beta_fast` and
    `beta_slow` rotations, its ends rounded outwards when `truncate`."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def __post_init__(self):
        try:
            hf_fields.check_positive(
                self, "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"
            )
        except ValueError as e:
            raise ValueError(f"rope_scaling.{e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptOssConfig(DecoderConfig):
    """Shapes and numerics of one gpt-oss decoder: the shared fields (`DecoderConfig`,
    some with gpt-oss's defaults) and these.

    A mixture of experts (`paxkv.models.moe`, `ExpertForm.gpt_oss`): a router with a
    bias picks `num_experts_per_tok` of `num_experts` experts by logit and weighs them
    by the softmax of those logits; each expert is one fused projection whose columns
    alternate gate and up (`2 x intermediate_size`), a clamped SwiGLU (`swiglu_limit`,
    `swiglu_alpha`) and a down projection, all with biases. Attention has biases on q,
    k, v and o (`attention_bias`) and attention sinks (a learned logit per query head
    in every softmax), and its layers are of two kinds (`layer_types`):
    "sliding_attention" sees itself and the `sliding_window - 1` tokens before it,
    "full_attention" the whole prefix. RoPE is stretched by YaRN (`rope_scaling`; None:
    plain RoPE of `rope_theta`).
    """

    num_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]
    sliding_window: int = 128
    rope_theta: float = 150000.0
    rope_scaling: YarnRope | None = None
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    attention_bias: bool = True
    max_position_embeddings: int = 131072
    grouped_matmul: str = "auto"

    model_type = "gpt_oss"
    # The softmax over the top-k logits: the top-k probabilities renormalised.
    norm_topk_prob = True
    attention_sinks = True

    def __post_init__(self):
        super().__post_init__()
        hf_fields.check_positive(self, "swiglu_limit", "swiglu_alpha")
        check_layer_types(self)
        check_experts(self)

    @property
    def layer_sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window W (None: the whole prefix)."""
        return windows_by_layer_type(self)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> GptOssConfig:
        """Parses a Hugging Face `config.json` of model_type gpt_oss.

        A field missing takes transformers' class default. Raises ValueError naming the
        field as `LlamaConfig.from_hf` does, and for what this decoder does not
        implement: other model types, quantized weights other than the published
        checkpoints' MXFP4 experts (`quant_method` "mxfp4": dequantized as they load,
        `paxkv.models.weights`), rope types other than yarn and default, and YaRN's
        explicit attention factors.
        """
        model_type = _field(hf, "model_type", str)
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} is not supported; expected 'gpt_oss'")
        quantization = _field(hf, "quantization_config", dict, default=None)
        if quantization is not None and quantization.get("quant_method") == "mxfp4":
            hf = {k: v for k, v in hf.items() if k != "quantization_config"}
        elif quantization is not None:
            method = quantization.get("quant_method")
            raise ValueError(
                f"quantization_config.quant_method={method!r}: of quantized gpt-oss "
                "checkpoints only MXFP4 experts are read (dequantized as they load); load "
                "bfloat16 weights, and quantize=int8 or fp8 at load"
            )
        shared = cls.shared_from_hf(
            hf,
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_layers=36,
            num_heads=64,
            head_dim=64,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
        )
        default_types = [SLIDING if i % 2 == 0 else FULL for i in range(shared["num_layers"])]
        rope = hf_fields.rope_parameters(hf)
        return cls(
            **shared,
            num_experts=_field(hf, "num_local_experts", int, default=128),
            num_experts_per_tok=_field(hf, "num_experts_per_tok", int, default=4),
            layer_types=tuple(_field(hf, "layer_types", list, default=default_types)),
            sliding_window=_field(hf, "sliding_window", int, default=128),
            rope_theta=hf_fields.rope_theta(hf, rope, default=150000.0),
            rope_scaling=_parse_yarn(rope),
            swiglu_limit=_field(hf, "swiglu_limit", float, default=7.0),
            swiglu_alpha=_field(hf, "swiglu_alpha", float, default=1.702),
            attention_bias=_field(hf, "attention_bias", bool, default=True),
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict; `from_hf(c.to_hf()) == c`."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {"rope_type": "yarn", "rope_theta": self.rope_theta}
            rope |= dataclasses.asdict(self.rope_scaling)
        return {
            "model_type": "gpt_oss",
            "architectures": ["GptOssForCausalLM"],
            **super().to_hf(),
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "rope_parameters": rope,
            "swiglu_limit": self.swiglu_limit,
            "swiglu_alpha": self.swiglu_alpha,
            "attention_bias": self.attention_bias,
        }


def _parse_yarn(rope: Mapping[str, Any]) -> YarnRope | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ValueError(f"rope_type={rope_type!r} is not supported; expected 'yarn' or 'default'")
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if rope.get(key) is not None:
            raise ValueError(f"rope_scaling.{key}={rope[key]!r} is not supported")
    get = lambda key, kind, **kw: _field(rope, key, kind, parent="rope_scaling", **kw)
    return YarnRope(
        factor=get("factor", float),
        original_max_position_embeddings=get("original_max_position_embeddings", int),
        beta_fast=get("beta_fast", float, default=32.0),
        beta_slow=get("beta_slow", float, default=1.0),
        truncate=get("truncate", bool, default=True),
    )


_YARN = YarnRope(
    factor=32.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
)

# Byte-level toy: ids are UTF-8 bytes (`ByteTokenizer`); a window layer then a full one.
TINY_GPT_OSS = GptOssConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    layer_types=(SLIDING, FULL),
    sliding_window=128,
    rope_scaling=_YARN,
    max_position_embeddings=4096,
    dtype="float32",
)

GPT_OSS_20B = GptOssConfig(
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_layers=24,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    layer_types=(SLIDING, FULL) * 12,
    sliding_window=128,
    rope_theta=150000.0,
    rope_scaling=_YARN,
    max_position_embeddings=131072,
    eos_token_id=200002,
)

PRESETS: dict[str, GptOssConfig] = {"tiny-gpt-oss": TINY_GPT_OSS, "gpt-oss-20b": GPT_OSS_20B}
# Presets whose ids are UTF-8 bytes: they come with the `ByteTokenizer`.
BYTE_LEVEL_PRESETS = ("tiny-gpt-oss",)
