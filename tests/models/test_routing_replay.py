"""Routing replay through the engine (`SamplingParams.return_routed_experts`): the experts
the engine returns for each token equal the router's top-k on a dense forward pass, and
replaying them through the model (`routing=`) gives back that forward pass, for each MoE
family; with chunked prefill, preemption, n > 1 and async scheduling; without a compile
or a device-to-host copy for the requests that do not ask."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from engine_configs import small_config
from flax import nnx
from test_models import perturbed_model

from paxkv import SamplingParams
from paxkv.engine import Engine
from paxkv.engine.fake_runner import FakeRunner
from paxkv.engine.routed_experts import NOT_ROUTED
from paxkv.models.gpt_oss_config import TINY_GPT_OSS
from paxkv.models.moe_config import TINY_MIXTRAL, TINY_QWEN3_MOE

DENSE_LEN = 64  # the dense pass's padded length: routing is causal, padding after is inert
# One 16-token bucket: every prompt past 16 tokens is prefilled in chunks.
CHUNKED = dict(max_num_batched_tokens=16, token_buckets=(16,))
FAMILIES = {
    "mixtral": TINY_MIXTRAL,
    "qwen3-moe": TINY_QWEN3_MOE,
    "gpt-oss": TINY_GPT_OSS.replace(sliding_window=8),
}


@functools.cache
def _model(name):
    return perturbed_model(FAMILIES[name])


@nnx.jit
def _dense_and_replay(model, tokens, routing):  # one compile: the pass, then the replay
    logits, dense = model.dense_logits(tokens, return_routing=True)
    # The trainer's forward pass: the rollout's routing, the router's where it has none.
    routing = jnp.where(routing == NOT_ROUTED, dense, routing)
    replayed, used = model.dense_logits(tokens, routing=routing, return_routing=True)
    return logits, dense, replayed, used


def _padded(tokens):
    out = np.zeros(DENSE_LEN, np.int32)
    out[: len(tokens)] = tokens
    return jnp.asarray(out)


def _check_against_dense(model, prompt, completion):
    """The completion's routing is the dense pass's, row for row (i32[N, L, k]), but for
    the last token's, which the model never computed; replaying it reproduces the pass."""
    tokens = list(prompt) + completion.token_ids
    n, c = len(tokens), model.config
    got = completion.routed_experts
    assert got.shape == (n, c.num_layers, c.num_experts_per_tok) and got.dtype == np.int32
    assert (got[-1] == NOT_ROUTED).all()
    routing = np.full((DENSE_LEN, *got.shape[1:]), NOT_ROUTED, np.int32)
    routing[:n] = got
    logits, dense, replayed, used = _dense_and_replay(
        model, _padded(tokens), jnp.asarray(routing.transpose(1, 0, 2))
    )
    dense = np.asarray(dense).transpose(1, 0, 2)  # [DENSE_LEN, L, k]
    np.testing.assert_array_equal(got[:-1], dense[: n - 1])
    np.testing.assert_array_equal(np.asarray(used).transpose(1, 0, 2)[: n - 1], got[:-1])
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(logits))


def _run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = engine.run_until_done()
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_engine_routing_replays_the_dense_pass(name):
    model = _model(name)
    engine = Engine(model, small_config(64, **CHUNKED))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (30, 5)]
    params = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, return_routed_experts=True
    )
    outs = _run(engine, prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        _check_against_dense(model, prompt, out.outputs[0])
    # The routing is not trivial: the tokens go to several experts.
    assert len(np.unique(outs[0].outputs[0].routed_experts[:-1])) > 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_routing_with_chunks_preemption_and_siblings(mode):
    """A pool that holds one long request: the others are preempted and recomputed, and
    the routing returned is that of the final computation. n = 2 sampled completions
    share their prompt. Requests that do not ask compile nothing more and copy no
    routing to the host."""
    model = _model("mixtral")
    kw = CHUNKED | ({"async_scheduling": True} if mode == "async" else {})
    engine = Engine(model, small_config(12, **kw))
    copies = []
    fetch = engine.runner.fetch_routing
    engine.runner.fetch_routing = lambda handle: copies.append(1) or fetch(handle)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (30, 21, 9)]
    sampled = dict(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, n=2)
    plain = _run(engine, prompts, SamplingParams(**sampled))
    assert not copies and all(c.routed_experts is None for o in plain for c in o.outputs)
    compiles, preemptions = engine.num_compilations, engine.stats()["num_preemptions"]
    outs = _run(engine, prompts, SamplingParams(**sampled, return_routed_experts=True))
    assert engine.num_compilations == compiles
    assert engine.stats()["num_preemptions"] > preemptions
    assert copies
    for prompt, out in zip(prompts, outs, strict=True):
        # Its pages are its own: the same prompts' cached pages are not read.
        assert out.num_cached_tokens == 0
        for completion in out.outputs:
            _check_against_dense(model, prompt, completion)


def _routing_fake(config):
    runner = FakeRunner(256, config)
    runner.routing_shape = (2, 2)  # as if it routed: what is checked comes before a step
    return runner


def test_routing_requests_are_checked():
    asks = SamplingParams(return_routed_experts=True)
    fake = Engine(None, small_config(16), runner=lambda config: FakeRunner(256, config))
    with pytest.raises(ValueError, match="return_routed_experts=True needs a model that routes"):
        fake.add_request("a", {"prompt_token_ids": [1]}, asks)
    spec = {"num_speculative_tokens": 2, "prompt_lookup_min": 1}
    fake = Engine(None, small_config(16, speculative_config=spec), runner=_routing_fake)
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        fake.add_request("a", {"prompt_token_ids": [1]}, asks)
    assert not fake.has_unfinished()
    with pytest.raises(TypeError, match="return_routed_experts must be a bool"):
        SamplingParams(return_routed_experts=1)
