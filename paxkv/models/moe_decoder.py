"""The sparse mixture-of-experts decoders (Mixtral, Qwen3-MoE, gpt-oss) in Flax NNX, over the paged KV cache.

The Llama-family block with its MLP replaced by a `moe.MoE` (router and experts).
Parameter names follow Hugging Face's, so checkpoints map by the family's rule:
Mixtral's `block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1` (gate), `w3`
(up), `w2` (down); Qwen3-MoE's `mlp.gate` and `mlp.experts.{e}.gate_proj`, `up_proj`,
`down_proj`, with q/k norms in attention; gpt-oss's `mlp.router` and
`mlp.experts.gate_up_proj` (all experts in one tensor), with biased attention, attention
sinks, YaRN RoPE and layers alternating a sliding window and full attention
(`GptOssConfig`).

Routing replay (for RL): the paged step and `dense_logits` take `routing=` (i32[L, T, k],
the experts of every layer and row) to force that routing, and with `return_routing=True`
also return the routing they used.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paxkv.kv_cache import PagedKVCache, PageTable, paged_attention

from . import layer_stack, moe, moe_config
from .family import Family
from .layers import (
    SHARDING_RULES,
    Attention,
    CausalLM,
    RMSNorm,
    dense_causal_attention,
    rope_inv_freq,
    yarn_inv_freq,
)
from .moe_config import MoeConfig

MoeFamilyConfig = Any  # MoeConfig or gpt_oss_config.GptOssConfig

# The MoE block's attribute, by Hugging Face model type.
_MOE_ATTRIBUTE = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp", "gpt_oss": "mlp"}


def expert_form(config: MoeFamilyConfig) -> moe.ExpertForm:
    """The layout and gated unit of `config`'s experts, by its model type."""
    if config.model_type == "gpt_oss":
        return moe.ExpertForm.gpt_oss(limit=config.swiglu_limit, alpha=config.swiglu_alpha)
    return {"mixtral": moe.MIXTRAL, "qwen3_moe": moe.QWEN}[config.model_type]


def rope(config: MoeFamilyConfig) -> tuple[np.ndarray, float]:  # f64[D // 2], sm_scale
    """RoPE inverse frequencies and the attention scale: `head_dim ** -0.5`, times the
    square of YaRN's attention factor when the config stretches RoPE by YaRN (the
    factor scales queries and keys alike)."""
    yarn = getattr(config, "rope_scaling", None)
    scale = config.head_dim**-0.5
    if yarn is None:
        return rope_inv_freq(config.head_dim, config.rope_theta, None), scale
    inv_freq, factor = yarn_inv_freq(config.head_dim, config.rope_theta, **dataclasses.asdict(yarn))
    return inv_freq, scale * factor**2


