"""paxkv as Tunix's rollout engine (`paxkv.rl.tunix_rollout`), against the real package:
per-token logprobs equal to Tunix's own actor forward (`tunix.rl.common.
compute_per_token_logps`) for tiny Llama 3, Qwen2 and Qwen3 actors, before and after
`update_params`; greedy rollouts that are the actor's argmax at every step; Tunix's own
`GRPOLearner` training through it with nothing compiled after warm-up.

Tunix cannot share the test extra's environment (it pins an older transformers), so
`.ci/run` runs this file in a virtualenv of its own (`pip install -e '.[tunix]'`); in
the main one it skips."""

import functools

import numpy as np
import pytest

tunix = pytest.importorskip("tunix")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.rl import common  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from paxkv.rl.tunix_rollout import PaxkvRollout  # noqa: E402

ENGINE = dict(num_pages=96, page_size=8, max_num_seqs=8, max_num_batched_tokens=64)


class ByteTokenizer:
    """Bytes shifted past pad 0, BOS 1 and EOS 2: what Tunix's tokenizer adapter takes."""

    PAD, BOS, EOS, OFF = 0, 1, 2, 3
    vocab_size = 256 + OFF

    def encode(self, text, **kw):
        return [b + self.OFF for b in text.encode("utf-8")]

    def decode(self, ids, **kw):
        data = bytes(int(i) - self.OFF for i in ids if int(i) >= self.OFF)
        return data.decode("utf-8", errors="replace")

    def bos_id(self):
        return self.BOS

    def eos_id(self):
        return self.EOS

    def pad_id(self):
        return self.PAD


def _mesh():
    return jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _actor(family: str, seed: int = 0):
    """A tiny random Tunix model of `family`, f32."""
    common_fields = dict(
        num_layers=2,
        vocab_size=ByteTokenizer.vocab_size,
        embed_dim=64,
        hidden_dim=128,
        num_heads=4,
        head_dim=16,
        num_kv_heads=2,
        rope_theta=10_000,
        norm_eps=1e-5,
    )
    with _mesh():
        if family == "llama3":
            from tunix.models.llama3 import model as lib

            return lib.Llama3(lib.ModelConfig(**common_fields), rngs=nnx.Rngs(seed))
        if family == "qwen2":
            from tunix.models.qwen2 import model as lib

            return lib.Qwen2(
                lib.ModelConfig(**common_fields, use_tied_embedding=True), rngs=nnx.Rngs(seed)
            )
        from tunix.models.qwen3 import model as lib

        return lib.Qwen3(lib.ModelConfig(**common_fields), rngs=nnx.Rngs(seed))


def _perturb(actor, scale=0.05, seed=1):
    """The actor's Params plus noise (Tunix's biases and norms start at 0 and 1)."""
    state = nnx.state(actor, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(state))))
    new = jax.tree.map(lambda x: x + scale * jax.random.normal(next(keys), x.shape, x.dtype), state)
    nnx.update(actor, new)
    return nnx.state(actor, nnx.Param)


def _batch(tok, rollout, prompts, completions, width=16, length=12):
    """Left-padded prompts i32[B, width] and right-padded completions i32[B, length]."""
    p = np.full((len(prompts), width), tok.PAD, np.int32)
    c = np.full((len(prompts), length), tok.PAD, np.int32)
    for i, (text, comp) in enumerate(zip(prompts, completions, strict=True)):
        ids = rollout._prompt_ids(text, width)
        p[i, width - len(ids) :] = ids
        c[i, : len(comp)] = comp
    return jnp.asarray(p), jnp.asarray(c)


def _tunix_logps(actor, tok, prompts, completions):
    graphdef, state = nnx.split(actor)
    return common.compute_per_token_logps(
        graphdef, state, prompts, completions, pad_id=tok.PAD, eos_id=tok.EOS
    )


# Qwen2 maps as Llama 3 does with biases on q/k/v; Qwen3's q/k norms are the other
# mapping: CI runs those two (`-m slow` adds Qwen2).
@pytest.mark.parametrize(
    "family", ["llama3", pytest.param("qwen2", marks=pytest.mark.slow), "qwen3"]
)
def test_logprobs_equal_tunix_actor_before_and_after_update_params(family):
    tok = ByteTokenizer()
    actor = _actor(family)
    _perturb(actor, seed=1)
    rollout = PaxkvRollout(
        rollout_actor=actor,
        tokenizer=tok,
        mesh=_mesh(),
        rollout_config=base_rollout.RolloutConfig(max_prompt_length=16, max_tokens_to_generate=12),
        warmup=False,
        **ENGINE,
    )
    rng = np.random.default_rng(0)
    completions = [rng.integers(3, 259, n).tolist() for n in (12, 5, 1, 9)]
    prompts = ["def f(x):", "hello", "a", "the quick brown fox jumps"]
    p, c = _batch(tok, rollout, prompts, completions)
    mask = np.asarray(c) != tok.PAD
    for step in range(2):
        got = np.asarray(rollout.get_per_token_logps(p, c))
        want = np.asarray(_tunix_logps(actor, tok, p, c))
        assert got.shape == want.shape == c.shape and got.dtype == np.float32
        np.testing.assert_allclose(got[mask], want[mask], atol=2e-5, rtol=1e-5)
        assert (got[~mask] == 0).all()
        if step == 0:  # the trainer steps: new weights, synced as RLCluster syncs them
            new = _perturb(actor, seed=2)
            rollout.update_params(new, (nnx.Param,))
            assert rollout.llm.engine.weight_version == 1


