"""GRPO on paxkv: rollouts through the engine, the policy-gradient step in plain JAX.

A small GRPO-style loop on the shipped `tiny-py` model (a byte-level LM of Python
source). Each iteration:

1. rollout: `n = group_size` completions of each prompt, sampled by one `paxkv.Engine`
   (built and warmed up once) under the current weights, with their logprobs;
2. reward: a verifiable score of each completion's text (`reward`);
3. advantages: the rewards normalized within each prompt's group (`group_advantages`);
4. training: one optax Adam step on the policy-gradient loss (`policy_gradient_loss`)
   of the sampled tokens' log-probabilities under the trainer's own dense forward pass
   (`model.dense_logits`, as `paxkv.models.training` trains the model), teacher-forced;
5. sync: `engine.update_weights(new_params)`, in place: the engine compiles nothing.

The loop is on-policy with one step per batch, so GRPO's ratio is 1 and its clip never
acts: the loss is the plain group-normalized policy gradient, without a KL term. The
engine's logprobs of the sampled tokens are checked against the trainer's under the
same weights every iteration (`logprob_gap`): the proof that the engine serves the
weights it was given.

    python examples/grpo_tiny_py.py --iterations=20 --json_out=/tmp/grpo.json
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from paxkv import Engine, EngineConfig, SamplingParams
from paxkv.launch.platform import quiet_backend_probes
from paxkv.models import load_model

PROMPTS = (
    "def area(width, height):\n    ",
    "for i in range(10):\n    ",
    "class Point:\n    def __init__(self",
    "import os\n\ndef main(",
)
# The reward: the fraction of a completion's characters in this set. The model writes
# few of them at first, and a policy gradient can visibly raise their share.
TARGET_CHARS = frozenset("0123456789")
ENGINE_CONFIG = EngineConfig(
    num_pages=256, page_size=16, max_num_seqs=32, max_num_batched_tokens=128, max_model_len=128
)


def reward(text: str) -> float:
    """The fraction of `text`'s characters in `TARGET_CHARS` (0 for empty text)."""
    return sum(c in TARGET_CHARS for c in text) / len(text) if text else 0.0


