"""Quantized weights (int8 and fp8, a scale per output channel) against a
dequantize-then-matmul reference: the same model with every quantized kernel replaced
by `values * scale` in f32, per family (dense, Qwen3, Gemma 3, Mixtral and Qwen3-MoE
experts, gpt-oss), logit for logit; the engine against the quantized model's dense
oracle, token for token; the bytes halved against bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from quantized_reference import dequantized_reference
from test_gemma import check_engine_matches_dense
from test_models import perturbed_model

from paxkv.models import load_model
from paxkv.models.gemma_config import TINY_GEMMA3
from paxkv.models.gpt_oss_config import TINY_GPT_OSS
from paxkv.models.llama_config import TINY, TINY_QWEN3
from paxkv.models.moe_config import TINY_MIXTRAL, TINY_QWEN3_MOE
from paxkv.models.quantized_weights import QTYPES, quantize_model

pytest.importorskip("qwix")

CONFIGS = {
    "llama": TINY,
    "qwen3": TINY_QWEN3,
    "gemma3": TINY_GEMMA3.replace(sliding_window=8),
    "mixtral": TINY_MIXTRAL,
    "qwen3-moe": TINY_QWEN3_MOE,
    "gpt-oss": TINY_GPT_OSS,
}


# In CI: int8 for every form of projection and experts (Llama, Gemma 3's GeGLU,
# Mixtral's experts, gpt-oss's fused and biased experts), fp8 for a dense and a MoE one.
# The rest (Qwen3 and Qwen3-MoE, which add nothing quantization reads; fp8 of the
# others) are slow tests.
IN_CI = {("llama", "int8"), ("gemma3", "int8"), ("mixtral", "int8"), ("gpt-oss", "int8")}
IN_CI |= {("llama", "fp8"), ("mixtral", "fp8")}
CASES = [
    pytest.param(
        name,
        mode,
        marks=[] if (name, mode) in IN_CI else pytest.mark.slow,
    )
    for name in sorted(CONFIGS)
    for mode in ("fp8", "int8")  # weight-only (W8A8 moves the activations: below)
]


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_quantized_logits_equal_the_dequantized_reference(name, mode):
    original = perturbed_model(CONFIGS[name].replace(dtype="float32"))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, 24), jnp.int32)
    before = np.asarray(original.dense_logits(tokens))
    model = nnx.clone(original)
    quantize_model(model, mode)
    assert model.config.quantization == mode
    got = np.asarray(model.dense_logits(tokens))
    reference = np.asarray(dequantized_reference(original, model).dense_logits(tokens))
    np.testing.assert_allclose(got, reference, rtol=0, atol=2e-5)
    # Quantized, not a copy: the logits moved (how far, on a trained model:
    # docs/quantization.md; these random ones are sharp, which amplifies it).
    moved = np.abs(got - before).max()
    assert 0 < moved < np.abs(before).max()


def test_the_weights_round_to_their_channel_scale():
    model = perturbed_model(TINY.replace(dtype="float32"))
    kernel = np.asarray(model.layers[0].self_attn.q_proj.kernel.get_value())
    quantize_model(model, "int8")
    proj = model.layers[0].self_attn.q_proj
    values, scale = np.asarray(proj.kernel.get_value()), np.asarray(proj.kernel_scale.get_value())
    assert values.dtype == np.int8 and scale.shape == (1, kernel.shape[1])
    # qwix's absmax calibration maps each column's largest magnitude to 127.5 steps.
    np.testing.assert_allclose(scale[0], np.abs(kernel).max(axis=0) / 127.5, rtol=1e-6)
    error = np.abs(values * scale - kernel)
    inner = np.abs(kernel) < 127 * scale  # rounded to the nearest step
    assert (error[inner] <= (scale / 2 + 1e-7).repeat(kernel.shape[0], 0)[inner]).all()
    assert error.max() <= scale.max() / 2 + 1e-7 or (error <= scale + 1e-7).all()


@pytest.mark.parametrize(("name", "mode"), [("llama", "int8"), ("mixtral", "int8")])
def test_engine_greedy_equals_the_quantized_dense_oracle(name, mode):
    model = perturbed_model(CONFIGS[name].replace(dtype="float32"))
    quantize_model(model, mode)
    check_engine_matches_dense(model, hybrid_kv_cache=False)


def test_int8_halves_the_bf16_bytes_of_the_weights_it_quantizes():
    _, model, _ = load_model("tiny", dtype="bfloat16")
    sizes = lambda m, kind: sum(
        x.nbytes
        for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(m, nnx.Param))
        if ("proj" in jax.tree_util.keystr(path)) == (kind == "projections")
    )
    before = sizes(model, "projections"), sizes(model, "rest")
    quantize_model(model, "int8")
    after = sizes(model, "projections"), sizes(model, "rest")
    # The scales (one bf16 per output channel) are the only bytes beyond half.
    assert before[0] / 2 < after[0] < before[0] / 2 * 1.05
    assert after[1] == before[1]  # embedding, head and norms untouched


def test_bad_modes_and_double_quantization_are_refused():
    _, model, _ = load_model("tiny", dtype="float32")
    with pytest.raises(
        ValueError, match=r"quantization='int4' must be one of \['fp8', 'int8', 'w8a8"
    ):
        quantize_model(model, "int4")
    quantize_model(model, "int8")
    with pytest.raises(ValueError, match="quantized already"):
        quantize_model(model, "fp8")
    with pytest.raises(ValueError, match="quantization='int4'"):
        load_model("tiny", quantization="int4")


def test_update_weights_quantizes_a_float_tree_in_place():
    from engine_configs import small_config

    from paxkv import SamplingParams
    from paxkv.engine import Engine

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]

    def serve(engine):
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        done = engine.run_until_done()
        return [done[str(i)].outputs[0] for i in range(len(prompts))]

    old, new = (perturbed_model(TINY.replace(dtype="float32"), seed=s) for s in (0, 1))
    quantized_old, quantized_new = nnx.clone(old), nnx.clone(new)
    quantize_model(quantized_old, "int8")
    quantize_model(quantized_new, "int8")
    engine = Engine(quantized_old, small_config(64))
    engine.warmup()
    compiled = engine.num_compilations
    serve(engine)
    engine.update_weights(nnx.state(new, nnx.Param))  # a float tree, as a trainer holds it
    got = serve(engine)
    expected = serve(Engine(quantized_new, small_config(64)))
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.cumulative_logprob for o in got] == [o.cumulative_logprob for o in expected]
    assert engine.num_compilations == compiled
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(new, nnx.Param))
    with pytest.raises(ValueError, match="give it in float32"):
        engine.update_weights(bf16)


# compressed-tensors checkpoints are read: tests/models/test_compressed_tensors.py.
@pytest.mark.parametrize("method", ["fp8", "awq", "gptq"])
def test_a_pre_quantized_checkpoint_is_refused_naming_its_format(method):
    from paxkv.models import config_from_hf

    hf = TINY.to_hf() | {"quantization_config": {"quant_method": method}}
    with pytest.raises(ValueError, match=f"quant_method='{method}'.*quantization='int8' or 'fp8'"):
        config_from_hf(hf)


@pytest.mark.parametrize("mode", ["w8a8-int8", "w8a8-fp8"])
def test_a_w8a8_projection_is_the_matmul_of_its_quantized_operands(mode):
    """Each input row is quantized with its own absmax scale (within half a step of
    the row for int8), and the projection equals the float matmul of the dequantized
    row and the dequantized kernel."""
    import qwix

    from paxkv.models.layers import project

    model = perturbed_model(TINY.replace(dtype="float32"))
    quantize_model(model, mode)
    proj = model.layers[0].mlp.down_proj
    x = jnp.asarray(np.random.default_rng(4).normal(size=(9, proj.kernel.shape[0])), jnp.float32)
    xq = qwix.quantize(x, QTYPES[mode], channelwise_axes=[0])
    rows = np.asarray(qwix.dequantize(xq))
    if mode == "w8a8-int8":
        step = np.abs(np.asarray(x)).max(axis=1, keepdims=True) / 127.5
        assert (np.abs(rows - np.asarray(x)) <= step / 2 + 1e-6).all()
    kernel = np.asarray(proj.kernel.get_value(), np.float32) * np.asarray(
        proj.kernel_scale.get_value()
    )
    expected = np.matmul(rows.astype(np.float64), kernel.astype(np.float64))
    got = np.asarray(project(proj, x, None))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    # Not weight-only: quantizing the rows moved the result.
    weight_only = np.asarray(x, np.float64) @ kernel.astype(np.float64)
    assert np.abs(got - weight_only).max() > 1e-4 * np.abs(weight_only).max()


@pytest.mark.parametrize(("mode", "most", "mean"), [("int8", 1e-5, 1e-6), ("w8a8-int8", 0.1, 0.01)])
def test_the_engine_scores_a_prompt_as_the_dense_oracle(mode, most, mean):
    """tiny-py's paged, chunked prompt logprobs against its dense forward. Weight-only,
    they agree to float rounding. W8A8 rounds each row to a step of 1/127.5 of its
    absmax, so what the paged and dense attentions leave (equal to ~1e-6) can land on
    either side of a step: measured, 0.033 nats at most and 0.005 on average over this
    prompt; the bounds are 3x and 2x that (an indexing bug moves nats)."""
    from engine_configs import small_config

    from paxkv import SamplingParams
    from paxkv.engine import Engine

    _, model, _ = load_model("tiny-py", quantization=mode)
    prompt = list(b"import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n")
    engine = Engine(model, small_config(64, max_num_batched_tokens=16, token_buckets=(16,)))
    engine.add_request(
        "p", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=0, prompt_logprobs=0)
    )
    got = engine.run_until_done()["p"].prompt_logprobs
    logits = np.asarray(model.dense_logits(jnp.asarray(prompt, jnp.int32)), np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    diff = np.array(
        [abs(got[p][prompt[p]].logprob - logp[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    )
    assert diff.max() < most and diff.mean() < mean, (diff.max(), diff.mean())
