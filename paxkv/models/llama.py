"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/3) in Flax NNX, over the paged KV cache.

Parameter names follow Hugging Face's (`embed_tokens`, `layers[i].self_attn.q_proj`,
`mlp.gate_proj`, `input_layernorm`, ...) so checkpoints map by rule (`family.hf_name`).
Linear kernels are stored `[in, out]` (NNX's layout), the transpose of Hugging Face's.
The layers other families share are in `layers.py`; the one per-layer call into the
cache is `paxkv.kv_cache.paged_attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paxkv.kv_cache import PagedKVCache, PageTable, paged_attention

from . import layer_stack, llama_config
from .family import Family
from .layers import (
    MLP,
    SHARDING_RULES,
    Attention,
    CausalLM,
    RMSNorm,
    dense_causal_attention,
    rope_inv_freq,
)
from .llama_config import LlamaConfig


class DecoderLayer(nnx.Module):
    """One transformer block: attention over the paged cache, then the MLP, each pre-normed."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        norm = lambda size: RMSNorm(size, eps=config.rms_norm_eps, dtype=config.dtype)
        self.input_layernorm = norm(config.hidden_size)
        self.self_attn = Attention(
            config,
            rngs=rngs,
            bias=config.attention_bias,
            qk_norm=norm if config.qk_norm else None,
        )
        self.post_attention_layernorm = norm(config.hidden_size)
        self.mlp = MLP(config, rngs=rngs)

    def finish(self, x: jax.Array, attn: jax.Array, lora: jax.Array | None = None) -> jax.Array:
        """The residual stream after this layer, given its attention output `[T, Hq, D]`."""
        x = x + self.self_attn.out(attn, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class LlamaForCausalLM(CausalLM):
    """The decoder with its LM head (or tied embedding); see `__call__` for the paged step."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        super().__init__(config, lambda: DecoderLayer(config, rngs=rngs), rngs=rngs)

    @property
    def inv_freq(self) -> np.ndarray:  # f64[D // 2]
        """RoPE inverse frequencies (f64[D // 2]), with llama3 scaling when configured."""
        c = self.config
        return rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)

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
        """One paged step over packed rows: writes their K/V and returns final-norm hidden states.

        Rows are packed as `table.cu_q_lens` says; `positions[t]` must be row t's
        absolute position (`kv_len - q_len + i`), which RoPE uses, while the cache
        write and the attention mask take positions from the table. Padding rows
        (token 0, position 0) are dropped by the write, attend to nothing, and give
        finite hidden states that the caller ignores. `decode_only`: a static promise
        that every sequence has at most one new row (the GPU kernel then skips prefill).
        `lora`: each row's adapter slot, for a model with slots (`paxkv.models.lora`).
        """
        c = self.config
        inv_freq = self.inv_freq

        def body(layer, i, kind, carry):
            x, kv_cache = carry
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), positions, inv_freq, lora)
            attn, kv_cache = paged_attention(
                i,
                q,
                k,
                v,
                kv_cache,
                table,
                sm_scale=c.head_dim**-0.5,
                sliding_window=c.sliding_window,
                soft_cap=None,
                num_kv_heads=c.num_kv_heads,
                mesh=self.mesh,
                backend=attention_backend,
                decode_only=decode_only,
            )
            return layer.finish(x, attn, lora), kv_cache

        carry = (self.embed_tokens(tokens), kv_cache)
        x, kv_cache = layer_stack.run(self.layers, carry, body, scanned=c.scan_layers)
        return self.norm(x), kv_cache

    def dense_logits(self, tokens: jax.Array, lora: jax.Array | None = None) -> jax.Array:
        """`i32[L]` -> `f32[L, vocab]`: one sequence from position 0, dense causal attention.

        The oracle for the paged path: the same weights and RoPE (and adapters), but no
        cache, no page table and no attention kernel.
        """
        c = self.config
        positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        inv_freq = self.inv_freq

        def body(layer, i, kind, x):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), positions, inv_freq, lora)
            attn = dense_causal_attention(
                q, k, v, sm_scale=c.head_dim**-0.5, sliding_window=c.sliding_window
            )
            return layer.finish(x, attn, lora)

        x = layer_stack.run(self.layers, self.embed_tokens(tokens), body, scanned=c.scan_layers)
        return self.logits(self.norm(x))


FAMILY = Family(
    name="llama",
    model_types=llama_config.HF_MODEL_TYPES,
    config_class=LlamaConfig,
    model_class=LlamaForCausalLM,
    presets=llama_config.PRESETS,
    byte_level_presets=llama_config.BYTE_LEVEL_PRESETS,
    sharding_rules=SHARDING_RULES,
)
