"""The dimensions of a decoder that the mesh arithmetic and the capacity planner read.
Plain Python, no JAX.

`ModelShape` is the part of every family's config (`paxkv.models.family.ModelConfig`
extends it) that sizes the weights and the KV cache, so `paxkv.planner.capacity` and
`paxkv.planner.parameters` count bytes from a config without importing a model.
"""

from __future__ import annotations

from typing import Protocol


class ModelShape(Protocol):
    """A decoder's dimensions and dtype.

    Optional, read with a default where present: `attention_bias` (q/k/v biases: Qwen2,
    gpt-oss; default False), `attention_sinks` (gpt-oss: an o bias and a sink per query
    head), `norm_params_per_layer` (default two RMSNorms of hidden_size); for a mixture
    of experts `num_experts` and `num_experts_per_tok` (default: a dense MLP; with
    experts, `intermediate_size` is each expert's), and `model_type` "gpt_oss" for
    biased experts and router.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    dtype: str
