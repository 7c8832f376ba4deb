"""The Gemma 2 and Gemma 3 (text) decoders in Flax NNX, over the paged KV cache.

Parameter names follow Hugging Face's (`layers[i].pre_feedforward_layernorm`,
`self_attn.q_norm`, ...) so checkpoints map by the shared rule (`family.hf_name`);
the projections, RoPE, MLP and attention oracle are the shared layers (`layers.py`),
`paged_attention` the cache's (`paxkv.kv_cache`). What differs is in `GemmaConfig`'s
docstring.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paxkv.kv_cache import PagedKVCache, PageTable, paged_attention

from . import gemma_config, layer_stack
from .family import Family
from .gemma_config import ACTIVATION, GemmaConfig
from .layers import (
    MLP,
    SHARDING_RULES,
    Attention,
    CausalLM,
    dense_causal_attention,
    output_logits,
    rms_normalize,
    rope_inv_freq,
)


class GemmaRMSNorm(nnx.Module):
    """`(1 + weight) * (x / sqrt(mean(x^2) + eps))`, all in float32 and then cast back
    (Hugging Face's Gemma order); the weight starts at zero, the identity scale."""

    def __init__(self, size: int, *, eps: float, dtype: str):
        self.weight = nnx.Param(jnp.zeros((size,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalises the last axis and scales it by `1 + weight`."""
        scale = 1.0 + self.weight[...].astype(jnp.float32)
        return (rms_normalize(x, self.eps) * scale).astype(x.dtype)


class GemmaDecoderLayer(nnx.Module):
    """One block: attention and the GeGLU MLP, each with a norm before and after."""

    def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
        norm = lambda size: GemmaRMSNorm(size, eps=config.rms_norm_eps, dtype=config.dtype)
        h = config.hidden_size
        self.input_layernorm = norm(h)
        self.self_attn = Attention(config, rngs=rngs, qk_norm=norm if config.qk_norm else None)
        self.post_attention_layernorm = norm(h)
        self.pre_feedforward_layernorm = norm(h)
        self.mlp = MLP(config, rngs=rngs, activation=ACTIVATION)
        self.post_feedforward_layernorm = norm(h)

    def finish(self, x: jax.Array, attn: jax.Array, lora: jax.Array | None = None) -> jax.Array:
        """The residual stream after this layer, given its attention output `[T, Hq, D]`."""
        x = x + self.post_attention_layernorm(self.self_attn.out(attn, lora))
        mlp = self.mlp(self.pre_feedforward_layernorm(x), lora)
        return x + self.post_feedforward_layernorm(mlp)


class GemmaForCausalLM(CausalLM):
    """The Gemma decoder with its (usually tied) LM head; the same contract as
    `LlamaForCausalLM`: `__call__` is the paged step, `dense_logits` the oracle."""

    def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
        # Its layers stacked by kind and scanned over periods (`LayerStack`), or looped.
        make_layer = lambda: GemmaDecoderLayer(config, rngs=rngs)
        super().__init__(config, make_layer, norm_class=GemmaRMSNorm, rngs=rngs)

    def layer_inv_freq(self, layer: int) -> np.ndarray:  # f64[D // 2]
        """RoPE inverse frequencies of `layer`: the local base on sliding layers, the
        global base, divided by the linear scaling factor, on full ones."""
        c = self.config
        if c.layer_sliding_windows[layer] is not None:
            return rope_inv_freq(c.head_dim, c.rope_local_theta, None)
        return rope_inv_freq(c.head_dim, c.rope_theta, None) / (c.rope_scaling_factor or 1.0)

    def _embed(self, tokens: jax.Array) -> jax.Array:  # [T, hidden]
        # The scale is rounded to the model dtype first, as Hugging Face does
        # (sqrt(3072) = 55.43 is 55.5 in bfloat16).
        x = self.embed_tokens(tokens)
        return x * jnp.asarray(math.sqrt(self.config.hidden_size), x.dtype)

    def __call__(
        self,
        tokens: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        kv_cache: PagedKVCache,
        table: PageTable,
        *,
        attention_backend: str = "auto",
        decode_only: bool = False,
        lora: jax.Array | None = None,
    ) -> tuple[jax.Array, PagedKVCache]:  # [T, hidden], new cache
        """One paged step over packed rows, as `LlamaForCausalLM.__call__`; each layer
        attends with its own window (`config.layer_sliding_windows`)."""
        c = self.config

        def body(layer, i, kind, carry):
            # `kind`: a static layer number with this layer's window and RoPE.
            x, kv_cache = carry
            q, k, v = layer.self_attn.qkv(
                layer.input_layernorm(x), positions, self.layer_inv_freq(kind), lora
            )
            attn, kv_cache = paged_attention(
                i,
                q,
                k,
                v,
                kv_cache,
                table,
                sm_scale=c.query_pre_attn_scalar**-0.5,
                sliding_window=c.layer_sliding_windows[kind],
                soft_cap=c.attn_logit_softcapping,
                num_kv_heads=c.num_kv_heads,
                mesh=self.mesh,
                backend=attention_backend,
                decode_only=decode_only,
            )
            return layer.finish(x, attn, lora), kv_cache

        carry = (self._embed(tokens), kv_cache)
        x, kv_cache = layer_stack.run(self.layers, carry, body, scanned=c.scan_layers)
        return self.norm(x), kv_cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """`hidden [N, hidden]` -> `f32[N, vocab]`, soft-capped by `final_logit_softcapping`."""
        logits = output_logits(self, hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def dense_logits(self, tokens: jax.Array, lora: jax.Array | None = None) -> jax.Array:
        """`i32[L]` -> `f32[L, vocab]`: one sequence from position 0, dense causal
        attention with each layer's window; the oracle for the paged path."""
        c = self.config
        positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)

        def body(layer, i, kind, x):
            q, k, v = layer.self_attn.qkv(
                layer.input_layernorm(x), positions, self.layer_inv_freq(kind), lora
            )
            attn = dense_causal_attention(
                q,
                k,
                v,
                sm_scale=c.query_pre_attn_scalar**-0.5,
                sliding_window=c.layer_sliding_windows[kind],
                soft_cap=c.attn_logit_softcapping,
            )
            return layer.finish(x, attn, lora)

        x = layer_stack.run(self.layers, self._embed(tokens), body, scanned=c.scan_layers)
        return self.logits(self.norm(x))


FAMILY = Family(
    name="gemma",
    model_types=gemma_config.HF_MODEL_TYPES,
    config_class=GemmaConfig,
    model_class=GemmaForCausalLM,
    presets=gemma_config.PRESETS,
    byte_level_presets=gemma_config.BYTE_LEVEL_PRESETS,
    sharding_rules=SHARDING_RULES,
)
