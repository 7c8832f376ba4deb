"""Checkpoints on disk (Hugging Face safetensors, orbax), tokenizers and `load_model`."""

import functools
import json
import logging
import math
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from paxkv.models import (
    ByteTokenizer,
    init_model,
    load_hf_checkpoint,
    load_model,
    load_tokenizer,
    restore_params,
    save_hf_checkpoint,
    save_params,
)
from paxkv.models.llama_config import TINY

# Qwen2-style (q/k/v bias) and untied, so every kind of tensor is in the checkpoint.
CONFIG = TINY.replace(attention_bias=True, num_layers=2)
TOKENS = jnp.asarray([3, 141, 59, 26, 5, 35, 89, 79, 32, 38, 46, 26], jnp.int32)


def source_model(config=CONFIG, seed=0):
    """A model with every parameter random and non-zero (norms and biases included)."""
    model = init_model(config, seed)
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        shape = var.get_value().shape
        scale = 1 / math.sqrt(shape[0]) if path[-1] == "kernel" else 1.0
        value = rng.standard_normal(shape) * scale + (1.0 if path[-1] == "weight" else 0.0)
        var.set_value(jnp.asarray(value, config.dtype))
    nnx.update(model, state)
    return model


def hf_tensors(model) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face names and layouts, spelled out by hand."""
    arr = lambda v: np.asarray(v[...])
    t = {"model.embed_tokens.weight": arr(model.embed_tokens.embedding)}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            proj = getattr(attn, name)
            t[f"{p}self_attn.{name}.weight"] = arr(proj.kernel).T  # HF Linear is [out, in]
            if proj.bias is not None:
                t[f"{p}self_attn.{name}.bias"] = arr(proj.bias)
        for name in ("gate_proj", "up_proj", "down_proj"):
            t[f"{p}mlp.{name}.weight"] = arr(getattr(layer.mlp, name).kernel).T
        t[f"{p}input_layernorm.weight"] = arr(layer.input_layernorm.weight)
        t[f"{p}post_attention_layernorm.weight"] = arr(layer.post_attention_layernorm.weight)
    t["model.norm.weight"] = arr(model.norm.weight)
    if model.lm_head is not None:
        t["lm_head.weight"] = arr(model.lm_head.kernel).T
    return {k: np.ascontiguousarray(v) for k, v in t.items()}


def hf_config(config) -> dict:
    """A Qwen2 `config.json` as transformers writes it, extra keys included."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "max_window_layers": config.num_layers,
        "model_type": "qwen2",
        "num_attention_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "sliding_window": 4096,
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": config.dtype,
        "transformers_version": "4.43.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": config.vocab_size,
    }


def write_checkpoint(path, tensors, config, *, shards=1):
    """Writes a Hugging Face checkpoint: one `model.safetensors`, or `shards` files + index."""
    from safetensors.numpy import save_file

    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(config)))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@functools.partial(jax.jit, static_argnums=1)
def _dense(state, graphdef, tokens):
    return nnx.merge(graphdef, state).dense_logits(tokens)


def dense_logits(model):
    graphdef, state = nnx.split(model)
    return np.asarray(_dense(state, graphdef, TOKENS))


def assert_same_params(a, b):
    flat_a = dict(nnx.to_flat_state(nnx.state(a, nnx.Param)))
    flat_b = dict(nnx.to_flat_state(nnx.state(b, nnx.Param)))
    assert flat_a.keys() == flat_b.keys()
    for path, var in flat_a.items():
        x, y = var.get_value(), flat_b[path].get_value()
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


@pytest.fixture(scope="module")
def model():
    return source_model()


@pytest.mark.parametrize("shards", [1, 3])
def test_hf_checkpoint_loads_with_identical_logits(tmp_path, model, shards):
    pytest.importorskip("safetensors")
    write_checkpoint(tmp_path / "ckpt", hf_tensors(model), CONFIG, shards=shards)
    config, loaded = load_hf_checkpoint(tmp_path / "ckpt")
    assert config == CONFIG
    assert_same_params(loaded, model)
    np.testing.assert_array_equal(dense_logits(loaded), dense_logits(model))


