"""The capacity planner (`capacity`, `parameters`, `kv_budget`): exact numbers on
hand-checkable inputs, trade-offs, the report.

The bytes of a page are `paxkv.pallas_kernels.layout`'s, tested in tests/kernels/test_layout.py.
"""

import itertools
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from paxkv.models import PRESETS, init_model
from paxkv.models.llama_config import TINY
from paxkv.pallas_kernels.layout import KV_CACHE_DTYPES
from paxkv.planner import capacity as plan
from paxkv.planner import kv_budget, parameters
from paxkv.planner.capacity_report import build_report
from paxkv.planner.workloads import Workload

# tiny: 2 layers, 2 KV heads x 64, float32 pages. One page of 16 tokens, one layer:
# K and V, 2 heads, 16 tokens, 64 dims, 4 bytes = 16384 bytes; both layers 32768.
TINY_PAGE = 2 * 2 * 16 * 64 * 4
TINY_PAGE_ALL_LAYERS = 2 * TINY_PAGE


def tiny_plan(num_pages, lengths, *, page_size=16, max_model_len=512, **kw):
    return plan.plan_capacity(
        TINY,
        kv_budget_bytes=num_pages * TINY_PAGE_ALL_LAYERS,
        page_size=page_size,
        lengths=np.asarray(lengths),
        max_model_len=max_model_len,
        **kw,
    )


def test_num_parameters_counts_the_models_params():
    model = nnx.eval_shape(lambda: init_model(TINY))  # shapes only, nothing computed
    params = nnx.state(model, nnx.Param)
    assert parameters.num_parameters(TINY) == sum(x.size for x in jax.tree.leaves(params))


@pytest.mark.parametrize(
    "name, count",
    [  # the published parameter counts
        ("llama-3.2-1b", 1_235_814_400),
        ("llama-3.1-8b", 8_030_261_248),
        ("mistral-7b", 7_241_732_096),
        ("qwen2.5-7b", 7_615_616_512),
    ],
)
def test_num_parameters_of_real_models(name, count):
    assert parameters.num_parameters(PRESETS[name]) == count
    assert parameters.weights_bytes(PRESETS[name]) == 2 * count  # bfloat16
    assert parameters.weights_bytes(PRESETS[name], "float32") == 4 * count


def test_fixed_lengths_exact():
    # 100 + 28 = 128 tokens: exactly 8 pages of 16, no waste.
    lengths = Workload("fixed", prompt_len=100, output_len=28).lengths(512)
    assert lengths.tolist() == [128]
    p = tiny_plan(100, lengths)
    assert p.num_pages == 100
    assert p.mean_pages_per_seq == 8
    assert p.paged_concurrency == 99 // 8 == 12  # page 0 is the null page
    # Contiguous: 512 slots of 2 layers x 2 heads x 64 x 4 bytes x K and V each.
    assert p.token_bytes == 2048
    assert p.contiguous_concurrency == 100 * TINY_PAGE_ALL_LAYERS // (512 * 2048) == 3
    assert p.paged_waste_tokens == 0
    assert p.contiguous_waste_tokens == 512 - 128
    assert p.pages_per_seq == 32
    assert p.block_table_bytes == 12 * 32 * 4
    assert p.fits_one_sequence


def test_the_null_page_is_not_given_out():
    # budget // (pages_per_seq * page bytes) would say 96 // 8 = 12; page 0 holds no
    # token, so 95 pages serve 11 sequences.
    assert tiny_plan(96, [128]).paged_concurrency == 11
    assert tiny_plan(97, [128]).paged_concurrency == 12


def test_waste_of_partial_pages():
    p = tiny_plan(100, [130])
    assert p.mean_pages_per_seq == 9  # ceil(130 / 16)
    assert p.paged_waste_tokens == 9 * 16 - 130 == 14
    assert p.contiguous_waste_tokens == 512 - 130
    assert p.paged_concurrency == 99 // 9


def test_expectations_over_a_distribution():
    # ceil(L / 16) = 1, 1, 2, 7 (11 in all); waste 15, 0, 15, 12.
    p = tiny_plan(100, [1, 16, 17, 100])
    assert p.mean_pages_per_seq == 11 / 4
    assert p.paged_waste_tokens == (15 + 0 + 15 + 12) / 4
    assert p.contiguous_waste_tokens == 512 - (1 + 16 + 17 + 100) / 4
    assert p.paged_concurrency == 99 * 4 // 11  # 36 = floor(99 / 2.75)
    assert p.mean_len == 134 / 4


