"""The threads soak benchmark, briefly: the RL pattern from four threads with no failure,
no page left, and a paused stream that uses no CPU."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_short_soak_has_no_failure():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.threads_soak", "--seconds=3", "--paused_seconds=1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "failures: 0" in result.stdout and "pages in use at the end 0" in result.stdout
    checked = int(re.search(r"(\d+) outputs equal", result.stdout).group(1))
    assert checked > 0, result.stdout
    cpu = float(re.search(r"the process used ([\d.]+) s of CPU", result.stdout).group(1))
    assert cpu < 0.5, result.stdout
