"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/3) in Flax NNX, over the paged KV cache.

Parameter names follow Hugging Face's (`embed_tokens`, `layers[i].self_attn.q_proj`,
`mlp.gate_proj`, `input_layernorm`, ...) so `weights.py` maps checkpoints by rule.
Linear kernels are stored `[in, out]` (NNX's layout), the transpose of Hugging Face's.
The pieces other families share live here too: RoPE, the projections, the MLP, dense
attention (the oracle); the one per-layer call into the cache is `paxkv.kv_cache`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paxkv.kv_cache import PagedKVCache, PageTable, paged_attention

from . import layer_stack
from .config import Llama3RopeScaling, LlamaConfig, ModelConfig

INIT_STD = 0.02  # Hugging Face's initializer_range for these models
# MLP activations by their Hugging Face names; gelu_pytorch_tanh is tanh-approximate.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def rope_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: Llama3RopeScaling | None
) -> np.ndarray:  # f64[D // 2]
    """RoPE inverse frequencies `theta ** (-2i / D)`, with Llama 3.1's scaling when given.

    Computed on the host in float64: they are constants of the model.
    """
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if rope_scaling is None:
        return inv_freq
    s = rope_scaling
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return np.where(
        wavelen > low_freq_wavelen,
        inv_freq / s.factor,
        np.where(wavelen < high_freq_wavelen, inv_freq, interpolated),
    )


def apply_rope(
    x: jax.Array,  # [T, H, D]
    positions: jax.Array,  # i32[T]
    inv_freq: np.ndarray,  # [D // 2]
) -> jax.Array:  # [T, H, D], x.dtype
    """Rotates x by its positions, Hugging Face's rotate-half convention.

    Element i pairs with element i + D/2: `out[i] = x[i] cos(p f_i) - x[i + D/2] sin(p f_i)`
    and `out[i + D/2] = x[i + D/2] cos(p f_i) + x[i] sin(p f_i)`. Computed in float32.
    """
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)
    cos = jnp.cos(angles)[:, None, :]  # [T, 1, D // 2]
    sin = jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def dense_causal_attention(
    q: jax.Array,  # [L, Hq, D]
    k: jax.Array,  # [L, Hkv, D]
    v: jax.Array,  # [L, Hkv, D]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None = None,
) -> jax.Array:  # [L, Hq, D], q.dtype
    """Plain causal softmax attention of one sequence, in float32 at HIGHEST precision.

    Query i sees keys `j <= i`, and with a window W only `j > i - W`. Logits are
    `sm_scale * q.k`, capped at `soft_cap * tanh(logits / soft_cap)` when it is set.
    """
    length, num_q_heads, _ = q.shape
    group = num_q_heads // k.shape[1]
    k = jnp.repeat(k.astype(jnp.float32), group, axis=1)
    v = jnp.repeat(v.astype(jnp.float32), group, axis=1)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k, precision=hi) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    i = jnp.arange(length)[:, None]
    j = jnp.arange(length)[None, :]
    mask = j <= i
    if sliding_window is not None:
        mask &= j > i - sliding_window
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("hqk,khd->qhd", p, v, precision=hi).astype(q.dtype)


def _precision(config: ModelConfig) -> jax.lax.Precision:
    # float32 models are the test dtype: keep their matmuls exact on TPU/GPU too.
    if config.dtype == "float32":
        return jax.lax.Precision.HIGHEST
    return jax.lax.Precision.DEFAULT