def test_bfloat16_checkpoint_loads(tmp_path, model):
    pytest.importorskip("safetensors")
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_tensors(model).items()}
    config16 = CONFIG.replace(dtype="bfloat16")
    write_checkpoint(tmp_path / "ckpt", tensors, config16)
    config, loaded = load_hf_checkpoint(tmp_path / "ckpt")
    assert config.dtype == "bfloat16"
    expected = init_model(config16)
    nnx.update(expected, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model)))
    assert_same_params(loaded, expected)
    assert loaded.layers[1].self_attn.k_proj.bias[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(dense_logits(loaded), dense_logits(expected))
    # The dtype can be overridden at load time.
    _, as_f32 = load_hf_checkpoint(tmp_path / "ckpt", dtype="float32")
    assert as_f32.norm.weight[...].dtype == jnp.float32


def _drop(t, name):
    del t[name]


def _reshape(t, name):
    t[name] = t[name][:, :-1].copy()


def _add(t, name):
    t[name] = np.zeros(3, np.float32)


@pytest.mark.parametrize(
    ("mutate", "name", "match"),
    [
        (_drop, "model.layers.1.mlp.up_proj.weight", "missing tensors"),
        (_drop, "model.layers.0.self_attn.k_proj.bias", "missing tensors"),
        (
            _reshape,
            "model.layers.0.self_attn.k_proj.weight",
            r"shape \(128, 127\), expected \(128, 128\)",
        ),
        (_add, "model.layers.0.self_attn.o_proj.bias", "unexpected tensors"),
    ],
    ids=["missing-weight", "missing-bias", "wrong-shape", "unexpected"],
)
def test_bad_checkpoint_names_the_tensor(tmp_path, model, mutate, name, match):
    pytest.importorskip("safetensors")
    tensors = hf_tensors(model)
    mutate(tensors, name)
    write_checkpoint(tmp_path / "ckpt", tensors, CONFIG)
    with pytest.raises(ValueError, match=match) as err:
        load_hf_checkpoint(tmp_path / "ckpt")
    assert name in str(err.value)


def test_index_naming_the_wrong_shard_names_the_tensor(tmp_path, model):
    pytest.importorskip("safetensors")
    write_checkpoint(tmp_path, hf_tensors(model), CONFIG, shards=2)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = "model.norm.weight"
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"][name] = next(f for f in files if f != index["weight_map"][name])
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"{name} is indexed in .* but not stored there"):
        load_hf_checkpoint(tmp_path)


def test_lm_head_is_unexpected_when_tied(tmp_path, model):
    pytest.importorskip("safetensors")
    tied = source_model(CONFIG.replace(tie_word_embeddings=True))
    tensors = hf_tensors(tied) | {"lm_head.weight": hf_tensors(model)["lm_head.weight"]}
    write_checkpoint(tmp_path / "ckpt", tensors, tied.config)
    with pytest.raises(ValueError, match=r"tie_word_embeddings=True.*lm_head\.weight"):
        load_hf_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize("max_shard_bytes", [None, 200_000])
def test_save_hf_checkpoint_writes_the_hf_layout(tmp_path, model, max_shard_bytes):
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    save_hf_checkpoint(model, tmp_path, max_shard_bytes=max_shard_bytes)
    expected = hf_tensors(model)
    if max_shard_bytes is None:
        files = {"model.safetensors"}
    else:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert index["weight_map"].keys() == expected.keys()
        files = set(index["weight_map"].values())
        assert len(files) > 1
    stored = {}
    for file in files:
        with safe_open(str(tmp_path / file), framework="numpy") as f:
            stored |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert stored.keys() == expected.keys()
    for k, v in expected.items():
        np.testing.assert_array_equal(stored[k], v, err_msg=k)
    config, loaded = load_hf_checkpoint(tmp_path)
    assert config == CONFIG
    assert_same_params(loaded, model)


def test_orbax_round_trip_is_exact(tmp_path, model):
    save_params(model, tmp_path / "run")
    restored = restore_params(CONFIG, tmp_path / "run")
    assert_same_params(restored, model)
    config, via_load, tokenizer = load_model(str(tmp_path / "run"))
    assert config == CONFIG and tokenizer is None
    assert_same_params(via_load, model)


def test_load_model_presets_and_directories(tmp_path, model):
    config, tiny, tokenizer = load_model("tiny", seed=1)
    assert config == TINY and isinstance(tokenizer, ByteTokenizer)
    assert tiny.embed_tokens.embedding[...].shape == (256, TINY.hidden_size)
    config, _, _ = load_model("tiny", dtype="bfloat16")
    assert config.dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"tiny, llama-3\.2-1b, llama-3\.1-8b"):
        load_model("no-such-model")

    pytest.importorskip("safetensors")
    save_hf_checkpoint(model, tmp_path)
    config, loaded, tokenizer = load_model(str(tmp_path))
    assert config == CONFIG and tokenizer is None
    assert_same_params(loaded, model)


def test_byte_tokenizer_round_trips():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓ 🦙"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([104, 0xFF, 105]) == "h\ufffdi"


def _write_tokenizer_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "paged": 3, "attention": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def test_load_tokenizer_reads_tokenizer_json(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    assert load_tokenizer(tmp_path) is None
    _write_tokenizer_json(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == 5
    assert tok.encode("hello paged world") == [1, 3, 2]
    assert tok.decode([4, 2]) == "attention world"
    # Without the optional library there is no tokenizer, not an error.
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert load_tokenizer(tmp_path) is None


def test_an_unreadable_tokenizer_json_warns_once_naming_the_file(tmp_path, monkeypatch, caplog):
    pytest.importorskip("tokenizers")
    _write_tokenizer_json(tmp_path)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with caplog.at_level(logging.WARNING):
        assert load_tokenizer(tmp_path) is None
        assert load_tokenizer(tmp_path) is None
    (record,) = [r for r in caplog.records if "tokenizer.json" in r.getMessage()]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert str(tmp_path / "tokenizer.json") in message
    assert "pip install -e '.[tokenizers]'" in message
