"""Training a byte-level causal LM on the Python standard library's own source files.

The corpus is on every machine that has Python: the `*.py` files under
`sysconfig.get_paths()["stdlib"]`, without the test suites and generated data. A file
is held out for evaluation when the SHA-256 of its path (relative to the stdlib, POSIX
separators) falls in the first `HELD_OUT_PERCENT` percent, so the split is the same on
every machine and run, and a file is never in both halves.

Training draws batches of random windows `i32[B, L + 1]` (bytes; the model reads the
first L and predicts the last L) and minimises the mean next-byte cross entropy of the
model's dense causal forward (`dense_logits`, vmapped over the batch) with AdamW under
a linear-warmup cosine schedule, in one jitted step with the parameters donated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import sysconfig
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
import optax
from absl import logging
from flax import nnx

HELD_OUT_PERCENT = 5.0
# Directories that are not library source: the test suites, pydoc's generated topic
# strings, and third-party packages.
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "pydoc_data", "site-packages", "__pycache__"}
)
SPLITS = ("train", "eval")


def stdlib_root() -> str:
    """The directory of this interpreter's standard library sources."""
    return sysconfig.get_paths()["stdlib"]


def corpus_files(root: str | os.PathLike | None = None) -> list[str]:
    """The corpus files under `root` (default: the stdlib), as sorted POSIX paths relative to it."""
    root = os.fspath(root or stdlib_root())
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        rel = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                path = name if rel == "." else os.path.join(rel, name)
                files.append(path.replace(os.sep, "/"))
    return sorted(files)


def is_held_out(path: str, percent: float = HELD_OUT_PERCENT) -> bool:
    """Whether the file at relative POSIX `path` belongs to the evaluation split."""
    digest = hashlib.sha256(path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < percent / 100


def split_files(
    files: Sequence[str], percent: float = HELD_OUT_PERCENT
) -> tuple[list[str], list[str]]:
    """`(train, eval)`: the files partitioned by `is_held_out`, each in the given order."""
    train, held_out = [], []
    for f in files:
        (held_out if is_held_out(f, percent) else train).append(f)
    return train, held_out


def load_corpus(split: str, root: str | os.PathLike | None = None) -> np.ndarray:
    """The bytes of one split's files, concatenated in path order: `u8[N]`."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    root = os.fspath(root or stdlib_root())
    train, held_out = split_files(corpus_files(root))
    files = train if split == "train" else held_out
    if not files:
        raise ValueError(f"no {split} files under {root}")
    chunks = []
    for f in files:
        with open(os.path.join(root, f), "rb") as fh:
            chunks.append(fh.read())
    return np.frombuffer(b"".join(chunks), np.uint8)


def random_windows(
    data: np.ndarray, rng: np.random.Generator, batch_size: int, length: int
) -> np.ndarray:
    """`i32[batch_size, length + 1]` windows of `data` at uniformly random offsets."""
    if len(data) <= length:
        raise ValueError(f"the corpus ({len(data)} bytes) is shorter than a window of {length + 1}")
    starts = rng.integers(0, len(data) - length, batch_size)
    return np.stack([data[s : s + length + 1] for s in starts]).astype(np.int32)


def spaced_windows(data: np.ndarray, num_windows: int, length: int) -> np.ndarray:
    """`i32[num_windows, length + 1]` windows of `data` at evenly spaced offsets (deterministic)."""
    if len(data) <= length:
        raise ValueError(f"the corpus ({len(data)} bytes) is shorter than a window of {length + 1}")
    starts = np.linspace(0, len(data) - length - 1, num_windows).astype(np.int64)
    return np.stack([data[s : s + length + 1] for s in starts]).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation of the byte-level LM; the defaults take a few minutes on a 2-core CPU."""

    steps: int = 1200
    batch_size: int = 8
    seq_len: int = 256
    learning_rate: float = 3e-3
    warmup_steps: int = 60
    end_learning_rate_ratio: float = 0.05
    weight_decay: float = 0.1
    b2: float = 0.99
    grad_clip_norm: float = 1.0
    seed: int = 0
    log_every: int = 50


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW after global-norm clipping, with a linear warmup to `learning_rate` and a cosine decay."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=max(config.steps, config.warmup_steps + 1),
        end_value=config.learning_rate * config.end_learning_rate_ratio,
    )
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip_norm),
        optax.adamw(schedule, b2=config.b2, weight_decay=config.weight_decay),
    )


def window_loss(model: nnx.Module, windows: jax.Array) -> jax.Array:
    """Mean next-token cross entropy (nats) of `windows i32[B, L + 1]` under the dense forward."""
    logits = jax.vmap(model.dense_logits)(windows[:, :-1])  # f32[B, L, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


def _train_step(graphdef, params, rest, opt_state, windows, *, optimizer):
    def loss_fn(p):
        return window_loss(nnx.merge(graphdef, p, rest), windows)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@dataclasses.dataclass
class TrainResult:
    """What a run measured: losses in nats per byte (bits per byte is `/ ln 2`)."""

    losses: list[float]  # mean of each logged interval of steps
    eval_loss: float | None
    seconds: float
    tokens: int


def train(
    model: nnx.Module,
    data: np.ndarray,
    config: TrainConfig = TrainConfig(),
    *,
    eval_data: np.ndarray | None = None,
    num_eval_windows: int = 32,
    on_log: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Trains `model` (an NNX causal LM with `dense_logits`) in place on byte corpus `data`.

    Logs the step, loss, bits per byte, throughput and remaining time through absl every
    `config.log_every` steps (and calls `on_log(step, loss)` then). With `eval_data`,
    also reports the loss on `num_eval_windows` evenly spaced held-out windows at the end.
    """
    optimizer = make_optimizer(config)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = optimizer.init(params)
    step = jax.jit(
        _train_step, static_argnames=("optimizer",), donate_argnames=("params", "opt_state")
    )
    rng = np.random.default_rng(config.seed)
    losses, interval = [], []
    start = time.perf_counter()
    for i in range(1, config.steps + 1):
        batch = random_windows(data, rng, config.batch_size, config.seq_len)
        params, opt_state, loss = step(
            graphdef, params, rest, opt_state, batch, optimizer=optimizer
        )
        interval.append(loss)
        if i % config.log_every == 0 or i == config.steps:
            mean = float(np.mean(jax.device_get(interval)))
            losses.append(mean)
            interval = []
            elapsed = time.perf_counter() - start
            logging.info(
                "step %d/%d  loss %.4f  %.3f bits/byte  %.0f tokens/s  %.0f s left",
                i,
                config.steps,
                mean,
                mean / math.log(2),
                i * config.batch_size * config.seq_len / elapsed,
                elapsed / i * (config.steps - i),
            )
            if on_log is not None:
                on_log(i, mean)
    seconds = time.perf_counter() - start
    nnx.update(model, params)
    eval_loss = None
    if eval_data is not None:
        windows = spaced_windows(eval_data, num_eval_windows, config.seq_len)
        eval_loss = float(
            jax.jit(lambda g, p, w: window_loss(nnx.merge(g, p), w))(*nnx.split(model), windows)
        )
        logging.info(
            "held-out loss %.4f  %.3f bits/byte  perplexity %.3f",
            eval_loss,
            eval_loss / math.log(2),
            math.exp(eval_loss),
        )
    return TrainResult(
        losses, eval_loss, seconds, config.steps * config.batch_size * config.seq_len
    )
