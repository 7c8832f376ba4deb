"""gpt-oss's registry entry: `GptOssConfig`, served by `MoeForCausalLM`
(`paxkv.models.moe_decoder`), with the names of its checkpoints and how its parameters
split over a mesh.

Its checkpoints hold each layer's experts as one tensor per projection, stacked over
the experts and stored `[E, in, out]` as the model holds them
(`model.layers.{l}.mlp.experts.gate_up_proj`, `..._bias`, `down_proj`), and every other
parameter under the shared rule (`family.hf_name`): `mlp.router`, `self_attn.sinks`.
"""

from __future__ import annotations

from . import family, gpt_oss_config, moe, moe_decoder
from .family import Family
from .gpt_oss_config import GptOssConfig
from .layers import SHARDING_RULES


def hf_name(path: tuple) -> tuple[str, bool]:
    """The Hugging Face tensor name of an NNX parameter path, and whether it is
    transposed: an expert tensor by its own name, untransposed; the rest by the shared
    rule (`family.hf_name`)."""
    *modules, leaf = (str(p) for p in path)
    if modules[-1:] == ["experts"]:
        return ".".join(["model", *modules, leaf]), False
    return family.hf_name(path)


# The experts by expert or inside each, as `moe.sharding_rules` says; attention (its
# biases and the o projection's), embedding and LM head as the Llama family's. The
# sinks are replicated here and split by query head inside the attention.
SHARDING_RULES_GPT_OSS = (
    *moe.sharding_rules(moe.ExpertForm.gpt_oss(limit=1.0, alpha=1.0)),
    *(rule for rule in SHARDING_RULES if "mlp" not in rule.modules),
)

FAMILY = Family(
    name="gpt_oss",
    model_types=gpt_oss_config.HF_MODEL_TYPES,
    config_class=GptOssConfig,
    model_class=moe_decoder.MoeForCausalLM,
    presets=gpt_oss_config.PRESETS,
    byte_level_presets=gpt_oss_config.BYTE_LEVEL_PRESETS,
    sharding_rules=SHARDING_RULES_GPT_OSS,
    hf_name=hf_name,
)
