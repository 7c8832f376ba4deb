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
    A and B (`benchmarks.lora.random_adapter`), written with safetensors alone (for
    models with no transformers class, like tiny-py); the parity tests check PEFT's own
    files against transformers."""
    import json
    import os

    from safetensors.numpy import save_file

    from benchmarks.lora import random_adapter

    tensors, adapter_config = random_adapter(config, r, seed, targets=targets, alpha=alpha)
    os.makedirs(path, exist_ok=True)
    tensors = {k: v.astype(np.float32) for k, v in tensors.items()}
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", **adapter_config, "target_modules": targets}, f)
    return str(path)


def random_loras(root, config, ids, *, r=4, alpha=8):
    """`LoRARequest`s `a{i}` for `i` in `ids`, each a random adapter of every target
    written under `root`."""
    from paxkv import LoRARequest

    return [
        LoRARequest(
            f"a{i}",
            i,
            write_random_adapter(
                root / f"a{i}", config, r=r, alpha=alpha, targets=ALL_TARGETS, seed=i
            ),
        )
        for i in ids
    ]