def test_greedy_rollouts_are_the_actors_argmax_and_follow_tunix_conventions():
    tok = ByteTokenizer()
    actor = _actor("llama3")
    _perturb(actor, scale=0.3, seed=3)
    config = base_rollout.RolloutConfig(
        max_prompt_length=16, max_tokens_to_generate=10, temperature=0.0, return_logprobs=True
    )
    rollout = PaxkvRollout(
        rollout_actor=actor,
        tokenizer=tok,
        mesh=_mesh(),
        rollout_config=config,
        warmup=False,
        **ENGINE,
    )
    prompts = ["def f(x):", "hello", "a" * 40]
    out = rollout.generate(prompts, config)
    assert out.left_padded_prompt_tokens.shape == (3, 16)
    assert out.left_padded_prompt_tokens.dtype == np.int32
    assert out.left_padded_prompt_tokens[2].tolist() == tok.encode("a" * 40)[-16:]  # cut left
    assert out.left_padded_prompt_tokens[1].tolist()[-6:] == [tok.BOS, *tok.encode("hello")]
    assert out.left_padded_prompt_tokens[1].tolist()[:10] == [tok.PAD] * 10
    for i, tokens in enumerate(out.tokens):
        assert tokens.dtype == np.int32 and 1 <= len(tokens) <= 10
        assert tok.EOS not in tokens.tolist()
        assert out.text[i] == tok.decode(tokens.tolist())
        p, c = _batch(tok, rollout, [prompts[i]], [tokens.tolist()], length=len(tokens))
        # Each token is the actor's argmax after the ones before it.
        graphdef, state = nnx.split(actor)
        logps = np.asarray(_tunix_logps(actor, tok, p, c))[0]
        np.testing.assert_allclose(out.logprobs[i], logps, atol=2e-5, rtol=1e-5)
        seq = jnp.concatenate([p, c], axis=1)
        positions = jnp.maximum(jnp.cumsum(seq != tok.PAD, axis=1) - 1, 0)
        n = seq.shape[1]
        keep = (seq != tok.PAD)[:, None, :] & jnp.tril(jnp.ones((n, n), bool))[None]
        logits, _ = nnx.merge(graphdef, state)(seq, positions, None, keep)
        argmax = np.asarray(jnp.argmax(logits[0, p.shape[1] - 1 : -1], axis=-1))
        assert argmax.tolist() == tokens.tolist(), (i, argmax, tokens)


def test_tunix_grpo_trains_through_paxkv_with_nothing_compiled_after_warmup():
    tok = ByteTokenizer()
    mesh = _mesh()
    actor = _actor("llama3", seed=0)
    reference = _actor("llama3", seed=0)
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=12,
        max_prompt_length=16,
        kv_cache_size=32,
        temperature=0.9,
        top_k=50,
        seed=0,
    )
    training_config = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.adamw(1e-2),
        eval_every_n_steps=100,
        max_steps=3,
        mini_batch_size=2,
        train_micro_batch_size=2,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=actor,
        reference=reference,
        tokenizer=tok,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={
                r: mesh
                for r in (
                    rl_cluster_lib.Role.ACTOR,
                    rl_cluster_lib.Role.REFERENCE,
                    rl_cluster_lib.Role.ROLLOUT,
                )
            },
            rollout_engine=functools.partial(PaxkvRollout, **ENGINE),
            offload_to_cpu=False,
            training_config=training_config,
            rollout_config=rollout_config,
        ),
    )
    rollout = cluster.rollout
    assert isinstance(rollout, PaxkvRollout)
    rewards = []

    def count_a(prompts, completions, **kwargs):
        r = [float(c.count("a")) for c in completions]
        rewards.append(float(np.mean(r)))
        return r

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1, beta=0.04),
        reward_fns=count_a,
    )
    assert learner.should_sync_weights  # the engine holds its own weights: Tunix syncs them
    compiled = rollout.llm.engine.num_compilations
    before = jax.tree.map(np.asarray, nnx.state(cluster.actor_trainer.model, nnx.Param))
    prompts = ["say aaa", "hello", "banana", "abc", "xyz", "q"]
    data = [{"prompts": np.array(prompts[i : i + 2])} for i in range(0, 6, 2)]
    learner.train(data)
    assert cluster.actor_trainer.train_steps == 3
    assert len(rewards) == 3
    after = nnx.state(cluster.actor_trainer.model, nnx.Param)
    assert (
        max(
            float(np.abs(np.asarray(a) - b).max())
            for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True)
        )
        > 0
    )
    engine_ = rollout.llm.engine
    assert engine_.weight_version >= 2  # synced after each step
    assert engine_.num_compilations == compiled  # warm-up ("full") compiled every program
    # The synced weights are the trainer's: scoring equals the actor's own forward.
    p, c = _batch(tok, rollout, ["say aaa"], [tok.encode("aaaa")], length=4)
    np.testing.assert_allclose(
        np.asarray(rollout.get_per_token_logps(p, c)),
        np.asarray(_tunix_logps(cluster.actor_trainer.model, tok, p, c)),
        atol=2e-5,
        rtol=1e-5,
    )
    assert engine_.pool.num_in_use == 0  # no page left held
