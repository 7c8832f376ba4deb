"""The environment variable that lets pytest collect `tests/multidevice/` (in a child
process), and the child run itself."""

import os
import pathlib
import subprocess
import sys

MULTIDEVICE_ENV = "PAXKV_MULTIDEVICE_TESTS"
ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_multidevice(paths: list[str], timeout_s: int = 1200) -> None:
    """Runs `paths` (files under tests/multidevice/) in a child pytest process with the
    forced host devices, and fails with the child's output if it fails.

    XLA creates forced host devices only from `XLA_FLAGS` set before JAX starts, which
    the parent process is past; the child sets it, so `python -m pytest` stays the one
    test command."""
    env = os.environ | {MULTIDEVICE_ENV: "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *paths]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]


def xla_flags(devices: int) -> str:
    """This process's `XLA_FLAGS` (the suite's fast-compile flags among them: a child
    that dropped them would compile at full optimisation, and miss the shared
    compilation cache) with `devices` forced host devices instead of any count it has."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    kept = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])