def test_min_budget_is_one_max_model_len_sequence_and_the_null_page():
    p = tiny_plan(32, [128])
    assert p.min_kv_budget_bytes == 33 * TINY_PAGE_ALL_LAYERS
    assert not p.fits_one_sequence
    assert tiny_plan(33, [128]).fits_one_sequence
    assert tiny_plan(1, [128]).paged_concurrency == 0  # a value, not an error


def test_quantized_pages():
    # int8, fp8 and fp8_e5m2: 1 byte per entry and 2 bytes of scale per token per head, K and V.
    for kind in ("int8", "fp8", "fp8_e5m2"):
        p = tiny_plan(100, [128], kv_cache_dtype=kind)
        assert p.page_bytes == 2 * 2 * 16 * (64 + 2)
        assert p.num_pages == 100 * TINY_PAGE_ALL_LAYERS // (2 * p.page_bytes)
        assert p.paged_concurrency == (p.num_pages - 1) // 8


@pytest.mark.parametrize("name", ["tiny", "llama-3.1-8b", "mistral-7b", "qwen2.5-7b"])
def test_quantized_cache_holds_at_least_1_9x(name):
    model = PRESETS[name]
    lengths = Workload("sharegpt", prompt_len=128, output_len=128, num_samples=2000).lengths(4096)
    kw = dict(kv_budget_bytes=40 * kv_budget.GIB, page_size=16, lengths=lengths, max_model_len=4096)
    base = plan.plan_capacity(model, **kw)
    for kind in ("int8", "fp8"):
        q = plan.plan_capacity(model, kv_cache_dtype=kind, **kw)
        assert q.paged_concurrency >= 1.9 * base.paged_concurrency
        assert q.contiguous_concurrency >= 1.9 * base.contiguous_concurrency


def test_quantized_gain_with_head_dim_64_in_bfloat16():
    # The scales cost relatively more with short heads: 2 * 64 * 2 bytes against
    # 2 * (64 + 2) (a bfloat16 scale), 1.94x (Llama 3.2 1B).
    p = plan.plan_capacity(
        PRESETS["llama-3.2-1b"],
        kv_budget_bytes=40 * kv_budget.GIB,
        page_size=16,
        lengths=np.array([1000]),
        max_model_len=4096,
    )
    q = plan.plan_capacity(
        PRESETS["llama-3.2-1b"],
        kv_budget_bytes=40 * kv_budget.GIB,
        page_size=16,
        lengths=np.array([1000]),
        max_model_len=4096,
        kv_cache_dtype="int8",
    )
    assert p.token_bytes / q.token_bytes == 256 / 132
    assert q.paged_concurrency / p.paged_concurrency == pytest.approx(256 / 132, rel=1e-3)


def test_page_size_tradeoff_is_monotonic():
    lengths = Workload("sharegpt", prompt_len=128, output_len=128, num_samples=5000).lengths(8192)
    plans = plan.page_size_tradeoff(
        PRESETS["llama-3.1-8b"],
        kv_budget_bytes=60 * kv_budget.GIB,
        lengths=lengths,
        max_model_len=8192,
    )
    assert [p.page_size for p in plans] == list(plan.PAGE_SIZES)
    for small, big in itertools.pairwise(plans):
        assert small.paged_waste_tokens <= big.paged_waste_tokens
        assert small.paged_concurrency >= big.paged_concurrency
        assert small.mean_pages_per_seq > big.mean_pages_per_seq
        assert small.block_table_bytes > big.block_table_bytes
        assert small.contiguous_concurrency == big.contiguous_concurrency  # no pages
    # Waste is below one page per sequence and above none, for these lengths.
    assert all(0 < p.paged_waste_tokens < p.page_size for p in plans)


def test_sharegpt_lengths():
    w = Workload("sharegpt", prompt_len=128, output_len=64, sigma=1.0, num_samples=10_000)
    lengths = w.lengths(1024)
    assert lengths.shape == (10_000,) and lengths.dtype == np.int64
    assert lengths.min() >= 2 and lengths.max() == 1024  # a long tail, capped
    assert 150 < np.median(lengths) < 300
    np.testing.assert_array_equal(lengths, w.lengths(1024))  # seeded
    assert not np.array_equal(lengths, Workload("sharegpt", 128, 64, seed=1).lengths(1024))
    fixed = Workload("sharegpt", prompt_len=100, output_len=28, sigma=0.0).lengths(512)
    assert set(fixed.tolist()) == {128}


