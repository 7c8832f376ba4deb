"""A benchmark run from a checkout on a CPU machine says nothing of the accelerators it
does not have (JAX logs each platform it could not start at INFO, under absl)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_benchmark_logs_no_backend_noise():
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # JAX probes them all
    args = ["--num_requests=4", "--prompt_len=4", "--output_len=4", "--vocab=64"]
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.host_step", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "all finished True" in result.stdout, result.stdout
    assert "Unable to initialize backend" not in result.stderr, result.stderr
