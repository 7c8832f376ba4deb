"""Transformers as the oracle: tiny random checkpoints written by transformers' own
model classes (torch, CPU, float32), loaded by paxkv, compared logit for logit and
greedy token for token (`tests/models/` and the mesh tests of `tests/multidevice/`)."""

import numpy as np
import pytest

from paxkv.models import load_hf_checkpoint

PROMPT_LEN = 40  # longer than the windows the tests set (8): the windows matter


def write_checkpoint(config, path, *, seed=0):
    """Writes a transformers model of `config` (its `to_hf()`), with every parameter
    random and O(1) in effect (norm weights included, so a norm's `1 + weight` versus
    `weight` shows), as a safetensors checkpoint in `path`; returns the torch model."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.AutoConfig.for_model(**config.to_hf())
    hf_config._attn_implementation = "eager"  # the plain reference, soft-capping included
    model_class = getattr(transformers, hf_config.architectures[0])
    torch.manual_seed(seed)
    model = model_class(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            else:  # embedding and projections: unit-scale outputs
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[-1]))
    model.save_pretrained(path, safe_serialization=True)
    return model


def assert_matches_transformers(config, path, *, atol=1e-4):
    """Loads the checkpoint `write_checkpoint` wrote and checks that its config reads
    back as `config` and its full-sequence `dense_logits` equal transformers'."""
    import jax.numpy as jnp

    torch = pytest.importorskip("torch")
    reference = write_checkpoint(config, path)
    loaded_config, model = load_hf_checkpoint(path)
    assert loaded_config == config
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, PROMPT_LEN)
    with torch.no_grad():
        expected = reference(torch.tensor(tokens)[None]).logits[0].numpy()
    got = np.asarray(model.dense_logits(jnp.asarray(tokens, jnp.int32)))
    assert got.shape == expected.shape == (PROMPT_LEN, config.vocab_size)
    np.testing.assert_allclose(got, expected, rtol=0, atol=atol)
    return model


def greedy(reference, prompt, n):
    """The `n` tokens transformers' model `reference` appends to `prompt` greedily."""
    torch = pytest.importorskip("torch")
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = reference(torch.tensor(tokens)[None]).logits[0, -1]
            tokens.append(int(torch.argmax(logits)))
    return tokens[len(prompt) :]
