"""PEFT as the oracle: LoRA adapters written by PEFT over transformers' tiny models,
and the merged models that are their reference (`merge_and_unload`)."""

import copy

import numpy as np
import pytest
from hf_reference import write_checkpoint

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_base(config, path):
    """A transformers model of `config` saved in `path` (random, O(1) weights)."""
    return write_checkpoint(config, path)


def write_adapter(base, path, *, r, alpha, targets, seed, rslora=False, rank_pattern=None):
    """A PEFT LoRA adapter over the torch model `base` with random A and B (PEFT starts
    B at zero: a zero adapter would hide every indexing bug), saved in `path`; returns
    the merged torch model, the reference of a request under it."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=rslora,
        rank_pattern=rank_pattern or {},
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / np.sqrt(p.shape[-1]))
    model.save_pretrained(path, safe_serialization=True)
    return model.merge_and_unload().eval()


def write_random_adapter(path, config, *, r, alpha, targets, seed):
    """A LoRA adapter in PEFT's files for a model of `config` (a paxkv config), random
    A and B, written with NumPy and safetensors alone (for models with no transformers
    class, like tiny-py); the parity tests check PEFT's own files against transformers."""
    import json
    import os

    from safetensors.numpy import save_file

    from paxkv.models.lora_checkpoint import _dims

    rng = np.random.default_rng(seed)
    holder = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
    holder |= {"o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    tensors = {}
    for layer in range(config.num_layers):
        for name in targets:
            d_in, d_out = _dims(config, name)
            key = f"base_model.model.model.layers.{layer}.{holder[name]}.{name}"
            tensors[f"{key}.lora_A.weight"] = (rng.normal(size=(r, d_in)) / np.sqrt(d_in)).astype(
                np.float32
            )
            tensors[f"{key}.lora_B.weight"] = (rng.normal(size=(d_out, r)) / np.sqrt(r)).astype(
                np.float32
            )
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f)
    return str(path)
