"""Parameter counts of a decoder, in all and on each device of a mesh, and the bytes
of its weights. Plain Python and NumPy, no JAX: every count comes from the config's
fields (`paxkv.models.decoder_config.DecoderConfig`).

A family whose layers hold other tensors than the shared layers' (`paxkv.models.layers`)
says so in its config, read here where present: `attention_bias` (q/k/v biases: Qwen2,
gpt-oss; default False), `attention_sinks` (gpt-oss: an o bias and a sink per query
head), `num_experts` and `num_experts_per_tok` (a mixture of experts, whose
`intermediate_size` is each expert's; default a dense MLP), `model_type` "gpt_oss"
(biased experts and router); and `norm_params_per_layer`.
`tests/sharding/test_sharding.py::test_plan_counts_the_sharded_parameters` checks the
counts of every preset against the model's own arrays.

    model = paxkv.models.PRESETS["llama-3.1-8b"]
    num_parameters(model), weights_bytes(model, mesh=MeshShape(model=4))
"""

from __future__ import annotations

import numpy as np

from paxkv.models.decoder_config import DecoderConfig
from paxkv.sharding.mesh_shape import ONE_DEVICE, MeshShape


def num_parameters(model: DecoderConfig) -> int:
    """Parameters of a decoder: embedding, layers, final norm, LM head."""
    h, d = model.hidden_size, model.head_dim
    q, kv = model.num_heads * d, model.num_kv_heads * d
    attention = h * q + 2 * h * kv + q * h
    if getattr(model, "attention_bias", False):  # Qwen2: q/k/v biases, none on o_proj
        attention += q + 2 * kv
    layer = (
        attention + _replicated(model) + _mlp(model) + _router(model) + model.norm_params_per_layer
    )
    embedding = model.vocab_size * h
    lm_head = 0 if model.tie_word_embeddings else model.vocab_size * h
    return embedding + model.num_layers * layer + h + lm_head


def _num_experts(model: DecoderConfig) -> int:
    """Experts per layer; 0 for a dense MLP."""
    return getattr(model, "num_experts", 0)


def _biased_experts(model: DecoderConfig) -> bool:
    """Whether the experts and the router have biases (gpt-oss)."""
    return getattr(model, "model_type", None) == "gpt_oss"


def _mlp(model: DecoderConfig) -> int:
    """Parameters of one layer's gated MLP, or of all its experts' MLPs (with gpt-oss's
    biases on their gate and up projections; split over a mesh as the experts are)."""
    h, i, e = model.hidden_size, model.intermediate_size, _num_experts(model)
    per_expert = 3 * h * i + (2 * i if _biased_experts(model) else 0)
    return per_expert * max(e, 1)


def _router(model: DecoderConfig) -> int:
    """Parameters of one layer's router (none for a dense MLP), and of the experts'
    down-projection biases (gpt-oss's): replicated on a mesh."""
    e, h = _num_experts(model), model.hidden_size
    return h * e + (e + e * h if _biased_experts(model) else 0)


def _expert_out_biases(model: DecoderConfig) -> int:
    """Parameters of one layer's experts' down-projection biases (gpt-oss's)."""
    return _num_experts(model) * model.hidden_size if _biased_experts(model) else 0


def _replicated(model: DecoderConfig) -> int:
    """Attention parameters of one layer that every device holds: gpt-oss's o bias and
    sinks."""
    if not getattr(model, "attention_sinks", False):
        return 0
    return model.hidden_size + model.num_heads


def expert_parameters(model: DecoderConfig) -> int:
    """Parameters of every layer's experts, biases included (0 for a dense model)."""
    if not _num_experts(model):
        return 0
    return model.num_layers * (_mlp(model) + _expert_out_biases(model))


def active_parameters(model: DecoderConfig) -> int:
    """Parameters one token runs through: all of them for a dense model; for a mixture
    of experts, all but the experts its router does not pick (k of E per layer)."""
    e = _num_experts(model)
    if not e:
        return num_parameters(model)
    unused = expert_parameters(model) * (e - model.num_experts_per_tok) // e
    return num_parameters(model) - unused


def num_parameters_per_device(model: DecoderConfig, mesh: MeshShape) -> int:
    """Parameters each device of `mesh` holds, by `paxkv.sharding`'s rules.

    Attention splits over the model axis by KV head, the MLP by intermediate feature,
    experts by expert or else by their intermediate feature, the embedding and LM head
    by vocabulary entry, each only when it divides; norms, routers and o/down biases are
    replicated.
    """
    h, d, m = model.hidden_size, model.head_dim, mesh.model
    q, kv = model.num_heads * d, model.num_kv_heads * d
    attention = h * q + 2 * h * kv + q * h
    if getattr(model, "attention_bias", False):
        attention += q + 2 * kv
    if mesh.splits(model.num_kv_heads):
        attention //= m  # every attention tensor has a head axis
    mlp = _mlp(model)
    e = _num_experts(model)
    if (e and mesh.splits(e)) or mesh.splits(model.intermediate_size):
        mlp //= m
    vocab = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    if mesh.splits(model.vocab_size):
        vocab //= m
    layer = attention + _replicated(model) + mlp + _router(model) + model.norm_params_per_layer
    return vocab + model.num_layers * layer + h


# Bytes of one stored value of each weight quantization (`paxkv.models.quantized_weights`).
QUANTIZED_ITEMSIZE = {"int8": 1, "fp8": 1, "w8a8-int8": 1, "w8a8-fp8": 1}


def quantized_parameters_per_device(model: DecoderConfig, mesh: MeshShape) -> tuple[int, int]:
    """`(weights, scales)`: the parameters weight quantization stores quantized on each
    device of `mesh` (every layer's attention projections and MLP or expert weights,
    split as `num_parameters_per_device` splits them), and the per-output-channel
    scales it adds (split with their outputs; replicated for the row-parallel o and
    down projections)."""
    h, d, m = model.hidden_size, model.head_dim, mesh.model
    q, kv = model.num_heads * d, model.num_kv_heads * d
    attention, attention_scales = h * q + 2 * h * kv + q * h, q + 2 * kv + h
    if mesh.splits(model.num_kv_heads):
        attention, attention_scales = attention // m, (q + 2 * kv) // m + h
    i, e = model.intermediate_size, max(_num_experts(model), 1)
    mlp, mlp_scales = 3 * h * i * e, (2 * i + h) * e
    if _num_experts(model) and mesh.splits(_num_experts(model)):
        mlp, mlp_scales = mlp // m, mlp_scales // m
    elif mesh.splits(i):
        mlp, mlp_scales = mlp // m, (2 * i // m + h) * e
    layers = model.num_layers
    return layers * (attention + mlp), layers * (attention_scales + mlp_scales)


def weights_bytes(
    model: DecoderConfig,
    dtype: str | None = None,
    *,
    mesh: MeshShape = ONE_DEVICE,
    quantization: str | None = None,
) -> int:
    """Bytes of the parameters in `dtype` (None: the model's) on each device of `mesh`,
    with the weights `quantization` (None: the model's own, `config.quantization`)
    stores quantized taking `QUANTIZED_ITEMSIZE` bytes each, and their scales `dtype`'s."""
    itemsize = np.dtype(dtype or model.dtype).itemsize
    total = num_parameters_per_device(model, mesh) * itemsize
    mode = quantization or getattr(model, "quantization", None)
    if not mode:
        return total
    weights, scales = quantized_parameters_per_device(model, mesh)
    return total - weights * (itemsize - QUANTIZED_ITEMSIZE[mode]) + scales * itemsize
