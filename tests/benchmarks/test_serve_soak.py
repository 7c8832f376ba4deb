"""The serving soak benchmark, briefly: it starts a server, loads it, and reports.

Not a timed test: ten seconds of the mixed workload at 8 clients, checked for the
report's fields, no 5xx, nothing unexpected answered, and no pages or requests left
once the server is idle.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

# A small engine: few step shapes to warm up on the CPU.
SERVER_FLAGS = ["--max_model_len=128", "--num_pages=256", "--max_num_batched_tokens=64"]


def test_a_short_soak_reports_no_5xx_and_no_leak(tmp_path):
    out = tmp_path / "soak.json"
    argv = [
        sys.executable,
        "-m",
        "benchmarks.serve_soak",
        "--duration_s=10",
        "--concurrency=8",
        f"--json_out={out}",
        *(f"--server_flag={f}" for f in SERVER_FLAGS),
    ]
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report == json.loads(result.stdout)
    assert report["num_5xx"] == 0 and report["unexpected"] == {}, report
    assert report["kv_pages_in_use_after"] == 0 and report["requests_left_after"] == 0, report
    assert report["server_exit_status"] == 0, report
    assert sum(report["requests"].values()) >= 8, report
    assert sum(report["statuses"].values()) > 0 and report["statuses"].get("200", 0) > 0
    assert report["normal_streams_tokens"] > 0
    assert 0 < report["itl_p50_ms"] <= report["itl_p99_ms"] <= report["itl_max_ms"]
    assert report["rss_start_mib"] > 0 and report["rss_end_mib"] > 0
    assert isinstance(report["compiles_after_warmup"], int) and report["compiles_at_start"] > 0
