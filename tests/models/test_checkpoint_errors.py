"""Damaged checkpoints: every error names the file, and the field or tensor.

Each case writes a small valid checkpoint, damages it one way, and loads it through
`load_model` (the path every app takes), expecting a ValueError (or OSError for a file
that is not there) whose message names what is wrong.
"""

import json
import re

import numpy as np
import pytest
from flax import nnx

from paxkv.models import (
    init_model,
    load_hf_checkpoint,
    load_model,
    restore_params,
    save_hf_checkpoint,
    save_params,
)
from paxkv.models.llama_config import TINY

CONFIG = TINY.replace(num_layers=1)
INDEX = "model.safetensors.index.json"
SHARD_1, SHARD_2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
UP_PROJ = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=3)


@pytest.fixture
def hf_dir(tmp_path, model):
    """A valid single-file Hugging Face checkpoint with a tokenizer_config.json."""
    path = tmp_path / "hf"
    save_hf_checkpoint(model, path)
    (path / "tokenizer_config.json").write_text('{"tokenizer_class": "ByteTokenizer"}')
    return path


@pytest.fixture
def sharded_dir(tmp_path, model):
    """A valid checkpoint in two shards and an index."""
    path = tmp_path / "sharded"
    save_hf_checkpoint(model, path, max_shard_bytes=600_000)
    assert sorted(json.loads((path / INDEX).read_text())["weight_map"].values())[-1] == SHARD_2
    return path


def edit_config(path, **changes):
    """Rewrites `config.json` with `changes`; a value of None deletes the field."""
    file = path / "config.json"
    hf = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            del hf[key]
        else:
            hf[key] = value
    file.write_text(json.dumps(hf))


def rewrite_tensors(file, change):
    """Rewrites safetensors `file` with `change(tensors)` applied in place."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file))


def truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def names(file, *parts):
    """A regex matching `file`'s path, then each of `parts` literally, in order."""
    return ".*".join(re.escape(str(p)) for p in (file, *parts))


