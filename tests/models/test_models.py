"""The Llama-family decoder: the paged step against the dense oracle, RoPE, and configs."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paxkv.kv_cache import PagedKVCache
from paxkv.measure.page_tables import page_table_from_host
from paxkv.models import PRESETS, LlamaConfig, config_from_hf, init_model
from paxkv.models.layers import apply_rope, rope_inv_freq
from paxkv.models.llama_config import LLAMA_3_2_1B, MISTRAL_7B, QWEN2_5_7B, TINY, Llama3RopeScaling

PAGE = 8
NUM_PAGES = 10
ROWS = 40  # every paged step is padded to this many rows: one compile per config
DENSE_LEN = 32  # the oracle runs one padded length: causality keeps the tail out of earlier rows


def perturbed_model(config: LlamaConfig, seed: int = 0):
    """A model whose every parameter is random and O(1) in effect: sharp attention, no zeros."""
    model = init_model(config, seed)
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        shape = var.get_value().shape
        if path[-1] == "kernel":
            value = rng.standard_normal(shape) / math.sqrt(shape[0])
        elif path[-2] == "experts":  # [E, in, out], stacked over the experts
            value = rng.standard_normal(shape) / math.sqrt(shape[-2])
        elif path[-1] == "weight":  # norms
            value = 1.0 + 0.2 * rng.standard_normal(shape)
        else:  # embedding, biases
            value = rng.standard_normal(shape) * (0.5 if path[-1] == "bias" else 1.0)
        var.set_value(jnp.asarray(value, config.dtype))
    nnx.update(model, state)
    return model


@functools.partial(jax.jit, static_argnums=1)
def _paged_step(state, graphdef, tokens, positions, kv_cache, table):
    model = nnx.merge(graphdef, state)
    hidden, kv_cache = model(tokens, positions, kv_cache, table, attention_backend="reference")
    return model.logits(hidden), hidden, kv_cache


@functools.partial(jax.jit, static_argnums=1)
def _dense(state, graphdef, tokens):
    return nnx.merge(graphdef, state).dense_logits(tokens)


def poisoned_cache(config: LlamaConfig) -> PagedKVCache:
    cache = PagedKVCache.create(
        num_layers=config.num_layers,
        num_pages=NUM_PAGES,
        num_kv_heads=config.num_kv_heads,
        page_size=PAGE,
        head_dim=config.head_dim,
        dtype=jnp.float32,
    )
    return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), cache)


def paged_step(model, cache, chunks, pages):
    """Runs one packed step; `chunks[s] = (start, new_tokens)`. Returns per-seq logits rows."""
    q_lens = [len(toks) for _, toks in chunks]
    kv_lens = [start + len(toks) for start, toks in chunks]
    table = page_table_from_host(
        pages, kv_lens, q_lens, page_size=PAGE, max_num_seqs=4, pages_per_seq=4
    )
    tokens = np.zeros(ROWS, np.int32)
    positions = np.zeros(ROWS, np.int32)
    row = 0
    for start, toks in chunks:
        tokens[row : row + len(toks)] = toks
        positions[row : row + len(toks)] = np.arange(start, start + len(toks))
        row += len(toks)
    graphdef, state = nnx.split(model)
    logits, hidden, cache = _paged_step(
        state, graphdef, jnp.asarray(tokens), jnp.asarray(positions), cache, table
    )
    logits, hidden = np.asarray(logits), np.asarray(hidden)
    # Padding rows are ignored by callers, but must stay finite.
    assert np.all(np.isfinite(hidden[row:]))
    cu = np.cumsum([0, *q_lens])
    return [logits[cu[s] : cu[s + 1]] for s in range(len(chunks))], cache


def dense_logits(model, tokens):
    graphdef, state = nnx.split(model)
    padded = np.zeros(DENSE_LEN, np.int32)
    padded[: len(tokens)] = tokens
    return np.asarray(_dense(state, graphdef, jnp.asarray(padded)))[: len(tokens)]


def assert_close(paged, dense):
    scale = float(np.abs(dense).max())
    np.testing.assert_allclose(paged, dense, rtol=1e-5, atol=1e-5 * scale)


def check_paged_matches_dense(model):
    """Prefill a ragged batch, then a step mixing decode and a prefill chunk, against dense."""
    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in (16, 1, 21)]
    # Scattered pages; sequence 0 fills its two pages exactly and decodes into a third.
    pages = [[5, 2], [7], [1, 9, 4]]
    cache = poisoned_cache(model.config)
    prefill, cache = paged_step(model, cache, [(0, p) for p in prompts], pages)

    chunk = rng.integers(0, vocab, 5).tolist()
    greedy = [int(np.argmax(prefill[s][-1])) for s in range(3)]
    step = [(16, [greedy[0]]), (1, chunk), (21, [greedy[2]])]
    pages[0] = [5, 2, 8]
    second, cache = paged_step(model, cache, step, pages)

    for s in range(3):
        full = prompts[s] + step[s][1]
        dense = dense_logits(model, full)
        assert_close(prefill[s], dense[: len(prompts[s])])
        assert_close(second[s], dense[len(prompts[s]) :])
    return prompts


def test_paged_prefill_and_decode_match_dense():
    check_paged_matches_dense(perturbed_model(TINY))


def test_sliding_window_matches_dense_with_the_window():
    config = TINY.replace(sliding_window=6)
    model = perturbed_model(config)
    prompts = check_paged_matches_dense(model)
    # The window is in force: without it the long prompt's late rows differ.
    unwindowed = perturbed_model(TINY)
    windowed, full = dense_logits(model, prompts[2]), dense_logits(unwindowed, prompts[2])
    np.testing.assert_array_equal(windowed[:6], full[:6])
    assert np.abs(windowed[6:] - full[6:]).min(axis=-1).max() > 1e-3


def test_qwen2_bias_and_tied_embeddings():
    config = TINY.replace(attention_bias=True, tie_word_embeddings=True)
    model = perturbed_model(config)
    attn = model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None
    assert attn.v_proj.bias is not None and attn.o_proj.bias is None
    assert model.lm_head is None
    hidden = jnp.asarray(np.random.default_rng(2).standard_normal((3, config.hidden_size)))
    embedding = np.asarray(model.embed_tokens.embedding[...], np.float64)
    np.testing.assert_allclose(
        np.asarray(model.logits(hidden.astype(jnp.float32))),
        np.asarray(hidden) @ embedding.T,
        rtol=1e-5,
        atol=1e-5,
    )
    check_paged_matches_dense(model)


def test_logits_are_float32_for_bfloat16_models():
    model = init_model(TINY.replace(dtype="bfloat16"), 0)
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    out = model.logits(jnp.ones((2, TINY.hidden_size), jnp.bfloat16))
    assert out.dtype == jnp.float32 and out.shape == (2, TINY.vocab_size)


def test_llama3_rope_scaling_matches_the_formula():
    theta, dim = 500000.0, 128
    scaling = Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    got = rope_inv_freq(dim, theta, scaling)
    unscaled = rope_inv_freq(dim, theta, None)
    for i in (0, 10, 30, 40, 63):
        assert unscaled[i] == pytest.approx(theta ** (-2 * i / dim), rel=1e-14)
    # i = 0, 10: wavelength 2 pi / f under 8192 / 4 = 2048, kept.
    for i in (0, 10):
        assert 2 * math.pi * theta ** (2 * i / dim) < 2048
        assert got[i] == pytest.approx(theta ** (-2 * i / dim), rel=1e-14)
    # i = 30: wavelength ~2947, between 2048 and 8192: interpolated.
    f = theta ** (-60 / dim)
    wavelen = 2 * math.pi / f
    assert 2048 < wavelen < 8192
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    assert got[30] == pytest.approx((1 - smooth) * f / 8.0 + smooth * f, rel=1e-14)
    # i = 40, 63: wavelength over 8192 / 1, divided by the factor.
    for i in (40, 63):
        assert 2 * math.pi * theta ** (2 * i / dim) > 8192
        assert got[i] == pytest.approx(theta ** (-2 * i / dim) / 8.0, rel=1e-14)


def test_rope_rotates_half_pairs_and_depends_on_relative_position():
    rng = np.random.default_rng(3)
    dim = 64
    inv_freq = rope_inv_freq(dim, 10000.0, None)
    x = rng.standard_normal((3, 2, dim)).astype(np.float32)
    positions = np.array([0, 5, 1000], np.int32)
    out = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), inv_freq))
    expected = np.empty_like(x, np.float64)
    half = dim // 2
    for t, p in enumerate(positions):
        for i in range(half):
            c, s = math.cos(p * inv_freq[i]), math.sin(p * inv_freq[i])
            expected[t, :, i] = x[t, :, i] * c - x[t, :, i + half] * s
            expected[t, :, i + half] = x[t, :, i + half] * c + x[t, :, i] * s
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(out[0], x[0])

    q, k = jnp.asarray(x[:1, :1]), jnp.asarray(x[1:2, :1])
    at = lambda v, p: apply_rope(v, jnp.asarray([p], jnp.int32), inv_freq)
    dot = lambda p, s: float(jnp.sum(at(q, p) * at(k, s)))
    assert dot(7, 3) == pytest.approx(dot(107, 103), rel=1e-4)


LLAMA_3_2_1B_INSTRUCT_HF = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

QWEN2_5_7B_HF = {
    "architectures": ["Qwen2ForCausalLM"],
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 152064,
}

MISTRAL_7B_HF = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}


@pytest.mark.parametrize(
    ("hf", "preset"),
    [
        (LLAMA_3_2_1B_INSTRUCT_HF, LLAMA_3_2_1B),
        (QWEN2_5_7B_HF, QWEN2_5_7B),
        (MISTRAL_7B_HF, MISTRAL_7B),
    ],
    ids=["llama", "qwen2", "mistral"],
)
def test_from_hf_parses_real_configs(hf, preset):
    # The Qwen2 and Mistral files give no head_dim: it defaults to hidden_size / num_heads.
    assert LlamaConfig.from_hf(hf) == preset


def test_presets_round_trip_through_hf_json():
    for name, config in PRESETS.items():
        assert config_from_hf(json.loads(json.dumps(config.to_hf()))) == config, name
    assert LLAMA_3_2_1B.eos_token_ids == (128001, 128008, 128009)
    assert MISTRAL_7B.eos_token_ids == (2,) and TINY.eos_token_ids == ()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "gpt2"}, "model_type='gpt2'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "o_proj bias"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_from_hf_rejects_what_it_cannot_run(change, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(LLAMA_3_2_1B_INSTRUCT_HF | change)


def test_attention_sinks_parameter():
    # The shared attention block with sinks (gpt-oss): one learned logit per query head,
    # under Hugging Face's name, handed to the attention as float32; none by default.
    from paxkv.models.family import hf_name
    from paxkv.models.layers import Attention

    config = TINY.replace(dtype="bfloat16")
    attn = Attention(config, rngs=nnx.Rngs(0), sinks=True)
    assert attn.sinks[...].shape == (config.num_heads,) and attn.sinks[...].dtype == jnp.bfloat16
    sinks = attn.attention_sinks()
    assert sinks.dtype == jnp.float32 and float(jnp.max(jnp.abs(sinks))) > 0
    np.testing.assert_array_equal(np.asarray(sinks), np.asarray(attn.sinks[...], np.float32))
    assert Attention(config, rngs=nnx.Rngs(0)).attention_sinks() is None
    assert hf_name(("layers", "0", "self_attn", "sinks")) == (
        "model.layers.0.self_attn.sinks",
        False,
    )