def test_device_budget():
    w = parameters.weights_bytes(PRESETS["llama-3.1-8b"])
    b = kv_budget.KVBudget.on_device("h200", weights_bytes=w, kv_fraction=0.9)
    assert b.device == "H200"
    assert b.kv_budget_bytes == int((141 * kv_budget.GIB - w) * 0.9)
    with pytest.raises(ValueError, match="not one of"):
        kv_budget.KVBudget.on_device("v4", weights_bytes=w, kv_fraction=0.9)
    with pytest.raises(ValueError, match="nothing is left"):  # 30 GiB of float32 weights
        kv_budget.KVBudget.on_device("v5e", weights_bytes=2 * w, kv_fraction=0.9)
    with pytest.raises(ValueError, match="kv_fraction"):
        kv_budget.KVBudget.on_device("H100", weights_bytes=w, kv_fraction=0.0)
    # A TPU slice name, as users write it, names its chip (each device's memory).
    v6e = kv_budget.KVBudget.on_device("v6e", weights_bytes=w, kv_fraction=0.9)
    assert kv_budget.KVBudget.on_device("v6e-8", weights_bytes=w, kv_fraction=0.9) == v6e
    assert kv_budget.device_of("V5E-16") == "V5E" and kv_budget.device_of("H100") == "H100"
    with pytest.raises(ValueError, match="'v4-8' is not one of"):
        kv_budget.KVBudget.on_device("v4-8", weights_bytes=w, kv_fraction=0.9)
    with pytest.raises(ValueError, match="must be positive"):
        kv_budget.KVBudget.given(0, weights_bytes=w)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kv_budget_bytes=0), "kv_budget_bytes=0 must be positive"),
        (dict(page_size=0), "page_size=0 must be positive"),
        (dict(page_size=-16), "page_size=-16 must be positive"),
        (dict(max_model_len=0), "max_model_len=0 must be positive"),
        (dict(lengths=np.array([600])), r"lengths must lie in \[1, max_model_len=512\]"),
        (dict(lengths=np.array([0])), "lengths must lie"),
        (dict(lengths=np.array([], np.int64)), "non-empty"),
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype='int4'"),
    ],
)
def test_bad_input(kwargs, match):
    args = dict(
        kv_budget_bytes=10 * kv_budget.GIB, page_size=16, lengths=np.array([128]), max_model_len=512
    )
    with pytest.raises(ValueError, match=match):
        plan.plan_capacity(TINY, **(args | kwargs))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kind="uniform"), "workload='uniform'"),
        (dict(prompt_len=0), "prompt_len=0 must be positive"),
        (dict(output_len=-1), "output_len=-1 must be positive"),
        (dict(sigma=-1.0), "sigma"),
    ],
)
def test_bad_workload(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Workload(**(dict(kind="fixed", prompt_len=10, output_len=10) | kwargs))


def test_fixed_workload_longer_than_max_model_len():
    with pytest.raises(ValueError, match="= 600 exceeds max_model_len=512"):
        Workload("fixed", prompt_len=500, output_len=100).lengths(512)


def test_report():
    model = PRESETS["llama-3.1-8b"]
    report = build_report(
        model,
        name="llama-3.1-8b",
        budget=kv_budget.KVBudget.on_device(
            "H200", weights_bytes=parameters.weights_bytes(model), kv_fraction=0.9
        ),
        workload=Workload("sharegpt", prompt_len=128, output_len=128, num_samples=2000),
        page_size=16,
        max_model_len=8192,
    )
    assert set(report.plans) == set(report.tradeoffs) == set(KV_CACHE_DTYPES)
    text = report.to_markdown()
    assert text.startswith("# KV capacity plan: llama-3.1-8b on H200")
    for heading in ("## Maximum concurrency at page_size 16", "## Page size trade-off: int8"):
        assert heading in text
    assert "| bfloat16 (auto) | 131072 |" in text  # 32 layers x 8 heads x 128 x 2 bytes x K, V
    data = json.loads(json.dumps(report.to_dict()))
    auto = data["plans"]["auto"]
    assert auto["paged_concurrency"] == report.plans["auto"].paged_concurrency
    assert auto["paged_concurrency"] > 10 * auto["contiguous_concurrency"]
    assert [p["page_size"] for p in data["page_size_tradeoff"]["fp8"]] == list(plan.PAGE_SIZES)
    assert data["model"]["num_parameters"] == 8_030_261_248


def test_the_planner_and_the_configs_import_no_jax():
    # The planner counts from a family's config (`DecoderConfig`); neither loads JAX.
    code = (
        "import sys; from paxkv.planner import capacity, capacity_report, parameters; "
        "from paxkv.models import DecoderConfig, GemmaConfig, GptOssConfig, MoeConfig; "
        "from paxkv.models.llama_config import LLAMA_3_1_8B; "
        "assert isinstance(LLAMA_3_1_8B, DecoderConfig); "
        "parameters.num_parameters(LLAMA_3_1_8B); "
        "assert not {'jax', 'flax'} & set(sys.modules), 'jax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
