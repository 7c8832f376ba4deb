"""The structured-outputs host benchmark runs, and its constrained outputs (the fake
runner's tokens, masked) are prefixes the schema allows, its free ones mostly not."""

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("tokenizers")

from benchmarks import structured_step


def test_masked_fake_outputs_follow_the_schema():
    tokenizer = structured_step.stdlib_bpe(1024)
    result = structured_step.run(tokenizer, 32, max_tokens=12)
    assert result["valid"] and result["steps"] > 0 and result["fill_us"] > 0
    assert result["sync_us"] > 0
    assert result["free_valid"] < 0.1  # the check can fail: unmasked outputs mostly do
