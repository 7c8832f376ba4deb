"""Qwen3 (the Llama family with q/k norms): transformers' logits, the paged path against
the dense oracle, and config parsing."""

import json

import numpy as np
import pytest
from hf_reference import assert_matches_transformers
from test_gemma import check_engine_matches_dense
from test_models import check_paged_matches_dense, dense_logits, perturbed_model

from paxkv.models import LlamaConfig, load_model
from paxkv.models.llama_config import QWEN3_0_6B, QWEN3_8B, TINY_QWEN3

# The tiny shape; a sliding window is Mistral's, not Qwen3's, so the windows here are full.
QWEN3 = TINY_QWEN3


def test_logits_match_transformers(tmp_path):
    model = assert_matches_transformers(QWEN3, tmp_path)
    attn = model.layers[0].self_attn
    assert attn.q_norm.weight[...].shape == attn.k_norm.weight[...].shape == (QWEN3.head_dim,)
    assert attn.q_proj.bias is None and attn.o_proj.bias is None


def test_paged_prefill_and_decode_match_dense():
    check_paged_matches_dense(perturbed_model(QWEN3))


def test_engine_greedy_matches_dense():
    check_engine_matches_dense(perturbed_model(QWEN3))


def test_kv_head_duplication_keeps_the_outputs():
    model = perturbed_model(QWEN3)
    tokens = list(range(3, 30))
    before = dense_logits(model, tokens)
    model.duplicate_kv_heads(2)
    assert model.config.num_kv_heads == 4
    np.testing.assert_allclose(dense_logits(model, tokens), before, rtol=1e-5, atol=1e-5)
    check_paged_matches_dense(model)


def test_tiny_qwen3_preset_comes_with_the_byte_tokenizer():
    config, _, tokenizer = load_model("tiny-qwen3")
    assert config is TINY_QWEN3 and tokenizer is not None
    assert config.layer_sliding_windows == (None, None)


# config.json as published: Qwen/Qwen3-0.6B (transformers 4) and Qwen3-8B as transformers
# 5 writes it (`rope_parameters`, `layer_types`, `dtype`).
QWEN3_0_6B_HF = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_8B_HF_5 = {
    k: v for k, v in QWEN3_0_6B_HF.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")
} | {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "max_window_layers": 36,
    "tie_word_embeddings": False,
    "layer_types": ["full_attention"] * 36,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    "dtype": "bfloat16",
    "transformers_version": "5.24.0",
}


@pytest.mark.parametrize(
    ("hf", "preset"),
    [(QWEN3_0_6B_HF, QWEN3_0_6B), (QWEN3_8B_HF_5, QWEN3_8B)],
    ids=["qwen3-0.6b", "qwen3-8b-transformers5"],
)
def test_from_hf_parses_real_configs(hf, preset):
    assert LlamaConfig.from_hf(hf) == preset
    assert LlamaConfig.from_hf(json.loads(json.dumps(preset.to_hf()))) == preset
    # Qwen3's head_dim is its own: without the field, transformers' default 128.
    no_head_dim = {k: v for k, v in hf.items() if k != "head_dim"}
    assert LlamaConfig.from_hf(no_head_dim).head_dim == 128


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"attention_bias": True}, "qwen3 attention_bias=True"),
        ({"use_sliding_window": True}, "qwen3 use_sliding_window=True"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        ({"num_key_value_heads": 8.0}, "'num_key_value_heads' must be an integer, got 8.0"),
    ],
)
def test_from_hf_rejects_what_it_cannot_run(change, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(QWEN3_0_6B_HF | change)


def test_to_hf_has_no_type_for_two_variants():
    with pytest.raises(ValueError, match="attention_bias with qk_norm"):
        QWEN3.replace(attention_bias=True).to_hf()
    assert QWEN3.to_hf()["model_type"] == "qwen3"
