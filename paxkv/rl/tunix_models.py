"""Tunix's model families as paxkv models: the config, and the parameter tree mapped
leaf by leaf through one table per family.

Tunix's Llama 3, Qwen2 and Qwen3 (`tunix.models.{llama3,qwen2,qwen3}`) are the Llama
architecture paxkv serves as `LlamaForCausalLM` (Qwen2 with Q/K/V biases, Qwen3 with
per-head Q/K norms); only the names and the projections' head axes differ: Tunix holds
q/k/v as `[D, H, hd]` and o as `[H, hd, D]` where paxkv holds `[D, H * hd]` and
`[H * hd, D]`. No Tunix import here: a family is found by the actor's module name, and
trees are read as flat `{path: array}` dicts (`nnx.to_flat_state`'s paths).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from paxkv.models.llama_config import LlamaConfig

TunixPath = tuple[Any, ...]  # ('layers', 0, 'attn', 'q_proj', 'w')


def _merge_out_heads(x: Any) -> Any:  # [D, H, hd] -> [D, H * hd]
    return x.reshape(x.shape[0], -1)


def _merge_in_heads(x: Any) -> Any:  # [H, hd, D] -> [H * hd, D]
    return x.reshape(-1, x.shape[-1])


@dataclasses.dataclass(frozen=True)
class Rule:
    """One Tunix leaf (`tunix`: '/'-joined path, `{i}` a layer index) and the paxkv leaf
    it becomes (`paxkv`), through `reshape` (None: as it is)."""

    tunix: str
    paxkv: str
    reshape: Callable[[Any], Any] | None = None

    def pattern(self) -> re.Pattern:
        """`tunix` as a regular expression, the layer index its group."""
        return re.compile("^" + re.escape(self.tunix).replace(r"\{i\}", r"(\d+)") + "$")


_LLAMA_RULES = (
    Rule("embedder/input_embedding", "embed_tokens/embedding"),
    Rule("layers/{i}/input_layernorm/w", "layers/{i}/input_layernorm/weight"),
    Rule("layers/{i}/post_attention_layernorm/w", "layers/{i}/post_attention_layernorm/weight"),
    Rule("layers/{i}/attn/q_proj/w", "layers/{i}/self_attn/q_proj/kernel", _merge_out_heads),
    Rule("layers/{i}/attn/k_proj/w", "layers/{i}/self_attn/k_proj/kernel", _merge_out_heads),
    Rule("layers/{i}/attn/v_proj/w", "layers/{i}/self_attn/v_proj/kernel", _merge_out_heads),
    Rule("layers/{i}/attn/o_proj/w", "layers/{i}/self_attn/o_proj/kernel", _merge_in_heads),
    Rule("layers/{i}/mlp/gate_proj/kernel", "layers/{i}/mlp/gate_proj/kernel"),
    Rule("layers/{i}/mlp/up_proj/kernel", "layers/{i}/mlp/up_proj/kernel"),
    Rule("layers/{i}/mlp/down_proj/kernel", "layers/{i}/mlp/down_proj/kernel"),
    Rule("final_norm/w", "norm/weight"),
    Rule("lm_head/w", "lm_head/kernel"),
)
_QWEN2_RULES = (
    *_LLAMA_RULES,
    Rule("layers/{i}/attn/q_bias", "layers/{i}/self_attn/q_proj/bias"),
    Rule("layers/{i}/attn/k_bias", "layers/{i}/self_attn/k_proj/bias"),
    Rule("layers/{i}/attn/v_bias", "layers/{i}/self_attn/v_proj/bias"),
)
_QWEN3_RULES = (
    *_LLAMA_RULES,
    Rule("layers/{i}/attn/q_norm/w", "layers/{i}/self_attn/q_norm/weight"),
    Rule("layers/{i}/attn/k_norm/w", "layers/{i}/self_attn/k_norm/weight"),
)


@dataclasses.dataclass(frozen=True)
class TunixFamily:
    """A Tunix model family paxkv serves: its module, its leaves' table, and what its
    `ModelConfig` adds to the Llama architecture."""

    name: str
    module: str  # the actor class's module starts with it
    rules: tuple[Rule, ...]
    tied_field: str  # the ModelConfig field that ties the LM head to the embedding
    extra: Mapping[str, Any]  # LlamaConfig fields of the family
    # The RoPE base the family's attention applies; None: its config's `rope_theta`.
    # Tunix 0.1.7's Llama 3 and Qwen3 call `apply_rope` without the config's value, so
    # its default, 1e6, is what the actor computes, whatever the config says; the
    # rollout follows the actor (tests/rl checks it against the actor's forward).
    rope_theta: float | None = None

    def config(self, tunix_config: Any, *, dtype: str, max_position_embeddings: int) -> LlamaConfig:
        """The paxkv `LlamaConfig` of a Tunix `ModelConfig`. ValueError for what paxkv
        does not serve (MoE)."""
        c = tunix_config
        if getattr(c, "num_experts", None):
            raise ValueError(
                f"tunix {self.name} with num_experts={c.num_experts}: Tunix's MoE models are "
                "not mapped (dense Llama 3, Qwen2 and Qwen3 are)"
            )
        return LlamaConfig(
            vocab_size=int(c.vocab_size),
            hidden_size=int(c.embed_dim),
            intermediate_size=int(c.hidden_dim),
            num_layers=int(c.num_layers),
            num_heads=int(c.num_heads),
            num_kv_heads=int(c.num_kv_heads),
            head_dim=int(c.head_dim),
            rope_theta=float(c.rope_theta if self.rope_theta is None else self.rope_theta),
            rms_norm_eps=float(c.norm_eps),
            tie_word_embeddings=bool(getattr(c, self.tied_field, False)),
            max_position_embeddings=max_position_embeddings,
            dtype=dtype,
            **self.extra,
        )

    def paxkv_tree(self, flat: Iterable[tuple[TunixPath, Any]]) -> dict[str, Any]:
        """The paxkv parameter tree (nested dicts, layer indices as ints) of a Tunix
        actor's `Param` leaves `flat` (`(path, array)` pairs). ValueError naming a leaf
        no rule maps; the arrays are reshaped, not copied where the reshape is free."""
        patterns = [(rule, rule.pattern()) for rule in self.rules]
        tree: dict[str, Any] = {}
        for path, value in flat:
            name = "/".join(str(k) for k in path)
            for rule, pattern in patterns:
                if m := pattern.match(name):
                    target = rule.paxkv.replace("{i}", m.group(1)) if m.groups() else rule.paxkv
                    _put(tree, target, rule.reshape(value) if rule.reshape else value)
                    break
            else:
                raise ValueError(
                    f"tunix {self.name} leaf {name} {_shape(value)}: paxkv has no mapping for "
                    f"it (the {self.name} table maps: {', '.join(r.tunix for r in self.rules)}); "
                    "LoRA leaves are not taken: merge the adapters into the weights first"
                )
        return tree


def _put(tree: dict[str, Any], path: str, value: Any) -> None:
    keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split("/")]
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value


def _shape(x: Any) -> str:
    return f"{tuple(np.shape(x))} {getattr(x, 'dtype', type(x).__name__)}"


FAMILIES = (
    TunixFamily("llama3", "tunix.models.llama3", _LLAMA_RULES, "weight_tying", {}, 1e6),
    TunixFamily(
        "qwen2", "tunix.models.qwen2", _QWEN2_RULES, "use_tied_embedding", {"attention_bias": True}
    ),
    TunixFamily(
        "qwen3", "tunix.models.qwen3", _QWEN3_RULES, "use_tied_embedding", {"qk_norm": True}, 1e6
    ),
)


def family_of(actor: Any) -> TunixFamily:
    """The family of a Tunix model object (by its class's module); ValueError naming
    the class when paxkv maps none."""
    module = type(actor).__module__
    for family in FAMILIES:
        if module == family.module or module.startswith(family.module + "."):
            return family
    raise ValueError(
        f"rollout_actor is a {module}.{type(actor).__name__}: paxkv maps Tunix's "
        f"{', '.join(f.module for f in FAMILIES)} models"
    )
