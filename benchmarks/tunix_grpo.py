"""Benchmark: Tunix's own GRPO trainer with paxkv as its rollout engine, on the CPU.

    .venv-tunix/bin/python -m benchmarks.tunix_grpo [--steps=30]

(In the venv of the `tunix` extra: `python3 -m venv .venv-tunix && .venv-tunix/bin/pip
install -e '.[tunix]'`.) A tiny random Tunix Llama 3 (2 layers, width 64, byte
vocabulary) learns to write the letter "a" (reward: the count of "a" in a 12-token
completion), 4 prompts x 4 generations a step, Tunix's `GRPOLearner` with
`paxkv.rl.tunix_rollout.PaxkvRollout`. Per step: the mean reward of its rollouts, the
time of `update_params` (the weight sync), the largest |logprob| gap between paxkv's
scoring and the actor's own forward (`tunix.rl.common.compute_per_token_logps`) on a
fixed batch after the sync, and the engine's compilations since warm-up.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

_STEPS = flags.DEFINE_integer("steps", 30, "GRPO steps.")


class ByteTokenizer:
    """Bytes past pad 0, BOS 1 and EOS 2."""

    PAD, BOS, EOS, OFF = 0, 1, 2, 3
    vocab_size = 256 + OFF

    def encode(self, text: str, **kw: object) -> list[int]:
        """The bytes of `text`, shifted."""
        return [b + self.OFF for b in text.encode("utf-8")]

    def decode(self, ids: list[int], **kw: object) -> str:
        """The text of `ids` (specials left out)."""
        return bytes(int(i) - self.OFF for i in ids if int(i) >= self.OFF).decode(
            "utf-8", errors="replace"
        )

    def bos_id(self) -> int:
        """The id Tunix asks for."""
        return self.BOS

    def eos_id(self) -> int:
        """The id Tunix asks for."""
        return self.EOS

    def pad_id(self) -> int:
        """The id Tunix asks for."""
        return self.PAD


def main(argv: list[str]) -> None:
    """Trains `--steps` GRPO steps and prints one line per step."""
    del argv
    from tunix.models.llama3 import model as llama3
    from tunix.rl import common
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    from paxkv.rl.tunix_rollout import PaxkvRollout

    tok = ByteTokenizer()
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    config = llama3.ModelConfig(
        num_layers=2, vocab_size=tok.vocab_size, embed_dim=64, hidden_dim=128, num_heads=4,
        head_dim=16, num_kv_heads=2, rope_theta=10_000, norm_eps=1e-5,
    )  # fmt: skip
    with mesh:
        actor = llama3.Llama3(config, rngs=nnx.Rngs(0))
        reference = llama3.Llama3(config, rngs=nnx.Rngs(0))
    steps = _STEPS.value
    cluster = rl.RLCluster(
        actor=actor,
        reference=reference,
        tokenizer=tok,
        cluster_config=rl.ClusterConfig(
            role_to_mesh={r: mesh for r in (rl.Role.ACTOR, rl.Role.REFERENCE, rl.Role.ROLLOUT)},
            rollout_engine=PaxkvRollout,
            offload_to_cpu=False,
            training_config=rl.RLTrainingConfig(
                actor_optimizer=optax.adamw(1e-2),
                eval_every_n_steps=10**6,
                max_steps=steps,
                mini_batch_size=4,
                train_micro_batch_size=4,
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=12, max_prompt_length=16, temperature=1.0, seed=0
            ),
        ),
    )
    rollout = cluster.rollout
    engine = rollout.llm.engine
    compiled = engine.num_compilations
    probe_p = jnp.asarray([[0] * 8 + [tok.BOS, *tok.encode("write a")]], jnp.int32)
    probe_c = jnp.asarray([tok.encode("aaaa bab aa")], jnp.int32)
    rows: list[dict] = []
    rewards: list[float] = []
    sync = rollout.update_params

    def timed_sync(params: object, filter_types: tuple | None = None) -> None:
        t0 = time.perf_counter()
        sync(params, filter_types)
        seconds = time.perf_counter() - t0
        # Tunix syncs under a transfer guard; the probe (not part of the sync) moves data.
        with jax.transfer_guard("allow"):
            measure(seconds)

    def measure(seconds: float) -> None:
        graphdef, state = nnx.split(cluster.actor_trainer.model)
        want = common.compute_per_token_logps(
            graphdef, state, probe_p, probe_c, pad_id=tok.PAD, eos_id=tok.EOS
        )
        got = rollout.get_per_token_logps(probe_p, probe_c)
        rows.append(
            {
                "update_s": seconds,
                "gap": float(jnp.abs(got - want).max()),
                "compilations": engine.num_compilations - compiled,
            }
        )

    rollout.update_params = timed_sync

    def count_a(prompts: list[str], completions: list[str], **kwargs: object) -> list[float]:
        r = [float(c.count("a")) for c in completions]
        rewards.append(float(np.mean(r)))
        return r

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(num_generations=4, num_iterations=1, beta=0.04),
        reward_fns=count_a,
    )
    prompts = ["write a", "say aaa", "a b c", "hello"]
    data = [{"prompts": np.array(prompts)} for _ in range(steps)]
    t0 = time.perf_counter()
    learner.train(data)
    print(f"GRPO steps: {cluster.actor_trainer.train_steps} in {time.perf_counter() - t0:.1f} s")
    print("| step | mean reward | update_params (ms) | max logprob gap | compilations |")
    print("|---:|---:|---:|---:|---:|")
    for i, (reward, row) in enumerate(zip(rewards, rows + [None] * len(rewards), strict=False)):
        if row is None:
            print(f"| {i} | {reward:.3f} | | | |")
            continue
        print(
            f"| {i} | {reward:.3f} | {row['update_s'] * 1e3:.1f} | {row['gap']:.1e} "
            f"| {row['compilations']} |"
        )


if __name__ == "__main__":
    app.run(main)
