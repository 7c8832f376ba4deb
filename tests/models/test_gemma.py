"""Gemma 2 and Gemma 3 (text): transformers' logits, the paged path against the dense
oracle (in one step, and through the engine token for token), and config parsing."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from engine.test_engine import _dense_greedy, _engine, _run
from hf_reference import PROMPT_LEN, assert_matches_transformers
from test_models import check_paged_matches_dense, perturbed_model

from paxkv import LLM, SamplingParams
from paxkv.models import ByteTokenizer, GemmaConfig, config_from_hf, load_model, read_hf_config
from paxkv.models.gemma_config import (
    FULL,
    GEMMA_2_2B,
    GEMMA_2_9B,
    GEMMA_3_1B,
    GEMMA_3_4B,
    SLIDING,
    TINY_GEMMA2,
    TINY_GEMMA3,
)

WINDOW = 8
# Small caps so that both soft-caps bite on O(1) logits.
GEMMA2 = TINY_GEMMA2.replace(
    sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0
)
GEMMA3 = TINY_GEMMA3.replace(sliding_window=WINDOW)


@pytest.mark.parametrize("config", [GEMMA2, GEMMA3], ids=["gemma2", "gemma3"])
def test_logits_match_transformers(config, tmp_path):
    model = assert_matches_transformers(config, tmp_path)
    # The window is in force: past it, the rows differ from the same weights without it.
    tokens = np.random.default_rng(1).integers(0, 256, PROMPT_LEN)
    model.config = config.replace(sliding_window=4096)
    unwindowed = np.asarray(model.dense_logits(jnp.asarray(tokens, jnp.int32)))
    model.config = config
    windowed = np.asarray(model.dense_logits(jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_array_equal(windowed[:WINDOW], unwindowed[:WINDOW])
    assert np.abs(windowed[WINDOW:] - unwindowed[WINDOW:]).max() > 1e-3


def test_layer_windows_rope_and_scale():
    assert TINY_GEMMA3.layer_sliding_windows == (128,) * 5 + (None,)
    assert GEMMA_2_2B.layer_sliding_windows[:4] == (4096, None, 4096, None)
    model = perturbed_model(GEMMA3)
    local, full = model.layer_inv_freq(0), model.layer_inv_freq(5)
    d = GEMMA3.head_dim
    np.testing.assert_allclose(local, 1e4 ** (-np.arange(0, d, 2) / d), rtol=1e-12)
    np.testing.assert_allclose(full, 1e6 ** (-np.arange(0, d, 2) / d) / 8.0, rtol=1e-12)


@pytest.mark.parametrize("config", [GEMMA2, GEMMA3], ids=["gemma2", "gemma3"])
def test_paged_prefill_and_decode_match_dense(config):
    # Prompts of 16, 1 and 21 tokens on 8-token pages, then a decode and a chunk: the
    # window (8) is shorter than two of them.
    check_paged_matches_dense(perturbed_model(config))


def check_engine_matches_dense(model, **engine_kw):
    """Greedy decoding through the engine equals the dense oracle token for token: prompts
    longer than the window and across page boundaries, prefill chunked by a small token
    budget, preemption in a small pool, and prefix caching on and off. `engine_kw` go to
    every engine."""
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in (1, 7, 8, 9, 30, 61)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [_dense_greedy(model, p, params.max_tokens)[0] for p in prompts]
    # A pool that fits the longest request, and little more: the others are preempted.
    kv = _engine(model, **engine_kw).scheduler.kv_cache_manager
    tight = max(kv.pages_at_submit(len(p) + params.max_tokens) for p in prompts) + 3
    runs = {
        "chunked": dict(max_num_batched_tokens=16, token_buckets=(16,)),
        "preempted": dict(num_pages=tight),
        "no prefix caching": dict(enable_prefix_caching=False),
    }
    for name, kw in runs.items():
        engine = _engine(model, **kw, **engine_kw)
        got = [o.outputs[0].token_ids for o in _run(engine, prompts, params)]
        assert got == expected, name
        if name == "preempted":
            assert engine.stats()["num_preemptions"] > 0
    # Prefix caching: a shared 27-token prefix (3 full pages) read back from the cache.
    prefix = rng.integers(0, vocab, 27).tolist()
    shared = [prefix + rng.integers(0, vocab, n).tolist() for n in (2, 9)]
    engine = _engine(model, **engine_kw)
    first = _run(engine, shared[:1], params)
    second = _run(engine, shared[1:], params)
    assert second[0].num_cached_tokens == 24
    for prompt, out in zip(shared, first + second, strict=True):
        assert out.outputs[0].token_ids == _dense_greedy(model, prompt, params.max_tokens)[0]


@pytest.mark.parametrize("hybrid", [False, True], ids=["uniform", "hybrid"])
@pytest.mark.parametrize("config", [GEMMA2, GEMMA3], ids=["gemma2", "gemma3"])
def test_engine_greedy_matches_dense(config, hybrid):
    check_engine_matches_dense(perturbed_model(config), hybrid_kv_cache=hybrid)


def test_llm_serves_tiny_gemma3_with_the_byte_tokenizer():
    config, model, tokenizer = load_model("tiny-gemma3")
    assert config is TINY_GEMMA3 and isinstance(tokenizer, ByteTokenizer)
    llm = LLM(
        model="tiny-gemma3",
        warmup=False,
        num_pages=64,
        page_size=8,
        max_model_len=128,
    )
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    (out,) = llm.generate(["def f(x):"], params, use_tqdm=False)
    prompt = list(b"def f(x):")
    assert out.outputs[0].token_ids == _dense_greedy(model, prompt, 5)[0]


# config.json as published (transformers 4): google/gemma-2-2b and google/gemma-3-1b-it.
GEMMA_2_2B_HF = {
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": 1,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "float32",
    "transformers_version": "4.42.4",
    "use_cache": True,
    "vocab_size": 256000,
}

GEMMA_3_1B_IT_HF = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "use_cache": True,
    "vocab_size": 262144,
}

# Gemma 3 4B's text decoder as transformers 5 writes it: layer kinds listed, RoPE per kind.
GEMMA_3_4B_TEXT_HF_5 = {
    "model_type": "gemma3_text",
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "num_hidden_layers": 34,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "layer_types": [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(34)],
    "sliding_window": 1024,
    "query_pre_attn_scalar": 256,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    },
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "max_position_embeddings": 131072,
    "vocab_size": 262208,
    "dtype": "bfloat16",
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
}


@pytest.mark.parametrize(
    ("hf", "preset"),
    [
        (GEMMA_2_2B_HF, GEMMA_2_2B.replace(dtype="float32")),
        (
            GEMMA_2_2B_HF
            | {
                "hidden_size": 3584,
                "intermediate_size": 14336,
                "num_hidden_layers": 42,
                "num_attention_heads": 16,
                "num_key_value_heads": 8,
                "torch_dtype": "bfloat16",
            },
            GEMMA_2_9B,
        ),
        (GEMMA_3_1B_IT_HF, GEMMA_3_1B),
        (GEMMA_3_4B_TEXT_HF_5, GEMMA_3_4B),
    ],
    ids=["gemma-2-2b", "gemma-2-9b", "gemma-3-1b-it", "gemma-3-4b-transformers5"],
)
def test_from_hf_parses_real_configs(hf, preset, tmp_path):
    assert GemmaConfig.from_hf(hf) == preset
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert read_hf_config(tmp_path) == preset


def test_older_spellings_and_defaults():
    old = {k: v for k, v in GEMMA_3_1B_IT_HF.items() if k != "sliding_window_pattern"}
    assert GemmaConfig.from_hf(old | {"sliding_window_pattern": 3}).layer_types[:3] == (
        SLIDING,
        SLIDING,
        FULL,
    )
    assert GemmaConfig.from_hf(old) == GEMMA_3_1B  # the pattern defaults to 6
    scaled = GemmaConfig.from_hf(
        old | {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 2e6}
    )
    assert (scaled.rope_scaling_factor, scaled.rope_theta, scaled.rope_local_theta) == (
        8.0,
        2e6,
        1e4,
    )
    # Missing soft-caps take Gemma 2's defaults; explicit nulls turn them off.
    bare = {k: v for k, v in GEMMA_2_2B_HF.items() if "softcapping" not in k}
    assert GemmaConfig.from_hf(bare) == GEMMA_2_2B.replace(dtype="float32")
    off = GemmaConfig.from_hf(
        GEMMA_2_2B_HF | {"attn_logit_softcapping": None, "final_logit_softcapping": None}
    )
    assert off.attn_logit_softcapping is None and off.final_logit_softcapping is None
    assert config_from_hf(GEMMA_2_2B_HF) == GemmaConfig.from_hf(GEMMA_2_2B_HF)


def test_to_hf_round_trips():
    for config in (GEMMA2, GEMMA3, GEMMA_3_4B, TINY_GEMMA3.replace(tie_word_embeddings=False)):
        assert GemmaConfig.from_hf(json.loads(json.dumps(config.to_hf()))) == config
    with pytest.raises(ValueError, match="single RoPE"):
        GEMMA2.replace(rope_local_theta=5.0).to_hf()


@pytest.mark.parametrize(
    ("base", "change", "match"),
    [
        (GEMMA_2_2B_HF, {"model_type": "gemma"}, "model_type='gemma'"),
        (GEMMA_2_2B_HF, {"model_type": "gemma3"}, "multimodal"),
        (GEMMA_2_2B_HF, {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        (GEMMA_2_2B_HF, {"attention_bias": True}, "attention_bias"),
        (GEMMA_2_2B_HF, {"query_pre_attn_scalar": 256.5}, "'query_pre_attn_scalar'.*256.5"),
        (GEMMA_2_2B_HF, {"sliding_window": "4096"}, "'sliding_window'.*'4096'"),
        (GEMMA_2_2B_HF, {"num_hidden_layers": 0}, "'num_hidden_layers' must be >= 1, got 0"),
        (GEMMA_2_2B_HF, {"attn_logit_softcapping": -1.0}, "'attn_logit_softcapping'.*-1.0"),
        (GEMMA_2_2B_HF, {"layer_types": [SLIDING] * 3}, "'layer_types'"),
        (GEMMA_2_2B_HF, {"rope_scaling": {"rope_type": "yarn"}}, "rope_type='yarn'"),
        (GEMMA_3_1B_IT_HF, {"attn_logit_softcapping": 50.0}, "does not apply it"),
        (GEMMA_3_1B_IT_HF, {"use_bidirectional_attention": True}, "bidirectional"),
        (
            GEMMA_3_1B_IT_HF,
            {"rope_parameters": {"global": {"rope_theta": 1.0}}},
            "'rope_parameters'.*'global'",
        ),
        (
            GEMMA_3_1B_IT_HF,
            {"rope_parameters": {FULL: {"rope_type": "linear"}}},
            r"missing field 'rope_parameters\.full_attention\.factor'",
        ),
        (GEMMA_3_1B_IT_HF, {"head_dim": None, "hidden_size": None}, "missing field 'hidden_size'"),
    ],
)
def test_from_hf_rejects_bad_values_naming_the_field(base, change, match):
    with pytest.raises(ValueError, match=match):
        GemmaConfig.from_hf(base | change)


def test_window_groups_hold_only_their_window():
    """Tiny Gemma 3 (5 window layers of 8, one global) on 8-token pages: after a 61-token
    prefill, a decode step's window groups hold the 2 pages its window touches, the
    global group all 8."""
    engine = _engine(perturbed_model(GEMMA3), page_size=8)
    assert engine.scheduler.kv_cache_manager.kv_groups.num_groups == 6
    prompt = np.random.default_rng(3).integers(0, 256, 61).tolist()
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4))
    engine.step()
    engine.step()  # decodes token 62 at position 61: its window starts at 54, page 6
    groups = engine.stats()["kv_groups"]
    assert groups[0] == {"window": None, "layers": 1, "pages_held": 8}
    assert groups[1:] == [{"window": WINDOW, "layers": 1, "pages_held": 2}] * 5
    engine.run_until_done()
    assert engine.pool.num_in_use == 0


@pytest.mark.parametrize(
    "mode", [{"num_decode_steps": 4}, {"async_scheduling": True}], ids=["multi-step", "async"]
)
def test_hybrid_multi_step_and_async_match_dense(mode):
    """Window groups let go of pages between the decode steps of one call, and while the
    host schedules a step ahead: outputs still equal the dense oracle, in a pool tight
    enough to preempt."""
    model = perturbed_model(GEMMA3)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 9, 12, 23)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [_dense_greedy(model, p, params.max_tokens)[0] for p in prompts]
    # Decodes grow the global group by a page each 8 tokens, a window group stays at 2.
    tight = dict(num_pages=30, max_num_batched_tokens=16, token_buckets=(16,))
    for kw in ({}, tight):
        engine = _engine(model, **kw, **mode)
        got = [o.outputs[0].token_ids for o in _run(engine, prompts, params)]
        assert got == expected, kw
        assert engine.pool.num_in_use == 0
    assert engine.stats()["num_preemptions"] > 0


def test_planner_pages_match_what_the_engine_holds():
    """`paxkv-plan`'s pages per sequence over the groups (`group_pages_held`) are what a
    decoding sequence of tiny Gemma 3 holds in the engine, step after step."""
    from paxkv.planner.capacity import group_pages_held

    engine = _engine(
        perturbed_model(TINY_GEMMA3),
        page_size=16,
        max_model_len=512,
        num_pages=256,
        page_buckets=(32,),
    )
    layout = engine.scheduler.kv_cache_manager.kv_groups
    prompt = np.random.default_rng(5).integers(0, 256, 200).tolist()
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=80))
    (seq,) = engine.requests.get("r").seqs
    checked = 0
    while engine.has_unfinished():
        engine.step()
        if seq.status.value != "running" or seq.num_computed_tokens < len(prompt):
            continue
        held = sum(g["pages_held"] for g in engine.stats()["kv_groups"])
        # The step just run computed the sequence's last token so far, at L - 1.
        length = seq.num_computed_tokens
        assert held == int(group_pages_held(layout, np.array([length]), 16)[0]), length
        checked += 1
    assert checked > 60