class MoeDecoderLayer(nnx.Module):
    """One block: attention over the paged cache, then the MoE block, each pre-normed."""

    def __init__(self, config: MoeFamilyConfig, *, rngs: nnx.Rngs):
        norm = lambda size: RMSNorm(size, eps=config.rms_norm_eps, dtype=config.dtype)
        self.input_layernorm = norm(config.hidden_size)
        biased = config.attention_bias  # gpt-oss: q, k, v and o
        self.self_attn = Attention(
            config,
            rngs=rngs,
            bias=biased,
            out_bias=biased,
            qk_norm=norm if getattr(config, "qk_norm", False) else None,
            sinks=config.attention_sinks,
        )
        self.post_attention_layernorm = norm(config.hidden_size)
        self.moe_attribute = _MOE_ATTRIBUTE[config.model_type]
        setattr(self, self.moe_attribute, moe.MoE(config, expert_form(config), rngs=rngs))

    def finish(
        self,
        x: jax.Array,  # [T, hidden]
        attn: jax.Array,  # [T, Hq, D]
        *,
        experts: jax.Array | None,  # i32[T, k]: replayed, or None to route
        mesh,
        lora: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:  # [T, hidden], i32[T, k]
        """The residual stream after this layer, and the experts each row went to
        (adapters on the attention only: the experts are no LoRA targets)."""
        x = x + self.self_attn.out(attn, lora)
        block = getattr(self, self.moe_attribute)
        y, experts = block(self.post_attention_layernorm(x), experts=experts, mesh=mesh)
        return x + y, experts


def _layer_routing(routing: jax.Array | None, i) -> jax.Array | None:
    return None if routing is None else routing[i]


class MoeForCausalLM(CausalLM):
    """The MoE decoder with its LM head (or tied embedding); the contract of
    `family.Model`: `__call__` is the paged step, `dense_logits` the oracle. Its config
    is a `MoeConfig` (Mixtral, Qwen3-MoE) or a `GptOssConfig`."""

    # The engine's step asks for the routing (`return_routing=True`), of
    # `config.num_layers` layers and `config.num_experts_per_tok` experts
    # (`paxkv.engine.routed_experts`).
    routes_experts = True

    def __init__(self, config: MoeFamilyConfig, *, rngs: nnx.Rngs):
        super().__init__(config, lambda: MoeDecoderLayer(config, rngs=rngs), rngs=rngs)

    def _empty_routing(self, num_rows: int) -> jax.Array:  # i32[L, T, k]
        c = self.config
        return jnp.zeros((c.num_layers, num_rows, c.num_experts_per_tok), jnp.int32)

    def __call__(
        self,
        tokens: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        kv_cache: PagedKVCache,
        table: PageTable,
        *,
        attention_backend: str = "auto",
        decode_only: bool = False,
        routing: jax.Array | None = None,  # i32[L, T, k]
        return_routing: bool = False,
        lora: jax.Array | None = None,
    ) -> tuple[jax.Array, ...]:  # [T, hidden], new cache (, i32[L, T, k])
        """One paged step over packed rows, as `LlamaForCausalLM.__call__`.

        `routing` (routing replay): each layer's experts for each row, used instead of
        the router's choice. `return_routing` (static): also return the experts every
        layer sent every row to, i32[L, T, k] (padding rows' entries mean nothing).
        """
        c = self.config
        inv_freq, sm_scale = rope(c)

        def body(layer, i, kind, carry):
            # `kind`: a static layer number with this layer's window.
            x, kv_cache, routes = carry
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), positions, inv_freq, lora)
            attn, kv_cache = paged_attention(
                i,
                q,
                k,
                v,
                kv_cache,
                table,
                sm_scale=sm_scale,
                sliding_window=c.layer_sliding_windows[kind],
                soft_cap=None,
                num_kv_heads=c.num_kv_heads,
                mesh=self.mesh,
                backend=attention_backend,
                decode_only=decode_only,
                sinks=layer.self_attn.attention_sinks(),
            )
            forced = _layer_routing(routing, i)
            x, experts = layer.finish(x, attn, experts=forced, mesh=self.mesh, lora=lora)
            routes = None if routes is None else routes.at[i].set(experts)
            return x, kv_cache, routes

        routes = self._empty_routing(tokens.shape[0]) if return_routing else None
        carry = (self.embed_tokens(tokens), kv_cache, routes)
        x, kv_cache, routes = layer_stack.run(self.layers, carry, body, scanned=c.scan_layers)
        if return_routing:
            return self.norm(x), kv_cache, routes
        return self.norm(x), kv_cache

    def dense_logits(
        self,
        tokens: jax.Array,  # i32[L]
        *,
        routing: jax.Array | None = None,  # i32[layers, L, k]
        return_routing: bool = False,
        lora: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:  # f32[L, vocab] (, i32[layers, L, k])
        """`i32[L]` -> `f32[L, vocab]`: one sequence from position 0, dense causal
        attention; the oracle for the paged path. `routing` and `return_routing` as in
        `__call__` (a trainer's forward pass replaying a rollout's routing)."""
        c = self.config
        positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        inv_freq, sm_scale = rope(c)

        def body(layer, i, kind, carry):
            x, routes = carry
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), positions, inv_freq, lora)
            attn = dense_causal_attention(
                q,
                k,
                v,
                sm_scale=sm_scale,
                sliding_window=c.layer_sliding_windows[kind],
                sinks=layer.self_attn.attention_sinks(),
            )
            forced = _layer_routing(routing, i)
            x, experts = layer.finish(x, attn, experts=forced, mesh=self.mesh, lora=lora)
            return x, None if routes is None else routes.at[i].set(experts)

        routes = self._empty_routing(tokens.shape[0]) if return_routing else None
        carry = (self.embed_tokens(tokens), routes)
        x, routes = layer_stack.run(self.layers, carry, body, scanned=c.scan_layers)
        logits = self.logits(self.norm(x))
        return (logits, routes) if return_routing else logits


# Attention, embedding and LM head as the Llama family's; the experts split by expert
# (or inside each expert), the router replicated (`moe.sharding_rules`).
SHARDING_RULES_MOE = (
    *moe.sharding_rules(moe.MIXTRAL),
    *moe.sharding_rules(moe.QWEN),
    *(rule for rule in SHARDING_RULES if "mlp" not in rule.modules),
)

FAMILY = Family(
    name="moe",
    model_types=moe_config.HF_MODEL_TYPES,
    config_class=MoeConfig,
    model_class=MoeForCausalLM,
    presets=moe_config.PRESETS,
    byte_level_presets=moe_config.BYTE_LEVEL_PRESETS,
    sharding_rules=SHARDING_RULES_MOE,
)
