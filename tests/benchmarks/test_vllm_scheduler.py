"""The vLLM side-by-side: its modules import without vLLM, the driver's medians and
ratios, and (where vLLM is installed) vLLM's scheduler replaying a host_step trace."""

import importlib.util
import subprocess
import sys

import pytest

from benchmarks import host_step, host_step_vs_vllm


def test_modules_import_nothing_of_vllm():
    code = (
        "import sys, benchmarks.vllm_scheduler, benchmarks.host_step_vs_vllm; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _run(p50s: dict[str, float], parts: tuple[str, ...], part_us: float) -> dict:
    def row(p50):
        return {"steps": 7, "p50": p50, **{k: {"p50": part_us} for k in parts}}

    return {"per_step_us": {"cpu": {r: row(p50s[r]) for r in host_step_vs_vllm.ROWS}}}


def test_compare_takes_medians_across_rounds_and_the_ratio():
    rows = host_step_vs_vllm.ROWS
    paxkv = [_run(dict.fromkeys(rows, x), host_step_vs_vllm.PAXKV_PARTS, x) for x in (9, 1, 2)]
    vllm = [_run(dict.fromkeys(rows, x), host_step_vs_vllm.VLLM_PARTS, x) for x in (10, 30, 20)]
    out = host_step_vs_vllm.compare({"paxkv": paxkv, "vllm": vllm})
    assert [r["row"] for r in out] == list(rows)
    for r in out:
        assert r["paxkv"]["total"] == 2 and r["paxkv"]["layout"] == 2
        assert r["vllm"]["total"] == 20 and r["vllm"]["update"] == 20
        assert r["ratio"] == 10 and r["paxkv"]["steps"] == 7
        assert r["round_ratios"] == [10 / 9, 30, 10]  # each round's vLLM / paxkv
    table = host_step_vs_vllm._tables(out)
    assert table.splitlines()[2].endswith("| 10.0x | 1.1x-30.0x |")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_replays_a_trace_to_the_end():
    from benchmarks import vllm_scheduler

    trace = host_step.make_trace(60, seed=1, arrival_rate=8.0, shared_prefix=32, vocab=64)
    schedulers = [
        vllm_scheduler.make_scheduler(
            num_pages=512,
            page_size=16,
            max_num_seqs=16,
            max_num_batched_tokens=1024,
            max_model_len=4096,
            enable_prefix_caching=True,
            vocab=64,
        )
        for _ in range(2)
    ]
    once = vllm_scheduler.run(trace, schedulers[:1], max_num_seqs=16)
    result = vllm_scheduler.run(trace, schedulers[1:], max_num_seqs=16)
    assert once["steps"] == result["steps"]
    assert result["all_finished"] and result["blocks_in_use_at_end"] == 0
    assert result["peak_running"] == 16
    at_max = result["per_step_us"]["cpu"]["at_max_num_seqs"]
    assert at_max["steps"] > 0 and at_max["p50"] > 0
