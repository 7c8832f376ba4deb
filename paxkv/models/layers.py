"""The layers every model family shares, in Flax NNX: RoPE, the projections, RMSNorm,
the gated MLP, the GQA attention block, dense attention (the oracle) and the sharding
rules of their parameters.

Parameter names follow Hugging Face's (`self_attn.q_proj`, `mlp.gate_proj`, ...), so
`family.hf_name` maps checkpoints by rule. Linear kernels are stored `[in, out]` (NNX's
layout), the transpose of Hugging Face's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paxkv.sharding.shardings import COLUMN, ROW, SplitRule

from . import layer_stack, lora, quantized_weights
from .decoder_config import DecoderConfig
from .llama_config import Llama3RopeScaling

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


def yarn_inv_freq(
    head_dim: int,
    rope_theta: float,
    *,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool,
) -> tuple[np.ndarray, float]:  # f64[D // 2], the attention factor
    """YaRN's RoPE inverse frequencies (gpt-oss), and its attention factor.

    Dimensions that turn more than `beta_fast` times over the original context keep
    their frequency, those that turn fewer than `beta_slow` times are divided by
    `factor`, with a linear ramp between (its ends floored and ceiled when `truncate`);
    queries and keys are then scaled by `0.1 ln(factor) + 1` (the attention factor; so
    the attention logits by its square). Computed on the host in float64.
    """
    dims = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    extrapolation = rope_theta**-dims
    interpolation = extrapolation / factor

    def correction_dim(rotations: float) -> float:
        turns = original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # no singular ramp
    ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


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
    sinks: jax.Array | None = None,  # [Hq]
) -> jax.Array:  # [L, Hq, D], q.dtype
    """Plain causal softmax attention of one sequence, in float32 at HIGHEST precision.

    Query i sees keys `j <= i`, and with a window W only `j > i - W`. Logits are
    `sm_scale * q.k`, capped at `soft_cap * tanh(logits / soft_cap)` when it is set.
    With `sinks`, head h's softmax has one more logit, `sinks[h]`, whose weight is dropped
    (attention sinks, as gpt-oss defines them).
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
    s = jnp.where(mask, s, -jnp.inf)
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1)
    else:  # the sink as one more column, dropped after the softmax
        sink = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], (*s.shape[:2], 1))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("hqk,khd->qhd", p, v, precision=hi).astype(q.dtype)


def matmul_precision(config: DecoderConfig) -> jax.lax.Precision:
    """HIGHEST for float32 models (the test dtype: exact on TPU and GPU too), else DEFAULT."""
    if config.dtype == "float32":
        return jax.lax.Precision.HIGHEST
    return jax.lax.Precision.DEFAULT


def linear(config: DecoderConfig, d_in: int, d_out: int, *, bias: bool, rngs) -> nnx.Linear:
    """A `[d_in, d_out]` projection in the config's dtype, normal(0.02) initialised."""
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=bias,
        dtype=config.dtype,
        param_dtype=config.dtype,
        precision=matmul_precision(config),
        kernel_init=nnx.initializers.normal(INIT_STD),
        rngs=rngs,
    )


def project(proj: nnx.Module, x: jax.Array, lora_slots: jax.Array | None) -> jax.Array:
    """A projection of `x [T, in]` -> `[T, out]`: `proj(x)`, or its quantized matmul for
    quantized weights (`paxkv.models.quantized_weights`), plus each row's LoRA adapter
    when `lora_slots` (i32[T], each row's slot) is given and `proj` has slots
    (`paxkv.models.lora`)."""
    quantized = hasattr(proj, "kernel_scale")
    y = quantized_weights.quantized_matmul(proj, x) if quantized else proj(x)
    a = getattr(proj, "lora_a", None)
    if lora_slots is None or a is None:
        return y
    method = proj.lora_method
    if method == "auto":  # the step's rows are static: one choice per compiled shape
        method = "gather" if x.shape[0] <= lora.GATHER_MAX_ROWS else "ragged"
    delta = lora.lora_delta(x, a[...], proj.lora_b[...], lora_slots, method, proj.precision)
    return (y.astype(jnp.float32) + delta).astype(y.dtype)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:  # f32, x's shape
    """`x / sqrt(mean(x^2) + eps)` over the last axis, in float32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def embedding(config: DecoderConfig, *, rngs: nnx.Rngs) -> nnx.Embed:
    """The token embedding `[vocab, hidden]`, normal(0.02) initialised."""
    return nnx.Embed(
        config.vocab_size,
        config.hidden_size,
        dtype=config.dtype,
        param_dtype=config.dtype,
        embedding_init=nnx.initializers.normal(INIT_STD),
        rngs=rngs,
    )


def lm_head(config: DecoderConfig, *, rngs: nnx.Rngs) -> nnx.Linear | None:
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
        precision=matmul_precision(model.config),
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

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs, activation: str = "silu"):
        h, m = config.hidden_size, config.intermediate_size
        self.gate_proj = linear(config, h, m, bias=False, rngs=rngs)
        self.up_proj = linear(config, h, m, bias=False, rngs=rngs)
        self.down_proj = linear(config, m, h, bias=False, rngs=rngs)
        self.activation = activation  # a name of ACTIVATIONS (static)

    def __call__(self, x: jax.Array, lora: jax.Array | None = None) -> jax.Array:
        """`down(act(gate(x)) * up(x))`, each projection with its rows' adapters (`lora`)."""
        act = ACTIVATIONS[self.activation]
        h = act(project(self.gate_proj, x, lora)) * project(self.up_proj, x, lora)
        return project(self.down_proj, h, lora)


