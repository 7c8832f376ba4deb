"""The engine tests' model: the tiny preset in float32 with seed 0, loaded once."""

import pytest

from paxkv.models import load_model


@pytest.fixture(scope="session")
def tiny():
    config, model, tokenizer = load_model("tiny", dtype="float32", seed=0)
    return config, model, tokenizer