def linear(config: ModelConfig, d_in: int, d_out: int, *, bias: bool, rngs) -> nnx.Linear:
    """A `[d_in, d_out]` projection in the config's dtype, normal(0.02) initialised."""
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=bias,
        dtype=config.dtype,
        param_dtype=config.dtype,
        precision=_precision(config),
        kernel_init=nnx.initializers.normal(INIT_STD),
        rngs=rngs,
    )


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:  # f32, x's shape
    """`x / sqrt(mean(x^2) + eps)` over the last axis, in float32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def embedding(config: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Embed:
    """The token embedding `[vocab, hidden]`, normal(0.02) initialised."""
    return nnx.Embed(
        config.vocab_size,
        config.hidden_size,
        dtype=config.dtype,
        param_dtype=config.dtype,
        embedding_init=nnx.initializers.normal(INIT_STD),
        rngs=rngs,
    )


def lm_head(config: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Linear | None:
    """The output projection, or None when it is tied to the embedding."""
    if config.tie_word_embeddings:
        return None
    return linear(config, config.hidden_size, config.vocab_size, bias=False, rngs=rngs)


def output_logits(model: Any, hidden: jax.Array) -> jax.Array:
    """`hidden [N, hidden]` -> `f32[N, vocab]` through `model.lm_head`, or its tied
    `model.embed_tokens` when that is None."""
    head = model.lm_head
    w = model.embed_tokens.embedding[...].T if head is None else head.kernel[...]
    return jnp.dot(
        hidden.astype(w.dtype),
        w,
        precision=_precision(model.config),
        preferred_element_type=jnp.float32,
    )


class RMSNorm(nnx.Module):
    """`weight * (x / sqrt(mean(x^2) + eps))`, normalised in float32 (Hugging Face's order)."""

    def __init__(self, size: int, *, eps: float, dtype: str):
        self.weight = nnx.Param(jnp.ones((size,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalises the last axis (in f32) and scales it by the learned weight."""
        return self.weight[...] * rms_normalize(x, self.eps).astype(x.dtype)


class MLP(nnx.Module):
    """A gated MLP, `down(act(gate(x)) * up(x))`: SwiGLU (silu) or GeGLU (gelu)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, activation: str = "silu"):
        h, m = config.hidden_size, config.intermediate_size
        self.gate_proj = linear(config, h, m, bias=False, rngs=rngs)
        self.up_proj = linear(config, h, m, bias=False, rngs=rngs)
        self.down_proj = linear(config, m, h, bias=False, rngs=rngs)
        self.activation = activation  # a name of ACTIVATIONS (static)

    def __call__(self, x: jax.Array) -> jax.Array:
        """`down(act(gate(x)) * up(x))`."""
        act = ACTIVATIONS[self.activation]
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))


class Attention(nnx.Module):
    """GQA projections and RoPE; the attention itself is the caller's (paged or dense).

    `bias` puts biases on q/k/v (Qwen2). `qk_norm`, when given, makes the norm of
    every q and of every k head over the head dim (`q_norm`, `k_norm`: Qwen3, Gemma 3),
    applied after the projection and before RoPE.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs,
        bias: bool = False,
        qk_norm: Callable[[int], nnx.Module] | None = None,
    ):
        h, d = config.hidden_size, config.head_dim
        self.q_proj = linear(config, h, config.num_heads * d, bias=bias, rngs=rngs)
        self.k_proj = linear(config, h, config.num_kv_heads * d, bias=bias, rngs=rngs)
        self.v_proj = linear(config, h, config.num_kv_heads * d, bias=bias, rngs=rngs)
        self.o_proj = linear(config, config.num_heads * d, h, bias=False, rngs=rngs)
        self.q_norm = None if qk_norm is None else qk_norm(d)
        self.k_norm = None if qk_norm is None else qk_norm(d)
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d

    def qkv(
        self, x: jax.Array, positions: jax.Array, inv_freq: np.ndarray
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`x [T, hidden]` -> q `[T, Hq, D]`, k and v `[T, Hkv, D]`, q and k rotated."""
        t = x.shape[0]
        q = self.q_proj(x).reshape(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def out(self, attn: jax.Array) -> jax.Array:
        """`attn [T, Hq, D]` -> `[T, hidden]`."""
        return self.o_proj(attn.reshape(attn.shape[0], self.num_heads * self.head_dim))


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

    def finish(self, x: jax.Array, attn: jax.Array) -> jax.Array:
        """The residual stream after this layer, given its attention output `[T, Hq, D]`."""
        x = x + self.self_attn.out(attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nnx.Module):
    """The decoder with its LM head (or tied embedding); see `__call__` for the paged step."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = embedding(config, rngs=rngs)
        layers = [DecoderLayer(config, rngs=rngs) for _ in range(config.num_layers)]
        # Stacked and scanned (`LayerStack`), or a module per layer, looped.
        self.layers = layer_stack.hold(layers, config)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=config.dtype)
        self.lm_head = lm_head(config, rngs=rngs)
        # A jax Mesh (static): attention runs per shard of its `model` axis. Set by
        # `paxkv.sharding.shardings.shard_engine_state`, with the weights and pages placed to match.
        self.mesh = None

    def duplicate_kv_heads(self, factor: int) -> None:
        """Repeats every KV head `factor` times, in place (see `duplicate_kv_heads`)."""
        duplicate_kv_heads(self, factor)

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
    ) -> tuple[jax.Array, PagedKVCache]:  # [T, hidden], new cache
        """One paged step over packed rows: writes their K/V and returns final-norm hidden states.

        Rows are packed as `table.cu_q_lens` says; `positions[t]` must be row t's
        absolute position (`kv_len - q_len + i`), which RoPE uses, while the cache
        write and the attention mask take positions from the table. Padding rows
        (token 0, position 0) are dropped by the write, attend to nothing, and give
        finite hidden states that the caller ignores. `decode_only`: a static promise
        that every sequence has at most one new row (the GPU kernel then skips prefill).
        """
        c = self.config
        inv_freq = self.inv_freq

        def body(layer, i, kind, carry):
            x, kv_cache = carry
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), positions, inv_freq)
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
            return layer.finish(x, attn), kv_cache

        carry = (self.embed_tokens(tokens), kv_cache)
        x, kv_cache = layer_stack.run(self.layers, carry, body, scanned=c.scan_layers)
        return self.norm(x), kv_cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """`hidden [N, hidden]` -> `f32[N, vocab]`, through lm_head or the tied embedding."""
        return output_logits(self, hidden)

    def dense_logits(self, tokens: jax.Array) -> jax.Array:
        """`i32[L]` -> `f32[L, vocab]`: one sequence from position 0, dense causal attention.

        The oracle for the paged path: the same weights and RoPE, but no cache, no page
        table and no attention kernel.
        """
        c = self.config
        positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        inv_freq = self.inv_freq

        def body(layer, i, kind, x):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), positions, inv_freq)
            attn = dense_causal_attention(
                q, k, v, sm_scale=c.head_dim**-0.5, sliding_window=c.sliding_window
            )
            return layer.finish(x, attn)

        x = layer_stack.run(self.layers, self.embed_tokens(tokens), body, scanned=c.scan_layers)
        return self.logits(self.norm(x))


def duplicate_kv_heads(model: Any, factor: int) -> None:
    """Repeats every KV head of `model` `factor` times, in place: K/V projection j
    becomes heads `j * factor .. (j + 1) * factor - 1`, so query head i still reads its
    own KV head (i // (Hq / Hkv)) and the outputs do not change. `config.num_kv_heads`
    becomes `num_kv_heads * factor`, which the KV cache is then sized by. For a model
    axis that outnumbers (or does not divide) the KV heads: each device then holds
    only the heads its query heads read (`paxkv.sharding.shardings.kv_head_factor`).
    Any model whose layers hold an `Attention` as `self_attn` (a k norm is per head
    dim, shared by the heads, so it stays).
    """
    c = model.config
    if factor == 1:
        return
    if c.num_heads % (c.num_kv_heads * factor):
        raise ValueError(
            f"cannot duplicate {c.num_kv_heads} KV heads {factor}x for {c.num_heads} "
            "query heads: the query heads must divide evenly among the KV heads"
        )
    d = c.head_dim
    for layer in layer_stack.layer_modules(model):
        attn = layer.self_attn
        for proj in (attn.k_proj, attn.v_proj):
            kernel = proj.kernel.get_value()  # [h, Hkv * D], stacked: [L, h, Hkv * D]
            lead = kernel.shape[:-1]
            heads = kernel.reshape(*lead, c.num_kv_heads, d)
            proj.kernel.set_value(jnp.repeat(heads, factor, axis=-2).reshape(*lead, -1))
            if proj.bias is not None:
                bias = proj.bias.get_value()  # [Hkv * D], stacked: [L, Hkv * D]
                heads = bias.reshape(*bias.shape[:-1], c.num_kv_heads, d)
                proj.bias.set_value(
                    jnp.repeat(heads, factor, axis=-2).reshape(*bias.shape[:-1], -1)
                )
        attn.num_kv_heads = c.num_kv_heads * factor
    model.config = c.replace(num_kv_heads=c.num_kv_heads * factor)


def init_cache(
    config: ModelConfig, *, num_pages: int, page_size: int, kv_cache_dtype: str = "auto"
) -> PagedKVCache:
    """A zeroed paged cache for every layer; "auto" pages are in `config.dtype`."""
    return PagedKVCache.for_model(config, num_pages, page_size, kv_cache_dtype)
