"""gpt-oss: transformers' logits and routing (attention sinks, YaRN, alternating windows,
the clamped SwiGLU experts), greedy generation against transformers', the paged path
against the dense oracle, scanned layers, and config parsing."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import PROMPT_LEN, greedy, write_checkpoint
from test_gemma import check_engine_matches_dense
from test_models import check_paged_matches_dense, perturbed_model
from test_moe import _hf_router_choice

from paxkv import LLM, SamplingParams
from paxkv.models import GptOssConfig, layer_stack, load_hf_checkpoint, load_model
from paxkv.models.gpt_oss_config import FULL, GPT_OSS_20B, SLIDING, TINY_GPT_OSS
from paxkv.planner import parameters

WINDOW = 8  # shorter than the prompts: the sliding layers' windows matter
GPT_OSS = TINY_GPT_OSS.replace(sliding_window=WINDOW)


@pytest.mark.parametrize("yarn", [True, False], ids=["yarn", "plain-rope"])
def test_logits_and_routing_match_transformers(yarn, tmp_path):
    import torch

    config = GPT_OSS if yarn else GPT_OSS.replace(rope_scaling=None)
    reference = write_checkpoint(config, tmp_path)
    loaded, model = load_hf_checkpoint(tmp_path)
    assert loaded == config
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, PROMPT_LEN)
    with torch.no_grad():
        expected = reference(torch.tensor(tokens)[None]).logits[0].numpy()
    ids = jnp.asarray(tokens, jnp.int32)
    got, routing = model.dense_logits(ids, return_routing=True)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=1e-4)
    ranked = _hf_router_choice(reference, tokens)
    for layer in range(config.num_layers):
        np.testing.assert_array_equal(np.asarray(routing[layer]), ranked[layer][:, :2])
    # The sinks are in force: without them the logits differ.
    attn = model.layers[0].self_attn
    assert attn.sinks.get_value().shape == (config.num_heads,) and attn.o_proj.bias is not None
    attn.sinks.set_value(jnp.full_like(attn.sinks.get_value(), -jnp.inf))
    assert np.abs(np.asarray(model.dense_logits(ids)) - expected).max() > 1e-3


def test_layers_alternate_window_and_full():
    assert GPT_OSS.layer_sliding_windows == (WINDOW, None)
    assert GPT_OSS_20B.layer_sliding_windows[:4] == (128, None, 128, None)
    assert layer_stack.period(layer_stack.kinds(GPT_OSS_20B)) == 2


def test_llm_greedy_matches_transformers(tmp_path):
    reference = write_checkpoint(GPT_OSS, tmp_path)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 256, n).tolist() for n in (1, 9, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = [greedy(reference, p, params.max_tokens) for p in prompts]
    llm = LLM(model=str(tmp_path), warmup=False, num_pages=64, page_size=8, max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_paged_prefill_and_decode_match_dense():
    check_paged_matches_dense(perturbed_model(GPT_OSS))


@pytest.mark.parametrize("hybrid", [False, True], ids=["uniform", "hybrid"])
def test_engine_greedy_matches_dense(hybrid):
    check_engine_matches_dense(perturbed_model(GPT_OSS), hybrid_kv_cache=hybrid)


def test_scanned_layers_match_the_loop():
    model = perturbed_model(
        GPT_OSS.replace(num_layers=5, layer_types=(SLIDING, FULL) * 2 + (SLIDING,))
    )
    scanned = layer_stack.with_scan_layers(model, True)
    assert (scanned.layers.period, scanned.layers.repeats, len(scanned.layers.tail)) == (2, 2, 1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, 30), jnp.int32)
    want, routes = model.dense_logits(tokens, return_routing=True)
    got, scanned_routes = scanned.dense_logits(tokens, return_routing=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    np.testing.assert_array_equal(scanned_routes, routes)


# config.json as published: openai/gpt-oss-20b (its MXFP4 experts aside).
GPT_OSS_20B_HF = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}


def test_from_hf_parses_the_published_config():
    assert GptOssConfig.from_hf(GPT_OSS_20B_HF) == GPT_OSS_20B.replace(dtype="float32")
    # The published checkpoints' MXFP4 experts are dequantized as they load.
    mxfp4 = GPT_OSS_20B_HF | {"quantization_config": {"quant_method": "mxfp4"}}
    assert GptOssConfig.from_hf(mxfp4) == GPT_OSS_20B.replace(dtype="float32")
    assert GptOssConfig.from_hf(json.loads(json.dumps(GPT_OSS_20B.to_hf()))) == GPT_OSS_20B
    # Transformers' defaults when the fields are missing: alternating layers, YaRN.
    bare = {"model_type": "gpt_oss", "num_hidden_layers": 4}
    assert GptOssConfig.from_hf(bare).layer_types == (SLIDING, FULL) * 2


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (  # MXFP4 is read (tests/models/test_mxfp4.py); other methods are not
            {"quantization_config": {"quant_method": "awq"}},
            "quant_method='awq': of quantized gpt-oss checkpoints only MXFP4",
        ),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
        (
            {"rope_scaling": dict(GPT_OSS_20B_HF["rope_scaling"], attention_factor=1.5)},
            "rope_scaling.attention_factor=1.5",
        ),
        ({"layer_types": ["sliding_attention"] * 3}, "must give 24 layers"),
        ({"swiglu_limit": 0}, "swiglu_limit=0.0 must be a finite number > 0"),
    ],
)
def test_from_hf_rejects_what_it_cannot_run(change, match):
    with pytest.raises(ValueError, match=match):
        GptOssConfig.from_hf(GPT_OSS_20B_HF | change)


def test_planner_counts_the_published_size():
    # 20.9B parameters; 3.6B active besides the embedding (OpenAI's figures).
    assert parameters.num_parameters(GPT_OSS_20B) == 20_914_757_184
    embedding = GPT_OSS_20B.vocab_size * GPT_OSS_20B.hidden_size
    assert parameters.active_parameters(GPT_OSS_20B) - embedding == 3_608_307_264


def test_tiny_preset_comes_with_the_byte_tokenizer():
    config, model, tokenizer = load_model("tiny-gpt-oss")
    assert config is TINY_GPT_OSS and tokenizer is not None
    assert type(model).__name__ == "MoeForCausalLM"