class Attention(nnx.Module):
    """GQA projections and RoPE; the attention itself is the caller's (paged or dense).

    `bias` puts biases on q/k/v (Qwen2), `out_bias` on o (gpt-oss). `qk_norm`, when given, makes the norm of
    every q and of every k head over the head dim (`q_norm`, `k_norm`: Qwen3, Gemma 3),
    applied after the projection and before RoPE. `sinks` gives the layer attention
    sinks (gpt-oss): a learned logit per query head, `self_attn.sinks [Hq]` (Hugging
    Face's name), that the caller passes to the attention as `attention_sinks()`.
    """

    def __init__(
        self,
        config: DecoderConfig,
        *,
        rngs: nnx.Rngs,
        bias: bool = False,
        qk_norm: Callable[[int], nnx.Module] | None = None,
        sinks: bool = False,
        out_bias: bool = False,
    ):
        h, d = config.hidden_size, config.head_dim
        self.q_proj = linear(config, h, config.num_heads * d, bias=bias, rngs=rngs)
        self.k_proj = linear(config, h, config.num_kv_heads * d, bias=bias, rngs=rngs)
        self.v_proj = linear(config, h, config.num_kv_heads * d, bias=bias, rngs=rngs)
        self.o_proj = linear(config, config.num_heads * d, h, bias=out_bias, rngs=rngs)
        self.q_norm = None if qk_norm is None else qk_norm(d)
        self.k_norm = None if qk_norm is None else qk_norm(d)
        init = nnx.initializers.normal(INIT_STD)
        self.sinks = (
            nnx.Param(init(rngs.params(), (config.num_heads,), config.dtype)) if sinks else None
        )
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d

    def qkv(
        self,
        x: jax.Array,
        positions: jax.Array,
        inv_freq: np.ndarray,
        lora: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`x [T, hidden]` -> q `[T, Hq, D]`, k and v `[T, Hkv, D]`, q and k rotated; each
        projection with its rows' adapters (`lora`)."""
        t = x.shape[0]
        q = project(self.q_proj, x, lora).reshape(t, self.num_heads, self.head_dim)
        k = project(self.k_proj, x, lora).reshape(t, self.num_kv_heads, self.head_dim)
        v = project(self.v_proj, x, lora).reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def attention_sinks(self) -> jax.Array | None:  # f32[Hq]
        """The layer's attention sinks as float32 (the attention's `sinks=`), or None."""
        return None if self.sinks is None else self.sinks[...].astype(jnp.float32)

    def out(self, attn: jax.Array, lora: jax.Array | None = None) -> jax.Array:
        """`attn [T, Hq, D]` -> `[T, hidden]`, with its rows' adapters (`lora`)."""
        flat = attn.reshape(attn.shape[0], self.num_heads * self.head_dim)
        return project(self.o_proj, flat, lora)


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
            # Per output column: the bias ([Hkv * D]) and a quantized kernel's scale
            # ([1, Hkv * D]; stacked: a leading [L]).
            for column in (proj.bias, getattr(proj, "kernel_scale", None)):
                if column is not None:
                    value = column.get_value()
                    heads = value.reshape(*value.shape[:-1], c.num_kv_heads, d)
                    column.set_value(
                        jnp.repeat(heads, factor, axis=-2).reshape(*value.shape[:-1], -1)
                    )
        attn.num_kv_heads = c.num_kv_heads * factor
    model.config = c.replace(num_kv_heads=c.num_kv_heads * factor)
    model.kv_head_repeats = getattr(model, "kv_head_repeats", 1) * factor


class CausalLM(nnx.Module):
    """What every family's decoder holds alike: `embed_tokens`, `num_layers` layers made
    by `make_layer()` (stacked and scanned, or one module each: `layer_stack.hold`), the
    final `norm` (`norm_class(hidden_size)`), `lm_head` (None: tied to the embedding),
    and `mesh`, a jax Mesh (static): attention (and experts) run per shard of its
    `model` axis; set by `paxkv.sharding.shardings.shard_engine_state`, with the
    weights and pages placed to match. Families add the paged step and the oracle."""

    def __init__(
        self,
        config: DecoderConfig,
        make_layer: Callable[[], nnx.Module],
        *,
        norm_class: type = RMSNorm,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.embed_tokens = embedding(config, rngs=rngs)
        self.layers = layer_stack.hold([make_layer() for _ in range(config.num_layers)], config)
        self.norm = norm_class(config.hidden_size, eps=config.rms_norm_eps, dtype=config.dtype)
        self.lm_head = lm_head(config, rngs=rngs)
        self.mesh = None

    def duplicate_kv_heads(self, factor: int) -> None:
        """Repeats every KV head `factor` times, in place (see `duplicate_kv_heads`)."""
        duplicate_kv_heads(self, factor)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """`hidden [N, hidden]` -> `f32[N, vocab]`, through lm_head or the tied embedding."""
        return output_logits(self, hidden)

    def quantize_weight(self, w: Any) -> tuple[jax.Array, jax.Array]:
        """`w [..., in, out]` quantized as this model's weights are (`config.quantization`):
        (values, scale per output channel)."""
        return quantized_weights.quantize_weight(jnp.asarray(w), mode=self.config.quantization)

    def add_lora_slots(self, max_loras: int, max_rank: int, method: str = "auto") -> None:
        """Gives the projections LoRA adapter slots, in place (`paxkv.models.lora`)."""
        lora.add_lora_slots(self, max_loras, max_rank, method)

    def lora_slot_contents(self, adapter: Any, max_rank: int) -> dict[tuple, np.ndarray]:
        """One slot's contents by state path for `adapter`: a PEFT checkpoint directory,
        or `(state_dict, adapter_config)` (`paxkv.models.lora_checkpoint`), checked
        against this model (ValueError naming the file and field)."""
        from .lora_checkpoint import adapter_from_state_dict, read_adapter

        config = lora.base_config(self)
        if isinstance(adapter, str):
            read = read_adapter(adapter, config, max_rank=max_rank)
        else:
            state_dict, adapter_config = adapter
            read = adapter_from_state_dict(state_dict, adapter_config, config, max_rank=max_rank)
        missing = set(read.targets) - set(lora.supported_targets(self))
        if missing:
            raise ValueError(
                f"{read.source}: target modules {sorted(missing)} are not LoRA targets of "
                f"this model (its targets: {list(lora.supported_targets(self))})"
            )
        return lora.slot_contents(self, read.weights)


# Megatron-style tensor parallelism over these layers' parameters (see
# `paxkv.sharding.shardings`): attention by KV heads, the MLP by its hidden features,
# the embedding and the LM head by the vocabulary.
SHARDING_RULES = (
    SplitRule(("self_attn", "q_proj"), COLUMN, "num_kv_heads"),
    SplitRule(("self_attn", "k_proj"), COLUMN, "num_kv_heads"),
    SplitRule(("self_attn", "v_proj"), COLUMN, "num_kv_heads"),
    SplitRule(("self_attn", "o_proj"), ROW, "num_kv_heads"),
    SplitRule(("mlp", "gate_proj"), COLUMN, "intermediate_size"),
    SplitRule(("mlp", "up_proj"), COLUMN, "intermediate_size"),
    SplitRule(("mlp", "down_proj"), ROW, "intermediate_size"),
    SplitRule(("embed_tokens",), ROW, "vocab_size"),
    SplitRule(("lm_head",), COLUMN, "vocab_size"),
)
