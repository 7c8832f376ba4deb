"""The stdlib corpus and its split, the training loop, and the trained tiny-py checkpoint."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paxkv.models import (
    CHECKPOINTS,
    ByteTokenizer,
    init_model,
    load_model,
    save_params,
    train,
)
from paxkv.models.llama_config import TINY

TEXT = b"def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n"


def _touch(root, path, text="x = 1\n"):
    path = root / path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_corpus_files_skip_tests_and_non_python(tmp_path):
    for path in [
        "a.py",
        "pkg/b.py",
        "pkg/readme.txt",
        "test/test_a.py",
        "pkg/tests/test_b.py",
        "idlelib/idle_test/t.py",
        "pydoc_data/topics.py",
        "site-packages/third/party.py",
    ]:
        _touch(tmp_path, path)
    assert train.corpus_files(tmp_path) == ["a.py", "pkg/b.py"]


def test_split_is_deterministic_disjoint_and_about_five_percent():
    files = train.corpus_files()
    assert len(files) > 100
    assert not any(set(f.split("/")) & train.EXCLUDED_DIRS for f in files)
    fit, held_out = train.split_files(files)
    assert (fit, held_out) == train.split_files(list(files))
    assert not set(fit) & set(held_out)
    assert sorted(fit + held_out) == files
    assert 0.02 < len(held_out) / len(files) < 0.10


def test_split_depends_on_the_path_only():
    # SHA-256 of the path: the same on every machine and run, whatever else is present.
    held = [f"m{i}.py" for i in range(400) if train.is_held_out(f"m{i}.py")]
    assert held == [f for f in (f"m{i}.py" for i in range(400)) if train.is_held_out(f)]
    assert train.split_files(["m0.py", *held])[1] == held
    assert 0 < len(held) < 40
    assert train.is_held_out("anything.py", percent=100)
    assert not train.is_held_out("anything.py", percent=0)


def test_load_corpus_concatenates_one_split(tmp_path):
    names = [f"f{i}.py" for i in range(60)]
    for n in names:
        _touch(tmp_path, n, f"# {n}\n")
    fit, held_out = train.split_files(sorted(names))
    assert held_out, "the fixture needs at least one held-out file"
    text = lambda files: "".join(f"# {n}\n" for n in files).encode()
    assert train.load_corpus("train", tmp_path).tobytes() == text(fit)
    assert train.load_corpus("eval", tmp_path).tobytes() == text(held_out)
    with pytest.raises(ValueError, match="split='test'"):
        train.load_corpus("test", tmp_path)


def test_windows_are_slices_of_the_data():
    data = np.frombuffer(TEXT * 4, np.uint8)
    w = train.random_windows(data, np.random.default_rng(0), 5, 16)
    assert w.shape == (5, 17) and w.dtype == np.int32
    assert all(bytes(row.astype(np.uint8)) in data.tobytes() for row in w)
    s = train.spaced_windows(data, 3, 16)
    assert s[0].tolist() == list(data[:17]) and s[-1].tolist() == list(data[-17:])
    with pytest.raises(ValueError, match="shorter than a window"):
        train.spaced_windows(data[:10], 1, 16)


@jax.jit
def _loss(graphdef, state, windows):
    return train.window_loss(nnx.merge(graphdef, state), windows)


def loss_of(model, windows) -> float:
    return float(_loss(*nnx.split(model), jnp.asarray(windows)))


def test_a_few_steps_reduce_the_loss():
    data = np.frombuffer(TEXT * 8, np.uint8)
    model = init_model(TINY.replace(num_layers=1), 0)  # one layer compiles in half the time
    windows = train.spaced_windows(data, 8, 32)
    before = loss_of(model, windows)
    assert abs(before - math.log(256)) < 0.3  # random init: about uniform
    config = train.TrainConfig(
        steps=20, batch_size=8, seq_len=32, learning_rate=1e-2, warmup_steps=2, log_every=10
    )
    logged = []
    result = train.train(model, data, config, on_log=lambda step, loss: logged.append(step))
    after = loss_of(model, windows)
    assert logged == [10, 20] and len(result.losses) == 2
    assert result.tokens == 20 * 8 * 32
    assert after < before - 2.0, (before, after)
    assert result.losses[1] < result.losses[0]


def test_checkpoint_round_trip(tmp_path):
    _, model, tokenizer = load_model("tiny-py")
    assert isinstance(tokenizer, ByteTokenizer)
    save_params(model, tmp_path)
    _, restored, _ = load_model(tmp_path)
    a = jax.tree.leaves(nnx.state(model, nnx.Param))
    b = jax.tree.leaves(nnx.state(restored, nnx.Param))
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_tiny_py_is_trained():
    config, model, _ = load_model("tiny-py")
    assert (config.vocab_size, config.hidden_size, config.num_layers, config.head_dim) == (
        256,
        128,
        2,
        64,
    )
    windows = train.spaced_windows(train.load_corpus("eval"), 8, 256)
    bits = loss_of(model, windows) / math.log(2)
    assert bits < 2.3  # random weights give 8; the bundled checkpoint about 2.05
    size = sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, fs in os.walk(CHECKPOINTS["tiny-py"])
        for f in fs
    )
    assert size < 10 * 2**20


def test_missing_checkpoint_says_how_to_train_it(tmp_path, monkeypatch):
    monkeypatch.setitem(CHECKPOINTS, "tiny-py", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="train it with `paxkv-train`"):
        load_model("tiny-py")