# (case id, damage(path), file the message names, what else it names)
CONFIG_CASES = [
    ("missing", lambda p: edit_config(p, hidden_size=None), ["missing field 'hidden_size'"]),
    (
        "string",
        lambda p: edit_config(p, hidden_size="64"),
        ["field 'hidden_size' must be an integer, got '64' (str)"],
    ),
    (
        "float",
        lambda p: edit_config(p, num_hidden_layers=1.0),
        ["field 'num_hidden_layers' must be an integer, got 1.0 (float)"],
    ),
    (
        "bool",
        lambda p: edit_config(p, vocab_size=True),
        ["field 'vocab_size' must be an integer, got True (bool)"],
    ),
    (
        "zero",
        lambda p: edit_config(p, num_attention_heads=0),
        ["field 'num_attention_heads' must be >= 1, got 0"],
    ),
    (
        "not_a_number",
        lambda p: edit_config(p, rms_norm_eps="tiny"),
        ["field 'rms_norm_eps' must be a number, got 'tiny' (str)"],
    ),
    (
        "infinite",
        lambda p: edit_config(p, rope_theta=float("inf")),
        ["field 'rope_theta' must be a number, got inf"],
    ),
    # Values of the right type that make every output zero or NaN without an error.
    (
        "negative_norm_eps",
        lambda p: edit_config(p, rms_norm_eps=-1),
        ["rms_norm_eps=-1.0 must be a finite number > 0"],
    ),
    ("zero_norm_eps", lambda p: edit_config(p, rms_norm_eps=0), ["rms_norm_eps=0.0 must be"]),
    (
        "nan_norm_eps",
        lambda p: edit_config(p, rms_norm_eps=float("nan")),
        ["field 'rms_norm_eps' must be a number, got nan"],
    ),
    ("zero_rope_theta", lambda p: edit_config(p, rope_theta=0), ["rope_theta=0.0 must be"]),
    (
        "negative_rope_factor",
        lambda p: edit_config(
            p,
            rope_scaling={
                "rope_type": "llama3",
                "factor": -8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        ["rope_scaling.factor=-8.0 must be a finite number > 0"],
    ),
    (
        "rope_band_empty",
        lambda p: edit_config(
            p,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        ["rope_scaling.high_freq_factor=4.0 must exceed low_freq_factor=4.0"],
    ),
    (
        "heads_do_not_divide",
        lambda p: edit_config(p, head_dim=None, hidden_size=130),
        ["'hidden_size'=130 is not a multiple of num_attention_heads=4"],
    ),
    (
        "zero_positions",
        lambda p: edit_config(p, max_position_embeddings=0),
        ["field 'max_position_embeddings' must be >= 1, got 0"],
    ),
    (
        "rope_scaling_field",
        lambda p: edit_config(p, rope_scaling={"rope_type": "llama3", "factor": 8.0}),
        ["missing field 'rope_scaling.low_freq_factor'"],
    ),
    (
        "eos_ids",
        lambda p: edit_config(p, eos_token_id=[1, "2"]),
        ["field 'eos_token_id' must be token ids", "[1, '2']"],
    ),
    (
        "model_type",
        lambda p: edit_config(p, model_type=None),
        ["missing field 'model_type'"],
    ),
    (
        "invalid_json",
        lambda p: (p / "config.json").write_text('{"hidden_size": 64,'),
        ["not valid JSON"],
    ),
    (
        "not_utf8",
        lambda p: (p / "config.json").write_bytes(b"\xff\xfe\x00garbage"),
        ["not valid JSON"],
    ),
    (
        "not_an_object",
        lambda p: (p / "config.json").write_text("[1, 2]"),
        ["expected a JSON object, got list"],
    ),
]


@pytest.mark.parametrize(
    "damage, parts", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES]
)
def test_config_errors_name_the_file_and_field(hf_dir, damage, parts):
    damage(hf_dir)
    with pytest.raises(ValueError, match=names(hf_dir / "config.json", *parts)):
        load_model(hf_dir)


def test_config_errors_on_the_orbax_path_name_the_file(tmp_path, model):
    save_params(model, tmp_path)
    edit_config(tmp_path, intermediate_size=None)
    with pytest.raises(ValueError, match=names(tmp_path / "config.json", "'intermediate_size'")):
        load_model(tmp_path)


def test_missing_config_is_an_os_error_naming_it(hf_dir):
    (hf_dir / "config.json").unlink()
    with pytest.raises(OSError, match=re.escape(str(hf_dir / "config.json"))):
        load_hf_checkpoint(hf_dir)


SAFETENSORS_CASES = [
    # A file cut in half: the tensors past the cut are named.
    ("truncated", "model.safetensors", truncate, ["not a complete safetensors file", UP_PROJ]),
    (
        "garbage",
        "model.safetensors",
        lambda f: f.write_bytes(b"this is not a safetensors file at all"),
        ["not a complete safetensors file"],
    ),
    ("empty", "model.safetensors", lambda f: f.write_bytes(b""), ["header too small"]),
    (
        "int8_weights",
        "model.safetensors",
        lambda f: rewrite_tensors(f, _to_int8),
        [f"tensor {UP_PROJ} is stored as I8; weights must be floating point"],
    ),
    (
        "bool_weights",
        "model.safetensors",
        lambda f: rewrite_tensors(f, lambda t: t.update({UP_PROJ: t[UP_PROJ] > 0})),
        [f"tensor {UP_PROJ} is stored as BOOL"],
    ),
]


def _to_int8(tensors):
    tensors[UP_PROJ] = np.round(tensors[UP_PROJ] * 100).astype(np.int8)


@pytest.mark.parametrize(
    "file, damage, parts", [c[1:] for c in SAFETENSORS_CASES], ids=[c[0] for c in SAFETENSORS_CASES]
)
def test_safetensors_errors_name_the_file(hf_dir, file, damage, parts):
    damage(hf_dir / file)
    with pytest.raises(ValueError, match=names(hf_dir / file, *parts)):
        load_model(hf_dir)


def test_a_directory_for_the_weights_file_is_an_os_error_naming_it(hf_dir):
    (hf_dir / "model.safetensors").unlink()
    (hf_dir / "model.safetensors").mkdir()
    with pytest.raises(OSError, match=names(hf_dir / "model.safetensors", "cannot open")):
        load_model(hf_dir)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rms_norm_eps": 0.0}, "rms_norm_eps=0.0 must be a finite number > 0"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan must be"),
        ({"rope_theta": -1.0}, "rope_theta=-1.0 must be"),
        ({"head_dim": 0}, "head_dim=0 must be an integer >= 1"),
        ({"intermediate_size": -4}, "intermediate_size=-4 must be"),
    ],
)
def test_configs_built_in_python_check_the_same_values(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        CONFIG.replace(**change)


def _drop_shard(path):
    (path / SHARD_2).unlink()


def _index_to_missing_file(path):
    index = json.loads((path / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00003-of-00002.safetensors"
    (path / INDEX).write_text(json.dumps(index))


SHARDED_CASES = [
    ("truncated_shard", SHARD_2, lambda p: truncate(p / SHARD_2), ["not a complete safetensors"]),
    ("missing_shard", INDEX, _drop_shard, [f"names the shard {SHARD_2}, which is not in"]),
    (
        "index_names_missing_file",
        INDEX,
        _index_to_missing_file,
        ["names the shard model-00003-of-00002.safetensors"],
    ),
    ("index_invalid_json", INDEX, lambda p: (p / INDEX).write_text("{oops"), ["not valid JSON"]),
    (
        "index_without_weight_map",
        INDEX,
        lambda p: (p / INDEX).write_text('{"metadata": {}}'),
        ["expected a 'weight_map'"],
    ),
]


@pytest.mark.parametrize(
    "file, damage, parts", [c[1:] for c in SHARDED_CASES], ids=[c[0] for c in SHARDED_CASES]
)
def test_sharded_errors_name_the_file(sharded_dir, file, damage, parts):
    damage(sharded_dir)
    with pytest.raises(ValueError, match=names(sharded_dir / file, *parts)):
        load_model(sharded_dir)


TOKENIZER_CASES = [
    ("tokenizer.json", b"garbage", "not a readable tokenizer file"),
    ("tokenizer.json", b'{"version": "1.0"}', "not a readable tokenizer file"),
    ("tokenizer.json", b"\xff\xfe\x00", "not a readable tokenizer file"),
    ("tokenizer_config.json", b"garbage", "not valid JSON"),
    ("tokenizer_config.json", b'"ByteTokenizer"', "expected a JSON object, got str"),
]


@pytest.mark.parametrize("file, content, part", TOKENIZER_CASES)
def test_tokenizer_errors_name_the_file(hf_dir, file, content, part):
    if file == "tokenizer.json":
        pytest.importorskip("tokenizers")
    (hf_dir / file).write_bytes(content)
    with pytest.raises(ValueError, match=names(hf_dir / file, part)):
        load_model(hf_dir)


def test_nonfinite_weights_are_named_with_their_files(sharded_dir):
    index = json.loads((sharded_dir / INDEX).read_text())["weight_map"]
    poisoned = {"model.norm.weight": np.nan, UP_PROJ: np.inf, "model.embed_tokens.weight": -np.inf}
    for name, value in poisoned.items():

        def poison(tensors, name=name, value=value):
            tensors[name][0, ...] = value

        rewrite_tensors(sharded_dir / index[name], poison)
    with pytest.raises(ValueError, match=r"non-finite values \(NaN or inf\)") as error:
        load_model(sharded_dir)
    message = str(error.value)
    for name in poisoned:
        assert re.search(names(sharded_dir / index[name], name), message), name
    assert "model.layers.0.mlp.down_proj.weight" not in message


def test_nonfinite_orbax_params_are_named(tmp_path):
    model = init_model(CONFIG, seed=3)
    kernel = model.layers[0].self_attn.q_proj.kernel
    kernel.set_value(kernel.get_value().at[1, 2].set(np.nan))
    save_params(model, tmp_path)
    with pytest.raises(ValueError, match=names(tmp_path / "params", "layers.0.self_attn.q_proj")):
        restore_params(CONFIG, tmp_path)


def test_damaged_orbax_params_name_the_directory(tmp_path, model):
    save_params(model, tmp_path)
    for file in (tmp_path / "params").rglob("*"):
        if file.is_file() and file.stat().st_size > 100_000:  # the arrays' data
            truncate(file)
    with pytest.raises(ValueError, match=names(tmp_path / "params", "cannot restore")) as error:
        restore_params(CONFIG, tmp_path)
    assert "\n" not in str(error.value)


def test_valid_checkpoints_still_load(hf_dir, sharded_dir, model):
    for path in (hf_dir, sharded_dir):
        config, loaded, _ = load_model(path)
        assert config == CONFIG
        for (p, a), (_, b) in zip(
            nnx.to_flat_state(nnx.state(loaded, nnx.Param)),
            nnx.to_flat_state(nnx.state(model, nnx.Param)),
            strict=True,
        ):
            np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg=str(p))
