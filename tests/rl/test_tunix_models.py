"""The Tunix-to-paxkv mapping (`paxkv.rl.tunix_models`) without Tunix: leaves renamed and
heads merged as the table says, and what cannot be mapped named (the parity with
Tunix's own forward: test_tunix_rollout.py, in the tunix venv)."""

import dataclasses

import numpy as np
import pytest

from paxkv.rl import tunix_models


class Llama3:  # what a Tunix Llama 3 looks like from outside: its module and config
    __module__ = "tunix.models.llama3.model"

    @dataclasses.dataclass
    class Config:
        num_layers: int = 1
        vocab_size: int = 11
        embed_dim: int = 8
        hidden_dim: int = 12
        num_heads: int = 2
        head_dim: int = 4
        num_kv_heads: int = 1
        rope_theta: int = 500_000
        norm_eps: float = 1e-5
        weight_tying: bool = True


def _leaves():
    rng = np.random.default_rng(0)
    shapes = {
        ("embedder", "input_embedding"): (11, 8),
        ("layers", 0, "attn", "q_proj", "w"): (8, 2, 4),
        ("layers", 0, "attn", "k_proj", "w"): (8, 1, 4),
        ("layers", 0, "attn", "v_proj", "w"): (8, 1, 4),
        ("layers", 0, "attn", "o_proj", "w"): (2, 4, 8),
        ("layers", 0, "input_layernorm", "w"): (8,),
        ("layers", 0, "post_attention_layernorm", "w"): (8,),
        ("layers", 0, "mlp", "gate_proj", "kernel"): (8, 12),
        ("layers", 0, "mlp", "up_proj", "kernel"): (8, 12),
        ("layers", 0, "mlp", "down_proj", "kernel"): (12, 8),
        ("final_norm", "w"): (8,),
    }
    return [(p, rng.normal(size=s).astype(np.float32)) for p, s in shapes.items()]


def test_a_llama3_actor_maps_onto_paxkv_llama():
    family = tunix_models.family_of(Llama3())
    config = family.config(Llama3.Config(), dtype="float32", max_position_embeddings=64)
    assert (config.hidden_size, config.intermediate_size, config.head_dim) == (8, 12, 4)
    assert config.tie_word_embeddings and config.rope_theta == 1e6  # what Tunix 0.1.7 applies
    leaves = dict(_leaves())
    tree = family.paxkv_tree(leaves.items())
    attn = tree["layers"][0]["self_attn"]
    q = leaves[("layers", 0, "attn", "q_proj", "w")]
    o = leaves[("layers", 0, "attn", "o_proj", "w")]
    # Head h's feature j is column h * head_dim + j, as paxkv's (and HF's) projections hold it.
    assert np.array_equal(attn["q_proj"]["kernel"][:, 1 * 4 + 3], q[:, 1, 3])
    assert np.array_equal(attn["o_proj"]["kernel"][1 * 4 + 2], o[1, 2])
    assert tree["embed_tokens"]["embedding"] is leaves[("embedder", "input_embedding")]
    assert tree["norm"]["weight"] is leaves[("final_norm", "w")]
    assert sorted(tree) == ["embed_tokens", "layers", "norm"]


def test_what_cannot_be_mapped_is_named():
    family = tunix_models.family_of(Llama3())
    lora = (("layers", 0, "attn", "q_proj", "w_lora_a"), np.zeros((8, 2), np.float32))
    with pytest.raises(ValueError, match=r"llama3 leaf layers/0/attn/q_proj/w_lora_a \(8, 2\)"):
        family.paxkv_tree([*_leaves(), lora])

    class Gemma:
        __module__ = "tunix.models.gemma.model"

    with pytest.raises(ValueError, match=r"tunix\.models\.gemma\.model\.Gemma: paxkv maps"):
        tunix_models.family_of(Gemma())
    moe = dataclasses.replace(Llama3.Config())
    moe.num_experts = 8
    with pytest.raises(ValueError, match="num_experts=8"):
        family.config(moe, dtype="float32", max_position_embeddings=64)
