"""The kernel benchmark's launch script, run end to end at --tiny sizes on the CPU."""

import json
import os
import subprocess
import sys

RESULT_FIELDS = {"kind", "impl", "batch", "context", "q_tokens", "kv_bytes", "flops"}
TIMED_FIELDS = {
    "median_s",
    "bandwidth_bytes_per_s",
    "bandwidth_fraction",
    "flops_per_s",
    "matmul_fraction",
    "max_abs_diff_vs_dense",
}


def test_tiny_run_prints_a_table_and_writes_json(tmp_path):
    json_out = tmp_path / "kernels.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels", "--tiny", f"--json_out={json_out}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| kind |"))
    assert "% copy BW" in lines[header] and "% matmul" in lines[header]
    assert lines[header + 1].startswith("|---")
    rows = [line.split("|")[1:-1] for line in lines[header + 2 :] if line.startswith("|")]
    assert {(r[0].strip(), r[3].strip()) for r in rows} == {
        (kind, impl)
        for kind in ("decode", "prefill")
        for impl in ("paxkv", "paxkv-1-item", "jax-pallas", "xla-dense")
    }

    report = json.loads(json_out.read_text())
    assert report["backend"] == "cpu"
    assert report["copy_bytes_per_s"] > 0 and report["matmul_flops_per_s"] > 0
    by_impl = {(r["kind"], r["impl"]): r for r in report["results"]}
    for r in report["results"]:
        assert set(r) >= RESULT_FIELDS
    for key in [("decode", "paxkv"), ("decode", "jax-pallas"), ("prefill", "paxkv")]:
        r = by_impl[key]
        assert set(r) >= TIMED_FIELDS, (key, r)
        assert r["median_s"] > 0 and r["bandwidth_fraction"] > 0 and r["matmul_fraction"] > 0
        assert r["max_abs_diff_vs_dense"] < 1e-5  # same inputs, f32: the kernels agree with XLA
    assert "median_s" in by_impl[("decode", "xla-dense")]
    assert by_impl[("prefill", "jax-pallas")]["error"].startswith("n/a")
    assert by_impl[("decode", "paxkv-1-item")]["error"].startswith("n/a: TPU only")
