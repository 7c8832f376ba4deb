"""`paxkv-plan` when the requested cache does not fit: the full report, then what would fit.

llama-3.1-8b: 32 layers, 8 KV heads of 128, bfloat16. A 16-token page of all layers
holds 16 x 8 x 128 x 2 (K, V) x 2 bytes x 32 layers = 2 MiB; one 8192-token sequence
needs 512 of them and the null page.
"""

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest
from test_launch import _error, _ok, _one_line_error

MIB = 2**20
PLAN = [sys.executable, "-m", "paxkv.launch.plan", "--setup=llama-3.1-8b", "--num_samples=2000"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    commands = {
        "v5e": [*PLAN, "--device=v5e", f"--json_out={tmp / 'v5e.json'}"],
        "v5e_int8": [*PLAN, "--device=v5e", "--kv_cache_dtype=int8"],
        "v5e_f32": [*PLAN, "--device=v5e", "--dtype=float32"],
        "half_gib": [*PLAN, "--kv_budget_gib=0.5", "--workload=fixed"],
    }
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    run = lambda argv: subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        futures = {name: pool.submit(run, argv) for name, argv in commands.items()}
        return {name: f.result() for name, f in futures.items()}, tmp


def test_v5e_prints_the_report_then_what_fits(runs):
    results, tmp = runs
    result = results["v5e"]
    err = _one_line_error(result)
    assert result.returncode == 1  # an answer of "no", not bad input (2)
    out = result.stdout
    assert out.startswith("# KV capacity plan: llama-3.1-8b on v5e\n")
    budget = json.loads((tmp / "v5e.json").read_text())["budget"]["kv_budget_bytes"]
    pages = budget // (2 * MIB)  # 480: one short of 513
    assert pages < 513
    assert f"| bfloat16 (auto) | 131072 | {pages} | 0 | does not fit |" in out
    assert "| int8 | " in out and "## Page size trade-off: int8" in out  # the rest, in full
    assert "is too small for one sequence of max_model_len=8192" in err
    assert f"needs at least {513 * 2 * MIB} bytes" in err
    # int8 pages are half the size (plus scales): they fit; so does a shorter limit,
    # and two devices, each holding half the KV heads and about half the weights.
    longest = (pages - 1) * 16
    # int8 weights (8.46 GiB: the embedding and head stay bfloat16) leave 3474 pages.
    assert (
        "fits with --kv_cache_dtype=int8 or --kv_cache_dtype=fp8 or --kv_cache_dtype=fp8_e5m2 "
        f"or --max_model_len={longest} or --quantization=int8 (3474 pages) "
        "or --mesh=model:2,data:1 (" in err
    )
    assert "| int8 (--quantization=int8) | 8.46 GiB | 3474 | 6 |" in out


def test_v5e_int8_fits(runs):
    results, _ = runs
    out = _ok(results["v5e_int8"])
    assert out.startswith("# KV capacity plan: llama-3.1-8b on v5e\n")


def test_given_budget_names_the_smallest_mesh(runs):
    results, _ = runs
    err = _one_line_error(results["half_gib"])
    # 512 MiB per device: 256 pages of 2 MiB hold 255 x 16 tokens. int8 needs 513 pages
    # of more than 1 MiB: no. model:2 halves a page to 1 MiB: 513 MiB, no; model:4
    # quarters it: 1024 pages of 0.5 MiB.
    assert err.endswith(
        "fits with --max_model_len=4080 or --mesh=model:4,data:1 (4 devices a replica, each "
        "holding its shard of the weights and KV heads: 1024 pages)\n"
    )
    assert results["half_gib"].stdout.startswith("# KV capacity plan: llama-3.1-8b\n")


def test_weights_that_fill_the_device_name_the_mesh(runs):
    results, _ = runs
    result = results["v5e_f32"]
    err = _error(result)
    # float32: 29.92 GiB of weights on a 16 GiB device; model:2 leaves 0.9 GiB for
    # 513 float32 pages of 2 MiB (4 heads a device): no; model:4 does.
    assert result.returncode == 2 and result.stdout == ""
    # int8 projections (the embedding and head stay float32) leave room for the cache.
    assert "nothing is left for the KV cache; fits with --quantization=int8 (" in err
    assert "or --mesh=model:4,data:1 (" in err
