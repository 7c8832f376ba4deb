"""LoRA adapters with paged attention's other features: every request's tokens (and
logprobs) equal those of a plain engine with the same adapters, with n-gram and
draft-model speculative decoding (the draft runs without adapters), async scheduling,
multi-step decode loops, scanned layers and int8 KV pages (against int8 without LoRA
mixed in: the base rows are untouched by a neighbour's adapter)."""

import numpy as np
import pytest
from engine_configs import small_config
from peft_adapters import random_loras

from paxkv import SamplingParams
from paxkv.engine import Engine
from paxkv.models import layer_stack, load_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=4)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-features")
    config, model, _ = load_model("tiny", dtype="float32", seed=0)
    loras = random_loras(root, config, (1, 2, 3))
    rng = np.random.default_rng(0)
    # Repetitive prompts, so that n-gram lookup finds proposals.
    submissions = [
        ((rng.integers(0, 9, 4).tolist() * 5)[: 11 + 3 * i], [*loras, None][i % 4])
        for i in range(8)
    ]
    return config, model, submissions


def _serve(engine, submissions):
    for i, (prompt, lora) in enumerate(submissions):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY, lora_request=lora)
    done = engine.run_until_done()
    return [done[str(i)].outputs[0] for i in range(len(submissions))]


@pytest.fixture(scope="module")
def plain(setup):
    _, model, submissions = setup
    return _serve(Engine(model, small_config(96, **LORA)), submissions)


@pytest.mark.parametrize(
    "feature",
    ["ngram", "draft_model", "async", "decode_loop", "scan_layers"],
)
def test_feature_with_adapters_equals_the_plain_engine(setup, plain, feature):
    _, model, submissions = setup
    overrides, draft = dict(LORA), None
    if feature == "ngram":
        overrides["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3}
    elif feature == "draft_model":  # the base model drafts: adapters' rows reject some
        overrides["speculative_config"] = {
            "method": "draft_model",
            "num_speculative_tokens": 3,
            "model": "tiny",
        }
        draft = model
    elif feature == "async":
        overrides["async_scheduling"] = True
    elif feature == "decode_loop":
        overrides["num_decode_steps"] = 4
    else:
        model = layer_stack.with_scan_layers(model, True)
    engine = Engine(model, small_config(96, **overrides), draft_model=draft)
    got = _serve(engine, submissions)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    np.testing.assert_allclose(
        [o.cumulative_logprob for o in got], [o.cumulative_logprob for o in plain], atol=1e-4
    )
    stats = engine.stats()
    if feature in ("ngram", "draft_model"):
        assert stats["spec_decode_num_accepted_tokens"] > 0
    if feature == "decode_loop":
        assert stats["num_decode_loops"] > 0


def test_int8_pages_keep_base_rows_apart_from_adapter_rows(setup):
    _, model, submissions = setup
    base_only = [(p, None) for p, lora in submissions if lora is None]
    alone = _serve(Engine(model, small_config(96, kv_cache_dtype="int8")), base_only)
    mixed = _serve(Engine(model, small_config(96, kv_cache_dtype="int8", **LORA)), submissions)
    got = [o for o, (_, lora) in zip(mixed, submissions, strict=True) if lora is None]
    assert [o.token_ids for o in got] == [o.token_ids for o in alone]
    # And the adapters' rows are their own: not the base model's tokens.
    assert any(
        o.token_ids != a.token_ids
        for o, a in zip(mixed[:3], plain_like(model, submissions[:3]), strict=True)
    )


def plain_like(model, submissions):
    """The same prompts on the base model (int8 pages), adapters dropped."""
    base = [(p, None) for p, _ in submissions]
    return _serve(Engine(model, small_config(96, kv_cache_dtype="int8")), base)


def test_adapters_survive_sleep_and_wake(setup, plain):
    _, model, submissions = setup
    engine = Engine(model, small_config(96, **LORA))
    first = _serve(engine, submissions[:4])
    engine.sleep(level=2)  # the slots go to host memory with the weights, and come back
    engine.wake_up()
    second = _serve(engine, submissions[4:])
    assert [o.token_ids for o in first + second] == [o.token_ids for o in plain]


def test_adapters_on_quantized_weights_equal_the_dequantized_model(setup):
    from flax import nnx
    from quantized_reference import dequantized_reference

    from paxkv.models.quantized_weights import quantize_model

    _, model, submissions = setup
    quantized = nnx.clone(model)
    quantize_model(quantized, "int8")
    reference = dequantized_reference(model, quantized)
    got = _serve(Engine(quantized, small_config(96, **LORA)), submissions)
    want = _serve(Engine(reference, small_config(96, **LORA)), submissions)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    np.testing.assert_allclose(
        [o.cumulative_logprob for o in got], [o.cumulative_logprob for o in want], atol=1e-3
    )
