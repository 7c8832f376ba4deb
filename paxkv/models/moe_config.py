"""Typed, frozen configuration of the sparse mixture-of-experts decoders (Mixtral, Qwen3-MoE) and their presets."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from . import hf_fields
from .decoder_config import DecoderConfig
from .hf_fields import field as _field

HF_MODEL_TYPES = ("mixtral", "qwen3_moe")
_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# How the experts multiply (`paxkv.models.moe.grouped_matmul`): "auto" is ragged_dot on
# TPU and GPU, tiled on the CPU.
GROUPED_MATMULS = ("auto", "ragged_dot", "tiled")


def check_experts(config: Any) -> None:
    """ValueError showing the value unless `config` routes each token to between 1 and
    `num_experts` experts and names one of `GROUPED_MATMULS`."""
    if not 1 <= config.num_experts_per_tok <= config.num_experts:
        raise ValueError(
            f"num_experts_per_tok={config.num_experts_per_tok} must be in "
            f"[1, num_experts={config.num_experts}]"
        )
    if config.grouped_matmul not in GROUPED_MATMULS:
        raise ValueError(
            f"grouped_matmul={config.grouped_matmul!r} must be one of {GROUPED_MATMULS}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig(DecoderConfig):
    """Shapes and numerics of one Mixtral or Qwen3-MoE decoder: the shared fields
    (`DecoderConfig`, some with these families' defaults) and these.

    The Llama-family decoder (`LlamaConfig`) with every layer's MLP replaced by
    `num_experts` gated-MLP experts of `intermediate_size` hidden features each (Hugging
    Face's Mixtral `intermediate_size`, Qwen3-MoE `moe_intermediate_size`), of which a
    router picks `num_experts_per_tok` (k) per token (`paxkv.models.moe`): the softmax of
    its logits at the top k, renormalised over them when `norm_topk_prob` (always in
    Mixtral). `qk_norm` means Qwen3-MoE's q/k RMSNorms (and its Hugging Face names),
    `sliding_window` Mixtral's window (None: the whole prefix). `grouped_matmul` (not in
    config.json) is how the experts multiply (`moe.GROUPED_MATMULS`).
    """

    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    qk_norm: bool = False
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 32768
    grouped_matmul: str = "auto"

    # What this decoder shares with gpt-oss's (`MoeForCausalLM` reads both): neither.
    attention_bias = False
    attention_sinks = False

    def __post_init__(self):
        super().__post_init__()
        check_experts(self)

    @property
    def model_type(self) -> str:
        """The Hugging Face model type: qwen3_moe with q/k norms, mixtral otherwise."""
        return "qwen3_moe" if self.qk_norm else "mixtral"

    @property
    def norm_params_per_layer(self) -> int:
        """Parameters of a layer's norms: two RMSNorms, and Qwen3-MoE's q/k norms."""
        return 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> MoeConfig:
        """Parses a Hugging Face `config.json` of model_type mixtral or qwen3_moe.

        Raises ValueError naming the field as `LlamaConfig.from_hf` does, and for what
        this decoder does not implement: other model types, activations other than
        SiLU, rope scalings, attention bias, Qwen3-MoE layers with a dense MLP
        (`decoder_sparse_step` other than 1, or `mlp_only_layers`) and its per-layer
        sliding windows.
        """
        model_type = _field(hf, "model_type", str)
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r} is not supported; expected one of {HF_MODEL_TYPES}"
            )
        act = _field(hf, "hidden_act", str, default="silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; only 'silu' (SwiGLU)")
        if _field(hf, "attention_bias", bool, default=False):
            raise ValueError(f"{model_type} attention_bias=True is not supported")
        rope = hf_fields.rope_parameters(hf)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type={rope_type!r} is not supported; only 'default'")
        qwen = model_type == "qwen3_moe"
        if qwen:
            if _field(hf, "use_sliding_window", bool, default=False):
                raise ValueError("qwen3_moe use_sliding_window=True is not supported")
            step = _field(hf, "decoder_sparse_step", int, default=1)
            dense = _field(hf, "mlp_only_layers", list, default=[])
            if step != 1 or dense:
                raise ValueError(
                    f"qwen3_moe decoder_sparse_step={step}, mlp_only_layers={dense}: layers "
                    "with a dense MLP are not supported (every layer must be sparse)"
                )
        experts_key = "num_experts" if qwen else "num_local_experts"
        if qwen and hf.get("num_experts") is None and hf.get("num_local_experts") is not None:
            experts_key = "num_local_experts"  # as transformers writes it (an attribute map)
        return cls(
            **cls.shared_from_hf(
                hf,
                intermediate_size_key="moe_intermediate_size" if qwen else "intermediate_size",
                head_dim=128 if qwen else None,
                rms_norm_eps=1e-6 if qwen else 1e-5,
                max_position_embeddings=32768,
            ),
            num_experts=_field(hf, experts_key, int),
            num_experts_per_tok=_field(hf, "num_experts_per_tok", int),
            norm_topk_prob=_field(hf, "norm_topk_prob", bool, default=False) if qwen else True,
            qk_norm=qwen,
            rope_theta=hf_fields.rope_theta(hf, rope, default=1000000.0),
            sliding_window=None if qwen else _field(hf, "sliding_window", int, default=None),
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict; `from_hf(c.to_hf()) == c`.

        Mixtral always renormalises the top-k weights and has no q/k norms, Qwen3-MoE no
        sliding window: a config outside these has no Hugging Face equivalent
        (ValueError).
        """
        if self.qk_norm and self.sliding_window is not None:
            raise ValueError("qwen3_moe (qk_norm) with a sliding_window has no Hugging Face type")
        if not self.qk_norm and not self.norm_topk_prob:
            raise ValueError("mixtral with norm_topk_prob=False has no Hugging Face type")
        model_type = self.model_type
        hf = {
            "model_type": model_type,
            "architectures": [_ARCHITECTURES[model_type]],
            **super().to_hf(),
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "sliding_window": self.sliding_window,
        }
        if model_type == "qwen3_moe":
            # Every layer sparse; the dense `intermediate_size` is then unused.
            hf |= {
                "num_experts": self.num_experts,
                "moe_intermediate_size": self.intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "attention_bias": False,
                "use_sliding_window": False,
            }
            del hf["num_local_experts"]
        return hf


# Byte-level toys: ids are UTF-8 bytes (see `ByteTokenizer`), the tiny Llama's attention.
TINY_MIXTRAL = MoeConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    dtype="float32",
)

TINY_QWEN3_MOE = TINY_MIXTRAL.replace(
    intermediate_size=64,
    num_experts=16,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    qk_norm=True,
    rms_norm_eps=1e-6,
)

MIXTRAL_8X7B = MoeConfig(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    num_experts=8,
    num_experts_per_tok=2,
    rope_theta=1000000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=32768,
    bos_token_id=1,
    eos_token_id=2,
)

QWEN3_30B_A3B = MoeConfig(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=768,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    qk_norm=True,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_id=151645,
)

PRESETS: dict[str, MoeConfig] = {
    "tiny-mixtral": TINY_MIXTRAL,
    "tiny-qwen3-moe": TINY_QWEN3_MOE,
    "mixtral-8x7b": MIXTRAL_8X7B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
}
# Presets whose ids are UTF-8 bytes: they come with the `ByteTokenizer`.
BYTE_LEVEL_PRESETS = ("tiny-mixtral", "tiny-qwen3-moe")
