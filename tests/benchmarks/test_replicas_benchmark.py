"""The replica router benchmark, briefly, over fake runners: its three runs and what
they must show (prefix routing computes fewer prompt tokens than round robin)."""

import json
import subprocess
import sys


def test_the_router_benchmark_runs_and_prefix_routing_wins(tmp_path):
    out = tmp_path / "replicas.json"
    argv = [
        sys.executable,
        "-m",
        "benchmarks.replicas",
        "--runner=fake",
        "--replicas=3",
        "--step_ms=1",
        "--prefixes=6",
        "--requests_per_prefix=4",
        f"--json_out={out}",
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    prefix, round_robin, one = json.loads(out.read_text())
    assert (prefix["router"], round_robin["router"], one["replicas"]) == (
        "prefix",
        "round_robin",
        1,
    )
    assert sum(prefix["routed"]) == sum(round_robin["routed"]) == 24
    assert round_robin["routed"] == [8, 8, 8]
    assert prefix["prompt_tokens_computed"] < round_robin["prompt_tokens_computed"]
    assert one["hit_rate"] >= prefix["hit_rate"] > round_robin["hit_rate"]
    assert "| 3 | prefix |" in result.stdout