def group_advantages(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """`f32[B, G]` -> `f32[B, G]`: each reward minus its group's (row's) mean, divided by
    the group's standard deviation plus `eps` (a group of equal rewards gives zeros)."""
    rewards = np.asarray(rewards, np.float32)
    mean = rewards.mean(axis=1, keepdims=True)
    std = rewards.std(axis=1, keepdims=True)
    return (rewards - mean) / (std + eps)


def token_logps(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """`i32[N, L]` -> `f32[N, L - 1]`: log p(tokens[:, t + 1] | tokens[:, : t + 1]) under
    the model's dense causal forward."""
    logits = jax.vmap(model.dense_logits)(tokens[:, :-1])  # f32[N, L - 1, V]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def policy_gradient_loss(logps: jax.Array, mask: jax.Array, advantages: jax.Array) -> jax.Array:
    """GRPO's loss, on-policy: -mean over sequences of `advantage * mean over its
    completion tokens of logp`. `logps, mask: f32[N, T]` (mask 1 at completion tokens),
    `advantages: f32[N]`."""
    per_seq = (logps * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)  # f32[N]
    return -(advantages * per_seq).mean()


def _train_step(graphdef, params, rest, opt_state, tokens, mask, advantages, *, optimizer):
    """One optax step on `policy_gradient_loss`; also returns the loss and the tokens'
    logprobs under the parameters before the step (`f32[N, L - 1]`)."""

    def loss_fn(p):
        logps = token_logps(nnx.merge(graphdef, p, rest), tokens)
        return policy_gradient_loss(logps, mask, advantages), logps

    (loss, logps), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, logps


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One iteration's samples: `G` completions of each of `B` prompts."""

    tokens: np.ndarray  # i32[B * G, L]: prompt, completion, then padding
    mask: np.ndarray  # f32[B * G, L - 1]: 1 where position t + 1 holds a completion token
    engine_logps: np.ndarray  # f32[B * G, L - 1]: the engine's logprobs there, 0 elsewhere
    rewards: np.ndarray  # f32[B, G]
    texts: list[list[str]]  # [B][G]


def rollout(
    engine: Engine,
    prompts: Sequence[str],
    params: SamplingParams,
    length: int,
    tag: str,
) -> Rollout:
    """Samples `params.n` completions of every prompt through `engine` (prompt i's
    completions with seeds `params.seed + i * n + j`, all distinct); packs each prompt +
    completion into a row of `length` tokens."""
    ids = [
        engine.add_request(
            f"{tag}-{i}", p, dataclasses.replace(params, seed=params.seed + i * params.n)
        )
        for i, p in enumerate(prompts)
    ]
    final = engine.run_until_done()
    n = len(prompts) * params.n
    tokens = np.zeros((n, length), np.int32)
    mask = np.zeros((n, length - 1), np.float32)
    engine_logps = np.zeros((n, length - 1), np.float32)
    rewards = np.zeros((len(prompts), params.n), np.float32)
    texts: list[list[str]] = []
    for b, rid in enumerate(ids):
        out = final[rid]
        texts.append([])
        for g, completion in enumerate(out.outputs):
            row, p, c = b * params.n + g, len(out.prompt_token_ids), len(completion.token_ids)
            tokens[row, :p] = out.prompt_token_ids
            tokens[row, p : p + c] = completion.token_ids
            mask[row, p - 1 : p + c - 1] = 1.0
            engine_logps[row, p - 1 : p + c - 1] = completion.token_logprobs
            rewards[b, g] = reward(completion.text)
            texts[b].append(completion.text)
    return Rollout(tokens, mask, engine_logps, rewards, texts)


@dataclasses.dataclass(frozen=True)
class Iteration:
    """What one iteration measured (times are wall-clock seconds)."""

    iteration: int
    mean_reward: float
    loss: float
    logprob_gap: float  # max |engine logprob - trainer logprob| of the sampled tokens
    rollout_s: float
    train_s: float
    update_weights_s: float
    weight_version: int
    num_compilations: int  # the engine's, since it was built
    sample: str  # the first completion of the first prompt


@dataclasses.dataclass(frozen=True)
class RunResult:
    """A run: the engine's warm-up (its compilations and seconds), then each iteration."""

    warmup_compilations: int
    warmup_s: float
    iterations: list[Iteration]

    def mean_reward(self, first: bool, k: int = 3) -> float:
        """The mean reward of the first (or last) `k` iterations."""
        its = self.iterations[:k] if first else self.iterations[-k:]
        return float(np.mean([it.mean_reward for it in its]))


def run(
    iterations: int = 20,
    group_size: int = 8,
    seed: int = 0,
    *,
    max_tokens: int = 24,
    learning_rate: float = 1e-3,
    prompts: Sequence[str] = PROMPTS,
    log: Callable[[Iteration], None] | None = None,
) -> RunResult:
    """Runs the loop; returns what each iteration measured. Raises AssertionError if the
    engine compiled anything after its warm-up."""
    _, model, tokenizer = load_model("tiny-py")
    t0 = time.perf_counter()
    engine = Engine(model, ENGINE_CONFIG, tokenizer=tokenizer)
    engine.warmup()
    warmup_s = time.perf_counter() - t0
    warmup_compilations = engine.num_compilations

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(params)
    # Params are not donated: the engine may hold the model's own arrays until the
    # first update_weights.
    step = jax.jit(functools.partial(_train_step, optimizer=optimizer))
    length = max(len(tokenizer.encode(p)) for p in prompts) + max_tokens
    results: list[Iteration] = []
    for it in range(iterations):
        sampling = SamplingParams(
            n=group_size,
            temperature=1.0,
            max_tokens=max_tokens,
            seed=(seed * 1_000_003 + it * 1_000) % 2**30,
            logprobs=0,
        )
        t = time.perf_counter()
        batch = rollout(engine, prompts, sampling, length, tag=f"it{it}")
        t_rollout = time.perf_counter() - t

        advantages = group_advantages(batch.rewards).reshape(-1)
        t = time.perf_counter()
        params, opt_state, loss, logps = step(
            graphdef, params, rest, opt_state, batch.tokens, batch.mask, advantages
        )
        loss, logps = float(loss), np.asarray(logps)
        t_train = time.perf_counter() - t
        gap = float(np.max(np.abs(logps - batch.engine_logps) * batch.mask))

        t = time.perf_counter()
        # It returns after its finiteness check has read every new array, so the time
        # includes the copies.
        version = engine.update_weights(params)
        t_update = time.perf_counter() - t

        record = Iteration(
            iteration=it,
            mean_reward=float(batch.rewards.mean()),
            loss=loss,
            logprob_gap=gap,
            rollout_s=t_rollout,
            train_s=t_train,
            update_weights_s=t_update,
            weight_version=version,
            num_compilations=engine.num_compilations,
            sample=batch.texts[0][0],
        )
        results.append(record)
        if log is not None:
            log(record)
    assert engine.num_compilations == warmup_compilations, (
        f"the engine compiled {engine.num_compilations - warmup_compilations} step shape(s) "
        "after its warm-up"
    )
    return RunResult(warmup_compilations, warmup_s, results)


def define_flags() -> None:
    """Defines the script's flags; called only when it runs as a script, so that
    importing it (the tests do) defines no global absl flags."""
    flags.DEFINE_integer("iterations", 20, "Policy-gradient iterations.")
    flags.DEFINE_integer("group_size", 8, "Completions sampled per prompt (GRPO's G).")
    flags.DEFINE_integer("seed", 0, "Seed of the sampling.")
    flags.DEFINE_integer("max_tokens", 24, "Tokens per completion.")
    flags.DEFINE_float("learning_rate", 1e-3, "Adam's learning rate.")
    flags.DEFINE_string("json_out", None, "Write the per-iteration log here (JSON).")


def _print(it: Iteration) -> None:
    print(
        f"iter {it.iteration:3d}  reward {it.mean_reward:.3f}  loss {it.loss:+.4f}  "
        f"logprob gap {it.logprob_gap:.1e}  rollout {it.rollout_s:.2f}s  "
        f"train {it.train_s:.2f}s  update_weights {it.update_weights_s * 1e3:.1f}ms  "
        f"compilations {it.num_compilations}  sample {it.sample!r}",
        flush=True,
    )


def main(argv: Sequence[str]) -> None:
    """Runs the loop with the flags' settings, prints each iteration and the summary."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    result = run(
        f.iterations,
        f.group_size,
        f.seed,
        max_tokens=f.max_tokens,
        learning_rate=f.learning_rate,
        log=_print,
    )
    k = min(3, len(result.iterations))
    print(
        f"warm-up: {result.warmup_compilations} compilations in {result.warmup_s:.1f}s; "
        f"none after it. Mean reward: first {k} iterations {result.mean_reward(True, k):.3f}, "
        f"last {k} {result.mean_reward(False, k):.3f}"
    )
    if f.json_out:
        with open(f.json_out, "w") as out:
            json.dump(
                {
                    "warmup_compilations": result.warmup_compilations,
                    "warmup_s": result.warmup_s,
                    "iterations": [dataclasses.asdict(it) for it in result.iterations],
                },
                out,
                indent=1,
            )


if __name__ == "__main__":
    quiet_backend_probes()  # no "Unable to initialize backend 'tpu'" on a CPU machine
    define_flags()
    app.run(main)
