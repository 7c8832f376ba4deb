"""The KV-cache quality measures on the trained tiny-py model, at a very small size."""

import dataclasses
import math

import numpy as np
import pytest

from paxkv.measure import kv_quality as quality
from paxkv.models import load_model
from paxkv.models import training as train

# fp8 is measured on its own (`test_fp8_is_finite_and_close`): an engine compilation
# per cache dtype is most of this file's time.
SMALL = quality.QualityConfig(
    kv_cache_dtypes=("auto", "int8"),
    num_windows=6,
    window_len=64,
    chunk_len=16,
    batch_size=4,  # two batches, the second padded
    num_prompts=4,
    prompt_len=24,
    max_tokens=12,
)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-py")[1]


@pytest.fixture(scope="module")
def eval_data():
    return train.load_corpus("eval")


@pytest.fixture(scope="module")
def evaluated(model, eval_data):
    """The result, and the `progress` calls made while computing it."""
    calls = []
    result = quality.evaluate(model, eval_data, SMALL, progress=lambda *a: calls.append(a))
    return result, calls


@pytest.fixture(scope="module")
def result(evaluated):
    return evaluated[0]


def test_progress_names_each_stage_before_it_runs(evaluated):
    assert evaluated[1] == [
        (0, 5, "dense forward"),
        (1, 5, "none weights, auto perplexity"),
        (2, 5, "none weights, auto greedy"),
        (3, 5, "none weights, int8 perplexity"),
        (4, 5, "none weights, int8 greedy"),
        (5, 5, "done"),
    ]


def test_agreement_by_hand():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert quality.agreement(ref, ref) == {
        "prefix_agreement": 1.0,
        "token_agreement": 1.0,
        "identical": 1.0,
    }
    # Diverges at 2 of 4, then matches again at 4 of 4; the second is identical.
    assert quality.agreement(ref, [[1, 2, 9, 4], [5, 6, 7, 8]]) == {
        "prefix_agreement": 6 / 8,
        "token_agreement": 7 / 8,
        "identical": 0.5,
    }
    assert quality.agreement([[1, 2]], [[3, 2]])["prefix_agreement"] == 0.0
    with pytest.raises(ValueError, match="continuations of 2 and 1 tokens"):
        quality.agreement([[1, 2]], [[1]])


def test_rows_for_every_dtype(result):
    rows = {r["kv_cache_dtype"]: r for r in result["rows"]}
    assert list(rows) == ["auto", "int8"]
    table = quality.markdown_table(result).splitlines()
    assert len(table) == 2 + 2 and table[2].startswith("| none | auto |")
    for r in rows.values():
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1
        assert r["bits_per_byte"] == pytest.approx(math.log2(r["perplexity"]))
        for key in ("prefix_agreement", "token_agreement", "identical"):
            assert 0 <= r[key] <= 1
        assert r["prefix_agreement"] <= r["token_agreement"]


def test_auto_cache_matches_the_dense_forward(result):
    auto = result["rows"][0]
    assert auto["nll"] == pytest.approx(result["dense"]["nll"], rel=1e-5)
    assert auto["perplexity_change"] == 0 and auto["nll_abs_diff"] == 0
    assert auto["prefix_agreement"] == auto["token_agreement"] == auto["identical"] == 1.0


def test_int8_stays_close(result):
    int8 = result["rows"][1]
    assert 0 < int8["nll_abs_diff"] < 0.01  # quantized, so not identical, but close
    assert abs(int8["perplexity_change"]) < 0.02
    assert int8["token_agreement"] > 0.5


def test_fp8_is_finite_and_close(model, eval_data, result):
    windows = train.spaced_windows(eval_data, SMALL.num_windows, SMALL.window_len)
    nll = {
        dtype: quality.paged_nll(
            model,
            windows,
            kv_cache_dtype=dtype,
            chunk_len=SMALL.chunk_len,
            batch_size=SMALL.batch_size,
        )
        for dtype in ("auto", "fp8")
    }
    assert np.isfinite(nll["fp8"]).all()
    assert (
        abs(quality.perplexity(nll["fp8"])["perplexity"] / result["rows"][0]["perplexity"] - 1)
        < 0.10
    )
    # e4m3 rounds to 3 mantissa bits (1/16 relative), int8 to steps of amax / 127.
    assert np.abs(nll["fp8"] - nll["auto"]).mean() > result["rows"][1]["nll_abs_diff"]


# These reuse the shapes `result` compiled, so they compile nothing more.


def test_greedy_auto_runs_agree_exactly(model, eval_data):
    prompts = quality.line_start_prompts(eval_data, SMALL.num_prompts, SMALL.prompt_len)
    assert all(len(p) == SMALL.prompt_len for p in prompts)
    first, second = (
        quality.greedy_continuations(model, prompts, max_tokens=SMALL.max_tokens) for _ in range(2)
    )
    assert first == second and quality.agreement(first, second)["token_agreement"] == 1.0
    assert all(len(c) == SMALL.max_tokens for c in first)


def test_per_token_nll_over_chunks(model, eval_data):
    windows = train.spaced_windows(eval_data, SMALL.num_windows, SMALL.window_len)
    paged = quality.paged_nll(
        model, windows, chunk_len=SMALL.chunk_len, batch_size=SMALL.batch_size
    )
    assert paged.shape == (SMALL.num_windows, SMALL.window_len)
    np.testing.assert_allclose(paged, quality.dense_nll(model, windows), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of chunk_len=5"):
        quality.paged_nll(model, windows, chunk_len=5)


def test_quantized_weights_get_rows_of_their_own(model, eval_data):
    pytest.importorskip("qwix")
    config = dataclasses.replace(SMALL, kv_cache_dtypes=("auto",), weight_quantizations=("int8",))
    rows = quality.evaluate(model, eval_data, config)["rows"]
    assert [(r["weights"], r["kv_cache_dtype"]) for r in rows] == [
        ("none", "auto"),
        ("int8", "auto"),
    ]
    unquantized, int8 = rows
    assert unquantized["nll_abs_diff"] == 0 and int8["nll_abs_diff"] > 0  # the weights moved
    assert abs(int8["perplexity_change"]) < 0.05  # and the trained model kept its loss
