"""gpt-oss's MXFP4 experts (the published checkpoints' format): `_blocks` and `_scales`
tensors dequantized as they load, against transformers' own MXFP4 dequantization of the
same tensors (`convert_moe_packed_tensors`), logit for logit through the float model
they stand for."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import write_checkpoint

from paxkv.models import load_hf_checkpoint
from paxkv.models.gpt_oss_config import TINY_GPT_OSS
from paxkv.models.weights import FP4_VALUES, dequantize_mxfp4

torch = pytest.importorskip("torch")
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def to_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`w [E, in, out]` as MXFP4 blocks `u8[E, out, in / 32, 16]` and scales
    `u8[E, out, in / 32]`: each 32 values get the power of two that brings their absmax
    to at most 6 (e2m1's largest), each value the nearest e2m1 code."""
    t = np.ascontiguousarray(w.transpose(0, 2, 1), np.float32)  # [E, out, in]
    e, r, k = t.shape
    groups = t.reshape(e, r, k // 32, 32)
    absmax = np.abs(groups).max(-1, keepdims=True)
    exponent = np.ceil(np.log2(np.maximum(absmax, 1e-30) / 6.0)).astype(np.int32)
    scaled = groups / np.ldexp(1.0, exponent)
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(-1).astype(np.uint8)  # nearest
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent[..., 0] + 127).astype(np.uint8)


def test_mxfp4_experts_equal_transformers_dequantization(tmp_path):
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    write_checkpoint(TINY_GPT_OSS, tmp_path / "base")
    tensors = load_file(f"{tmp_path}/base/model.safetensors")
    packed, reference = {}, {}
    for name, t in tensors.items():
        if not name.endswith(EXPERT_WEIGHTS):
            packed[name] = reference[name] = t
            continue
        blocks, scales = to_mxfp4(t)
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        # transformers' reading of the same bytes: the oracle of the values.
        theirs = convert_moe_packed_tensors(
            torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
        ).numpy()
        np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales), theirs)
        assert 0 < np.abs(theirs - t).max() < 0.5 * np.abs(t).max()  # quantized, not copied
        reference[name] = theirs
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    for name, files in (("mxfp4", packed), ("reference", reference)):
        (tmp_path / name).mkdir()
        save_file(files, f"{tmp_path}/{name}/model.safetensors")
        with_q = config | (
            {"quantization_config": {"quant_method": "mxfp4"}} if name == "mxfp4" else {}
        )
        (tmp_path / name / "config.json").write_text(json.dumps(with_q))
    _, model = load_hf_checkpoint(tmp_path / "mxfp4")
    _, float_model = load_hf_checkpoint(tmp_path / "reference")  # read as transformers does
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, 24), jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(model.dense_logits(tokens)), np.asarray(float_model.dense_logits(tokens))
    )
    # And on to int8 experts as they load, as from the float checkpoint.
    config, int8 = load_hf_checkpoint(tmp_path / "mxfp4", quantization="int8")
    _, int8_from_float = load_hf_checkpoint(tmp_path / "reference", quantization="int8")
    experts = int8.layers[0].mlp.experts
    assert config.quantization == "int8" and experts.gate_up_proj.get_value().dtype == np.int8
    np.testing.assert_array_equal(
        np.asarray(int8.dense_logits(tokens)), np.asarray(int8_from_float.dense_logits(tokens))
    )


def test_bad_mxfp4_tensors_are_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    write_checkpoint(TINY_GPT_OSS, tmp_path)
    tensors = load_file(f"{tmp_path}/model.safetensors")
    name = next(n for n in tensors if n.endswith(EXPERT_WEIGHTS[0]))
    blocks, scales = to_mxfp4(tensors.pop(name))
    tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales[..., :1]
    save_file(tensors, f"{tmp_path}/model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"MXFP4 tensor {name}: blocks"):
        load_hf_checkpoint(tmp_path)
