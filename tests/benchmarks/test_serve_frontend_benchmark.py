"""The front end benchmark, briefly, over the fake runner: its three runs of the same
load (each checks that the clients received every token they asked for) and figures
that hold by construction."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("uvicorn")


def test_the_front_end_benchmark_runs_its_three_modes(tmp_path):
    out = tmp_path / "frontend.json"
    argv = [
        sys.executable,
        "-m",
        "benchmarks.serve_frontend",
        "--clients=6",
        "--requests_per_client=2",
        "--prompt_len=20",
        "--max_tokens=8",
        "--step_ms=1",
        "--repeats=1",
        f"--json_out={out}",
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["clients"], r["mode"]) for r in rows] == [
        (6, "engine, ids"),
        (6, "engine"),
        (6, "http"),
    ]
    for r in rows:
        # At least one step per output token of the longest request (8 tokens).
        assert r["steps"] >= 8
        assert 0 < r["loop_cpu_share_of_process"] <= 1.0
        assert 0 < r["device_busy"] <= 1.0
        assert r["gap_cpu_ms_p50"] <= r["gap_ms_p50"] + 0.05  # a thread's CPU <= wall
    assert rows[2]["client_cpu_s"] > 0 and rows[0]["client_cpu_s"] is None
    assert "| 6 | http |" in result.stdout
