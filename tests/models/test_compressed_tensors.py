"""Pre-quantized checkpoints in compressed-tensors' format (llm-compressor's): 8-bit
weights with their scales, read as the quantized model they are, against transformers
loading the same files through compressed-tensors, logit for logit and greedy token for
token; the schemes not read are refused naming the field."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import greedy, write_checkpoint

from paxkv import LLM, SamplingParams
from paxkv.models import load_hf_checkpoint
from paxkv.models.llama_config import TINY
from paxkv.models.moe_config import TINY_MIXTRAL

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROJECTIONS += ("w1", "w2", "w3")  # Mixtral's experts
QMAX = {"int": 127.0, "float": 448.0}  # int8, float8 e4m3


def write_compressed(base, out, *, kind="int", strategy="channel", activations=False):
    """`base`'s float checkpoint quantized as llm-compressor stores it: each projection's
    `weight` in int8 or float8 e4m3 (`[out, in]`) and its `weight_scale` (`[out, 1]` per
    channel, `[1]` per tensor), symmetric absmax; `config.json` with the
    quantization_config. `activations`: a W8A8 config (dynamic per-token int8 inputs)."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for name, w in load_file(f"{base}/model.safetensors").items():
        if not (name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS):
            tensors[name] = w
            continue
        absmax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax()
        scale = absmax.reshape(-1, 1) if strategy == "channel" else absmax.reshape(1)
        scale = scale / QMAX[kind]
        q = w / scale.reshape(-1, 1) if strategy == "channel" else w / scale
        if kind == "int":
            q = torch.clamp(torch.round(q), -128, 127).to(torch.int8)
        else:
            q = q.clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[name] = q
        tensors[name.removesuffix("weight") + "weight_scale"] = scale.to(w.dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, f"{out}/model.safetensors")
    config = json.loads((base / "config.json").read_text())
    fmt = f"{kind}-quantized"
    scheme = {
        "targets": ["Linear"],
        "format": fmt,
        "weights": {"num_bits": 8, "type": kind, "strategy": strategy, "symmetric": True},
        "input_activations": (
            {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
            if activations
            else None
        ),
    }
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": scheme},
        "ignore": ["lm_head"],
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def _reference(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    ("config", "kind", "strategy"),
    [
        (TINY, "int", "channel"),
        (TINY, "int", "tensor"),
        (TINY, "float", "channel"),
    ],
    ids=["llama-int8-channel", "llama-int8-tensor", "llama-fp8-channel"],
)
def test_logits_equal_transformers_reading_the_same_files(config, kind, strategy, tmp_path):
    write_checkpoint(config, tmp_path / "base")
    path = write_compressed(tmp_path / "base", tmp_path / "q", kind=kind, strategy=strategy)
    loaded, model = load_hf_checkpoint(path)
    assert loaded.quantization == {"int": "int8", "float": "fp8"}[kind]
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, 30)
    with torch.no_grad():
        expected = _reference(path)(torch.tensor(tokens)[None]).logits[0].numpy()
    got = np.asarray(model.dense_logits(jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)


def write_dequantized(compressed, out):
    """`compressed`'s checkpoint with every quantized weight replaced by its `values *
    scale` in float32 and no quantization_config: the float model it stands for."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{compressed}/model.safetensors")
    plain = {}
    for name, t in tensors.items():
        if name.endswith("weight_scale"):
            continue
        scale = tensors.get(name.removesuffix("weight") + "weight_scale")
        plain[name] = t if scale is None else t.to(torch.float32) * scale.to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(plain, f"{out}/model.safetensors")
    config = json.loads((compressed / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_moe_experts_read_from_compressed_files_equal_their_dequantized_model(tmp_path):
    # transformers 5 fuses Mixtral's experts and cannot convert their per-expert
    # quantized tensors, so the oracle is the float model the files stand for (a float
    # checkpoint paxkv reads as transformers does: tests/models/test_moe.py).
    write_checkpoint(TINY_MIXTRAL, tmp_path / "base")
    path = write_compressed(tmp_path / "base", tmp_path / "q")
    loaded, model = load_hf_checkpoint(path)
    assert loaded.quantization == "int8"
    experts = model.layers[0].block_sparse_moe.experts
    assert experts.w1.get_value().dtype == np.int8 and experts.w1_scale.get_value().shape[1] == 1
    _, reference = load_hf_checkpoint(write_dequantized(path, tmp_path / "dq"))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, 24), jnp.int32)
    got, want = (np.asarray(m.dense_logits(tokens)) for m in (model, reference))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


def test_llm_serves_a_compressed_checkpoint_as_transformers_does(tmp_path):
    write_checkpoint(TINY, tmp_path / "base")
    path = write_compressed(tmp_path / "base", tmp_path / "q")
    reference = _reference(path)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, TINY.vocab_size, n).tolist() for n in (3, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(model=str(path), warmup=False, num_pages=32, page_size=8, max_model_len=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [greedy(reference, p, 8) for p in prompts]
    assert llm.engine.model_config.quantization == "int8"


def test_a_w8a8_checkpoint_quantizes_its_activations_too(tmp_path):
    write_checkpoint(TINY, tmp_path / "base")
    w8a8 = write_compressed(tmp_path / "base", tmp_path / "w8a8", activations=True)
    w8 = write_compressed(tmp_path / "base", tmp_path / "w8")
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, 20), jnp.int32)
    config, model = load_hf_checkpoint(w8a8)
    assert config.quantization == "w8a8-int8"
    assert model.layers[0].self_attn.q_proj.input_qtype == jnp.int8
    a = np.asarray(model.dense_logits(tokens))
    b = np.asarray(load_hf_checkpoint(w8)[1].dense_logits(tokens))
    # The same weights; the activations' rounding moves the logits a little.
    assert 0 < np.abs(a - b).max() < 0.05 * np.abs(b).max()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quant_method": "awq"}, r"quant_method='awq'.*not read"),
        ({"format": "pack-quantized"}, r"format'='pack-quantized'"),
        ({"ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, r"ignore'=.*only lm_head"),
        ({"weights": {"strategy": "group", "group_size": 128}}, r"group_size'=128"),
        ({"weights": {"num_bits": 4}}, r"num_bits'=4: only 8 is read"),
        ({"weights": {"symmetric": False}}, r"symmetric'=False"),
    ],
)
def test_schemes_not_read_are_refused_naming_the_field(change, message):
    from paxkv.models import config_from_hf

    group = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
    }
    group["weights"] |= change.pop("weights", {})
    q = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    } | change
    with pytest.raises(ValueError, match=message):
        config_from_hf(TINY.to_hf() | {"quantization_config": q})


@pytest.mark.parametrize("config", [TINY, TINY_MIXTRAL], ids=["llama", "mixtral"])
def test_a_float_checkpoint_is_quantized_as_it_loads(config, tmp_path):
    import jax
    from flax import nnx

    from paxkv.models import load_model
    from paxkv.models.quantized_weights import quantize_model

    write_checkpoint(config, tmp_path)
    loaded, model = load_hf_checkpoint(tmp_path, quantization="int8")
    _, after = load_hf_checkpoint(tmp_path)
    quantize_model(after, "int8")
    assert loaded == after.config and loaded.quantization == "int8"
    for a, b in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)),
        jax.tree.leaves(nnx.state(after, nnx.Param)),
        strict=True,
    ):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert load_model(tmp_path, quantization="fp8")[0].quantization == "fp8"
    with pytest.raises(ValueError, match="quantized already"):
        load_hf_checkpoint(write_compressed(tmp_path, tmp_path / "q"), quantization="fp8")
